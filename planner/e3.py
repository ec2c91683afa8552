"""E3's split-and-replicate as an exact dynamic program (splits x replicas per split x GPU type).

The model (data in `E3Problem`, built from the cost model by `plan_service`):

- The model's N blocks are cut into S <= max_splits contiguous splits. Every split holds one
  pipeline per length bucket k; the replicas of one split share one pool (GPU type).
- Pipelined execution: with S splits the end-to-end bound is 2S cycles -- at every split a row may
  wait one cycle for its fusion queue and then runs one (`cycles` in planner/problem.py) -- so every split must
  finish a batch (exec + ramps + the transfer of its survivors) within (SLO - slack) / 2S. `rate[S-1, p, a, b, k]`
  is the best throughput of one replica of split [a, b] on pool p for bucket k under that cycle
  (inputs entering the split per second, over the profiled batch sizes that fit the cycle and the
  pool's memory); 0 when no batch size fits.
- At a total goodput G (requests/s), bucket k sends G * share[k] requests/s, of which the fraction
  sigma_in[a] reaches split [a, b]; it needs ceil(G share[k] sigma_in[a] / rate) replicas, and at
  least one (the router may send any bucket to any split).
- Constraints: replicas per pool <= caps[p]; total cost <= cost_cap; total replicas <= max_replicas.
- Objectives: max goodput (then min cost), or min cost at a target goodput.

The solver: for a candidate G, a DP over (splits used, next block, replicas used on every pool but
one) keeps the fewest replicas on the remaining pool; it is exact because the per-pool usage is the
state. Feasibility in G is a step function that changes only where some ceil() steps (r * rate /
load, with r no more than the pool can hold), so the largest feasible G is one of those
breakpoints. The search over them is in planner/e3_search.py: a race probes the split counts at
a level just below the largest fractional upper bound until one is feasible; a bisection over
that one's sorted breakpoints finds its optimum, and every other split count is settled from
what the race saw (out without a probe when seen infeasible below the best so far) or probed at
and just above the best so far. A probe is settled by a certificate where one applies
(planner/e3_bounds.py: a Lagrangian bound over shortest paths, or a shortest path that is itself a
plan within every limit), else by a DP restricted to the options whose demand fits their pool; a
plan found lifts the lower bound to its own best goodput. `exhaustive` enumerates every plan for tests.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from exitplan.planner.e3_bounds import layout_goodput, multipliers, settle
from exitplan.planner.e3_model import EPS, E3Problem, E3Solution, Segment
from exitplan.planner.e3_search import GoodputSearch
from exitplan.planner.errors import PlanInfeasible, PlanInvalid

__all__ = ["E3Problem", "E3Solution", "Segment", "exhaustive", "max_goodput", "min_cost", "reaches", "solution"]

FloatArray = npt.NDArray[np.float64]
F32Array = npt.NDArray[np.float32]
_Layer = tuple[F32Array, npt.NDArray[np.int32], npt.NDArray[np.int32]]  # a DP layer's values and argmins (start, pool)

MAX_GRID_STATES = 20_000
"""Replica-count states over all pools but the largest; a DP layer holds blocks^2 x states floats."""


class _Grid:
    """Replica usage on every pool but `value_pool`, flattened; the DP keeps value-pool usage as its value."""

    def __init__(self, caps: np.ndarray) -> None:
        self.value_pool = int(np.argmax(caps))
        self.grid_pools = [p for p in range(len(caps)) if p != self.value_pool]
        dims = [int(caps[p]) + 1 for p in self.grid_pools]
        self.size = int(np.prod(dims)) if dims else 1
        if self.size > MAX_GRID_STATES:
            raise PlanInfeasible(
                f"the exact planner keeps one state per replica count on each pool; {len(caps)} pools with caps "
                f"{caps.tolist()} make {self.size} states. Cap maxGpus on the smaller pools or list fewer pools",
                field="spec.pools",
            )
        self.strides = {}
        self.coords = {}
        self.dims = dict(zip(self.grid_pools, dims))
        self.flat = flat = np.arange(self.size)
        stride = 1
        for p, dim in reversed(list(zip(self.grid_pools, dims))):
            self.strides[p] = stride
            self.coords[p] = (flat // stride) % dim
            stride *= dim


def _run_dp(
    problem: E3Problem, grid: _Grid, goodput: float, s: int, track: bool = True
) -> tuple[F32Array, list[_Layer], FloatArray]:
    """Layers F[k][pos, f] = fewest value-pool replicas covering blocks < pos with k splits.

    With track=False only the final layer's values are kept (a feasibility probe, no argmins).
    """
    n = problem.n_blocks
    demand = problem.demand(goodput, s)  # (P, N, N)
    ends_ok = np.ones(n, dtype=bool) if problem.cuts is None else np.append(problem.cuts.astype(bool), True)
    F = np.full((n + 1, grid.size), np.inf, dtype=np.float32)  # replica counts: exact in float32
    F[0, 0] = 0.0
    layers: list[_Layer] = []
    for k in range(1, s + 1):
        ends = np.array([n - 1]) if k == s else np.flatnonzero(ends_ok[: n - 1])
        new = np.full((n + 1, grid.size), np.inf, dtype=np.float32)
        arg_a = np.full((n + 1, grid.size), -1, dtype=np.int32)
        arg_p = np.full((n + 1, grid.size), -1, dtype=np.int32)
        prev = F[:n]  # start positions a = 0..n-1
        live = np.flatnonzero(np.isfinite(prev).any(axis=1))
        if len(live) == 0 or len(ends) == 0:
            layers.append((new, arg_a, arg_p))
            F = new
            continue
        # a split that ends at b leaves s - k splits for blocks b+1.., so b <= n - 1 - (s - k)
        ends = ends[ends <= n - 1 - (s - k)]
        A = len(live)
        prev_live = prev[live]
        rows = np.arange(A)[:, None]
        for p in range(len(problem.caps)):
            D = demand[p][np.ix_(live, ends)].astype(np.float32)  # (A, E)
            if p == grid.value_pool:
                cand = prev_live[:, None, :] + D[:, :, None]
            else:
                # shifted[a, d] = prev[a] moved up by d replicas on pool p (inf where that would go
                # below 0); row dim = every shift beyond the cap (all inf). Then gather whole rows.
                dim, stride = grid.dims[p], grid.strides[p]
                view = prev_live.reshape(A, -1, dim, stride)
                shifted = np.full((A, dim + 1, grid.size), np.inf, dtype=np.float32)
                blocks = shifted.reshape(A, dim + 1, -1, dim, stride)  # a view: `shifted` is contiguous
                for d in range(dim):
                    blocks[:, d, :, d:, :] = view[:, :, : dim - d, :]
                Di = np.where(np.isfinite(D) & (D < dim), D, dim).astype(np.intp)
                cand = shifted[rows, Di]
            if not track:
                new[ends + 1] = np.minimum(new[ends + 1], cand.min(axis=0))
                continue
            best_i = np.argmin(cand, axis=0)  # (E, G)
            best = np.take_along_axis(cand, best_i[None], axis=0)[0]
            cur = new[ends + 1]
            better = best < cur
            new[ends + 1] = np.where(better, best, cur)
            arg_a[ends + 1] = np.where(better, live[best_i], arg_a[ends + 1])
            arg_p[ends + 1] = np.where(better, p, arg_p[ends + 1])
        layers.append((new, arg_a, arg_p))
        F = new
    return F[n], layers, demand


def _final_values(problem: E3Problem, grid: _Grid, goodput: float, s: int) -> F32Array:
    """F[n] of `_run_dp` without argmins (a feasibility probe): the same recursion, but only over
    the options whose demand fits their pool's cap, each end's candidates reduced in one call."""
    final: F32Array = _value_layers(problem, grid, goodput, s)[-1][problem.n_blocks]
    return final


def _value_layers(
    problem: E3Problem, grid: _Grid, goodput: float, s: int, keep: npt.NDArray[np.bool_] | None = None
) -> list[F32Array]:
    """`_final_values`' layers F[0..s] (each (N + 1, states)): the values alone, from which `_backtrack`
    recovers a plan without the argmins `_run_dp` keeps. `keep[k-1, p, a, b]` (e3_bounds.Verdict.keep):
    the options split k may take (None: all); leaving out options that are in no plan within the limits
    changes no feasible final state."""
    n = problem.n_blocks
    demand = problem.demand(goodput, s)  # (P, N, N)
    ends_ok = np.ones(n, dtype=bool) if problem.cuts is None else np.append(problem.cuts.astype(bool), True)
    G = grid.size
    # Per pool: options (a, b, replicas), sorted by b; only those that fit the pool's cap.
    opts = []
    for p in range(len(problem.caps)):
        Dt = demand[p].T  # (b, a)
        limit = problem.caps[p] if p == grid.value_pool else grid.dims[p] - 1
        b, a = np.nonzero(np.isfinite(Dt) & (Dt <= limit))
        opts.append((a, b, Dt[b, a]))
    F = np.full((n + 1, G), np.inf, dtype=np.float32)
    F[0, 0] = 0.0
    layers = [F]
    for k in range(1, s + 1):
        live: npt.NDArray[np.bool_] = np.any(np.isfinite(F[:n]), axis=1)
        end_ok = ends_ok.copy() if k < s else np.zeros(n, dtype=bool)
        end_ok[n - 1 - (s - k) + 1 :] = False  # leave a block for each later split
        if k == s:
            end_ok[n - 1] = True
        new = np.full((n + 1, G), np.inf, dtype=np.float32)
        live_idx = np.flatnonzero(live)
        pos_of = np.full(n, -1)
        pos_of[live_idx] = np.arange(len(live_idx))
        flat = np.concatenate([F[live_idx], np.full((len(live_idx), 1), np.inf, dtype=np.float32)], axis=1).ravel()
        for p, (a, b, d) in enumerate(opts):
            use = live[a] & end_ok[b]
            if keep is not None:
                use &= keep[k - 1, p, a, b]
            if not use.any():
                continue
            a_, b_, d_ = a[use], b[use], d[use]
            if p == grid.value_pool:
                cand = F[a_] + d_.astype(np.float32)[:, None]
            else:
                # row i: prev[a_i] moved up by d_i replicas on pool p (the sentinel column G where
                # that would go below 0), gathered from the flattened rows
                di = d_.astype(np.intp)[:, None]
                idx = np.where(grid.coords[p][None, :] >= di, grid.flat[None, :] - di * grid.strides[p], G)
                idx += (pos_of[a_] * (G + 1))[:, None]
                cand = flat.take(idx)
            # the best candidate per end: groups of rows (sorted by end) padded to one length
            first = np.flatnonzero(np.append(True, b_[1:] != b_[:-1]))
            sizes = np.diff(np.append(first, len(b_)))
            slot = np.arange(len(b_)) - np.repeat(first, sizes)
            rows = np.full((len(first), int(sizes.max())), len(b_), dtype=np.intp)
            rows[np.repeat(np.arange(len(first)), sizes), slot] = np.arange(len(b_))
            cand = np.concatenate([cand, np.full((1, G), np.inf, dtype=np.float32)])
            red = cand[rows].min(axis=1)
            tgt = b_[first] + 1
            new[tgt] = np.minimum(new[tgt], red)
        F = new
        layers.append(F)
    return layers


def _backtrack(problem: E3Problem, grid: _Grid, goodput: float, s: int, layers: list[F32Array], f: int) -> E3Solution:
    """The plan behind final state f of `_value_layers`: at each layer, from the last split back, the option
    whose predecessor's value accounts for this one's (the same ties as `_run_dp`'s argmins: the first
    pool, then the first start)."""
    n = problem.n_blocks
    demand = problem.demand(goodput, s)
    pos = n
    segs: list[tuple[int, int, int]] = []
    for k in range(s, 0, -1):
        target, prev, b = layers[k][pos, f], layers[k - 1], pos - 1
        found = None
        for p in range(len(problem.caps)):
            for a in range(b + 1):
                d = demand[p, a, b]
                if not np.isfinite(d):
                    continue
                if p == grid.value_pool:
                    if prev[a, f] + np.float32(d) == target:
                        found = (a, p, f)
                elif grid.coords[p][f] >= d and prev[a, f - int(d) * grid.strides[p]] == target:
                    found = (a, p, f - int(d) * grid.strides[p])
                if found is not None:
                    break
            if found is not None:
                break
        if found is None:  # cannot happen: every finite value has a predecessor
            raise PlanInvalid("the planner's DP lost its own path; please report this")
        a, p, f = found
        segs.append((p, a, b))
        pos = a
    return solution(problem, goodput, segs[::-1])


def solution(problem: E3Problem, goodput: float, layout: Sequence[tuple[int, int, int]]) -> E3Solution:
    """The plan of `layout` ((pool, first, last) per split) at `goodput`: the fewest replicas per split and
    bucket that carry it, the goodput they sustain and their cost."""
    s = len(layout)
    segs = []
    for p, a, b in layout:
        need = goodput * problem.shares * problem.sigma_in[a]
        reps = np.maximum(1, np.ceil(need / problem.rate[s - 1, p, a, b] - EPS)).astype(np.int64)
        segs.append(Segment(a, b, p, reps))
    actual = min(problem.split_goodput(s, g.pool, g.first, g.last, g.replicas) for g in segs)
    sol = E3Solution(s, segs, actual, 0.0)
    sol.cost = float(sol.replicas_per_pool(len(problem.caps)) @ problem.costs)
    return sol


def _feasible_states(problem: E3Problem, grid: _Grid, final: F32Array) -> FloatArray:
    cap_v = problem.caps[grid.value_pool]
    cost = final * problem.costs[grid.value_pool]
    total = final.astype(np.float64)
    for p in grid.grid_pools:
        cost = cost + grid.coords[p] * problem.costs[p]
        total = total + grid.coords[p]
    ok = final <= cap_v + EPS
    if problem.cost_cap is not None:
        ok &= cost <= problem.cost_cap + 1e-9
    if problem.max_replicas is not None:
        ok &= total <= problem.max_replicas + EPS
    costs: FloatArray = np.where(ok, cost, np.inf)
    return costs


def _probe(
    problem: E3Problem,
    grid: _Grid,
    goodput: float,
    cheapest: bool = True,
    order: list[int] | None = None,
    keep: npt.NDArray[np.bool_] | None = None,
) -> E3Solution | None:
    """The cheapest plan reaching `goodput` over every split count (or, with cheapest=False, the
    first one found); None if there is none. `keep`: the options the DP may use (one split count)."""
    best: tuple[float, int, E3Solution] | None = None
    for s in order or range(1, problem.max_splits + 1):
        layers = _value_layers(problem, grid, goodput, s, keep)
        cost = _feasible_states(problem, grid, layers[-1][problem.n_blocks])
        f = int(np.argmin(cost))
        if not np.isfinite(cost[f]):
            continue
        sol = _backtrack(problem, grid, goodput, s, layers, f)
        if not cheapest:
            return sol
        key = (sol.cost, s)
        if best is None or key < best[:2]:
            best = (sol.cost, s, sol)
    return None if best is None else best[2]


def _min_cost_at(problem: E3Problem, grid: _Grid, goodput: float, s: int) -> float:
    """The least cost of a plan with `s` splits reaching `goodput` (inf: none), without argmins."""
    return float(_feasible_states(problem, grid, _final_values(problem, grid, goodput, s)).min())


class _Prober:
    """The search's probe (e3_search.Reach): the certificates first (planner/e3_bounds.py: a Lagrangian
    bound rules G out, or a shortest path is a witness plan), the exact DP only when neither settles it.
    A feasible probe returns the best goodput of the plan it found (its layout's, above G); `dps` counts
    the probes the DP settled."""

    def __init__(self, problem: E3Problem) -> None:
        self.problem = problem
        self.grid = _grid_for(problem)  # a typed error up front where the DP's states would be too many
        self.weights, self.bounds = multipliers(problem)
        self.dps = 0

    def __call__(self, goodput: float, s: int) -> float | None:
        problem = self.problem
        verdict = settle(problem, problem.demand(goodput, s), s, self.weights, self.bounds)
        if verdict.infeasible:
            return None
        layouts = verdict.witnesses
        if not layouts:
            self.dps += 1
            layers = _value_layers(problem, self.grid, goodput, s, verdict.keep)
            cost = _feasible_states(problem, self.grid, layers[-1][problem.n_blocks])
            f = int(np.argmin(cost))
            if not np.isfinite(cost[f]):
                return None
            sol = _backtrack(problem, self.grid, goodput, s, layers, f)
            layouts = [tuple((g.pool, g.first, g.last) for g in sol.segments)]
        return max(layout_goodput(problem, layout, goodput) for layout in layouts)

    def cheapest(self, goodput: float, splits: Sequence[int]) -> E3Solution | None:
        """The cheapest plan reaching `goodput` over split counts `splits` (ties: the earlier split count in
        `splits`, then the DP's own ties): per split count the DP with argmins over the options the bound
        leaves (the same feasible states, least cost and plan as over all options)."""
        problem = self.problem
        best: E3Solution | None = None
        for s in splits:
            verdict = settle(problem, problem.demand(goodput, s), s, self.weights, self.bounds, need_keep=True)
            if verdict.infeasible:
                continue
            sol = _probe(problem, self.grid, goodput, order=[s], keep=verdict.keep)
            if sol is not None and (best is None or (sol.cost, s) < (best.cost, best.splits)):
                best = sol
        return best


def _grid_for(problem: E3Problem) -> _Grid:
    """The DP's state grid over the replicas each pool can hold in any plan (its cap, maxReplicas, the cost cap)."""
    return _Grid(problem.pool_limits().astype(np.int64))


def reaches(problem: E3Problem, goodput: float) -> bool:
    """Whether some plan (any split count) sustains `goodput`: one probe per split count (certificates, else the DP)."""
    prober = _Prober(problem)
    return any(prober(goodput, s) is not None for s in range(1, problem.max_splits + 1))


def max_goodput(problem: E3Problem, hints: Sequence[Sequence[Segment]] = ()) -> E3Solution:
    """The plan with the largest goodput (ties: the cheapest). Raises PlanInfeasible if none exists.

    Feasibility changes only at breakpoints (goodputs where some ceil() steps), so per split count
    the optimum is the largest feasible one of its breakpoints. A race first probes the split
    counts, most promising upper bound first, at a common level just below the largest bound
    (then lower levels) until one is feasible: that one leads, and a bisection over its breakpoints
    above the level finds its optimum. Every other split count is then settled from what is known:
    one seen infeasible at or below the best so far is out without a probe; otherwise it is probed
    at the best so far (for ties) and, if feasible, searched above it the same way. Each probe is
    settled by a certificate where one applies, else by the DP; a feasible one lifts the split
    count's lower bound to the best goodput of the plan it found. At the optimum the exact DP gives
    the cheapest plan of every split count that reaches it.

    `hints`: layouts known to be good (the previous plan's): each seeds its split count's lower bound
    with the best goodput it reaches in this problem, a warm start; the result is the same plan.
    """
    prober = _Prober(problem)
    search = GoodputSearch(problem, prober)
    for hint in hints:
        layout = tuple((g.pool, g.first, g.last) for g in hint)
        search.seed(len(layout), layout_goodput(problem, layout))
    lead = search.race() or (
        search.order[0] if search.order else None
    )  # none feasible at any level: the most promising, from 0
    if lead is not None:
        search.search(lead, [], gallop_up=False)
    lo = search.settle(lead)
    ties = search.ties(lo)
    if not ties:
        raise PlanInfeasible(
            "no plan fits: not even one replica per split and bucket fits the caps, cost cap, maxReplicas and SLO",
            field="spec",
        )
    best = prober.cheapest(lo, ties)
    if best is None:  # cannot happen: lo was probed feasible for every tie
        raise PlanInfeasible("the planner lost its own feasible plan; please report this", field="spec")
    best.probes = search.probes + len(ties)
    best.notes.append(
        f"{search.probes} probes ({prober.dps} settled by the DP); the cheapest plan at the optimum by the DP "
        f"over {len(ties)} split count(s)"
    )
    return best


def min_cost(problem: E3Problem, target: float) -> E3Solution:
    """The cheapest plan reaching `target` goodput. Raises PlanInfeasible naming the best reachable."""
    grid = _grid_for(problem)
    sol = _probe(problem, grid, target)
    if sol is None:
        reach = max_goodput(problem).goodput
        raise PlanInfeasible(
            f"target {target:.4g} req/s is out of reach: the best plan within the pools' caps, the cost cap "
            f"and the SLO serves {reach:.4g} req/s. Lower planner.targetRps, raise maxGpus or the cost cap, or relax the SLO",
            field="spec.planner.targetRps",
        )
    sol.probes = 1
    return sol


def exhaustive(problem: E3Problem, target: float | None = None) -> tuple[float, float]:
    """Every split layout and pool assignment, each with its best replica counts (tests only).

    Returns (goodput, cost) of the optimum: max goodput then min cost, or (target, min cost).
    """
    n, P = problem.n_blocks, len(problem.caps)
    best = (-1.0, math.inf)
    cuts = [b for b in range(n - 1) if problem.cuts is None or problem.cuts[b]]
    for s in range(1, problem.max_splits + 1):
        for inner in itertools.combinations(cuts, s - 1):
            bounds = list(zip([0, *[c + 1 for c in inner]], [*inner, n - 1]))
            for pools in itertools.product(range(P), repeat=s):
                for g, c in _structure_frontier(problem, s, bounds, pools, target):
                    if (
                        target is None and (g > best[0] * (1 + 1e-9) or (g >= best[0] * (1 - 1e-9) and c < best[1]))
                    ) or (target is not None and c < best[1]):
                        best = (g, c)
    return best


def _structure_frontier(
    problem: E3Problem, s: int, bounds: list[tuple[int, int]], pools: tuple[int, ...], target: float | None
) -> list[tuple[float, float]]:
    """(goodput, cost) of one structure at its largest feasible goodput, or at `target`."""
    rates = [problem.rate[s - 1, p, a, b] for (a, b), p in zip(bounds, pools)]
    if any(np.any(r <= 0) for r in rates):
        return []

    def cost_at(g: float) -> float | None:
        use = np.zeros(P, dtype=np.int64)
        for (a, _), p, r in zip(bounds, pools, rates):
            use[p] += int(np.maximum(1, np.ceil(g * problem.shares * problem.sigma_in[a] / r - EPS)).sum())
        if np.any(use > problem.caps) or (problem.max_replicas is not None and use.sum() > problem.max_replicas):
            return None
        c = float(use @ problem.costs)
        if problem.cost_cap is not None and c > problem.cost_cap + 1e-9:
            return None
        return c

    P = len(problem.caps)
    if target is not None:
        c = cost_at(target)
        return [] if c is None else [(target, c)]
    # Breakpoints: goodputs at which one bucket of one split has exactly r replicas busy.
    cands = {EPS}
    top = int(problem.caps.max())
    for (a, _), r in zip(bounds, rates):
        for k, share in enumerate(problem.shares):
            load = share * problem.sigma_in[a]
            if load > 0:
                cands.update(reps * r[k] / load for reps in range(1, top + 1))
    best = None
    for g in sorted(cands):
        c = cost_at(g)
        if c is None:
            break
        best = (g, c)
    return [] if best is None else [best]
