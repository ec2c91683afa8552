"""`plan_service`: the one entry point that turns a service spec, its pools and profiles into a Plan.

Stages (timed in `PlanResult.timings`):
1. inputs: spec values, pools (caps = min(capacity, maxGpus)), one cost model per pool (profile checks);
2. survival: the thresholds in force (ramps off -> no exits there), observed or forecast survival;
3. lengths: a histogram on the profile's length grid, the staircase, candidate bucket sets;
4. solve: E3's exact DP per bucket set (splits x replicas x pool per split, one pipeline per bucket)
   on the problem planner/problem.py builds (options cached per pool and length across bucket sets; a set
   that cannot beat the best plan found is not solved); with spec.planner.rebatch on and exits enabled, a
   split rebatches (a fusion queue per block) on a pool where the rebatching cost tables make it no slower
   for any bucket and REBATCH_MIN_GAIN cheaper for the bucket mix;
5. plan: cells, spare replicas to the tightest cells (max-goodput), DensePipe's placement of the
   layout over all pools when it beats one pool per split (one bucket, several pools), prediction
   (goodput: the solver's, capped by the routers and shared cores, planner/serving_path.py;
   p99: cycles(splits) x the slowest stage; with rebatching splits, each split's longest time -- its
   queues' whole gather times and runs -- summed, at most the budget, which the deadline rule keeps),
   smallest change.

The thresholds a plan names are those it is sized with (given, else the latest observation window's, else the
previous plan's, else none: then no ramp exits).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from exitplan.api.observations import Observations
from exitplan.api.plan import Cell, Plan, Prediction, SplitPlan, colocated_routers
from exitplan.api.resources import EarlyExitServiceSpec, GPUPoolSpec, ModelProfileSpec, Objective
from exitplan.planner import buckets as bk
from exitplan.planner.densepipe import Placement, place
from exitplan.planner.e3 import max_goodput, min_cost, reaches
from exitplan.planner.e3_model import E3Problem, E3Solution, Segment
from exitplan.planner.e3_search import upper_bounds
from exitplan.planner.errors import PlanInfeasible, PlanInvalid
from exitplan.planner.forecast import DEFAULT_PREDICTOR
from exitplan.planner.inputs import Inputs, observation_windows, resolve_inputs
from exitplan.planner.problem import OptionCache, PlanProblem, build_problem, cycles, diagnose, rebatching
from exitplan.planner.serving_path import PathLimit, colocated_cells, colocated_gain, path_limits, why_not_colocate

MAX_BUCKETS = 6
COLOCATE_MIN_GAIN = 0.02
"""Co-locate the routers and split 0 (planner.colocate auto) only where it predicts this much more goodput."""
HYSTERESIS = 0.05
"""A re-plan keeps the previous layout (splits, buckets, pools) when it reaches this close to the optimum."""


@dataclass
class PlanResult:
    plan: Plan
    inputs: Inputs
    problem: E3Problem
    solution: E3Solution
    buckets: list[int]
    cycle_ms: float
    """The cycle every split must finish a batch in: (SLO - slack) / cycles(splits)."""
    stage_ms: dict[tuple[int, int], float]
    """(split, bucket) -> time of one batch of that cell (exec + ramps + transfer)."""
    timings: dict[str, float]
    notes: list[str]
    alternatives: list[dict[str, object]] = field(default_factory=list)
    """The bucket sets tried: buckets, goodput, cost."""
    kept_previous: bool = False
    rebatch: bool = False
    """Splits were allowed to rebatch (a fusion queue per block); those that do are marked in the
    plan, and the problem's rates and stage times are theirs."""

    def problems(self) -> list[str]:
        """Every invariant the plan breaks (empty when it is sound)."""
        plan, inp = self.plan, self.inputs
        out: list[str] = []
        n = inp.n_blocks
        if plan.splits[0].first_block != 0 or plan.splits[-1].last_block != n - 1:
            out.append(
                f"splits cover blocks {plan.splits[0].first_block}..{plan.splits[-1].last_block}, not 0..{n - 1}"
            )
        reps: dict[tuple[int, int], int] = {}
        per_pool = dict.fromkeys(inp.pool_names, 0)
        for c in plan.cells:
            if c.replicas < 1:
                out.append(f"cell split {c.split} bucket {c.bucket} pool {c.pool} has no replicas")
            if c.pool not in per_pool:
                out.append(f"cell names pool {c.pool!r}, which the service may not use")
                continue
            per_pool[c.pool] += c.replicas
            reps[(c.split, c.bucket)] = reps.get((c.split, c.bucket), 0) + c.replicas
            model = inp.models[inp.pool_names.index(c.pool)]
            if c.batch_size not in model.profile.batch_sizes:
                out.append(f"cell split {c.split} bucket {c.bucket}: batch {c.batch_size} was not profiled on {c.pool}")
        for s in plan.splits:
            for b in plan.buckets:
                if reps.get((s.index, b), 0) < 1:
                    out.append(
                        f"split {s.index} has no replica for bucket {b}: requests of that bucket could not pass it"
                    )
        for name, cap in zip(inp.pool_names, inp.caps):
            if per_pool[name] > cap:
                out.append(f"pool {name}: {per_pool[name]} replicas exceed the cap {cap}")
        if inp.max_replicas is not None and sum(per_pool.values()) > inp.max_replicas:
            out.append(f"{sum(per_pool.values())} replicas exceed maxReplicas {inp.max_replicas}")
        cost = sum(per_pool[p] * c for p, c in zip(inp.pool_names, inp.costs))
        if inp.cost_cap is not None and cost > inp.cost_cap + 1e-6:
            out.append(f"cost {cost:.4g}/h exceeds the cap {inp.cost_cap:.4g}/h")
        if abs(cost - plan.prediction.cost_per_hour) > 1e-6 * max(1.0, cost):
            out.append(f"predicted cost {plan.prediction.cost_per_hour} differs from the cells' cost {cost}")
        if not set(plan.buckets) <= set(inp.grid):
            out.append(f"buckets {plan.buckets} are not among the allowed lengths {inp.grid}")
        for key, ms in self.stage_ms.items():
            if ms > self.cycle_ms * (1 + 1e-9):
                out.append(f"cell {key}: a batch takes {ms:.3f} ms, over the cycle {self.cycle_ms:.3f} ms")
        if plan.prediction.p99_ms > inp.budget_ms * (1 + 1e-9):
            out.append(f"predicted p99 {plan.prediction.p99_ms:.3f} ms exceeds the SLO budget {inp.budget_ms:.3f} ms")
        if isinstance(self.problem, PlanProblem):
            for s in plan.splits:
                sized = {
                    self.problem.rebatches(len(plan.splits), inp.pool_names.index(c.pool), s.first_block, s.last_block)
                    for c in plan.cells
                    if c.split == s.index and c.pool in inp.pool_names
                }
                if sized and sized != {s.rebatch}:
                    out.append(
                        f"split {s.index} is marked rebatch={s.rebatch}, but its cells were sized with rebatch={sorted(sized)}"
                    )
        unknown = set(plan.thresholds) - set(inp.ramp_names)
        if unknown:
            out.append(f"thresholds name unknown ramps {sorted(unknown)}")
        return out

    def verify(self) -> None:
        """Raise PlanInvalid listing every broken invariant."""
        problems = self.problems()
        if problems:
            raise PlanInvalid("; ".join(problems), field="plan")


# ---------------------------------------------------------------- from a solution to a Plan


def _fill_spare(problem: E3Problem, sol: E3Solution) -> None:
    """Max-goodput spends the whole budget (caps, cost cap, maxReplicas): spare replicas go, one at a
    time, to the tightest cell."""
    use = sol.replicas_per_pool(len(problem.caps))
    cost = float(use @ problem.costs)
    while problem.max_replicas is None or int(use.sum()) < problem.max_replicas:
        best = None
        for i, seg in enumerate(sol.segments):
            if use[seg.pool] >= problem.caps[seg.pool]:
                continue
            if problem.cost_cap is not None and cost + problem.costs[seg.pool] > problem.cost_cap + 1e-9:
                continue
            for k, share in enumerate(problem.shares):
                load = share * problem.sigma_in[seg.first]
                if load <= 0:
                    continue
                g = seg.replicas[k] * problem.rate[sol.splits - 1, seg.pool, seg.first, seg.last, k] / load
                if best is None or g < best[0]:
                    best = (g, i, k)
        if best is None:
            break
        _, i, k = best
        seg = sol.segments[i]
        seg.replicas[k] += 1
        use[seg.pool] += 1
        cost += float(problem.costs[seg.pool])
    sol.cost = cost
    sol.goodput = min(problem.split_goodput(sol.splits, g.pool, g.first, g.last, g.replicas) for g in sol.segments)


def _to_plan(
    service: str,
    spec: EarlyExitServiceSpec,
    inp: Inputs,
    bucket_set: list[int],
    problem: E3Problem,
    sol: E3Solution,
    thresholds: Mapping[str, float],
    reason: str,
    placement: Placement | None = None,
) -> tuple[Plan, float, dict[tuple[int, int], float]]:
    s = sol.splits
    cycle = inp.budget_ms / cycles(s)
    splits: list[SplitPlan] = []
    cells: list[Cell] = []
    stage: dict[tuple[int, int], float] = {}
    for i, seg in enumerate(sol.segments):
        rb = isinstance(problem, PlanProblem) and problem.rebatches(s, seg.pool, seg.first, seg.last)
        splits.append(SplitPlan(index=i, first_block=seg.first, last_block=seg.last, rebatch=rb))
        for k, length in enumerate(bucket_set):
            if placement is not None:  # one bucket, a split may span pools
                per_pool = [(p, int(r)) for p, r in enumerate(placement.replicas[i]) if r > 0]
            else:
                per_pool = [(seg.pool, int(seg.replicas[k]))] if seg.replicas[k] > 0 else []
            for p, reps in per_pool:
                cells.append(
                    Cell(
                        split=i,
                        bucket=int(length),
                        pool=inp.pool_names[p],
                        replicas=reps,
                        batch_size=int(problem.batch[s - 1, p, seg.first, seg.last, k]),
                    )
                )
                ms = float(problem.stage_ms[s - 1, p, seg.first, seg.last, k])
                stage[(i, int(length))] = max(stage.get((i, int(length)), 0.0), ms)
    slowest = max(stage.values())
    p99 = cycles(s) * slowest
    if any(x.rebatch for x in splits):
        # rebatching splits: each queue's whole gather time and the run, split by split (PlanProblem.longest_ms);
        # the deadline rule caps every row at the budget whatever the queues do
        longest = problem.longest_ms if isinstance(problem, PlanProblem) else None
        p99 = inp.budget_ms
        if longest is not None:
            per_split = [
                max(float(longest[s - 1, c_pool, seg.first, seg.last, k]) for c_pool, k in _cells_of(i, placement, seg))
                for i, seg in enumerate(sol.segments)
            ]
            p99 = min(inp.budget_ms, sum(per_split))
    goodput = sol.goodput if math.isfinite(sol.goodput) else 0.0
    if placement is not None:
        goodput, sol = (
            placement.goodput,
            E3Solution(sol.splits, sol.segments, placement.goodput, placement.cost, sol.probes),
        )
    limits, colocate, goodput, cells = _serving_path(inp, problem, splits, bucket_set, cells, spec, goodput)
    for limit in limits:
        if limit.goodput_rps < goodput:
            inp.notes.append(
                f"goodput {goodput:.4g} -> {limit.goodput_rps:.4g} req/s: the serving path limits it ({limit.what})"
            )
            goodput = limit.goodput_rps
    plan = Plan(
        service=service,
        model=spec.model.name,
        splits=splits,
        buckets=[int(b) for b in bucket_set],
        cells=cells,
        thresholds={k: float(v) for k, v in thresholds.items()},
        survival=[float(x) for x in inp.survival],
        length_histogram=[float(x) for x in problem.shares],
        prediction=Prediction(goodput_rps=float(goodput), p99_ms=float(p99), cost_per_hour=float(sol.cost)),
        reason=reason,
        colocate=colocate,
    )
    return plan, cycle, stage


def _serving_path(
    inp: Inputs,
    problem: E3Problem,
    splits: list[SplitPlan],
    buckets: Sequence[int],
    cells: list[Cell],
    spec: EarlyExitServiceSpec,
    goodput: float,
) -> tuple[list[PathLimit], bool, float, list[Cell]]:
    """The serving path's limits, whether the routers run split 0 (spec.planner.colocate, serving_path.py),
    the cells' goodput that way (the solver's `goodput`, more when split 0 sheds its hop) and the cells (split
    0's at its best batch without the hop where it runs in the routers)."""
    routers = spec.router.replicas
    apart = path_limits(inp, problem, splits, buckets, cells, routers)
    mode = spec.planner.colocate
    if mode == "off":
        return apart, False, goodput, cells
    why_not = why_not_colocate(inp, cells, buckets, routers)
    if why_not is not None:
        if mode == "on":
            raise PlanInfeasible(f"cannot run split 0 in the routers: {why_not}", field="spec.planner.colocate")
        return apart, False, goodput, cells
    co_cells = colocated_cells(inp, problem, splits, buckets, cells)
    together = path_limits(inp, problem, splits, buckets, co_cells, routers, colocate=True)
    shed = goodput * colocated_gain(inp, problem, splits, buckets, cells)
    kept = min([goodput, *(x.goodput_rps for x in apart)])
    merged = min([shed, *(x.goodput_rps for x in together)])
    if mode == "on" or merged > kept * (1 + COLOCATE_MIN_GAIN):
        inp.notes.append(
            f"split 0 runs in the routers ({colocated_routers(cells, routers)}): {merged:.4g} req/s predicted "
            f"that way, {kept:.4g} with a hop to split-0 workers"
        )
        return together, True, shed, co_cells
    return apart, False, goodput, cells


def _cells_of(i: int, placement: Placement | None, seg: Segment) -> list[tuple[int, int]]:
    """(pool, bucket index) of every cell of split i."""
    if placement is not None:
        pools = [p for p, r in enumerate(placement.replicas[i]) if r > 0]
        return [(p, k) for p in pools for k in range(len(seg.replicas))]
    return [(seg.pool, k) for k in range(len(seg.replicas)) if seg.replicas[k] > 0]


@dataclass
class PlanChange:
    """How far a new plan is from the previous one, in worker instances."""

    added: int
    removed: int
    kept: int

    @property
    def replaced(self) -> int:
        """Instances that must start (a removed one can become an added one of another cell)."""
        return self.added

    @property
    def moved_fraction(self) -> float:
        total = self.kept + self.removed
        return (max(self.added, self.removed) / total) if total else 1.0


def plan_change(previous: Plan | None, plan: Plan) -> PlanChange:
    """Per cell (split layout, bucket, pool): replicas kept, added and removed between two plans."""

    def key_map(p: Plan) -> dict[tuple[tuple[int, int], int, str, int], int]:
        layout = {s.index: (s.first_block, s.last_block) for s in p.splits}
        out: dict[tuple[tuple[int, int], int, str, int], int] = {}
        for c in p.cells:
            k = (layout[c.split], c.bucket, c.pool, c.batch_size)
            out[k] = out.get(k, 0) + c.replicas
        return out

    new = key_map(plan)
    old = key_map(previous) if previous is not None else {}
    kept = sum(min(new.get(k, 0), old.get(k, 0)) for k in set(new) | set(old))
    return PlanChange(added=sum(new.values()) - kept, removed=sum(old.values()) - kept, kept=kept)


def _previous_layout(previous: Plan, inp: Inputs) -> tuple[list[int], tuple[list[tuple[int, int]], list[int]]] | None:
    """The previous plan's buckets and layout (segments, pool per segment), if it still applies."""
    if previous.splits[-1].last_block != inp.n_blocks - 1 or not set(previous.buckets) <= set(inp.grid):
        return None
    pools = []
    for s in previous.splits:
        used = {c.pool for c in previous.cells if c.split == s.index}
        if len(used) != 1 or next(iter(used)) not in inp.pool_names:
            return None
        pools.append(inp.pool_names.index(next(iter(used))))
    return list(previous.buckets), ([(s.first_block, s.last_block) for s in previous.splits], pools)


def _hints(previous: Plan | None, inp: Inputs) -> list[list[Segment]]:
    """The previous plan's layout (a split on one pool each) as the search's warm start; none if it no longer applies."""
    layout = _previous_layout(previous, inp) if previous is not None else None
    if layout is None:
        return []
    return [[Segment(a, b, p, np.zeros(0, dtype=np.int64)) for (a, b), p in zip(*layout[1])]]


def _densepipe(problem: E3Problem, sol: E3Solution) -> Placement | None:
    """DensePipe's placement of the chosen layout over every pool (a split may span pools); returned
    only when it beats E3's one-pool-per-split replicas."""
    s = sol.splits
    # a pool joins a split only where it would run it the same way (rebatching or not) as the split's own pool
    same = [
        [
            not isinstance(problem, PlanProblem)
            or problem.rebatches(s, p, g.first, g.last) == problem.rebatches(s, g.pool, g.first, g.last)
            for p in range(len(problem.caps))
        ]
        for g in sol.segments
    ]
    mu = np.asarray(
        [
            [problem.rate[s - 1, p, g.first, g.last, 0] if same[i][p] else 0.0 for p in range(len(problem.caps))]
            for i, g in enumerate(sol.segments)
        ]
    )
    q = np.asarray([problem.sigma_in[g.first] for g in sol.segments])
    if np.any(q <= 0):
        return None
    try:
        placement = place(mu, q, problem.caps, problem.costs, cost_cap=problem.cost_cap, time_limit_s=2.0)
    except PlanInfeasible:
        return None
    if problem.max_replicas is not None and int(placement.replicas.sum()) > problem.max_replicas:
        return None  # DensePipe knows no total cap: E3's replicas keep to maxReplicas
    return placement if placement.goodput > sol.goodput * (1 + 1e-6) else None


def _solve(problem: E3Problem, spec: EarlyExitServiceSpec, hints: Sequence[Sequence[Segment]] = ()) -> E3Solution:
    """The solver the objective names; `hints`: layouts that warm-start max-goodput's search (the same plan)."""
    if spec.planner.objective == Objective.min_cost:
        target = spec.planner.target_rps or spec.workload.rps
        return min_cost(problem, float(target))
    sol = max_goodput(problem, hints=[h for h in hints if len(h) <= problem.max_splits])
    _fill_spare(problem, sol)
    return sol


_Choice = tuple[list[int], PlanProblem, E3Solution]
"""A bucket set, the problem built for it and the solver's solution."""


def _default_thresholds(
    observations: Observations | Sequence[Observations] | None, previous: Plan | None
) -> dict[str, float]:
    """The thresholds a plan names when the caller gives none: the latest observation window's, else the
    previous plan's, else none (then no ramp exits, and the plan is sized so)."""
    windows = observation_windows(observations)
    latest = windows[-1].thresholds if windows and windows[-1].thresholds else None
    return dict(latest or (previous.thresholds if previous else None) or {})


def _bucket_sets(inp: Inputs) -> dict[int, list[int]]:
    """Candidate bucket sets by their number of buckets: the spec's fixed buckets, or the best set of each size
    from the staircase of per-input costs, keeping only buckets that some input falls into (and the longest)."""
    if inp.fixed_buckets:
        return {len(inp.grid): list(inp.grid)}
    ref = inp.models[0]
    top_batch = float(ref.profile.batch_sizes[-1])
    per_input = [min(m.full_model_ms(length, top_batch) for m in inp.models) / top_batch for length in inp.grid]
    candidates = bk.staircase(inp.grid, per_input)
    useful = [g for g, w in zip(inp.grid, inp.mass) if w > 0]
    candidates = [c for c in candidates if c == inp.grid[-1] or any(u <= c for u in useful)]
    limit = min(MAX_BUCKETS, int(inp.caps.sum()), inp.max_replicas or MAX_BUCKETS)
    sets = bk.best_bucket_sets(inp.grid, inp.mass, per_input, candidates, limit)
    return {
        m: b for m, b in sets.items() if all(inp.mass[inp.grid.index(x)] > 0 or x == inp.grid[-1] for x in b) or m == 1
    }


def _best_bucket_set(
    inp: Inputs,
    spec: EarlyExitServiceSpec,
    sets: dict[int, list[int]],
    max_splits: int,
    rebatch: bool,
    cache: OptionCache | None = None,
    hints: Sequence[Sequence[Segment]] = (),
) -> tuple[_Choice, list[dict[str, object]]]:
    """The best plan over the bucket sets (most goodput, or least cost for min-cost) and what each set gave.

    For max-goodput the sets are solved in the order of their fractional upper bound (e3_search.upper_bounds),
    and a set whose bound is below the best plan found, or that no plan of it reaches, is not solved (it
    could not beat it). Ties go to the set with fewer buckets.

    `hints`: layouts that warm-start each set's search (the previous plan's; each set's solution is one for the
    sets after it).

    Raises the min-cost target's PlanInfeasible, or one naming the binding constraint, when no set has a plan."""
    hints = list(hints)
    tried: list[dict[str, object]] = []
    chosen: _Choice | None = None
    last_error: PlanInfeasible | None = None
    most = spec.planner.objective == Objective.max_goodput
    problems = [
        (bucket_set, build_problem(inp, bucket_set, max_splits, rebatch=rebatch, cache=cache))
        for _, bucket_set in sorted(sets.items())
    ]
    bounds = [float(upper_bounds(problem).max(initial=0.0)) if most else 0.0 for _, problem in problems]
    for i in sorted(range(len(problems)), key=lambda i: -bounds[i]) if most else range(len(problems)):
        bucket_set, problem = problems[i]
        if most and chosen is not None:
            # a set that cannot beat the best plan (or tie it with fewer buckets) is not solved
            floor = chosen[2].goodput * (1 - 1e-9 if len(bucket_set) < len(chosen[0]) else 1 + 1e-9)
            if bounds[i] < floor or not reaches(problem, floor):
                tried.append({"buckets": bucket_set, "bound": bounds[i], "skipped": "it cannot beat the best plan"})
                continue
        try:
            sol = _solve(problem, spec, hints)
        except PlanInfeasible as err:
            last_error = err
            tried.append({"buckets": bucket_set, "goodput": 0.0, "cost": 0.0, "error": str(err)})
            continue
        hints.append(sol.segments)
        tried.append({"buckets": bucket_set, "goodput": sol.goodput, "cost": sol.cost, "splits": sol.splits})
        if chosen is None:
            better = True
        elif most:
            ratio = sol.goodput / chosen[2].goodput if chosen[2].goodput > 0 else math.inf
            better = ratio > 1 + 1e-9 or (ratio >= 1 - 1e-9 and len(bucket_set) < len(chosen[0]))
        else:
            better = sol.cost < chosen[2].cost - 1e-9
        if better:
            chosen = (bucket_set, problem, sol)
    if chosen is None:
        if last_error is not None and last_error.field == "spec.planner.targetRps":
            raise last_error
        raise diagnose(
            inp, min(sets.values(), key=len), max_splits
        )  # splits without rebatching are always among the options
    return chosen, tried


def _previous_if_close(
    previous: Plan,
    inp: Inputs,
    spec: EarlyExitServiceSpec,
    best: E3Solution,
    max_splits: int,
    rebatch: bool,
    keep_layout: bool,
    cache: OptionCache | None = None,
) -> _Choice | None:
    """The previous plan's buckets and layout, re-solved, when they still apply and reach within HYSTERESIS of
    `best` (or at all, with `keep_layout`); else None."""
    layout = _previous_layout(previous, inp)
    if layout is None or len(layout[1][0]) > max_splits:
        return None  # gone, or more splits than spec.planner.maxSplits now allows
    prev_buckets, prev_layout = layout
    try:
        problem = build_problem(inp, prev_buckets, max_splits, layout=prev_layout, rebatch=rebatch, cache=cache)
        sol = _solve(problem, spec)
    except PlanInfeasible:
        return None
    close = keep_layout or (
        sol.goodput >= (1 - HYSTERESIS) * best.goodput
        if spec.planner.objective == Objective.max_goodput
        else sol.cost <= (1 + HYSTERESIS) * best.cost
    )
    return (prev_buckets, problem, sol) if close else None


def plan_service(
    service_name: str,
    spec: EarlyExitServiceSpec,
    pools: Mapping[str, GPUPoolSpec],
    profiles: Mapping[str, ModelProfileSpec],
    *,
    thresholds: Mapping[str, float] | None = None,
    observations: Observations | Sequence[Observations] | None = None,
    previous: Plan | None = None,
    reason: str = "initial",
    lengths: Sequence[int] | None = None,
    forecaster: str = DEFAULT_PREDICTOR,
    keep_layout: bool = False,
    cache: OptionCache | None = None,
) -> PlanResult:
    """Plan a service: splits, length buckets, cells (split, bucket, pool) with replicas and batch sizes.

    `thresholds`: per exit ramp (ramps not named do not exit); None: the latest observation window's,
    else the previous plan's, else none. The plan names them and is sized with them: without any, no
    ramp exits (the data plane exits nowhere until thresholds are set). `observations`: the latest
    window(s); their survival (forecast over windows) and length histogram replace the profile's. `lengths`: raw input lengths (e.g. from a trace) to size the
    buckets when no observations exist. `previous`: keep its layout when it is within 5 % of the
    optimum (fewest replaced instances), or whatever the optimum with `keep_layout` (the operator's
    move cap: replicas move within a layout, a new layout replaces every instance); its layout also
    warm-starts the search. `cache`: the service's OptionCache, kept by the caller between its plans (the
    options whose inputs did not change are reused; it keeps this plan's). Raises SpecError, ProfileError
    or PlanInfeasible.
    """
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    if thresholds is None:
        thresholds = _default_thresholds(observations, previous)
    # sized with exactly the thresholds the plan names: the data plane exits where they say, nowhere else
    inp = resolve_inputs(
        spec, pools, profiles, thresholds=thresholds, observations=observations, lengths=lengths, forecaster=forecaster
    )
    if not thresholds and inp.ramp_names:
        inp.notes.append("no thresholds given: the plan names none, so it is sized (and served) without exits")
    timings["inputs"] = time.perf_counter() - t0

    t1 = time.perf_counter()
    max_splits = min(spec.planner.max_splits, inp.n_blocks)
    rebatch = rebatching(spec, inp)
    sets = _bucket_sets(inp)
    timings["buckets"] = time.perf_counter() - t1

    t2 = time.perf_counter()
    cache = OptionCache() if cache is None else cache
    chosen, tried = _best_bucket_set(inp, spec, sets, max_splits, rebatch, cache, _hints(previous, inp))
    timings["solve"] = time.perf_counter() - t2

    kept = False
    if previous is not None:
        again = _previous_if_close(previous, inp, spec, chosen[2], max_splits, rebatch, keep_layout, cache)
        if again is not None:
            chosen, kept = again, True
            inp.notes.append("kept the previous layout (within 5 % of the optimum): fewest replaced instances")

    t3 = time.perf_counter()
    bucket_set, problem, sol = chosen
    placement = None
    if len(bucket_set) == 1 and len(inp.pool_names) > 1 and spec.planner.objective == Objective.max_goodput:
        placement = None if kept else _densepipe(problem, sol)
        if placement is not None:
            inp.notes.append(
                f"DensePipe placement spreads splits over pools: goodput {sol.goodput:.4g} -> {placement.goodput:.4g} req/s"
            )
    timings["densepipe"] = time.perf_counter() - t3
    t3 = time.perf_counter()
    plan, cycle, stage = _to_plan(
        service_name, spec, inp, list(bucket_set), problem, sol, thresholds, reason, placement
    )
    timings["plan"] = time.perf_counter() - t3
    timings["total"] = time.perf_counter() - t0
    notes = list(dict.fromkeys(inp.notes + [n for m in inp.models for n in m.notes]))
    cache.retain_used()
    result = PlanResult(plan, inp, problem, sol, list(bucket_set), cycle, stage, timings, notes, tried, kept, rebatch)
    result.verify()  # a broken invariant is a planner bug: a typed PlanInvalid, never a bad plan
    return result
