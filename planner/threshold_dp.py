"""A budget-indexed dynamic programme over the ramps: the tuner's restart from scratch (pure numpy).

The greedy climb spends the budget in the order of best ratio first, which can leave a knapsack
gap: a cheap, efficient move taken early leaves too little budget for the move that pays most
(bench/tuner_vs_grid.py found windows at 84 % of the grid optimum that way). This programme looks
at the budget as a whole. It decides the ramps in block order; a *state* after ramps 0..r-1 is a
configuration of those ramps, with the inputs still running (``alive``), the number of exited
inputs that disagree with the full model ``d`` (0 <= d <= allowed) and the saving so far, counting
the inputs still running as if they ran to the end. For ramp r and a state, the options are:
disabled, or active letting out the longest confidence-ordered prefix of the running inputs that
holds exactly b more disagreements, for each b that fits. (A shorter prefix with the same b is never
better when exiting earlier saves more: the extra inputs agree, and exit where they save most.)
States are merged by d, keeping the ``beam`` best savings per d (with a large budget, d is
grouped into at most ``max_levels`` levels, so the cost does not grow with the budget). After the last ramp the best state
is the answer: a complete configuration, exactly evaluated, within budget by construction.

With one ramp (and with two, given savings that shrink with depth) this is exact over all distinct
thresholds; beyond, the merge by d is the approximation. Cost: per ramp a few [states, N] array
operations, states <= beam * min(allowed + 1, max_levels).
"""

from __future__ import annotations

import numpy as np

from .exit_window import DISABLED, Window


def budget_dp(w: Window, allowed: int, beam: int = 1, max_levels: int = 16, movable: np.ndarray | None = None,
              fixed: np.ndarray | None = None, orders: list[np.ndarray] | None = None,
              ties: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """(thresholds [R], their total saving over the window's inputs) from the programme.

    ``movable`` False ramps keep ``fixed`` (their thresholds).

    ``orders``: per ramp, the inputs by confidence, highest first (computed here when not given);
    ``ties``: per ramp, whether two inputs share a confidence (checked here when not given).
    """
    n, r_all = w.n_inputs, w.n_ramps
    levels = allowed + 1
    width = -(-levels // max_levels)  # disagreement counts merged per state level
    alive = np.ones((1, n), dtype=bool)
    d = np.zeros(1, dtype=np.int64)
    total = np.zeros(1)
    parents: list[np.ndarray] = []
    cuts: list[np.ndarray] = []  # per ramp and state: last exiting position in confidence order (-1: off)
    sorted_conf: list[np.ndarray] = []
    bad_t = ~np.ascontiguousarray(w.agree.T)
    conf_t = np.ascontiguousarray(w.conf.T)
    for r in range(r_all):
        order = np.argsort(-conf_t[r]) if orders is None else orders[r]
        c = conf_t[r, order]
        sorted_conf.append(c)
        tied = bool((c[1:] == c[:-1]).any()) if ties is None else bool(ties[r])
        ends = np.flatnonzero(np.append(c[1:] != c[:-1], True)) if tied else None
        s_count = d.size
        cost_r, saving_r = float(w.cost_ms[r]), float(w.saving_ms[r])
        if movable is not None and not movable[r]:
            # A fixed ramp: every state applies the given threshold.
            t_fix = float(fixed[r]) if fixed is not None else DISABLED
            if t_fix <= 1.0:
                n_alive = np.count_nonzero(alive, axis=1)
                out = alive & (conf_t[r] >= t_fix)
                exits = out.sum(axis=1)
                d = d + (out & bad_t[r]).sum(axis=1)
                total = total + saving_r * exits - cost_r * n_alive
                alive = alive & ~out
            keep = d < levels
            parents.append(np.flatnonzero(keep))
            cuts.append(np.full(int(keep.sum()), -2))  # -2: the fixed threshold
            alive, d, total = alive[keep], d[keep], total[keep]
            continue
        alive_sorted = alive[:, order]
        c_alive = np.cumsum(alive_sorted, axis=1, dtype=np.int32)
        c_bad = np.cumsum(alive_sorted & bad_t[r, order], axis=1, dtype=np.int32)
        n_alive = c_alive[:, -1]
        if ends is not None:
            c_alive, c_bad = c_alive[:, ends], c_bad[:, ends]
        groups = n if ends is None else ends.size
        # For each state and b: the last tie group with <= b disagreements (c_bad never decreases
        # along a row, so one search over the rows laid end to end answers every (state, b)).
        offset = np.arange(s_count, dtype=np.int32)[:, None] * np.int32(n + 1)
        flat = (c_bad + offset).ravel()
        queries = np.arange(levels, dtype=np.int32)[None, :] + offset
        upto = np.searchsorted(flat, queries.ravel(), side="right").reshape(s_count, levels) - 1
        upto -= np.arange(s_count)[:, None] * groups
        j = np.maximum(upto, 0)
        exits = np.where(upto >= 0, np.take_along_axis(c_alive, j, axis=1), 0)
        bad = np.take_along_axis(c_bad, j, axis=1)
        new_d = d[:, None] + bad
        ok = (upto >= 0) & (exits > 0) & (new_d < levels)
        # The same prefix shows up for several b; keep it once (at its own b).
        ok &= bad == np.arange(levels)[None, :]
        cand_total = total[:, None] + saving_r * exits - cost_r * n_alive[:, None]
        src = np.nonzero(ok)[0]
        grp = j[ok]
        all_d = np.concatenate((d, new_d[ok]))
        all_total = np.concatenate((total, cand_total[ok]))
        all_src = np.concatenate((np.arange(s_count), src))
        all_grp = np.concatenate((np.full(s_count, -1), grp))
        # Keep the `beam` best per level of d (levels grouped `width` at a time on large budgets).
        sort = np.lexsort((-all_total, all_d // width))
        sd = all_d[sort] // width
        first = np.searchsorted(sd, sd, side="left")
        keep = sort[(np.arange(sd.size) - first) < beam]
        parents.append(all_src[keep])
        gsel = all_grp[keep]
        cut = gsel if ends is None else np.where(gsel >= 0, ends[np.maximum(gsel, 0)], -1)
        cuts.append(cut)
        # The prefix up to a tie-group end is exactly the inputs with confidence >= its last one.
        lowest = np.where(cut >= 0, c[np.maximum(cut, 0)], np.inf)
        alive = alive[all_src[keep]] & (conf_t[r][None, :] < lowest[:, None])
        d, total = all_d[keep], all_total[keep]
    if total.size == 0:  # the fixed ramps alone break the budget
        return np.where(movable, DISABLED, fixed) if movable is not None else np.full(r_all, DISABLED), -np.inf
    best = int(np.argmax(total))
    best_total = float(total[best])
    t = np.empty(r_all)
    for r in range(r_all - 1, -1, -1):
        e = int(cuts[r][best])
        c = sorted_conf[r]
        if e == -2:
            t[r] = float(fixed[r]) if fixed is not None else DISABLED
        elif e < 0:
            t[r] = DISABLED
        elif e + 1 < n and c[e + 1] < (c[e] + c[e + 1]) / 2.0 <= c[e]:
            t[r] = (c[e] + c[e + 1]) / 2.0  # midway to the next lower confidence
        else:
            t[r] = c[e]
        best = int(parents[r][best])
    return t, best_total
