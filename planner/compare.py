"""The configurations the simulator compares, each planned by `plan_service` with a feature set:

| config    | exits | splits (E3)     | rebatching           | length buckets (Arlo)            |
|-----------|-------|-----------------|----------------------|----------------------------------|
| vanilla   | off   | 1               | no                   | one, at the longest length       |
| naive-ee  | on    | 1               | no                   | one                              |
| e3        | on    | up to maxSplits | no (E3's technique)  | one                              |
| arlo      | off   | 1               | no                   | from the staircase + Algorithm 1 |
| exitplan  | on    | up to maxSplits | spec.planner.rebatch | from the staircase + Algorithm 1 |
| oracle    | free  | --              | --                   | none needed (fluid bound)        |

Rebatching: a split keeps a fusion queue per block, so each block runs a full batch of the rows
that reached it (SplitPlan.rebatch); without it a block runs what is left of one entering batch.
With spec.planner.rebatch on, the planner rebatches a split on a pool where that is no slower.
All share the spec's pools, caps and cost cap (equal cost), the SLO and the dispatch/batching rules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from exitplan.api.resources import EarlyExitServiceSpec, GPUPoolSpec, ModelProfileSpec
from exitplan.planner.errors import PlanInfeasible
from exitplan.planner.service import PlanResult, plan_service
from exitplan.planner.simulator import SimResult, Simulation, depths_from_survival, oracle_goodput, poisson_arrivals

CONFIGS = ("vanilla", "naive-ee", "e3", "arlo", "exitplan", "oracle")


@dataclass
class Config:
    name: str
    exits: bool
    splits: bool
    buckets: bool
    rebatch: bool
    """False: never rebatch; True: as the spec's planner.rebatch says."""


FEATURES = {
    "vanilla": Config("vanilla", False, False, False, False),
    "naive-ee": Config("naive-ee", True, False, False, False),
    "e3": Config("e3", True, True, False, False),
    "arlo": Config("arlo", False, False, True, False),
    "exitplan": Config("exitplan", True, True, True, True),
}


def plan_config(
    name: str,
    service: str,
    spec: EarlyExitServiceSpec,
    pools: Mapping[str, GPUPoolSpec],
    profiles: Mapping[str, ModelProfileSpec],
    lengths: Sequence[int] | None = None,
    thresholds: Mapping[str, float] | None = None,
) -> PlanResult:
    """Plan `spec` with the features of configuration `name` (not 'oracle')."""
    f = FEATURES[name]
    ref = profiles[spec.pools[0].name]
    ramps = [r.name for r in ref.ramps]
    on = dict(thresholds) if thresholds else {r: 0.9 for r in ramps}
    th = on if f.exits else {r: 2.0 for r in ramps}
    planner = spec.planner.model_copy(
        update={"max_splits": spec.planner.max_splits if f.splits else 1, "rebatch": spec.planner.rebatch and f.rebatch}
    )
    workload = spec.workload
    if not f.buckets:
        top = max(spec.workload.length_buckets) if spec.workload.length_buckets else max(ref.seq_lens)
        workload = workload.model_copy(update={"length_buckets": [int(top)]})
    cspec = spec.model_copy(update={"planner": planner, "workload": workload})
    return plan_service(service, cspec, pools, profiles, thresholds=th, lengths=lengths, reason=f"config:{name}")


def simulate_plan(
    result: PlanResult,
    arrivals: np.ndarray,
    lengths: np.ndarray,
    slo_ms: float,
    *,
    seed: int = 0,
    name: str = "",
    depths: np.ndarray | None = None,
    max_wait_ms: float = 2.0,
    compact_exits: bool = True,
) -> SimResult:
    inp = result.inputs
    models = {m.pool_name: m for m in inp.models}
    sim = Simulation(
        result.plan,
        models,
        slo_ms,
        enabled=inp.enabled,
        survival=_true_survival(result),
        seed=seed,
        name=name,
        pool_costs=dict(zip(inp.pool_names, inp.costs.tolist())),
        max_wait_ms=max_wait_ms,
        compact_exits=compact_exits,
    )
    return sim.run(arrivals, lengths, depths)


def _true_survival(result: PlanResult) -> list[float]:
    ref = result.inputs.models[0].profile
    return list(ref.survival) if ref.survival else [1.0] * len(ref.ramps)


def sustainable_rate(
    result: PlanResult,
    lengths_pool: np.ndarray,
    slo_ms: float,
    *,
    target: float = 0.99,
    n: int = 6000,
    seed: int = 0,
    iters: int = 9,
    max_wait_ms: float = 2.0,
    duration_s: float = 0.0,
    depths_survival: Sequence[float] | None = None,
    compact_exits: bool = True,
) -> tuple[float, SimResult]:
    """The largest Poisson rate at which >= `target` of requests are answered within the SLO
    (drops count as misses), by bisection between 0 and twice the planned goodput; lengths drawn
    from `lengths_pool`. With `duration_s`, each run holds at least that many seconds of arrivals
    at the planned goodput (so an overload has time to show). A rate passes only in a steady
    state: the target must hold over the whole run and also over the requests that arrived in its
    last third (a queue that is still building near capacity passes the whole run on the strength
    of its empty start, not the last third)."""
    rng = np.random.default_rng(seed)
    top = max(result.plan.prediction.goodput_rps, 1e-3) * 2.0
    n = max(n, int(top / 2 * duration_s))
    lengths = rng.choice(lengths_pool, size=n)
    base = poisson_arrivals(rng, 1.0, n)
    lo, hi = 0.0, top
    best = None
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        res = simulate_plan(
            result, base / mid, lengths, slo_ms, seed=seed, max_wait_ms=max_wait_ms, compact_exits=compact_exits
        )
        if res.attainment >= target and res.tail_attainment >= target:
            lo, best = mid, res
        else:
            hi = mid
    if best is None:
        best = simulate_plan(
            result,
            base / max(lo, 1e-3),
            lengths,
            slo_ms,
            seed=seed,
            max_wait_ms=max_wait_ms,
            compact_exits=compact_exits,
        )
    return lo, best


def oracle_for(result: PlanResult, lengths: np.ndarray, rate: float, seed: int = 0) -> float:
    inp = result.inputs
    ref = inp.models[0]
    rng = np.random.default_rng(seed)
    depths = depths_from_survival(
        rng, len(lengths), ref.n_blocks, ref.ramp_after, _true_survival(result), [True] * len(ref.ramp_after)
    )
    return oracle_goodput(
        {m.pool_name: m for m in inp.models},
        dict(zip(inp.pool_names, inp.caps.tolist())),
        np.asarray(lengths),
        depths,
        rate,
    )


def plan_all(
    service: str,
    spec: EarlyExitServiceSpec,
    pools: Mapping[str, GPUPoolSpec],
    profiles: Mapping[str, ModelProfileSpec],
    lengths: Sequence[int] | None = None,
    configs: Sequence[str] = CONFIGS,
) -> dict[str, PlanResult | str]:
    """Every configuration's plan, or the reason it has none."""
    out: dict[str, PlanResult | str] = {}
    for name in configs:
        if name == "oracle":
            continue
        try:
            out[name] = plan_config(name, service, spec, pools, profiles, lengths)
        except PlanInfeasible as err:
            out[name] = str(err)
    return out
