"""The configurations the simulator compares, each planned by `plan_service` with a feature set, and how
their goodput is measured.

| config           | exits | splits (E3)     | rebatching           | length buckets (Arlo)            |
|------------------|-------|-----------------|----------------------|----------------------------------|
| vanilla          | off   | 1               | no                   | one, at the longest length       |
| naive-ee         | on    | 1               | no                   | one                              |
| naive-ee+buckets | on    | 1               | no                   | from the staircase + Algorithm 1 |
| e3               | on    | up to maxSplits | no (E3's technique)  | one                              |
| e3+buckets       | on    | up to maxSplits | no                   | from the staircase + Algorithm 1 |
| arlo             | off   | 1               | no                   | from the staircase + Algorithm 1 |
| exitplan         | on    | up to maxSplits | spec.planner.rebatch | from the staircase + Algorithm 1 |
| oracle           | free  | --              | --                   | none needed (fluid bound)        |

The "+buckets" rows give the baselines exitplan's length buckets, so that a gain over them is its own and
not Arlo's (on mixed lengths naive early exit padded to the longest length loses mostly to the padding).
Rebatching: a split keeps a fusion queue per block, so each block runs a full batch of the rows that
reached it (SplitPlan.rebatch); without it a block runs what is left of one entering batch. The planner
rebatches a split where its cost tables say that needs fewer replicas; `measure_all` keeps a rebatching
plan only where the simulator sustains more with it than with the same planner without rebatching
(e3+buckets). All share the spec's pools, caps and cost cap (equal cost), the SLO and the dispatch and
batching rules.

Goodput (`measure`): the highest offered rate at which >= 99 % of requests are answered within the SLO over
a run and over the requests that arrived in its last third (drops count as misses), found on runs of
`duration_s` seconds and confirmed on one of `confirm_s` (30 s) seconds with a quarter of the misses allowed; reported
as the answers within the SLO per second of that confirming run (at most the rate: what the GPUs served,
never what was offered).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from exitplan.api.resources import EarlyExitServiceSpec, GPUPoolSpec, ModelProfileSpec
from exitplan.planner.arrivals import looped_trace, poisson_for
from exitplan.planner.errors import PlanInfeasible
from exitplan.planner.inputs import Sized
from exitplan.planner.oracle import oracle_goodput
from exitplan.planner.service import PlanResult, plan_service
from exitplan.planner.simulator import ServingPath, SimResult, Simulation, depths_from_survival

CONFIGS = ("vanilla", "naive-ee", "naive-ee+buckets", "e3", "e3+buckets", "arlo", "exitplan", "oracle")


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
    "naive-ee+buckets": Config("naive-ee+buckets", True, False, True, False),
    "e3": Config("e3", True, True, False, False),
    "e3+buckets": Config("e3+buckets", True, True, True, False),
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
    result: Sized,
    arrivals: np.ndarray,
    lengths: np.ndarray,
    slo_ms: float,
    *,
    seed: int = 0,
    name: str = "",
    depths: np.ndarray | None = None,
    max_wait_ms: float = 2.0,
    compact_exits: bool = True,
    trim: Sequence[int] | None = None,
    path: ServingPath = ServingPath(),
    survival: Sequence[float] | None = None,
) -> SimResult:
    """One simulated run of the plan (planner/simulator.py; `trim`, `path`: its options of the same names;
    `survival`: where requests exit, default the profile's)."""
    inp = result.inputs
    models = {m.pool_name: m for m in inp.models}
    sim = Simulation(
        result.plan,
        models,
        slo_ms,
        enabled=inp.enabled,
        survival=_true_survival(result) if survival is None else survival,
        seed=seed,
        name=name,
        pool_costs=dict(zip(inp.pool_names, inp.costs.tolist())),
        max_wait_ms=max_wait_ms,
        compact_exits=compact_exits,
        trim=trim,
        path=path,
    )
    return sim.run(arrivals, lengths, depths)


def _true_survival(result: Sized) -> list[float]:
    ref = result.inputs.models[0].profile
    return list(ref.survival) if ref.survival else [1.0] * len(ref.ramps)


# ---------------------------------------------------------------- goodput


class Workload:
    """Arrivals at any rate over any number of seconds, the same draws scaled: Poisson (lengths drawn from
    `lengths_pool`), or with `pattern` = (timestamps, lengths) of a trace, its pattern looped and scaled
    (planner/arrivals.py) with its own lengths."""

    def __init__(
        self,
        lengths_pool: np.ndarray,
        *,
        seed: int = 0,
        pattern: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        self.pool = np.asarray(lengths_pool)
        self.pattern = pattern
        self.rng = np.random.default_rng(seed)
        self.base = np.zeros(0)
        """Unit-rate Poisson arrival times; a rate r over d seconds takes those below r d, divided by r."""
        self.lengths = np.zeros(0, dtype=np.int64)

    def at(self, rate: float, duration_s: float) -> tuple[np.ndarray, np.ndarray]:
        """(arrival times, lengths) of `duration_s` seconds at a mean of `rate` per second."""
        if self.pattern is not None:
            times, lens = looped_trace(self.pattern[0], self.pattern[1], rate, duration_s)
            return times, lens
        horizon = rate * duration_s
        if not len(self.base) or self.base[-1] < horizon:
            more = poisson_for(self.rng, 1.0, horizon * 1.25 + 64 - (self.base[-1] if len(self.base) else 0.0))
            start = self.base[-1] if len(self.base) else 0.0
            self.base = np.concatenate([self.base, start + more])
            self.lengths = np.concatenate([self.lengths, self.rng.choice(self.pool, size=len(more))])
        n = int(np.searchsorted(self.base, horizon, side="left"))
        return self.base[:n] / rate, self.lengths[:n]


@dataclass
class Goodput:
    rate: float
    """The highest offered rate that passed: >= target of the requests answered within the SLO over the
    whole run and over those that arrived in its last third, drops counted as misses."""
    goodput: float
    """Answers within the SLO per second in the confirming run at `rate` (at most `rate`)."""
    run: SimResult
    """The confirming run (`confirm_s` seconds at `rate`)."""
    probes: int = 0
    notes: list[str] = field(default_factory=list)


def passes(res: SimResult, target: float = 0.99) -> bool:
    """A steady state within the SLO: the target over the whole run and over its last third."""
    return res.offered > 0 and res.attainment >= target and res.tail_attainment >= target


def measure(
    result: PlanResult,
    lengths_pool: np.ndarray,
    slo_ms: float,
    *,
    duration_s: float = 10.0,
    confirm_s: float = 30.0,
    target: float = 0.99,
    tol: float = 0.005,
    seed: int = 0,
    max_wait_ms: float = 2.0,
    compact_exits: bool = True,
    pattern: tuple[np.ndarray, np.ndarray] | None = None,
) -> Goodput:
    """The plan's goodput (module docstring): from the planned rate, up by 10 % steps while runs of
    `duration_s` pass or down by 15 % steps until one does, then bisection to a relative `tol`; the rate
    found is confirmed on a run of `confirm_s` seconds that must keep a quarter of the allowed misses
    (99.75 % for a 99 % target: near capacity the share within the SLO moves by up to a per cent from one
    draw of arrivals to another -- the router's admission limit follows the answers' latency, so a burst
    that made answers late is refused for a while after --, and another 30 s at the goodput must still
    hold the target), 2 `tol` lower each time that run fails."""
    work = Workload(lengths_pool, seed=seed, pattern=pattern)
    probes = 0

    def run(rate: float, seconds: float) -> SimResult:
        nonlocal probes
        probes += 1
        times, lens = work.at(rate, seconds)
        return simulate_plan(
            result, times, lens, slo_ms, seed=seed, max_wait_ms=max_wait_ms, compact_exits=compact_exits
        )

    lo, hi = _bracket(lambda r: passes(run(r, duration_s), target), max(result.plan.prediction.goodput_rps, 1e-3))
    while lo > 0 and hi - lo > tol * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if passes(run(mid, duration_s), target) else (lo, mid)
    strict = 1 - (1 - target) / 4
    res = run(lo, confirm_s) if lo > 0 else None
    for _ in range(40):
        if res is None or passes(res, strict):
            break
        lo *= 1 - 2 * tol
        res = run(lo, confirm_s)
    if res is None or not passes(res, strict):
        empty = SimResult(result.plan.service, 0, 0, 0, 0, 1.0, np.zeros(0))
        return Goodput(0.0, 0.0, res or empty, probes, ["no rate passed"])
    return Goodput(lo, res.goodput, res, probes)


def _bracket(ok: Callable[[float], bool], planned: float) -> tuple[float, float]:
    """(a rate that passed or 0, a rate that failed) around `planned`."""
    if ok(planned):
        lo = planned
        for _ in range(12):
            if not ok(lo * 1.1):
                return lo, lo * 1.1
            lo *= 1.1
        return lo, lo * 1.1
    hi = planned
    for _ in range(30):
        if ok(hi * 0.85):
            return hi * 0.85, hi
        hi *= 0.85
    return 0.0, hi


def sustainable_rate(
    result: PlanResult,
    lengths_pool: np.ndarray,
    slo_ms: float,
    *,
    target: float = 0.99,
    seed: int = 0,
    max_wait_ms: float = 2.0,
    duration_s: float = 10.0,
    confirm_s: float = 30.0,
    compact_exits: bool = True,
) -> tuple[float, SimResult]:
    """(goodput, the confirming run) of `measure`: answers within the SLO per second at the highest Poisson
    rate that keeps >= `target` of requests within it over a whole run and its last third."""
    got = measure(
        result,
        lengths_pool,
        slo_ms,
        duration_s=duration_s,
        confirm_s=confirm_s,
        target=target,
        seed=seed,
        max_wait_ms=max_wait_ms,
        compact_exits=compact_exits,
    )
    return got.goodput, got.run


# ---------------------------------------------------------------- every configuration


def oracle_for(result: PlanResult, lengths: np.ndarray, rate: float, seed: int = 0) -> float:
    """The fluid bound (planner/oracle.py) on the plan's service: its pools, caps, cost cap and maxReplicas,
    every ramp on and charged, exit depths drawn from the profile's survival curve."""
    inp = result.inputs
    ref = inp.models[0]
    rng = np.random.default_rng(seed)
    on = [True] * len(ref.ramp_after)
    depths = depths_from_survival(rng, len(lengths), ref.n_blocks, ref.ramp_after, _true_survival(result), on)
    return oracle_goodput(
        {m.pool_name: m for m in inp.models},
        dict(zip(inp.pool_names, inp.caps.tolist())),
        np.asarray(lengths),
        depths,
        rate,
        costs=dict(zip(inp.pool_names, inp.costs.tolist())),
        cost_cap=inp.cost_cap,
        max_replicas=inp.max_replicas,
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


@dataclass
class Measured:
    plan: PlanResult
    goodput: Goodput


def measure_all(
    plans: Mapping[str, PlanResult | str],
    lengths_pool: np.ndarray,
    slo_ms: float,
    *,
    duration_s: float = 10.0,
    confirm_s: float = 30.0,
    seed: int = 0,
    max_wait_ms: float = 2.0,
) -> dict[str, Measured]:
    """Each planned configuration's goodput (`measure`). Where `plans` holds e3+buckets (the same planner
    without rebatching), exitplan keeps a plan that rebatches only if the simulator sustains more with it
    than with that one; else exitplan is that plan, with a note saying so."""
    out: dict[str, Measured] = {}
    seen: dict[str, Goodput] = {}  # plan hash -> its goodput: configurations that plan alike are measured once
    for name, res in plans.items():
        if isinstance(res, PlanResult):
            key = res.plan.content_hash()
            if key not in seen:
                seen[key] = measure(
                    res,
                    lengths_pool,
                    slo_ms,
                    duration_s=duration_s,
                    confirm_s=confirm_s,
                    seed=seed,
                    max_wait_ms=max_wait_ms,
                )
            out[name] = Measured(res, seen[key])
    ep, plain = out.get("exitplan"), out.get("e3+buckets")
    if ep is not None and plain is not None and any(s.rebatch for s in ep.plan.plan.splits):
        if plain.goodput.goodput > ep.goodput.goodput:
            note = (
                f"rebatching dropped: the simulator sustained {ep.goodput.goodput:.0f} req/s with it and "
                f"{plain.goodput.goodput:.0f} without"
            )
            kept = Goodput(plain.goodput.rate, plain.goodput.goodput, plain.goodput.run, plain.goodput.probes, [note])
            out["exitplan"] = Measured(plain.plan, kept)
    return out
