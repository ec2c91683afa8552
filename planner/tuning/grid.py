"""Exhaustive grid search over exit thresholds: the reference the tuner is measured against.

Every ramp takes each value of ``grid`` (e.g. 0.00, 0.01, ..., 1.00) or is disabled; the search
returns the configuration with the largest saving whose agreement holds the budget (ties: higher
agreement, then the first found). The same semantics as :mod:`exitplan.planner.tuning.feedback`.

It is exact and vectorised: the thresholds of all ramps but the last two are enumerated (a Python
loop over |grid + 1| ** (R - 2) combinations); for the last two ramps every pair of thresholds is
scored at once from 2-D histograms of the inputs' grid bins and cumulative sums. With R = 3 at step
0.01 that is 102 combinations of a 102 x 102 table; R = 4 at step 0.05, 484 combinations of 22 x 22.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from exitplan.planner.tuning.feedback import DISABLED, FeedbackWindow, allowed_disagreements, outcome


@dataclass(frozen=True)
class GridResult:
    thresholds: np.ndarray
    agreement: float
    saving_ms: float
    configs: int
    """Configurations scored."""


def grid_values(step: float) -> np.ndarray:
    """0, step, 2 step, ..., 1 (rounded to 1e-9 so 0.07 is 0.07)."""
    count = int(round(1.0 / step))
    if count < 1 or abs(count * step - 1.0) > 1e-9:
        raise ValueError(f"grid step must divide 1, got {step}")
    return np.round(np.arange(count + 1) * step, 9)


def grid_search(w: FeedbackWindow, budget: float, step: float) -> GridResult:
    """The best grid configuration within ``budget``; all ramps disabled is always a candidate."""
    grid = grid_values(step)
    g = grid.size  # active values; index g means disabled
    n, r = w.n_inputs, w.n_ramps
    allowed = allowed_disagreements(n, budget)
    # bins[i, q] = number of grid values <= conf: ramp q at grid index j lets input i out iff j < bins.
    bins = np.searchsorted(grid, w.conf, side="right")
    agree = w.agree.astype(np.float64)
    cost, saving = w.cost_ms, w.saving_ms
    head = r - 2 if r >= 2 else 0
    pair = list(range(head, r))
    best_total, best_agree, best_cfg = -np.inf, -1, None
    configs = 0
    for combo in itertools.product(range(g + 1), repeat=head):
        j = np.asarray(combo, dtype=np.int64)
        # Inputs leaving at the enumerated head ramps.
        total_fixed, agree_fixed = 0.0, 0
        alive = np.ones(n, dtype=bool)
        paid = 0.0  # cost of the active head ramps, paid by everyone who reaches the pair
        for q in range(head):
            if j[q] >= g:
                continue
            paid += cost[q]
            out = alive & (j[q] < bins[:, q])
            total_fixed += float(out.sum()) * (saving[q] - paid)
            agree_fixed += int(agree[out, q].sum())
            alive &= ~out
        totals, agrees = _score_tail(bins[alive][:, pair], agree[alive][:, pair], saving[pair], cost[pair], g, paid)
        totals = totals + total_fixed
        agrees = agrees + agree_fixed
        configs += totals.size
        feasible = n - agrees <= allowed
        if not feasible.any():
            continue
        top = totals[feasible].max()
        flat = int(np.argmax(np.where(feasible & (totals >= top - 1e-9), agrees, -1)))
        if top > best_total + 1e-9 or (top >= best_total - 1e-9 and agrees.flat[flat] > best_agree):
            best_total, best_agree = float(totals.flat[flat]), int(agrees.flat[flat])
            best_cfg = (j, np.unravel_index(flat, totals.shape))
    assert best_cfg is not None  # all disabled agrees everywhere
    j, tail = best_cfg
    idx = list(j) + [int(x) for x in tail]
    thresholds = np.array([DISABLED if i >= g else grid[i] for i in idx])
    out = outcome(w, thresholds)
    return GridResult(thresholds, out.agreement, out.saving_ms, configs)


def _score_tail(
    bins: np.ndarray, agree: np.ndarray, saving: np.ndarray, cost: np.ndarray, g: int, paid: float
) -> tuple[np.ndarray, np.ndarray]:
    """Total saving and agreeing count for every threshold index of the last one or two ramps."""
    m = bins.shape[0]
    size = g + 1
    act = np.arange(size) < g  # index g = disabled
    if bins.shape[1] == 1:
        b = bins[:, 0]
        count_out = np.bincount(b, minlength=size + 1)  # bins run 0..g
        agree_out = np.bincount(b, weights=agree[:, 0], minlength=size + 1)
        # exits at index j: inputs with bin > j (suffix sums)
        n_exit = np.cumsum(count_out[::-1])[::-1][1 : size + 1]
        a_exit = np.cumsum(agree_out[::-1])[::-1][1 : size + 1]
        c0 = np.where(act, cost[0], 0.0)
        totals = n_exit * (saving[0] - paid - c0) + (m - n_exit) * (-paid - c0)
        agrees = np.rint(a_exit).astype(np.int64) + (m - n_exit)
        return totals, agrees
    x, y = bins[:, 0], bins[:, 1]
    cells = (size + 1) * (size + 1)
    key = x * (size + 1) + y
    h_one = np.bincount(key, minlength=cells).reshape(size + 1, size + 1).astype(np.float64)
    h_a = np.bincount(key, weights=agree[:, 0], minlength=cells).reshape(size + 1, size + 1)
    h_b = np.bincount(key, weights=agree[:, 1], minlength=cells).reshape(size + 1, size + 1)
    # Ramp a at index ja lets out bins x > ja; the rest (x <= ja) reach ramp b, which lets out y > jb.
    row_one, row_a = h_one.sum(axis=1), h_a.sum(axis=1)
    n_a = np.cumsum(row_one[::-1])[::-1][1 : size + 1]  # x > ja
    agree_a = np.cumsum(row_a[::-1])[::-1][1 : size + 1]
    stay_one = np.cumsum(h_one, axis=0)[:size]  # [ja, y]: x <= ja
    stay_b = np.cumsum(h_b, axis=0)[:size]
    n_b = np.cumsum(stay_one[:, ::-1], axis=1)[:, ::-1][:, 1 : size + 1]  # y > jb
    agree_b = np.cumsum(stay_b[:, ::-1], axis=1)[:, ::-1][:, 1 : size + 1]
    n_end = (m - n_a)[:, None] - n_b
    ca = np.where(act, cost[0], 0.0)[:, None]
    cb = np.where(act, cost[1], 0.0)[None, :]
    totals = n_a[:, None] * (saving[0] - paid - ca) + n_b * (saving[1] - paid - ca - cb) + n_end * (-paid - ca - cb)
    agrees = np.rint(agree_a[:, None] + agree_b).astype(np.int64) + n_end.astype(np.int64)
    return totals, agrees
