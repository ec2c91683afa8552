"""A split worker's warm-up: the split's first-block inputs read from its ONNX file, a dummy batch shaped
from them, and the timings that fit the worker's expected service time (`service_time.py`).

Runs once, before the worker reports ready, on its inference thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnxruntime as ort

from exitplan.api.dtypes import by_onnx
from exitplan.worker_image.bundle_runtime import BundleRuntime
from exitplan.worker_image.classify.executor import execute
from exitplan.worker_image.classify.service_time import Fit, ServiceTime
from exitplan.worker_image.classify.trim import TRIM_STEP, cut_to

log = logging.getLogger(__name__)


def first_block_inputs(runtime: BundleRuntime) -> list[Any]:
    """The input specs (`onnxruntime.NodeArg`: name, shape with its named dimensions, type) of the
    runtime's first block's ONNX file."""
    first = runtime.manifest.blocks[runtime.first_block]
    session = ort.InferenceSession(str(runtime.directory / first.file), providers=["CPUExecutionProvider"])
    return list(session.get_inputs())


def dummy_state(runtime: BundleRuntime, n: int, bucket: int) -> dict[str, np.ndarray]:
    """Inputs of the runtime's first block, shaped for batch n and this bucket (read from the ONNX file)."""
    state = {}
    for spec in first_block_inputs(runtime):
        dims = [n if d == "batch" else bucket if d == "seq" else (d if isinstance(d, int) else 1) for d in spec.shape]
        dtype = np.dtype(by_onnx(spec.type).numpy)  # the runtime checked these types at load
        state[spec.name] = (np.ones if "mask" in spec.name else np.zeros)(dims, dtype=dtype)
    return state


def time_batch(runtime: BundleRuntime, bucket: int, n: int, template: Mapping[str, np.ndarray]) -> float:
    """The fastest of three runs of a batch of n copies of `template`'s first row, in ms."""
    state = {k: np.repeat(v[:1], n, axis=0) for k, v in template.items()}
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        execute(runtime, state, bucket, {}, np.zeros(n, bool), np.zeros(n, bool))
        best = min(best, (time.perf_counter() - t0) * 1000)
    return best


def warm_up(
    runtime: BundleRuntime, bucket: int, batch_size: int, trim_axes: Mapping[str, int], times: ServiceTime
) -> dict[str, np.ndarray]:
    """Run and time the split at batch 1 and at its planned batch; fit `times` from that (at the bucket's
    length, and at a short length too for a trimming worker, `trim_axes` non-empty). Returns the one-row
    input the model ran: a known-good input (`batch_bisect.known_input_check`)."""
    template = dummy_state(runtime, 1, bucket)
    small = time_batch(runtime, bucket, 1, template)
    big_n = max(2, batch_size)
    big = time_batch(runtime, bucket, big_n, template)
    times.fits[bucket] = Fit.of(small, big, big_n)
    if trim_axes and bucket > 2 * TRIM_STEP:  # a trimming worker: its fit at a short length too
        cut = cut_to(template, trim_axes, 2 * TRIM_STEP)
        short = 2 * TRIM_STEP
        times.fits[short] = Fit.of(time_batch(runtime, bucket, 1, cut), time_batch(runtime, bucket, big_n, cut), big_n)
    log.info("warm-up: %.2f ms at batch 1, %.2f ms at batch %d; fits %s", small, big, big_n, times.describe())
    return template
