"""The time a rebatching split holds its replica when its queues may not fill: a fixed point per split.

A rebatching split (a fusion queue per block, planner/costmodel.py) runs block k on x_k rows: a full batch
B when its queue fills within the wait `fill_ms` (the cycle), else the rows that arrived in it. A replica
busy at its rate B / T (T the mean ms per B entering rows) brings block k B s(k)/s(a) x fill_ms / T rows
per wait, so x_k = min(B, that), block k runs x_k / (B s(k)/s(a)) times per B entering rows, and
T = sum_k s(k)/s(a) x B / x_k x (block k + ramp at x_k rows). `fill_tables` solves that by fixed-point
iteration from the full-batch T for every (wait, batch, split) at once, and derives each split's latency.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]
IntArray = npt.NDArray[np.intp]

MAX_ROUNDS = 200
"""Fixed-point rounds at most (a few to a dozen are usual); a split still moving after them is inf."""


class _Curve:
    """Every block's time (+ its enabled ramp) at any number of rows: linear between the profiled batch sizes
    xs[1:] (comb[k, j] at xs[j + 1]), to 0 at xs[0] = 0, extrapolated past the largest."""

    def __init__(self, comb: FloatArray, xs: FloatArray) -> None:
        ys = np.concatenate([np.zeros((comb.shape[0], 1)), comb], axis=1)  # (k, len(xs))
        slope = np.diff(ys, axis=1) / np.diff(xs)[None, :]  # (k, segments)
        self.xs, self.ys, self.slope, self.m = xs, ys[:, :-1].ravel(), slope.ravel(), len(xs) - 1

    def at(self, x: FloatArray, k: IntArray) -> FloatArray:
        """Block k[i] at x[i] rows."""
        i = np.clip(np.searchsorted(self.xs, x, side="right") - 1, 0, self.m - 1)
        flat = k * self.m + i  # (block, segment) of each element, taken from the flattened tables
        y: FloatArray = self.ys.take(flat) + self.slope.take(flat) * (x - self.xs.take(i))
        return y


@dataclass
class _Elements:
    """The entries solved, one row per (wait, batch, split [a, b]), and one element per (row, block k the split
    runs): the arithmetic is per element, and a row's sum is over its dense row (zeros elsewhere), as a
    masked dense sum would be. Rows of the same batch and split at other waits share their elements' setup."""

    n: int
    wait_of: IntArray
    batch_of: IntArray
    a: IntArray
    b: IntArray
    fill: FloatArray
    """Per row: its wait."""
    base_of: IntArray
    """Per row: its (batch, split) among those any wait needs."""
    share: FloatArray
    """(batch and split, k): s(k)/s(a) where the split runs block k, else 0."""
    row: IntArray
    k: IntArray
    sh: FloatArray
    bsz: FloatArray
    full: FloatArray
    """Per element: its row, block, share, batch, and its block's time at the full batch."""

    def sums(self, rows: IntArray, k: IntArray, vals: FloatArray, n_rows: int) -> FloatArray:
        dense = np.zeros((n_rows, self.n))
        dense[rows, k] = vals
        total: FloatArray = dense.sum(axis=-1)
        return total


def _elements(
    curve: _Curve, ratio: FloatArray, batches: FloatArray, fills: Sequence[float], needed: BoolArray | None
) -> _Elements:
    n, nb, nf = ratio.shape[0], len(batches), len(fills)
    a_pair, b_pair = np.triu_indices(n)
    a_b, b_b = np.tile(a_pair, nb), np.tile(b_pair, nb)  # (batch, split) rows
    batch_b = np.repeat(np.arange(nb), len(a_pair))
    want = np.ones((nf, len(a_b)), dtype=bool) if needed is None else needed[:, batch_b, a_b, b_b]
    any_wait = want.any(axis=0)
    a_b, b_b, batch_b, want = a_b[any_wait], b_b[any_wait], batch_b[any_wait], want[:, any_wait]
    bsz_b = np.asarray(batches, dtype=np.float64)[batch_b]
    k_ = np.arange(n)[None, :]
    share = ratio[a_b][:, :n]  # (batch and split, k)
    mask = (k_ >= a_b[:, None]) & (k_ <= b_b[:, None]) & (bsz_b[:, None] * share > 1e-9)
    share = np.where(mask, share, 0.0)
    row_eb, k_eb = np.nonzero(mask)  # sorted by row
    b_eb = bsz_b[row_eb]
    full_eb = curve.at(b_eb, k_eb)
    # rows (wait, batch, split), and each row's elements: its (batch, split)'s
    wait_of, base_of = np.nonzero(want)
    count = np.bincount(row_eb, minlength=len(a_b))
    start = np.concatenate([[0], np.cumsum(count)[:-1]])
    per_row = count[base_of]
    row_e = np.repeat(np.arange(len(base_of)), per_row)
    idx = np.repeat(start[base_of] - np.concatenate([[0], np.cumsum(per_row)[:-1]]), per_row) + np.arange(len(row_e))
    fill = np.asarray(fills, dtype=np.float64)[wait_of]
    return _Elements(
        n,
        wait_of,
        batch_b[base_of],
        a_b[base_of],
        b_b[base_of],
        fill,
        base_of,
        share,
        row_e,
        k_eb[idx],
        share[row_eb, k_eb][idx],
        b_eb[idx],
        full_eb[idx],
    )


def _at_frac(curve: _Curve, e: _Elements, el: IntArray, frac: FloatArray) -> FloatArray:
    """Elements el's blocks at frac x their batch (their full-batch time where frac is 1: the same value)."""
    y = e.full[el].copy()
    part = frac < 1.0
    y[part] = curve.at(e.bsz[el][part] * frac[part], e.k[el][part])
    return y


def _fixed_point(curve: _Curve, e: _Elements) -> FloatArray:
    """T per row: iterated from the full-batch time until it moves by at most 1e-9 of itself; inf where it
    passes the wait (or still moves after MAX_ROUNDS)."""
    n_rows = len(e.a)
    total = e.sums(e.row, e.k, e.sh * e.full, n_rows)  # full batches
    out = np.full(n_rows, np.inf)
    active = np.flatnonzero(total <= e.fill)
    t = total[active]
    slot = np.full(n_rows, -1)  # a row's place among the active ones
    el = np.flatnonzero(np.isin(e.row, active))  # the elements of the active rows
    for _ in range(MAX_ROUNDS):
        slot[active] = np.arange(len(active))
        r_, sh = slot[e.row[el]], e.sh[el]
        frac = np.clip(sh * e.fill[e.row[el]] / t[r_], 1e-12, 1.0)
        nxt = e.sums(r_, e.k[el], sh / frac * _at_frac(curve, e, el, frac), len(active))
        done = np.abs(nxt - t) <= 1e-9 * t
        out[active[done]] = nxt[done]
        keep = ~done & (nxt <= e.fill[active])
        active, t = active[keep], nxt[keep]
        if not len(active):
            break
        el = el[keep[r_]]
    return out


def _latency(curve: _Curve, e: _Elements, out: FloatArray) -> FloatArray:
    """W per row, and `out` set to inf where a row would take more than two cycles through the split.

    A row's time through the split: at each block it waits on average half the time its queue takes to
    gather a batch (B s(k)/s(a) rows per T at the replica's rate, at most the wait), then runs; at most two
    cycles, the share a split has without rebatching (wait one, run one)."""
    ok = np.flatnonzero(np.isfinite(out))
    slot = np.full(len(out), -1)
    slot[ok] = np.arange(len(ok))
    el = np.flatnonzero(np.isfinite(out[e.row]))
    row_el = e.row[el]
    r_, k_el, sh, fill_el, t_el = slot[row_el], e.k[el], e.sh[el], e.fill[row_el], out[row_el]
    frac = np.clip(sh * fill_el / t_el, 1e-12, 1.0)
    gather = np.minimum(frac * t_el / np.maximum(sh, 1e-12), fill_el)
    # a block whose rows all come from the block before in whole batches fills at once
    prev = np.where(k_el > 0, e.share[e.base_of[row_el], np.maximum(k_el - 1, 0)], 0.0)
    gather = np.where((k_el > e.a[row_el]) & (np.abs(prev - sh) <= 1e-12), 0.0, gather)
    run = _at_frac(curve, e, el, frac)
    latency = e.sums(r_, k_el, gather / 2 + run, len(ok))
    worst = np.full(len(out), np.inf)
    worst[ok] = e.sums(r_, k_el, gather + run, len(ok))
    too_long = latency > 2.0 * e.fill[ok] * (1 + 1e-9)
    out[ok[too_long]] = np.inf
    worst[ok[too_long]] = np.inf
    return worst


def fill_tables(
    comb: FloatArray,
    xs: FloatArray,
    ratio: FloatArray,
    batches: FloatArray,
    fills: Sequence[float],
    needed: BoolArray | None = None,
) -> tuple[FloatArray, FloatArray]:
    """(T[f, bi, a, b], W[f, bi, a, b]) at batch batches[bi] and wait fills[f]: T the mean ms per batch of
    entering rows of rebatching split [a, b]; inf where T would exceed the wait (slower than any split
    without rebatching that fits the cycle) or a row would take longer than two cycles through the split
    on average. W the longest a row that runs every block of the split takes through it: at each block the
    whole time its queue takes to gather its rows, then the run (inf where T is).

    `comb[k, j]`: block k (+ its enabled ramp) at xs[j + 1] rows (xs[0] = 0: linear to 0 below the
    smallest, extrapolated above the largest); `ratio[a, k]` = s(k)/s(a); `needed[f, bi, a, b]`: the
    entries wanted (the others inf; every entry is solved on its own, so leaving some out changes none).
    """
    n, nb, nf = comb.shape[0], len(batches), len(fills)
    curve = _Curve(comb, xs)
    e = _elements(curve, ratio, batches, fills, needed)
    out = _fixed_point(curve, e)
    worst = _latency(curve, e, out)
    table, longest = np.full((nf, nb, n, n), np.inf), np.full((nf, nb, n, n), np.inf)
    table[e.wait_of, e.batch_of, e.a, e.b] = out
    longest[e.wait_of, e.batch_of, e.a, e.b] = worst
    return table, longest
