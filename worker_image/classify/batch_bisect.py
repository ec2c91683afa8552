"""The worker's execute entry point: a fused batch through `executor.execute`, and when ONNX Runtime
refuses the batch, bisected until only the inputs the model cannot run fail (each alone).

A worker's batch fuses the inputs of many requests. The router checks every value before it sends
an input (dtypes, ranges, token ids inside the vocabulary), but a model may still refuse a value it
cannot check (a user's ONNX graph with a lookup table, a data-dependent shape): the whole batch then
fails in ONNX Runtime. `execute_isolated` runs the batch; when it fails, it bisects — each half runs
on its own, a failing half is split again — so every input that can run is answered and only an input
that fails on its own is *rejected*, with ONNX Runtime's reason (`BatchOutcome.rejected`).

Whose fault: a row that fails alone is the input's when the model runs other inputs: one of its batch
ran, or a known-good input (the worker's warm-up input) runs now. When neither holds — every row
fails, and the warm-up input fails too or there is none for this stage — the model or the device is
at fault: the first error is raised and the worker answers every row of the batch with a worker error
(the router's 502 path). A state that does not fit the bundle (`StateError`: a missing tensor, a
wrong dtype or shape) is the frame's, the same for every row: it is raised at once, without bisecting.

Pure compute, like `executor.execute`: called where the batch runs (inference thread or event loop).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from exitplan.worker_image.bundle_runtime import BundleRuntime, StateError
from exitplan.worker_image.classify.executor import Answer, BatchOutcome, execute

REASON_CHARS = 400
"""ONNX Runtime's messages name the node and the value; longer ones are cut here."""


@dataclass(frozen=True, slots=True)
class _Batch:
    """What `execute` takes besides the rows: the batch's state and per-row flags, and its stage."""

    runtime: BundleRuntime
    state: dict[str, np.ndarray]
    bucket: int
    thresholds: dict[str, float]
    answered: np.ndarray
    recorded: np.ndarray
    first: int | None
    last: int | None

    def run(self, rows: np.ndarray) -> BatchOutcome:
        """`execute` on the batch's `rows` alone."""
        sub = {name: value[rows] for name, value in self.state.items()}
        return execute(
            self.runtime,
            sub,
            self.bucket,
            self.thresholds,
            self.answered[rows],
            self.recorded[rows],
            self.first,
            self.last,
        )


def _bisect(
    batch: _Batch, rows: np.ndarray, ran: list[tuple[np.ndarray, BatchOutcome]], rejected: dict[int, Exception]
) -> None:
    """Run `rows` (which failed together) in halves, down to single rows; collect what ran and what failed."""
    for half in (rows[: len(rows) // 2], rows[len(rows) // 2 :]):
        try:
            ran.append((half, batch.run(half)))
        except StateError:
            raise
        except Exception as err:  # onnxruntime raises several unrelated types
            if len(half) == 1:
                rejected[int(half[0])] = err
            else:
                _bisect(batch, half, ran, rejected)


def _merge(parts: list[tuple[np.ndarray, BatchOutcome]], rejected: dict[int, str]) -> BatchOutcome:
    """One outcome, in the batch's row numbers, from the outcomes of its parts."""
    answers = [Answer(int(rows[a.row]), a.ramp, a.final, a.logits) for rows, out in parts for a in out.answers]
    survivors = [rows[out.survivors] for rows, out in parts if len(out.survivors)]
    state: dict[str, np.ndarray] = {}
    if survivors:
        names = next(out.state for _, out in parts if len(out.survivors))
        state = {name: np.concatenate([out.state[name] for _, out in parts if len(out.survivors)]) for name in names}
    records = {int(rows[r]): rec for rows, out in parts for r, rec in out.records.items()}
    return BatchOutcome(
        answers,
        np.concatenate(survivors) if survivors else np.zeros(0, dtype=np.int64),
        state,
        records,
        sum(out.compute_ms for _, out in parts),
        rejected,
    )


def reason(err: Exception) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    text = text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "..."
    return f"the model cannot run this input (ONNX Runtime refused it alone, while it runs other inputs): {text}"


def execute_isolated(
    runtime: BundleRuntime,
    state: dict[str, np.ndarray],
    bucket: int,
    thresholds: dict[str, float],
    answered: np.ndarray,
    recorded: np.ndarray,
    first: int | None = None,
    last: int | None = None,
    known_good: Callable[[], bool] | None = None,
) -> BatchOutcome:
    """`execute`, but a failing batch is bisected: the rows that fail alone are in `rejected`, the
    others answered as usual. `known_good()`: whether the model runs a known-good input of this
    stage now (None: no such input). Raises the batch's first error when the model or the device is
    at fault (see the module's docstring)."""
    try:
        return execute(runtime, state, bucket, thresholds, answered, recorded, first, last)
    except StateError:
        raise
    except Exception as err:  # onnxruntime raises several unrelated types
        first_error = err
    n = len(answered)
    batch = _Batch(runtime, state, bucket, thresholds, answered, recorded, first, last)
    ran: list[tuple[np.ndarray, BatchOutcome]] = []
    failed: dict[int, Exception] = {}
    if n > 1:
        _bisect(batch, np.arange(n), ran, failed)
    else:
        failed[0] = first_error
    if not ran and (known_good is None or not known_good()):
        raise first_error
    return _merge(ran, {row: reason(err) for row, err in sorted(failed.items())})


def known_input_check(
    runtime: BundleRuntime, known: dict[str, np.ndarray] | None, bucket: int, first: int, last: int
) -> Callable[[], bool] | None:
    """`known_good` for blocks first..last: runs `known` (a known-good input of the runtime's first
    block, e.g. the warm-up's) through them; None when there is none or the blocks start later."""
    if known is None or first != runtime.first_block:
        return None

    def check() -> bool:
        n = len(next(iter(known.values())))
        try:
            execute(runtime, known, bucket, {}, np.zeros(n, bool), np.zeros(n, bool), first, last)
        except Exception:  # the model fails on an input it ran at warm-up: not the batch's fault
            return False
        return True

    return check
