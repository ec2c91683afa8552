"""One batch through one split: blocks, exit decisions, shadow recording.

`execute` runs the blocks of a split (or of one block of it, when the split rebatches) on a fused
batch and decides per row:
- a row whose confidence at an active exit ramp reaches the ramp's threshold is *answered* there;
- a *recorded* row (shadow-sampled by the router) is answered the same way, but keeps running to the
  final head, and every exit ramp (active or not) is evaluated on it, so the router gets one complete
  feedback sample (confidence and answer at every ramp plus the full model's answer) — the window
  format of `exitplan tune`;
- rows still running after the split's last block are survivors to forward.

Pure compute: no I/O, called from the worker's inference thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from exitplan.api.bundle import BundleManifest
from exitplan.worker_image.bundle_runtime import BundleRuntime, softmax


@dataclass
class Answer:
    row: int
    ramp: str
    final: bool
    logits: np.ndarray


@dataclass
class Record:
    """Per-ramp outputs accumulated for a recorded row (exit ramps in block order)."""

    conf: dict[str, float] = field(default_factory=dict)
    pred: dict[str, int] = field(default_factory=dict)
    final_pred: int | None = None


@dataclass
class BatchOutcome:
    answers: list[Answer]
    survivors: np.ndarray
    """Rows (of the input batch) to forward to the next split, in `state` order."""
    state: dict[str, np.ndarray]
    records: dict[int, Record]
    """Row -> what this split added to the row's feedback record (recorded rows only)."""
    compute_ms: float = 0.0
    """Wall time of this call, measured on the thread that ran it (no hand-off or queueing in it)."""
    rejected: dict[int, str] = field(default_factory=dict)
    """Row -> why the model cannot run it (rows that failed alone, `batch_bisect.execute_isolated`)."""


def execute(
    runtime: BundleRuntime,
    state: dict[str, np.ndarray],
    bucket: int,
    thresholds: dict[str, float],
    answered: np.ndarray,
    recorded: np.ndarray,
    first: int | None = None,
    last: int | None = None,
) -> BatchOutcome:
    """Run blocks `first`..`last` (default: the runtime's whole range) on `state` ([n, ...] per tensor).

    `answered[i]`: row i was already answered upstream (it is a shadow still running for feedback).
    `recorded[i]`: row i is shadow-sampled (all ramps evaluated, runs to the final head).
    The survivors' state is the input of block `last` + 1.
    """
    started = time.perf_counter()
    manifest: BundleManifest = runtime.manifest
    first = runtime.first_block if first is None else first
    last = runtime.last_block if last is None else last
    if not runtime.first_block <= first <= last <= runtime.last_block:
        raise ValueError(
            f"blocks {first}..{last} are outside this runtime's range {runtime.first_block}..{runtime.last_block}"
        )
    rows = np.arange(len(answered))
    answered = answered.copy()
    work = dict(state)
    answers: list[Answer] = []
    records: dict[int, Record] = {int(r): Record() for r in np.flatnonzero(recorded)}
    for index in range(first, last + 1):
        if rows.size == 0:
            break
        runtime.run_block(index, work, bucket)
        for ramp in manifest.ramps_in(index, index):
            if rows.size == 0:
                break
            limit = thresholds.get(ramp.name, 2.0)
            active = ramp.final or limit <= 1.0
            rec_here = recorded[rows]
            if ramp.final:
                sel = np.arange(rows.size)
            elif active:
                sel = np.flatnonzero(~answered[rows] | rec_here)
            else:
                sel = np.flatnonzero(rec_here)
            if sel.size == 0:
                continue
            sub = work if sel.size == rows.size else {k: v[sel] for k, v in work.items()}
            logits = runtime.run_ramp(ramp.name, sub, bucket)
            probs = softmax(logits)
            conf = probs.max(axis=-1)
            pred = probs.argmax(axis=-1)
            for j, i in enumerate(sel):
                row = int(rows[i])
                if row in records:
                    if ramp.final:
                        records[row].final_pred = int(pred[j])
                    else:
                        records[row].conf[ramp.name] = float(conf[j])
                        records[row].pred[ramp.name] = int(pred[j])
                if not answered[row] and (ramp.final or (active and conf[j] >= limit)):
                    answered[row] = True
                    answers.append(Answer(row, ramp.name, ramp.final, logits[j]))
            # Rows that are answered and not recorded leave the batch.
            keep = ~answered[rows] | recorded[rows]
            if not keep.all():
                rows = rows[keep]
                work = {k: v[keep] for k, v in work.items()}
        live = manifest.live_after(index)
        work = {name: work[name] for name in live if name in work}
    if runtime.ends_model and last == runtime.last_block:
        rows, work = rows[:0], {}
    return BatchOutcome(answers, rows, work, records, (time.perf_counter() - started) * 1000)
