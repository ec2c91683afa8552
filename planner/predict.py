"""A plan's capacity as served: the simulator on the whole serving path, not the fluid rate.

`plan_service`'s goodput is the solver's fluid rate: every replica busy with full batches, capped by the
serving path's CPU on average (planner/serving_path.py). Served, a plan holds its SLO at a lower rate: a
worker launches a batch after its short wait with the rows it has (at a rate its cells can hold, one to
three rows on a CPU, not the planned batch), the arrivals come in bursts that must drain within the SLO,
the router's admission limit follows the answers' latency, and on a machine whose cores the workers,
the routers and any other process share, a burst slows every batch at once.

`serving_capacity` replays arrivals (Poisson with the plan's lengths, or a trace's own pattern looped and
scaled, planner/arrivals.py) through the plan in the simulator with all of that (planner/sim_path.py:
the routers' CPU per request from the profile, split 0 in them where the plan co-locates it, the pools'
shared cores and the workers' threads; the CPU workers' trimming, planner/trimming.py) and returns the
highest rate at which >= 99 % of the requests finish within the SLO over the run and over its last third,
drops counted as misses -- what `exitplan bench --find-capacity` measures on the served plan.

`plan_as_served` does the same for a plan read back (the operator's PlanAccurate, which judges the
routers' measured goodput against the lower of the solver's rate and this): its inputs resolved again
from the spec, pools and profiles, at the plan's own length mix and survival.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from exitplan.api.plan import Plan, colocated_routers
from exitplan.api.resources import EarlyExitServiceSpec, GPUPoolSpec, ModelProfileSpec
from exitplan.planner import buckets as bk
from exitplan.planner.compare import Workload, passes, simulate_plan
from exitplan.planner.inputs import Inputs, Sized, resolve_inputs
from exitplan.planner.serving_path import colocated_router_ms, router_ms
from exitplan.planner.sim_path import ServingPath
from exitplan.planner.sim_result import SimResult
from exitplan.planner.trimming import TRIM_STEP, trims

TARGET = 0.99


@dataclass
class Served:
    rate_rps: float
    """The highest rate that passed (0.0: none down to a thousandth of the fluid rate did)."""
    run: SimResult | None
    """The run at that rate."""
    path: ServingPath
    probes: int


def serving_path(result: Sized, routers: int = 1, sender_ms: float = 0.0, background: float = 0.0) -> ServingPath:
    """The plan's serving path from what its profiles measured and its pools say: `routers` routers
    (spec.router.replicas; a co-locating plan runs as many as its most split-0 replicas of a bucket) at
    the profile's CPU per request, and the shared cores where every pool's processes share them (one
    machine), with a sender of `sender_ms` CPU per request on them (a load generator there) and `background`
    cores' worth of other processes running there."""
    inp, plan = result.inputs, result.plan
    per_request = (colocated_router_ms(inp) if plan.colocate else router_ms(inp)) or 0.0
    shared = [m.pool.shared_cores for m in inp.models]
    cores = min(c for c in shared if c is not None) if all(c is not None for c in shared) else None
    serving = [m.profile.serving for m in inp.models if m.profile.serving is not None]
    devices = tuple((m.pool_name, float(m.pool.shared_devices)) for m in inp.models if m.pool.shared_devices)
    return ServingPath(
        router_ms=per_request,
        routers=colocated_routers(plan.cells, routers) if plan.colocate else routers,
        cores=None if cores is None else float(cores),
        sender_ms=sender_ms,
        background=background if cores is not None else 0.0,
        threads=max((s.threads for s in serving), default=1),
        colocated=plan.colocate,
        devices=devices,
    )


def trim_lengths(result: Sized) -> list[int] | None:
    """The lengths the plan's CPU workers may cut a batch to (its longest row rounded up to TRIM_STEP, at
    most the bucket), where the planner charges trimming (planner/trimming.py `trims`); None elsewhere."""
    inp = result.inputs
    if not any(trims(m.pool.gpu_resource, m.profile.seq_lens, False) for m in inp.models):
        return None
    top = max(result.plan.buckets)
    return [*range(TRIM_STEP, top, TRIM_STEP), top]


def lengths_pool(result: Sized, n: int = 4096, seed: int = 0) -> np.ndarray:
    """Input lengths to draw from: the raw ones the plan was sized for, else the grid's histogram."""
    inp = result.inputs
    if inp.lengths is not None and len(inp.lengths):
        return np.asarray(inp.lengths)
    mass = np.asarray(inp.mass, dtype=np.float64)
    p = mass / mass.sum() if mass.sum() > 0 else np.full(len(inp.grid), 1.0 / len(inp.grid))
    return np.random.default_rng(seed).choice(np.asarray(inp.grid), size=n, p=p)


def simulated_seconds(result: Sized, seconds: float = 8.0, max_requests: int = 40_000) -> float:
    """Seconds of arrivals per simulated run: `seconds`, fewer for a plan whose fluid rate would put more
    than `max_requests` into one (at least half a second)."""
    return min(seconds, max(0.5, max_requests / max(result.plan.prediction.goodput_rps, 1.0)))


def search(ok: Callable[[float], bool], start: float, ceiling: float, tol: float = 0.01) -> float:
    """The highest rate in (0, ceiling] at which `ok` holds: bracketed by 10 % steps from `start`, then
    bisected to `tol`; 0.0 when none down to start / 1000 does."""
    lo, hi = 0.0, None
    rate = min(start, ceiling)
    if ok(rate):
        lo = rate
        while hi is None:
            up = min(lo * 1.1, ceiling)
            if up <= lo:
                return lo
            lo, hi = (up, None) if ok(up) else (lo, up)
    else:
        hi = rate
        while lo == 0.0 and hi > start / 1000:
            down = hi * 0.9
            lo, hi = (down, hi) if ok(down) else (0.0, down)
        if lo == 0.0:
            return 0.0
    while hi - lo > tol * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def serving_capacity(
    result: Sized,
    slo_ms: float,
    *,
    path: ServingPath | None = None,
    arrivals: Callable[[float], tuple[np.ndarray, np.ndarray]] | None = None,
    seconds: float | None = None,
    ceiling: float | None = None,
    tol: float = 0.01,
    seed: int = 0,
    survival: Sequence[float] | None = None,
) -> Served:
    """The plan's capacity as served (module doc). `arrivals(rate)`: (times, lengths) of one run at that
    rate (default: Poisson over `seconds`, default `simulated_seconds`, with `lengths_pool`'s lengths);
    `path`: default `serving_path`; `survival`: where requests exit (default the profile's)."""
    path = path or serving_path(result)
    if arrivals is None:
        work = Workload(lengths_pool(result, seed=seed), seed=seed)
        span = seconds or simulated_seconds(result)

        def arrivals(rate: float) -> tuple[np.ndarray, np.ndarray]:
            return work.at(rate, span)

    trim = trim_lengths(result)
    runs: dict[float, SimResult] = {}

    def ok(rate: float) -> bool:
        times, lens = arrivals(rate)
        runs[rate] = simulate_plan(result, times, lens, slo_ms, seed=seed, trim=trim, path=path, survival=survival)
        return passes(runs[rate], TARGET)

    fluid = max(result.plan.prediction.goodput_rps, 1.0)
    rate = search(ok, fluid, ceiling or 16 * fluid, tol)
    return Served(rate, runs.get(rate), path, len(runs))


@dataclass(frozen=True)
class PlanOn:
    """A plan read back and the inputs resolved again for it (planner/inputs.py `Sized`)."""

    plan: Plan
    inputs: Inputs


def at_plan_mix(
    spec: EarlyExitServiceSpec,
    pools: Mapping[str, GPUPoolSpec],
    profiles: Mapping[str, ModelProfileSpec],
    plan: Plan,
) -> PlanOn:
    """`plan` with its inputs resolved from the spec, pools and profiles at its thresholds, its length mix
    (each bucket's share at the bucket's length, as the planner charges an observed histogram) and its
    survival. Raises the planner's errors when the spec, pools or profiles no longer resolve."""
    inputs = resolve_inputs(spec, pools, profiles, thresholds=plan.thresholds)
    if plan.length_histogram and len(plan.length_histogram) == len(plan.buckets) and sum(plan.length_histogram) > 0:
        inputs.mass = bk.histogram_on_grid(inputs.grid, bounds=plan.buckets, counts=plan.length_histogram)
        inputs.lengths = None
    if plan.survival and len(plan.survival) == len(inputs.survival):
        inputs.survival = [float(x) for x in plan.survival]
    return PlanOn(plan, inputs)


def plan_as_served(
    spec: EarlyExitServiceSpec,
    pools: Mapping[str, GPUPoolSpec],
    profiles: Mapping[str, ModelProfileSpec],
    plan: Plan,
    *,
    max_requests: int = 20_000,
    tol: float = 0.02,
) -> Served:
    """The capacity as served of a plan read back (module doc): Poisson arrivals at the plan's mix, with
    its survival, through its cells and `spec.router.replicas` routers; runs of at most `max_requests`."""
    sized = at_plan_mix(spec, pools, profiles, plan)
    path = serving_path(sized, routers=spec.router.replicas)
    seconds = simulated_seconds(sized, max_requests=max_requests)
    return serving_capacity(
        sized, spec.slo.latency_ms, path=path, seconds=seconds, tol=tol, survival=sized.inputs.survival
    )
