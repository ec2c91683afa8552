"""The planner's inputs, checked and resolved: spec values, pools (caps = min(capacity, maxGpus)),
one cost model per pool, the survival curve in force (thresholds, observations, forecast) and the
length histogram. Every problem found here is a typed error naming the field.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from exitplan.api.observations import Observations
from exitplan.api.plan import Plan
from exitplan.api.resources import EarlyExitServiceSpec, GPUPoolSpec, ModelProfileSpec
from exitplan.planner import buckets as bk
from exitplan.planner.costmodel import CostModel, survival_before_blocks
from exitplan.planner.errors import PlanInfeasible, ProfileError, SpecError
from exitplan.planner.forecast import DEFAULT_PREDICTOR, forecast_survival


@dataclass
class Inputs:
    """What the solver needs, checked and resolved from the spec, pools and profiles."""

    pool_names: list[str]
    caps: np.ndarray
    costs: np.ndarray
    models: list[CostModel]
    ramp_names: list[str]
    ramp_after: list[int]
    survival: list[float]
    enabled: list[bool]
    budget_ms: float
    grid: list[int]
    mass: np.ndarray
    fixed_buckets: bool
    cost_cap: float | None
    notes: list[str] = field(default_factory=list)
    max_replicas: int | None = None
    """spec.planner.maxReplicas: the most replicas over all pools (None: the caps alone)."""
    lengths: np.ndarray | None = None
    """The raw input lengths the plan is sized for, when given (a trace); None: only the grid's mass."""
    _digests: dict[int, str] = field(default_factory=dict, repr=False, compare=False)

    def option_digest(self, p: int) -> str:
        """What pool p's options are computed from, as a digest: its profile and pool spec, the survival
        and ramps in force, the SLO budget (the length mix is `length_digest`'s): equal digests, equal
        options, so a re-plan reuses them (planner/problem.py `OptionCache`). A pool's capacity and price are
        the solver's caps and costs, not part of its options."""
        if p not in self._digests:
            model = self.models[p]
            pool = model.pool.model_dump_json(exclude={"capacity", "cost_per_hour"})
            h = hashlib.blake2b(digest_size=16)
            for part in (model.profile.model_dump_json(), pool, repr(self.budget_ms)):
                h.update(part.encode())
            h.update(np.ascontiguousarray(self.sigma(), dtype=np.float64).tobytes())
            h.update(bytes(self.ramps_on()))
            self._digests[p] = h.hexdigest()
        return self._digests[p]

    def length_digest(self) -> str:
        """The length mix as a digest (grid, mass and the raw lengths): what trimming workers' options also
        depend on."""
        if -1 not in self._digests:
            h = hashlib.blake2b(digest_size=16)
            h.update(np.asarray(self.grid, dtype=np.int64).tobytes())
            h.update(np.ascontiguousarray(self.mass, dtype=np.float64).tobytes())
            if self.lengths is not None:
                h.update(np.ascontiguousarray(self.lengths, dtype=np.int64).tobytes())
            self._digests[-1] = h.hexdigest()
        return self._digests[-1]

    @property
    def n_blocks(self) -> int:
        return self.models[0].n_blocks

    def sigma(self) -> np.ndarray:
        return survival_before_blocks(self.n_blocks, self.ramp_after, self.survival, self.enabled)

    def ramps_on(self) -> list[bool]:
        """Ramps that run: enabled exits, and any ramp after the last block (the model's head)."""
        return [on or after == self.n_blocks - 1 for on, after in zip(self.enabled, self.ramp_after)]


class Sized(Protocol):
    """A plan with the inputs it is sized (and simulated) on: a PlanResult, or a plan read back with its
    inputs resolved again (planner/predict.py `PlanOn`)."""

    @property
    def plan(self) -> Plan: ...

    @property
    def inputs(self) -> Inputs: ...


# ---------------------------------------------------------------- inputs


def _check_spec(spec: EarlyExitServiceSpec) -> None:
    # The pydantic model checks these on construction; specs built with model_construct() skip it.
    if not 0.0 <= spec.accuracy.max_drop < 1.0:
        raise SpecError(
            f"the accuracy budget must lie in [0, 1), got {spec.accuracy.max_drop}", field="spec.accuracy.maxDrop"
        )
    if not spec.slo.latency_ms > 0:
        raise SpecError(f"the SLO must be > 0 ms, got {spec.slo.latency_ms}", field="spec.slo.latencyMs")
    if not 0 <= spec.slo.slack_ms < spec.slo.latency_ms:
        raise SpecError(
            f"slack {spec.slo.slack_ms} ms must be >= 0 and below the SLO {spec.slo.latency_ms} ms",
            field="spec.slo.slackMs",
        )
    if not spec.pools:
        raise SpecError("the service names no pools", field="spec.pools")


def _resolve_pools(
    spec: EarlyExitServiceSpec, pools: Mapping[str, GPUPoolSpec]
) -> tuple[list[str], np.ndarray, np.ndarray]:
    names, caps, costs = [], [], []
    for i, ref in enumerate(spec.pools):
        if ref.name not in pools:
            raise SpecError(
                f"GPUPool {ref.name!r} does not exist (known: {sorted(pools)}); create it or remove it from spec.pools",
                field=f"spec.pools[{i}].name",
            )
        pool = pools[ref.name]
        cap = pool.capacity if ref.max_gpus is None else min(pool.capacity, ref.max_gpus)
        cap = min(cap, spec.planner.max_replicas)  # no pool can hold more than the whole service may run
        if cap < 0 or pool.cost_per_hour < 0:
            raise SpecError(f"pool {ref.name}: capacity and costPerHour must be >= 0", field=f"pools[{ref.name}]")
        names.append(ref.name)
        caps.append(int(cap))
        costs.append(float(pool.cost_per_hour))
    if sum(caps) == 0:
        raise PlanInfeasible(
            f"the pools {names} have no capacity for this service (capacity or maxGpus is 0); raise GPUPool capacity or spec.pools[].maxGpus",
            field="spec.pools",
        )
    return names, np.asarray(caps, dtype=np.int64), np.asarray(costs)


def _cost_models(
    spec: EarlyExitServiceSpec,
    names: list[str],
    pools: Mapping[str, GPUPoolSpec],
    profiles: Mapping[str, ModelProfileSpec],
) -> list[CostModel]:
    models = []
    for name in names:
        if name not in profiles:
            raise ProfileError(
                f"no ModelProfile of model {spec.model.name!r} on pool {name!r}; run `exitplan profile` on that pool or remove it from spec.pools",
                field=f"profiles[{name}]",
            )
        models.append(CostModel(profiles[name], name, pools[name]))
    ref = models[0].profile
    for m in models[1:]:
        p = m.profile
        if len(p.blocks) != len(ref.blocks):
            raise ProfileError(
                f"pool {m.pool_name}'s profile has {len(p.blocks)} blocks, pool {names[0]}'s has {len(ref.blocks)}",
                field=f"profiles[{m.pool_name}].blocks",
            )
        if [(r.name, r.after_block) for r in p.ramps] != [(r.name, r.after_block) for r in ref.ramps]:
            raise ProfileError(
                f"pool {m.pool_name}'s profile lists other ramps than pool {names[0]}'s",
                field=f"profiles[{m.pool_name}].ramps",
            )
    return models


def observation_windows(observations: Observations | Sequence[Observations] | None) -> list[Observations]:
    """The observation windows given, oldest first, as a list (none, one, or several)."""
    if observations is None:
        return []
    if isinstance(observations, Observations):
        return [observations]
    return list(observations)


def _survival(
    ref: ModelProfileSpec,
    thresholds: Mapping[str, float] | None,
    windows: list[Observations],
    forecaster: str,
    notes: list[str],
) -> tuple[list[float], list[bool]]:
    names = [r.name for r in ref.ramps]
    base = list(ref.survival) if ref.survival else [1.0] * len(names)
    if not ref.survival and names:
        notes.append("the profile holds no survival curve: planned as if no input exits")
    series = []
    for w in windows:
        if w.survival and w.ramps:
            lookup = dict(zip(w.ramps, w.survival))
            series.append([lookup.get(n, base[i]) for i, n in enumerate(names)])
    if series and names:
        base = list(forecast_survival(np.asarray(series), forecaster if len(series) > 1 else "constant"))
        notes.append(
            f"survival forecast ({forecaster if len(series) > 1 else 'last window'}) from {len(series)} observation window(s)"
        )
    if thresholds is None:
        enabled = [True] * len(names)
    else:
        unknown = sorted(set(thresholds) - set(names))
        if unknown:
            raise SpecError(
                f"thresholds name ramps the model does not have: {unknown} (ramps: {names})", field="thresholds"
            )
        for n, t in thresholds.items():
            if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
                raise SpecError(f"threshold of ramp {n!r} must be a number >= 0, got {t!r}", field=f"thresholds[{n}]")
        enabled = [thresholds.get(n, 2.0) <= 1.0 for n in names]
    # A disabled ramp exits nothing: the inputs it would have let go ride on to the next enabled ramp.
    out, level = [], 1.0
    for s, on in zip(base, enabled):
        if on:
            level = min(level, s)
        out.append(level)
    return out, enabled


def _lengths(
    spec: EarlyExitServiceSpec,
    ref: ModelProfileSpec,
    windows: list[Observations],
    lengths: Sequence[int] | None,
    notes: list[str],
) -> tuple[list[int], np.ndarray, bool]:
    fixed = bool(spec.workload.length_buckets)
    grid = list(spec.workload.length_buckets) if fixed else list(ref.seq_lens)
    latest = next((w for w in reversed(windows) if w.length_histogram and sum(w.length_histogram) > 0), None)
    if lengths is not None and len(lengths):
        mass = bk.histogram_on_grid(grid, lengths)
    elif latest is not None:
        mass = bk.histogram_on_grid(grid, bounds=latest.length_buckets, counts=latest.length_histogram)
    elif fixed:
        mass = np.full(len(grid), 1.0 / len(grid))
        notes.append("no length observations yet: the requested lengthBuckets are planned with equal shares")
    else:
        mass = np.zeros(len(grid))
        mass[-1] = 1.0
        notes.append(f"no length observations yet: planned for the longest profiled length {grid[-1]} (one bucket)")
    return grid, mass, fixed


def resolve_inputs(
    spec: EarlyExitServiceSpec,
    pools: Mapping[str, GPUPoolSpec],
    profiles: Mapping[str, ModelProfileSpec],
    *,
    thresholds: Mapping[str, float] | None = None,
    observations: Observations | Sequence[Observations] | None = None,
    lengths: Sequence[int] | None = None,
    forecaster: str = DEFAULT_PREDICTOR,
) -> Inputs:
    _check_spec(spec)
    notes: list[str] = []
    names, caps, costs = _resolve_pools(spec, pools)
    models = _cost_models(spec, names, pools, profiles)
    ref = models[0].profile
    windows = observation_windows(observations)
    survival, enabled = _survival(ref, thresholds, windows, forecaster, notes)
    grid, mass, fixed = _lengths(spec, ref, windows, lengths, notes)
    cost_cap = spec.planner.cost_cap_per_hour
    if cost_cap is not None and cost_cap < float(costs[caps > 0].min()):
        raise PlanInfeasible(
            f"costCapPerHour {cost_cap:g} is below the cheapest single worker ({float(costs[caps > 0].min()):g}/h); raise the cap",
            field="spec.planner.costCapPerHour",
        )
    budget = spec.slo.latency_ms - spec.slo.slack_ms
    return Inputs(
        names,
        caps,
        costs,
        models,
        [r.name for r in ref.ramps],
        [r.after_block for r in ref.ramps],
        survival,
        enabled,
        budget,
        grid,
        mass,
        fixed,
        cost_cap,
        notes,
        max_replicas=spec.planner.max_replicas,
        lengths=np.sort(np.asarray(lengths, dtype=np.int64)) if lengths is not None and len(lengths) else None,
    )
