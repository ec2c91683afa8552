"""Length buckets (Arlo's polymorphing): a histogram of input lengths on the profile's length grid,
the staircase of latency over length, and the choice of bucket sets.

A length distribution is held as mass per profiled length `grid[i]`: the share of inputs whose
length falls in (grid[i-1], grid[i]]. A bucket set is a strictly increasing subset of the grid that
holds its largest length (every input must fit some bucket); each input runs in the smallest bucket
that holds it, padded to the bucket's length.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

STAIR_STEP = 0.10
"""A profiled length starts a new stair when it costs this much more than the previous length."""


def histogram_on_grid(
    grid: Sequence[int],
    lengths: Sequence[int] | None = None,
    *,
    bounds: Sequence[int] | None = None,
    counts: Sequence[float] | None = None,
) -> np.ndarray:
    """Mass per grid length, from raw lengths or from a histogram (bounds = each bin's max length).

    A bin is charged to the smallest grid length >= its bound (conservative: never shorter than the
    input). Lengths above the grid's largest length are charged to it.
    """
    g = np.asarray(grid, dtype=np.int64)
    mass = np.zeros(len(g))
    if lengths is not None:
        idx = np.minimum(np.searchsorted(g, np.asarray(lengths), side="left"), len(g) - 1)
        np.add.at(mass, idx, 1.0)
    if bounds is not None and counts is not None:
        for b, c in zip(bounds, counts):
            mass[min(int(np.searchsorted(g, b, side="left")), len(g) - 1)] += float(c)
    total = mass.sum()
    return mass / total if total > 0 else mass


def staircase(grid: Sequence[int], cost: Sequence[float], step: float = STAIR_STEP) -> list[int]:
    """The grid lengths where the per-input cost jumps (the top of each stair), largest always kept.

    A length whose cost is within `step` of the next longer one does not earn its own runtime:
    padding up to the next length costs little. `cost[i]` is the per-input cost at `grid[i]`.
    """
    keep = []
    for i in range(len(grid)):
        if i == len(grid) - 1 or cost[i + 1] > (1.0 + step) * cost[i]:
            keep.append(int(grid[i]))
    return keep


def best_bucket_sets(
    grid: Sequence[int], mass: np.ndarray, cost: Sequence[float], candidates: Sequence[int], max_buckets: int
) -> dict[int, list[int]]:
    """For each count m <= max_buckets, the m-bucket set (from `candidates`, holding the largest
    length) that minimises the expected per-input cost sum_i mass[i] * cost(bucket of grid[i]).

    An exact DP over the candidates in order (O(m n^2)).
    """
    grid = list(grid)
    cand = sorted(set(int(c) for c in candidates) | {grid[-1]})
    pos = {length: grid.index(length) for length in cand}
    cum = np.concatenate([[0.0], np.cumsum(mass)])

    def seg_cost(prev_len: int | None, top: int) -> float:
        lo = 0 if prev_len is None else pos[prev_len] + 1
        hi = pos[top]
        return float((cum[hi + 1] - cum[lo]) * cost[hi])

    n = len(cand)
    max_buckets = max(1, min(max_buckets, n))
    # best[m][j]: cheapest way to cover lengths up to cand[j] with m buckets, the last at cand[j].
    best = np.full((max_buckets + 1, n), np.inf)
    arg = np.full((max_buckets + 1, n), -1, dtype=np.int64)
    for j in range(n):
        best[1, j] = seg_cost(None, cand[j])
    for m in range(2, max_buckets + 1):
        for j in range(n):
            for i in range(j):
                c = best[m - 1, i] + seg_cost(cand[i], cand[j])
                if c < best[m, j]:
                    best[m, j], arg[m, j] = c, i
    out: dict[int, list[int]] = {}
    for m in range(1, max_buckets + 1):
        if not np.isfinite(best[m, n - 1]):
            continue
        chosen, j, mm = [], n - 1, m
        while mm >= 1 and j >= 0:
            chosen.append(cand[j])
            j, mm = int(arg[mm, j]), mm - 1
        out[m] = sorted(chosen)
    return out


def shares(grid: Sequence[int], mass: np.ndarray, buckets: Sequence[int]) -> np.ndarray:
    """Share of inputs per bucket (each input in the smallest bucket that holds it)."""
    grid_arr = np.asarray(grid)
    idx = np.searchsorted(np.asarray(buckets), grid_arr, side="left")
    out = np.zeros(len(buckets))
    for i, k in enumerate(idx):
        out[min(int(k), len(buckets) - 1)] += mass[i]
    total = out.sum()
    return out / total if total > 0 else out
