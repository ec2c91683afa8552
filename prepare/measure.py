"""Running a bundle's held-out inputs through ONNX Runtime, and timing blocks and ramps on them.

Timings use real held-out inputs (padded to the bucket, repeated to fill a batch) chained through
the blocks, so every block is timed on the activations it really receives.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import numpy.typing as npt

from exitplan.api.bundle import BundleError, BundleManifest
from exitplan.worker_image.bundle_runtime import BundleRuntime, bucket_for, input_role, pad_batch


@dataclass
class Heldout:
    """A bundle's held-out inputs in model form, and labels: token ids (a text bundle with a
    tokenizer), or `inputs`, one array per bundle input keyed by the input's name (with a sequence
    axis, each row's length is `lengths`, read from an attention mask when the model has one)."""

    label: np.ndarray
    ids: list[list[int]] | None = None
    full_pred: np.ndarray | None = None
    inputs: dict[str, np.ndarray] | None = None
    lengths: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.label.size)


def sequence_lengths(manifest: BundleManifest, inputs: dict[str, np.ndarray]) -> np.ndarray | None:
    """Per-row lengths of named inputs with a sequence axis: the attention mask's sum where the
    bundle has an input named like one (`*mask*`), else the full axis. None without a sequence axis."""
    if manifest.seq_axis is None:
        return None
    axis = manifest.seq_axis
    masks = [t.name for t in manifest.inputs if "mask" in t.name.lower() and t.name in inputs]
    if masks:
        mask = inputs[masks[0]]
        present = (mask != 0).reshape(mask.shape[0], mask.shape[axis], -1)
        lengths: npt.NDArray[np.int64] = present.any(axis=2).sum(axis=1).astype(np.int64)
        return lengths
    first = inputs[manifest.inputs[0].name]
    return np.full(first.shape[0], first.shape[axis], dtype=np.int64)


def fit_to_bucket(manifest: BundleManifest, arrays: dict[str, np.ndarray], bucket: int) -> dict[str, np.ndarray]:
    """Named inputs cut or padded along the sequence axis to `bucket` (token ids with the pad token,
    positions counting on, masks, token types and everything else with zeros); unchanged without a
    sequence axis."""
    if manifest.seq_axis is None:
        return {name: np.ascontiguousarray(a) for name, a in arrays.items()}
    axis, out = manifest.seq_axis, {}
    for spec in manifest.inputs:
        array = arrays[spec.name]
        size = array.shape[axis]
        if size >= bucket:
            out[spec.name] = np.ascontiguousarray(np.take(array, np.arange(bucket), axis=axis))
            continue
        widths = [(0, 0)] * array.ndim
        widths[axis] = (0, bucket - size)
        role = input_role(spec.name)
        if role == "positions" and array.dtype.kind in "iu":
            out[spec.name] = np.pad(array, widths, mode="linear_ramp", end_values=array.max() + bucket - size)
            continue
        fill = manifest.pad_token_id if role == "tokens" and array.dtype.kind in "iu" else 0
        out[spec.name] = np.pad(array, widths, constant_values=fill)
    return out


def load_heldout(directory: Path, manifest: BundleManifest) -> Heldout:
    path = Path(directory) / manifest.data.heldout
    if not path.is_file():
        raise BundleError(f"{path}: the bundle has no held-out data; rebuild it with `exitplan prepare --force`")
    data = np.load(path)
    full = data["full_pred"] if "full_pred" in data.files else None
    if "text" in data.files:
        if not manifest.tokenizer:
            raise BundleError(f"{path}: held-out texts but bundle.yaml names no tokenizer")
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(Path(directory) / manifest.tokenizer))
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=manifest.max_length or 512)
        ids = [enc.ids for enc in tokenizer.encode_batch([str(t) for t in data["text"]])]
        return Heldout(label=data["label"], ids=ids, full_pred=full)
    names = [spec.name for spec in manifest.inputs]
    if len(names) == 1 and names[0] not in data.files and "x" in data.files:  # one input, stored as `x`
        inputs = {names[0]: data["x"]}
    elif all(name in data.files for name in names):
        inputs = {name: data[name] for name in names}
    else:
        raise BundleError(
            f"{path}: held-out data holds neither `text`, `x` nor one array per bundle input {names} "
            f"(it has {data.files})"
        )
    return Heldout(label=data["label"], full_pred=full, inputs=inputs, lengths=sequence_lengths(manifest, inputs))


def heldout_batches(
    runtime: BundleRuntime, heldout: Heldout, batch: int = 64
) -> Iterator[tuple[np.ndarray, dict[str, np.ndarray], int]]:
    """(rows, state, bucket) over the held-out inputs, each text in the smallest bucket that holds it."""
    if heldout.inputs is not None:
        yield from _named_batches(runtime, heldout, batch)
        return
    assert heldout.ids is not None
    lengths = np.array([min(len(s), max(runtime.buckets)) for s in heldout.ids])
    buckets = np.array([bucket_for(int(n), runtime.buckets) for n in lengths])
    for bucket in runtime.buckets:
        members = np.flatnonzero(buckets == bucket)
        for start in range(0, members.size, batch):
            rows = members[start : start + batch]
            yield (
                rows,
                pad_batch(
                    [heldout.ids[r][:bucket] for r in rows], bucket, runtime.manifest.pad_token_id, _names(runtime)
                ),
                int(bucket),
            )


def _named_batches(
    runtime: BundleRuntime, heldout: Heldout, batch: int
) -> Iterator[tuple[np.ndarray, dict[str, np.ndarray], int]]:
    assert heldout.inputs is not None
    manifest = runtime.manifest
    if heldout.lengths is None:
        buckets = np.full(len(heldout), runtime.buckets[0])
    else:
        top = max(runtime.buckets)
        buckets = np.array([bucket_for(min(int(n), top), runtime.buckets) for n in heldout.lengths])
    for bucket in runtime.buckets:
        members = np.flatnonzero(buckets == bucket)
        for start in range(0, members.size, batch):
            rows = members[start : start + batch]
            arrays = {name: a[rows] for name, a in heldout.inputs.items()}
            yield rows, fit_to_bucket(manifest, arrays, int(bucket)), int(bucket)


def all_ramp_logits(
    runtime: BundleRuntime, heldout: Heldout, progress: Callable[[int], object] | None = None
) -> dict[str, np.ndarray]:
    """Logits of every ramp (final head included) for every held-out input, no exits."""
    out: dict[str, np.ndarray] = {}
    for rows, state, bucket in heldout_batches(runtime, heldout):
        logits, _ = runtime.run_all_ramps(state, bucket)
        for name, value in logits.items():
            if name not in out:
                out[name] = np.zeros((len(heldout), value.shape[1]), dtype=np.float32)
            out[name][rows] = value
        if progress:
            progress(len(rows))
    return out


def batch_state(runtime: BundleRuntime, heldout: Heldout, batch: int, bucket: int) -> dict[str, np.ndarray]:
    """`batch` held-out inputs (repeated if need be) padded to `bucket`: the state before block 0."""
    rows = np.arange(batch) % len(heldout)
    if heldout.inputs is not None:
        if heldout.lengths is not None:  # the longest inputs that fit, like the bucket's real traffic
            fitting = np.flatnonzero(heldout.lengths <= bucket)
            order = fitting[np.argsort(-heldout.lengths[fitting], kind="stable")] if fitting.size else np.arange(1)
            rows = order[np.arange(batch) % order.size]
        arrays = {name: a[rows] for name, a in heldout.inputs.items()}
        return fit_to_bucket(runtime.manifest, arrays, bucket)
    assert heldout.ids is not None
    fits = [s for s in heldout.ids if len(s) <= bucket] or [s[:bucket] for s in heldout.ids]
    # prefer the longest inputs that fit, so the batch looks like this bucket's real traffic
    fits = sorted(fits, key=len, reverse=True)
    names = _names(runtime)
    return pad_batch([fits[i % len(fits)] for i in range(batch)], bucket, runtime.manifest.pad_token_id, names)


def _names(runtime: BundleRuntime) -> list[str]:
    return [t.name for t in runtime.manifest.inputs]


MIN_TIMED_MS = 5.0
"""Short calls are repeated until this much time is measured (at most MAX_REPEATS runs)."""
MAX_REPEATS = 100


@dataclass
class ChainTiming:
    block_ms: list[float]
    """Per block of the runtime's range."""
    ramp_ms: dict[str, float]
    states: list[dict[str, np.ndarray]]
    """The state after each block (what a split boundary there would forward, and more)."""


def _block_call(runtime: BundleRuntime, index: int, state: dict[str, np.ndarray], bucket: int) -> Callable[[], object]:
    """Run block `index` on a fresh copy of `state` (the block writes its outputs into the state it gets)."""
    return lambda: runtime.run_block(index, dict(state), bucket)


def time_chain(
    runtime: BundleRuntime, state: dict[str, np.ndarray], bucket: int, repeats: int, warmup: int = 1
) -> ChainTiming:
    """Time every block and ramp of the range on `state`, passing real activations forward.

    The first pass computes each block's real input state; then `warmup` untimed passes and timed
    passes over the whole chain, each running every block and ramp once, so a burst of load from
    other processes spreads over all of them instead of hitting one block's repeats. Passes go on
    past `repeats` until every call has MIN_TIMED_MS of samples (at most MAX_REPEATS passes).
    """
    work = dict(state)
    inputs: list[dict[str, np.ndarray]] = []
    states: list[dict[str, np.ndarray]] = []
    ramps: list[tuple[str, dict[str, np.ndarray]]] = []
    for index in range(runtime.first_block, runtime.last_block + 1):
        inputs.append(dict(work))
        runtime.run_block(index, work, bucket)
        states.append(dict(work))
        ramps.extend((ramp.name, states[-1]) for ramp in runtime.manifest.ramps_in(index, index))
    # in serving order: each block, then the ramps that follow it
    calls: list[tuple[str, Callable[[], object]]] = []
    for index, before, after in zip(range(runtime.first_block, runtime.last_block + 1), inputs, states):
        calls.append((f"block:{index}", _block_call(runtime, index, before, bucket)))
        for ramp in runtime.manifest.ramps_in(index, index):
            calls.append((f"ramp:{ramp.name}", partial(runtime.run_ramp, ramp.name, after, bucket)))
    for _ in range(warmup):
        for _, call in calls:
            call()
    samples: dict[str, list[float]] = {key: [] for key, _ in calls}
    for passes in range(MAX_REPEATS):
        short = [(k, c) for k, c in calls if passes < max(1, repeats) or sum(samples[k]) < MIN_TIMED_MS]
        if not short:
            break
        for key, call in short:
            start = time.perf_counter()
            call()
            samples[key].append((time.perf_counter() - start) * 1000.0)
    # the fastest run, not the median: other processes on the machine only ever add time, and a call short
    # enough to run within one of the scheduler's time slices keeps its true cost in its fastest run
    fastest = {key: float(np.min(values)) for key, values in samples.items()}
    return ChainTiming(
        block_ms=[fastest[f"block:{i}"] for i in range(runtime.first_block, runtime.last_block + 1)],
        ramp_ms={name: fastest[f"ramp:{name}"] for name, _ in ramps},
        states=states,
    )
