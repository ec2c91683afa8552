"""Certificates that settle a probe of E3's search without the exact DP, and a layout's own best goodput.

A probe asks whether some plan with s splits reaches goodput G; planner/e3.py's DP answers exactly, with
one state per replica count on every pool but one (thousands of states at 192 GPUs). Two arguments over
shortest paths (split by split, each option at its best pool: microseconds) settle most probes first:

- infeasible (a Lagrangian bound): give every pool's replicas a weight w >= 0. Each limit -- a pool's
  cap, maxReplicas, the cost cap -- bounds a weighted sum of the replicas, so a combination with
  multipliers mu >= 0 bounds w . use <= mu . limits for every plan that keeps to them. Every plan uses at
  least the w-shortest path's weight, so a shortest path above that bound rules out every plan.
  `WEIGHT_STEPS` spreads mu over the simplex of the limits (each normalised by its size).
- feasible (a witness): the shortest paths are plans themselves; one that keeps to every limit proves G
  reachable, with the DP's own tolerances (E3Problem.fits).

A probe neither settles is the DP's, so the search stays exact; the certificates only skip DPs whose answer
they prove. The same bound prunes that DP (`Verdict.keep`): an option whose lightest path through it
(forward to its first block, backward from its last) is above a bound is in no plan that keeps to the
limits, so the DP runs without it and finds the same feasible plans. `layout_goodput` gives the largest goodput a layout (splits and their pools) reaches, from its
own breakpoints: a witness at G lifts the search's lower bound to that, not just to G.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from exitplan.planner.e3_model import EPS, E3Problem

FloatArray = npt.NDArray[np.float64]
Layout = tuple[tuple[int, int, int], ...]
"""A plan's structure: (pool, first block, last block) per split, in order."""

WEIGHT_STEPS = 4
"""The multipliers are the points of the simplex over the limits with coordinates in steps of 1/4."""
MARGIN = 1e-9
"""A shortest path counts as above its bound only past this relative margin (rounding never decides)."""
WITNESS_LAYOUTS = 4
"""The distinct witnesses per probe whose layout goodput is computed (the best one lifts the bound)."""


@dataclass
class Verdict:
    """What the certificates prove about one probe: `infeasible`, or witnesses (layouts that reach the
    goodput within every limit), or neither (the DP decides, over the options `keep` leaves)."""

    infeasible: bool = False
    witnesses: list[Layout] = field(default_factory=list)
    keep: npt.NDArray[np.bool_] | None = None
    """(s, P, N, N): may option (pool, first, last) be the k-th split of a plan that keeps to every limit."""


def multipliers(problem: E3Problem) -> tuple[FloatArray, FloatArray]:
    """(weights (L, P), bounds (L,)): per multiplier vector the weight of one replica on each pool and the
    bound every plan that keeps to the limits meets, w . use <= bound."""
    n_pools = len(problem.caps)
    rows, limits = [], []
    for p in range(n_pools):
        if problem.caps[p] > 0:
            rows.append(np.eye(n_pools)[p])
            limits.append(float(problem.caps[p]))
    if problem.max_replicas is not None:
        rows.append(np.ones(n_pools))
        limits.append(float(problem.max_replicas))
    if problem.cost_cap is not None and problem.cost_cap > 0:
        rows.append(problem.costs.astype(np.float64))
        limits.append(float(problem.cost_cap))
    if not rows:
        return np.zeros((0, n_pools)), np.zeros(0)
    coef = np.asarray(rows) / np.asarray(limits)[:, None]  # each limit normalised: coef . use <= 1
    points = [
        np.bincount(np.asarray(c, dtype=np.intp), minlength=len(rows))
        for c in itertools.combinations_with_replacement(range(len(rows)), WEIGHT_STEPS)
    ]
    mu = np.asarray(points, dtype=np.float64) / WEIGHT_STEPS  # (L, limits), rows sum to 1
    weights: FloatArray = mu @ coef
    bounds: FloatArray = mu.sum(axis=1)
    return weights, bounds


def fitting_demand(problem: E3Problem, demand: FloatArray) -> FloatArray:
    """`demand` (P, N, N) with inf where an option needs more replicas than its pool can ever hold."""
    limit = problem.pool_limits()[:, None, None]
    out: FloatArray = np.where(np.isfinite(demand) & (demand <= limit + EPS), demand, np.inf)
    return out


def settle(
    problem: E3Problem, demand: FloatArray, s: int, weights: FloatArray, bounds: FloatArray, need_keep: bool = False
) -> Verdict:
    """Try to settle the probe whose option demands (replicas per (pool, first, last), inf: out) are
    `demand`, with `s` splits, by the Lagrangian bound and witnesses of `multipliers(problem)`; failing
    those, by enumerating every plan over the options the bound leaves when they are few (at most
    MAX_LABELS partial plans). `need_keep`: `keep` as well when a witness settles it."""
    demand = fitting_demand(problem, demand)
    n = problem.n_blocks
    finite = np.isfinite(demand)
    if not len(weights):  # no limit at all: any path is a plan
        weights, bounds = np.ones((1, len(problem.caps))), np.full(1, np.inf)
    weighted = np.where(finite[None], weights[:, :, None, None] * np.where(finite, demand, 0.0)[None], np.inf)
    pool = np.argmin(weighted, axis=1)  # (L, a, b): each option at its lightest pool
    edge = np.take_along_axis(weighted, pool[:, None], axis=1)[:, 0]
    edge[:, np.tril(np.ones((n, n), dtype=bool), -1)] = np.inf  # a split ends at or after its first block
    fwd, starts = _shortest_paths(edge, problem.ends_ok(), s)
    dist = fwd[-1][:, n]
    live = np.flatnonzero(np.isfinite(dist))
    if not len(live) or np.any(dist > bounds * (1 + MARGIN) + MARGIN):
        return Verdict(infeasible=True)  # above a bound, or no layout at all (every path has an option out)
    out = Verdict()
    for layout in dict.fromkeys(_paths(starts, pool, live, n, s)):
        use = np.zeros(len(problem.caps))
        for p, a, b in layout:
            use[p] += demand[p, a, b]
        if problem.fits(use):
            out.witnesses.append(layout)
            if len(out.witnesses) >= WITNESS_LAYOUTS:
                break
    if out.witnesses and not need_keep:
        return out
    out.keep = _useful_options(demand, weights, bounds, edge, fwd, problem.ends_ok(), s)
    if not out.witnesses:
        plans = _enumerate(problem, demand, out.keep, s)
        if plans is not None and not plans:
            return Verdict(infeasible=True)
        out.witnesses = (plans or [])[:WITNESS_LAYOUTS]
    return out


MAX_LABELS = 4096
"""The most partial plans `_enumerate` keeps at a split before it leaves the probe to the DP."""


def _enumerate(problem: E3Problem, demand: FloatArray, keep: npt.NDArray[np.bool_], s: int) -> list[Layout] | None:
    """Every plan over the options `keep` leaves that keeps to every limit, the most slack first (usage
    only grows along a plan, so a partial plan past a limit is dropped; of partial plans that end at the
    same block with the same replicas per pool one is kept); None when more than MAX_LABELS partial plans
    remain at some split (the DP's case)."""
    n_pools = len(problem.caps)
    caps = problem.caps.astype(np.float64)
    pos = np.zeros(1, dtype=np.intp)  # per partial plan: the next block, the replicas per pool, its splits
    use = np.zeros((1, n_pools))
    paths: list[list[tuple[int, int, int]]] = [[]]
    for k in range(s):
        p_o, a_o, b_o = np.nonzero(keep[k])
        match = pos[:, None] == a_o[None, :]  # (partial plans, options)
        lab, opt = np.nonzero(match)
        if len(lab) > MAX_LABELS:
            return None
        new_use = use[lab].copy()
        new_use[np.arange(len(lab)), p_o[opt]] += demand[p_o[opt], a_o[opt], b_o[opt]]
        ok = np.all(new_use <= caps + EPS, axis=1)
        if problem.max_replicas is not None:
            ok &= new_use.sum(axis=1) <= problem.max_replicas + EPS
        if problem.cost_cap is not None:
            ok &= new_use @ problem.costs <= problem.cost_cap + 1e-9
        lab, opt, new_use = lab[ok], opt[ok], new_use[ok]
        key = np.concatenate([b_o[opt][:, None].astype(np.float64), new_use], axis=1)
        _, first = np.unique(key, axis=0, return_index=True)
        first.sort()
        lab, opt, use = lab[first], opt[first], new_use[first]
        pos = b_o[opt] + 1
        paths = [paths[i] + [(int(p_o[j]), int(a_o[j]), int(b_o[j]))] for i, j in zip(lab, opt)]
    done = pos == problem.n_blocks
    if not done.any():
        return []
    slack = np.max(use[done] / np.maximum(caps, 1.0), axis=1)
    order = np.flatnonzero(done)[np.argsort(slack, kind="stable")]
    return [tuple(paths[i]) for i in order]


def _end_masks(ends_ok: npt.NDArray[np.bool_], s: int) -> list[npt.NDArray[np.bool_]]:
    """Per split k = 1..s, where it may end: at an allowed cut leaving a block for each later split; the
    last one at the last block (the DP's rule)."""
    n = len(ends_ok)
    out = []
    for k in range(1, s + 1):
        end_ok = ends_ok.copy() if k < s else np.zeros(n, dtype=bool)
        end_ok[n - 1 - (s - k) + 1 :] = False
        if k == s:
            end_ok[n - 1] = True
        out.append(end_ok)
    return out


def _useful_options(
    demand: FloatArray,
    weights: FloatArray,
    bounds: FloatArray,
    edge: FloatArray,
    fwd: list[FloatArray],
    ends_ok: npt.NDArray[np.bool_],
    s: int,
) -> npt.NDArray[np.bool_]:
    """keep[k-1, p, a, b]: whether option (p, a, b) as split k has, under every weight row, a path through
    it (`fwd[k-1]` to a, its own weight, the lightest s-k splits from b+1) within that row's bound."""
    n_rows, n = edge.shape[0], edge.shape[1]
    ends = _end_masks(ends_ok, s)
    bwd = [np.full((n_rows, n + 1), np.inf)]  # bwd[j][l, pos]: the lightest j splits over blocks pos..N-1
    bwd[0][:, n] = 0.0
    for j in range(1, s):
        end_ok = ends[s - j]  # the split that starts a j-split tail is split s-j+1
        cand = edge + np.where(end_ok[None, :], bwd[j - 1][:, 1:], np.inf)[:, None, :]  # (L, a, b)
        nxt = np.full((n_rows, n + 1), np.inf)
        nxt[:, :n] = cand.min(axis=2)
        bwd.append(nxt)
    finite = np.isfinite(demand)
    own = np.where(finite[None], weights[:, :, None, None] * np.where(finite, demand, 0.0)[None], np.inf)
    limit = (bounds * (1 + MARGIN) + MARGIN)[:, None, None, None]
    keep = np.zeros((s,) + demand.shape, dtype=bool)
    for k in range(1, s + 1):
        through = fwd[k - 1][:, :n, None, None].transpose(0, 2, 1, 3) + own + bwd[s - k][:, None, None, 1:]
        keep[k - 1] = np.all(through <= limit, axis=0) & ends[k - 1][None, None, :] & finite
    return keep


def _shortest_paths(
    edge: FloatArray, ends_ok: npt.NDArray[np.bool_], s: int
) -> tuple[list[FloatArray], list[np.ndarray]]:
    """Per weight row l, the lightest paths of k = 0..s splits from block 0 (edge[l, a, b]: split [a, b];
    split k ends only where `_end_masks` allows, as in the DP); returns (per k the weights (L, N + 1) by
    the block after the path, per split the best start for each end (L, N))."""
    n_rows, n = edge.shape[0], edge.shape[1]
    dist = np.full((n_rows, n + 1), np.inf)
    dist[:, 0] = 0.0
    layers, starts = [dist], []
    for end_ok in _end_masks(ends_ok, s):
        cand = dist[:, :n, None] + edge  # (L, a, b)
        best = np.argmin(cand, axis=1)  # (L, b)
        nxt = np.full((n_rows, n + 1), np.inf)
        nxt[:, 1:] = np.where(end_ok[None], np.take_along_axis(cand, best[:, None], axis=1)[:, 0], np.inf)
        starts.append(best)
        layers.append(nxt)
        dist = nxt
    return layers, starts


def _paths(starts: list[np.ndarray], pool: np.ndarray, rows: np.ndarray, n: int, s: int) -> list[Layout]:
    """The layouts behind `_shortest_paths`' rows `rows` (each split's pool: `pool[l, a, b]`), in row order."""
    pos = np.full(len(rows), n)
    segs = []
    for k in range(s, 0, -1):
        b = pos - 1
        a = starts[k - 1][rows, b]
        segs.append((pool[rows, a, b], a, b))
        pos = a
    segs.reverse()
    return [tuple((int(p[i]), int(a[i]), int(b[i])) for p, a, b in segs) for i in range(len(rows))]


def layout_goodput(problem: E3Problem, layout: Sequence[tuple[int, int, int]], above: float = 0.0) -> float:
    """The largest goodput `layout` reaches within every limit, from its breakpoints (the goodputs where
    one of its replica counts steps) above `above` (1e-12 relative: not a rounding copy of it); `above`
    when none of them is reachable. Replica counts as E3Problem.demand computes them."""
    s = len(layout)
    if s < 1 or s > problem.max_splits:
        return above
    pools = np.asarray([p for p, _, _ in layout])
    firsts = np.asarray([a for _, a, _ in layout])
    rate = np.asarray([problem.rate[s - 1, p, a, b] for p, a, b in layout])  # (splits, K)
    if np.any(rate <= 0):
        return above
    share = problem.shares[None, :] * np.ones((s, 1))
    sigma = problem.sigma_in[firsts][:, None] * np.ones((1, len(problem.shares)))
    load = share * sigma
    limit = problem.pool_limits()[pools][:, None] * np.ones((1, len(problem.shares)))
    ok = load > 0
    x = (rate / np.where(ok, load, 1.0))[ok]
    top = limit[ok].astype(np.int64)
    if not len(x) or int(top.max(initial=0)) < 1:
        return above
    r = np.arange(1, int(top.max()) + 1, dtype=np.float64)
    cands = (x[:, None] * r[None, :])[r[None, :] <= top[:, None]]
    cands = np.unique(cands[cands > above * (1 + 1e-12)])
    if not len(cands):
        return above
    # replicas per (candidate, split, bucket), exactly as E3Problem.demand
    need = cands[:, None, None] * share[None] * sigma[None]
    reps = np.maximum(1.0, np.ceil(need / rate[None] - EPS)).sum(axis=2)  # (G, splits)
    use = np.zeros((len(cands), len(problem.caps)))
    np.add.at(use.T, pools, reps.T)
    ok_g = np.all(use <= problem.caps[None] + EPS, axis=1)
    if problem.max_replicas is not None:
        ok_g &= use.sum(axis=1) <= problem.max_replicas + EPS
    if problem.cost_cap is not None:
        ok_g &= use @ problem.costs <= problem.cost_cap + 1e-9
    # feasibility falls with the goodput: the largest candidate of the feasible prefix
    bad = np.flatnonzero(~ok_g)
    last = (bad[0] if len(bad) else len(cands)) - 1
    return float(cands[last]) if last >= 0 else above
