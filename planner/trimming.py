"""What a trimming worker computes a batch at: its longest row, not its bucket.

A CPU worker that ends the model and runs its split as one batch cuts each batch to its longest row,
rounded up to TRIM_STEP tokens (worker_image/classify/trim.py). Its mean time per batch is then the
profile's time at that length, not at the bucket's: for a batch of B inputs of the bucket (lo, hi], the
expected length is E[min(hi, ceil(max(L_1..L_B) / step) x step)] with the L_i drawn independently from
the bucket's lengths. The lengths are the raw ones the planner was given (a trace), else the histogram on
the profile's grid with each bin's mass spread evenly over its lengths (the routers report no finer).

Only the throughput (the mean) uses it: a batch may still hold a row of the bucket's full length, so the
bound each split must fit into its cycle stays at the bucket.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

TRIM_STEP = 8
"""As the data plane's (worker_image/classify/trim.py; the planner imports nothing from the data plane)."""


def trims(gpu_resource: str, seq_lens: Sequence[int], rebatch: bool) -> bool:
    """Whether a pool's workers that end the model trim: CPU pools (no accelerator resource) of a model
    with a sequence axis, splits that run as one batch (`--trim auto`)."""
    return gpu_resource == "" and list(seq_lens) != [1] and not rebatch


def length_support(
    grid: Sequence[int], mass: np.ndarray, lengths: np.ndarray | None, lo: int, hi: int
) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, probabilities) of inputs in the bucket (lo, hi]: the raw lengths when given, else the
    grid's mass spread evenly over each bin's lengths. Empty when none falls there."""
    if lengths is not None and len(lengths):
        inside = lengths[(lengths > lo) & (lengths <= hi)]
        values, counts = np.unique(inside, return_counts=True)
        total = counts.sum()
        return values.astype(np.float64), (counts / total if total else counts.astype(np.float64))
    spans: list[np.ndarray] = []
    weights: list[np.ndarray] = []
    prev = 0
    for g, m in zip(grid, mass):
        span = np.arange(prev + 1, int(g) + 1)
        keep = span[(span > lo) & (span <= hi)]
        if m > 0 and len(keep):
            spans.append(keep.astype(np.float64))
            weights.append(np.full(len(keep), float(m) / len(span)))
        prev = int(g)
    if not spans:
        return np.zeros(0), np.zeros(0)
    v, p = np.concatenate(spans), np.concatenate(weights)
    return v, p / p.sum()


def trimmed_length(values: np.ndarray, probs: np.ndarray, hi: int, batch: float, step: int = TRIM_STEP) -> float:
    """Expected length a batch of `batch` inputs drawn from (values, probs) runs at: the longest rounded
    up to `step`, at most `hi` (`hi` when the bucket holds no input)."""
    if not len(values):
        return float(hi)
    rounded = np.minimum(np.ceil(values / step) * step, hi)
    order = np.argsort(rounded, kind="stable")
    r, cdf = rounded[order], np.cumsum(probs[order])
    cdf[-1] = 1.0
    below = np.concatenate([[0.0], cdf[:-1]])
    b = max(float(batch), 1.0)
    return float(np.sum(r * (cdf**b - below**b)))
