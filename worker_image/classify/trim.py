"""Each batch padded only to its longest row (rounded up to TRIM_STEP tokens), within the worker's bucket.

The router pads every input to its cell's bucket. On a CPU, where a batch costs about its tokens, a worker
of bucket 128 running a batch of 30-token inputs at 128 spends four times what it needs; the serving
systems users compare against pad a batch only to its longest input. A worker that trims runs sessions
whose `seq` dimension is free (`BundleRuntime(free_length=True)`: on CPU a free-shape session is as fast
as a fixed one at the same length, BENCHMARKS "Length buckets vs one padded length vs dynamic shapes")
and runs each batch at its longest row rounded up to TRIM_STEP: the attention mask says where each row
ends (right-padded, as the router pads), every input with a `seq` dimension is cut there, and the masked
positions it drops changed nothing but padding.

Only where the shorter shapes go nowhere: the worker must end the model (the last split: its batches
answer and forward nothing) and run its split as one batch (no rebatching, whose inner queues stack
rows of one length). GPUs, whose kernels are tuned to fixed shapes and whose batches are flat in their
size up to a point, keep them: by default only CPU workers trim (`--trim auto`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from exitplan.api.bundle import BundleManifest
from exitplan.api.plan import SplitPlan
from exitplan.worker_image.bundle_runtime import mask_input

__all__ = ["SEQ_DIM", "TRIM_STEP", "cut_to", "longest_row", "mask_input", "seq_axes", "trim_length", "trimmed", "trims"]

SEQ_DIM = "seq"
TRIM_STEP = 8
"""A trimmed batch's length is a multiple of this (or the bucket): fewer distinct shapes, at most 7 pad tokens."""


def trims(manifest: BundleManifest, split: SplitPlan, providers: Sequence[str], trim: bool | None) -> bool:
    """Whether a worker of `split` trims: asked to (None: on CPU providers only), the model has an attention
    mask, the split ends the model and runs as one batch."""
    if trim is None:
        trim = all(p == "CPUExecutionProvider" for p in providers)
    ends = split.last_block == len(manifest.blocks) - 1
    return bool(trim and mask_input(manifest) and ends and not split.rebatch)


def seq_axes(input_shapes: Mapping[str, Sequence[object]]) -> dict[str, int]:
    """Per input, the axis named `seq` in its ONNX shape (inputs without one are left out)."""
    return {name: list(shape).index(SEQ_DIM) for name, shape in input_shapes.items() if SEQ_DIM in list(shape)}


def longest_row(mask: np.ndarray, axis: int) -> int:
    """One past the last position any row of the batch marks as real (right-padded rows)."""
    marked = np.flatnonzero(np.any(np.moveaxis(mask, axis, -1).reshape(-1, mask.shape[axis]) != 0, axis=0))
    return int(marked[-1]) + 1 if marked.size else 1


def trim_length(
    state: Mapping[str, np.ndarray], mask: str, axes: Mapping[str, int], bucket: int, step: int = TRIM_STEP
) -> int:
    """The length a batch is trimmed to: its longest row rounded up to `step`, at most `bucket`."""
    return min(-(-longest_row(state[mask], axes[mask]) // step) * step, bucket)


def trimmed(
    state: Mapping[str, np.ndarray], mask: str, axes: Mapping[str, int], bucket: int, step: int = TRIM_STEP
) -> tuple[dict[str, np.ndarray], int]:
    """(the state cut to its longest row rounded up to `step`, that length); the state as it is and `bucket`
    when nothing shorter holds it."""
    length = trim_length(state, mask, axes, bucket, step)
    if length >= bucket:
        return dict(state), bucket
    return cut_to(state, axes, length), length


def cut_to(state: Mapping[str, np.ndarray], axes: Mapping[str, int], length: int) -> dict[str, np.ndarray]:
    """Every input with a `seq` axis (`axes`) cut to its first `length` positions; the others as they are."""
    return {
        name: np.take(value, np.arange(length), axis=axes[name]) if name in axes else value
        for name, value in state.items()
    }
