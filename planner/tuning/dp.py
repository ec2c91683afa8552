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
import numpy.typing as npt

from exitplan.planner.tuning.feedback import DISABLED, FeedbackWindow

BoolArray = npt.NDArray[np.bool_]
IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


def budget_dp(
    w: FeedbackWindow,
    allowed: int,
    beam: int = 1,
    max_levels: int = 16,
    movable: np.ndarray | None = None,
    fixed: np.ndarray | None = None,
    orders: list[np.ndarray] | None = None,
    ties: np.ndarray | None = None,
) -> tuple[np.ndarray, float]:
    """(thresholds [R], their total saving over the window's inputs) from the programme.

    ``movable`` False ramps keep ``fixed`` (their thresholds).

    ``orders``: per ramp, the inputs by confidence, highest first (computed here when not given);
    ``ties``: per ramp, whether two inputs share a confidence (checked here when not given).
    """
    n, r_all = w.n_inputs, w.n_ramps
    levels = allowed + 1
    width = -(-levels // max_levels)  # disagreement counts merged per state level
    count_t: npt.DTypeLike = np.int16 if n < 2**15 else np.int64  # running counts (exact; narrow is faster)
    d = np.zeros(1, dtype=np.int64)
    total = np.zeros(1)
    parents: list[IntArray] = []
    cuts: list[IntArray] = []  # per ramp and state: last exiting position in confidence order (-1: off)
    sorted_conf: list[FloatArray] = []
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
        cost_r, saving_r = float(w.cost_ms[r]), float(w.saving_ms[r])
        if movable is not None and not movable[r]:
            t_fix = float(fixed[r]) if fixed is not None else DISABLED
            exiting = c >= t_fix if t_fix <= 1.0 else None
            alive, d, total, keep = _apply_fixed(alive, d, total, exiting, bad_r, saving_r, cost_r, levels)
            parents.append(keep)
            cuts.append(np.full(keep.size, -2))  # -2: the fixed threshold
            if r + 1 < r_all:  # rows into ramp r + 1's confidence order
                rank_in[order] = positions
                alive = np.take(alive, rank_in[orders[r + 1]], axis=0)
            continue
        # A movable ramp: every state may leave it off (cut -1) or take one of its exit options.
        tied = bool((c[1:] == c[:-1]).any()) if ties is None else bool(ties[r])
        gstart = _tie_group_starts(c) if tied else None
        src, b, ex, cut, n_alive = _exit_options(alive, bad_r, gstart, d, levels, count_t)
        s_count = d.size
        all_d = np.concatenate((d, d[src] + b))
        all_total = np.concatenate((total, total[src] + saving_r * ex - cost_r * n_alive[src]))
        all_src = np.concatenate((np.arange(s_count), src))
        all_cut = np.concatenate((np.full(s_count, -1), cut))
        keep = _keep_best(all_d // width, all_total, beam, max_levels)
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
    if total.size == 0:  # the fixed ramps alone break the budget (so ``fixed`` was given)
        off = np.full(r_all, DISABLED)
        return (np.where(movable, DISABLED, off if fixed is None else fixed) if movable is not None else off), -np.inf
    best = int(np.argmax(total))
    return _thresholds(best, cuts, parents, sorted_conf, fixed), float(total[best])


def _apply_fixed(
    alive: BoolArray,
    d: IntArray,
    total: FloatArray,
    exiting: BoolArray | None,
    bad_r: BoolArray,
    saving_r: float,
    cost_r: float,
    levels: int,
) -> tuple[BoolArray, IntArray, FloatArray, IntArray]:
    """A fixed ramp: in every state the running inputs in ``exiting`` (None: the ramp is off) leave; the states
    that then break the budget are dropped. Returns the new alive, d and total, and the states kept."""
    if exiting is not None:
        n_alive = alive.sum(axis=0, dtype=np.int64)
        out = alive & exiting[:, None]
        exits = out.sum(axis=0, dtype=np.int64)
        d = d + (out & bad_r[:, None]).sum(axis=0, dtype=np.int64)
        total = total + saving_r * exits - cost_r * n_alive
        alive = alive & ~out
    keep = np.flatnonzero(d < levels)
    return alive[:, keep], d[keep], total[keep], keep


def _tie_group_starts(c: FloatArray) -> IntArray:
    """Per sorted position: where its group of equal confidences starts."""
    starts = np.flatnonzero(np.concatenate(([True], c[1:] != c[:-1])))
    groups: IntArray = np.repeat(starts, np.diff(np.append(starts, c.size)))
    return groups


def _exit_options(
    alive: BoolArray, bad_r: BoolArray, gstart: IntArray | None, d: IntArray, levels: int, count_t: npt.DTypeLike
) -> tuple[IntArray, IntArray, IntArray, IntArray, IntArray]:
    """The active options of one ramp: (state, b more disagreements, exits, cut) per option, and per state the
    inputs still running. ``gstart``: per sorted position, where its tie group starts (None: no ties)."""
    n, s_count = alive.shape
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
    return src, b, ex, cut, n_alive


def _keep_best(level: IntArray, total: FloatArray, beam: int, max_levels: int) -> IntArray:
    """The candidates kept: the ``beam`` best totals per level of d (levels grouped on large budgets)."""
    if beam == 1:  # per level the best total, the first such candidate on ties (no sort needed)
        best_at = np.full(max_levels + 1, -np.inf)
        np.maximum.at(best_at, level, total)
        tops = np.flatnonzero(total == best_at[level])
        first = np.full(max_levels + 1, total.size)
        np.minimum.at(first, level[tops], tops)
        kept: IntArray = first[first < total.size]
        return kept
    sort = np.lexsort((-total, level))
    sd = level[sort]
    kept = sort[(np.arange(sd.size) - np.searchsorted(sd, sd, side="left")) < beam]
    return kept


def _thresholds(
    best: int, cuts: list[IntArray], parents: list[IntArray], sorted_conf: list[FloatArray], fixed: np.ndarray | None
) -> FloatArray:
    """The thresholds of final state ``best``, read back ramp by ramp through each state's parent."""
    t = np.empty(len(cuts))
    for r in range(len(cuts) - 1, -1, -1):
        e = int(cuts[r][best])
        c = sorted_conf[r]
        if e == -2:
            t[r] = float(fixed[r]) if fixed is not None else DISABLED
        elif e < 0:
            t[r] = DISABLED
        elif e + 1 < c.size and c[e + 1] < (c[e] + c[e + 1]) / 2.0 <= c[e]:
            t[r] = (c[e] + c[e + 1]) / 2.0  # midway to the next lower confidence
        else:
            t[r] = c[e]
        best = int(parents[r][best])
    return t
