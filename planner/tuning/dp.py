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

from exitplan.planner.tuning.feedback import DISABLED, FeedbackWindow


def budget_dp(w: FeedbackWindow, allowed: int, beam: int = 1, max_levels: int = 16, movable: np.ndarray | None = None,
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
    count_t = np.int16 if n < 2**15 else np.int64  # running counts (exact; narrow is faster)
    d = np.zeros(1, dtype=np.int64)
    total = np.zeros(1)
    parents: list[np.ndarray] = []
    cuts: list[np.ndarray] = []  # per ramp and state: last exiting position in confidence order (-1: off)
    sorted_conf: list[np.ndarray] = []
    bad_t = ~np.ascontiguousarray(w.agree.T)
    conf_t = w.conf_t
    if orders is None:
        orders = [np.argsort(-conf_t[r]) for r in range(r_all)]
    # ``alive`` [N, states]: the inputs still running in each state, rows in ramp r's confidence
    # order (input-major, so moving to the next ramp's order is one row gather).
    alive = np.ones((n, 1), dtype=bool)
    positions = np.arange(n)
    rank_in = np.empty(n, dtype=np.intp)
    for r in range(r_all):
        order = orders[r]
        c = conf_t[r, order]
        sorted_conf.append(c)
        bad_r = bad_t[r, order]
        tied = bool((c[1:] == c[:-1]).any()) if ties is None else bool(ties[r])
        gstart = None  # per sorted position: where its tie group starts (None: no ties)
        if tied:
            starts = np.flatnonzero(np.concatenate(([True], c[1:] != c[:-1])))
            gstart = np.repeat(starts, np.diff(np.append(starts, n)))
        s_count = d.size
        cost_r, saving_r = float(w.cost_ms[r]), float(w.saving_ms[r])
        if movable is not None and not movable[r]:
            # A fixed ramp: every state applies the given threshold.
            t_fix = float(fixed[r]) if fixed is not None else DISABLED
            if t_fix <= 1.0:
                n_alive = alive.sum(axis=0, dtype=np.int64)
                out = alive & (c >= t_fix)[:, None]
                exits = out.sum(axis=0, dtype=np.int64)
                d = d + (out & bad_r[:, None]).sum(axis=0, dtype=np.int64)
                total = total + saving_r * exits - cost_r * n_alive
                alive = alive & ~out
            keep = np.flatnonzero(d < levels)
            parents.append(keep)
            cuts.append(np.full(keep.size, -2))  # -2: the fixed threshold
            alive, d, total = alive[:, keep], d[keep], total[keep]
        else:
            c_alive = np.cumsum(alive, axis=0, dtype=count_t)
            n_alive = c_alive[-1].astype(np.int64)
            # For each state and b: the longest prefix (ending at a tie-group end) holding exactly b
            # disagreements ends just before the tie group of the state's (b+1)-th disagreeing
            # input, and holds b of them only if its b-th one lies before that group; b = all of
            # them: every running input exits. Read off the disagreeing running inputs state by state.
            bad_pos = np.flatnonzero(bad_r)  # sorted positions of the inputs ramp r gets wrong
            bad_alive = alive[bad_pos]
            seen = np.cumsum(bad_alive, axis=0, dtype=count_t)  # [B, S]: rank + 1 of each running one
            n_bad = seen[-1].astype(np.int64) if bad_pos.size else np.zeros(s_count, dtype=np.int64)
            take = bad_alive & (seen <= (levels - d)[None, :])  # b = rank keeps d + b < levels
            hit = np.flatnonzero(take.T)  # state-major: each state's ranks 0, 1, ... in turn
            rows = hit // max(bad_pos.size, 1)
            j = hit - rows * bad_pos.size
            cols = bad_pos[j]
            rank = seen[j, rows].astype(np.int64) - 1
            start = cols if gstart is None else gstart[cols]
            cut = start - 1
            exits = np.where(cut >= 0, c_alive[np.maximum(cut, 0), rows], 0).astype(np.int64)
            ok = exits > 0
            if gstart is not None and rows.size:
                prev = np.empty_like(cols)
                prev[0], prev[1:] = -1, cols[:-1]
                ok &= (rank == 0) | (prev < start)
            whole_rows = np.flatnonzero((n_alive > 0) & (d + n_bad < levels))
            src = np.concatenate((rows[ok], whole_rows))
            b = np.concatenate((rank[ok], n_bad[whole_rows]))
            ex = np.concatenate((exits[ok], n_alive[whole_rows]))
            cut = np.concatenate((cut[ok], np.full(whole_rows.size, n - 1)))
            if whole_rows.size and src.size > whole_rows.size:
                seq = np.argsort(src * np.int64(levels + 1) + b, kind="stable")  # state-major (state, b)
                src, b, ex, cut = src[seq], b[seq], ex[seq], cut[seq]
            all_d = np.concatenate((d, d[src] + b))
            all_total = np.concatenate((total, total[src] + saving_r * ex - cost_r * n_alive[src]))
            all_src = np.concatenate((np.arange(s_count), src))
            all_cut = np.concatenate((np.full(s_count, -1), cut))
            # Keep the `beam` best per level of d (levels grouped `width` at a time on large budgets).
            level = all_d // width
            if beam == 1:  # per level the best total, the first such candidate on ties (no sort needed)
                best_at = np.full(max_levels + 1, -np.inf)
                np.maximum.at(best_at, level, all_total)
                tops = np.flatnonzero(all_total == best_at[level])
                first = np.full(max_levels + 1, all_total.size)
                np.minimum.at(first, level[tops], tops)
                keep = first[first < all_total.size]
            else:
                sort = np.lexsort((-all_total, level))
                sd = level[sort]
                keep = sort[(np.arange(sd.size) - np.searchsorted(sd, sd, side="left")) < beam]
            parents.append(all_src[keep])
            cut = all_cut[keep]
            cuts.append(cut)
            d, total = all_d[keep], all_total[keep]
            if r + 1 < r_all:  # (after the last ramp nobody asks who is still running)
                # Still running after ramp r: sorted positions past the cut (a cut ends a tie group),
                # taken straight into ramp r + 1's confidence order (rows first: the cheaper gather).
                rank_in[order] = positions
                rows_next = rank_in[orders[r + 1]]
                alive = np.take(alive, rows_next, axis=0)[:, all_src[keep]] & (rows_next[:, None] > cut[None, :])
            continue
        if r + 1 < r_all:  # rows into ramp r + 1's confidence order
            rank_in[order] = positions
            alive = np.take(alive, rank_in[orders[r + 1]], axis=0)
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
