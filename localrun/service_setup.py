"""From a service file to a Plan, outside Kubernetes (used by `exitplan up` and `exitplan demo`).

Reads the EarlyExitService (and any GPUPool / ModelProfile documents beside it), finds or measures
a profile per pool, tunes the initial thresholds on the bundle's calibration window under the
accuracy budget, and asks the planner. Also builds the two baseline configurations the demo
compares against: vanilla (no exits, one split) and naive early exit (exits, one split).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import yaml

from exitplan.api import load_resources
from exitplan.api.bundle import BundleManifest, read_manifest, resolve_bundle_uri
from exitplan.api.plan import Cell, Plan, SplitPlan
from exitplan.api.resources import (
    EarlyExitService,
    EarlyExitServiceSpec,
    GPUPool,
    GPUPoolSpec,
    ModelProfile,
    ModelProfileSpec,
    ModelRef,
)
from exitplan.localrun.processes import exitplan_command

if TYPE_CHECKING:
    from exitplan.planner.service import PlanResult


class ServiceFileError(ValueError):
    """The service file (or what it refers to) cannot be used; the message says what to add or fix."""


@dataclass
class ServiceSetup:
    name: str
    spec: EarlyExitServiceSpec
    bundle: Path
    manifest: BundleManifest
    pools: dict[str, GPUPoolSpec] = field(default_factory=dict)
    profiles: dict[str, ModelProfileSpec] = field(default_factory=dict)


Echo = Callable[[str], object]
"""Where a long step says what it does, a line at a time (`print`, a console's `print`)."""

BundleFetcher = Callable[[ModelRef], Path]
"""Gives the local directory of spec.model's bundle, fetching a remote one (the CLI passes
exitplan.storage.cache.cached_bundle: this room imports no storage code)."""


def load_setup(
    service_file: Path, extra: Sequence[Path] = (), fetch_bundle: BundleFetcher | None = None
) -> ServiceSetup:
    """The service, its pools and profiles from `service_file` and `extra` YAML files; the bundle from
    `fetch_bundle` (s3://, https:// into a local cache), else only a path or file:// URI."""
    docs = []
    for path in [service_file, *extra]:
        docs.extend(load_resources(path))
    services = [d for d in docs if isinstance(d, EarlyExitService)]
    if len(services) != 1:
        raise ServiceFileError(f"{service_file}: expected exactly one EarlyExitService, found {len(services)}")
    svc = services[0]
    name = svc.metadata.get("name") or "exitplan"
    bundle = fetch_bundle(svc.spec.model) if fetch_bundle else resolve_bundle_uri(svc.spec.model.bundle)
    if not bundle.is_absolute():
        bundle = (Path.cwd() / bundle).resolve()
    manifest = read_manifest(bundle)
    pools = {d.metadata.get("name", ""): d.spec for d in docs if isinstance(d, GPUPool)}
    missing = [p.name for p in svc.spec.pools if p.name not in pools]
    if missing:
        raise ServiceFileError(
            f"{service_file}: the service names pools {missing} but no GPUPool document defines them; add a GPUPool "
            f"(for this machine: capacity = how many worker processes may run, e.g. 2)"
        )
    profiles = {
        d.spec.pool: d.spec for d in docs if isinstance(d, ModelProfile) and d.spec.model == svc.spec.model.name
    }
    return ServiceSetup(name, svc.spec, bundle, manifest, pools, profiles)


def ensure_profiles(setup: ServiceSetup, echo: Echo = print, *, remeasure: bool = False) -> None:
    """Measure a profile for every pool that has none (cached in the bundle's profiles/ folder); with
    `remeasure`, for every pool whatever the cache holds (a profile of this machine as it is now)."""
    for ref in setup.spec.pools:
        if ref.name in setup.profiles:
            continue
        cache = setup.bundle / "profiles" / f"{ref.name}.yaml"
        problem = "re-measuring the profile (asked)" if remeasure else _cached_profile_problem(cache)
        if problem is not None:
            echo(f"{problem} for pool {ref.name!r}: measuring one on this machine -> {cache}")
            cache.parent.mkdir(parents=True, exist_ok=True)
            cmd = [*exitplan_command(), "profile", str(setup.bundle), "--pool", ref.name, "--out", str(cache)]
            done = subprocess.run(cmd, check=False)
            if done.returncode != 0:
                if remeasure or _cached_profile_problem(cache, costs=False) is not None:
                    raise ServiceFileError(
                        f"profiling the bundle for pool {ref.name!r} failed (exit {done.returncode}): {' '.join(cmd)}"
                    )
                echo(
                    f"profiling the bundle for pool {ref.name!r} failed (exit {done.returncode}); planning with the "
                    f"cached profile as it is (the serving path's costs it lacks count as free)"
                )
        setup.profiles[ref.name] = ModelProfile.model_validate(yaml.safe_load(cache.read_text())).spec


def _cached_profile_problem(cache: Path, *, costs: bool = True) -> str | None:
    """Why the cached profile cannot be used (None: it can): missing, unreadable, one the planner rejects (e.g.
    measured by an older profiler on a busy machine), or (with `costs`) one without the serving path's costs
    the profiler now measures (a profile written with `--no-serving` included: `exitplan up` and the demo plan
    with them; where measuring them fails, such a profile is still used as it is)."""
    if not cache.is_file():
        return "no ModelProfile"
    from pydantic import ValidationError

    from exitplan.planner.costmodel import validate_profile
    from exitplan.planner.errors import ProfileError

    try:
        spec = ModelProfile.model_validate(yaml.safe_load(cache.read_text())).spec
        validate_profile(spec)
    except (ValidationError, ProfileError, yaml.YAMLError, AttributeError) as err:
        return f"the cached ModelProfile {cache} cannot be used ({str(err).splitlines()[0]})"
    serving = spec.serving
    on_cpu = not spec.providers or spec.providers[0] == "CPUExecutionProvider"  # an accelerator's: never scaled
    if costs and (serving is None or serving.colocated_ms is None or (on_cpu and not serving.compute_scale)):
        missing = (
            "serving"
            if serving is None
            else "serving.colocatedMs"
            if serving.colocated_ms is None
            else "serving.computeScale"
        )
        return f"the cached ModelProfile {cache} was written by an older profiler (no {missing})"
    return None


def tuned_thresholds(bundle: Path, budget: float, bounds: Sequence[int]) -> dict[str, float]:
    """Initial thresholds, computed as the operator computes them
    (`exitplan.planner.tuning.initial.initial_thresholds`): tuned on the bundle's calibration window
    (held-out data) within `budget` less its sampling error in every length stratum (`bounds`: the
    service's ``spec.workload.length_buckets``; [] = the whole window), so that traffic the window did
    not see stays within `budget`. Raises a ValueError (``MissingCalibrationWindow``) when the bundle
    has exit ramps but no calibration window."""
    from exitplan.planner.tuning.initial import initial_thresholds

    return initial_thresholds(bundle, budget, bounds)[0]


def trace_lengths(trace: Path | None, max_length: int) -> tuple[np.ndarray, int]:
    """(the trace's input lengths scaled to [1, max_length], the raw length mapped to max_length: its p99)."""
    from exitplan.planner.traces import default_trace_path, load_trace

    path = trace or default_trace_path()
    raw = load_trace(path, max_length=10**9, length_mode="clip").lengths
    reference = int(np.percentile(raw, 99))
    return load_trace(path, max_length=max_length, length_mode="scale", reference_max=reference).lengths, reference


def on_this_machine(setup: ServiceSetup, routers: int = 1) -> tuple[EarlyExitServiceSpec, dict[str, GPUPoolSpec]]:
    """The spec and pools as this machine runs them: `routers` router processes, and every CPU pool (no
    accelerator resource) sharing this machine's cores unless it says how many (`sharedCores`), so the
    planner counts the cores the worker processes and routers really have."""
    from exitplan.localrun.serving_costs import usable_cores

    cores = usable_cores()
    spec = setup.spec.model_copy(update={"router": setup.spec.router.model_copy(update={"replicas": routers})})
    pools = {
        name: pool.model_copy(update={"shared_cores": cores})
        if not pool.gpu_resource and pool.shared_cores is None
        else pool
        for name, pool in setup.pools.items()
    }
    return spec, pools


def at_thresholds(setup: ServiceSetup, thresholds: dict[str, float]) -> ServiceSetup:
    """The setup with every profile's survival curve read at `thresholds` from the bundle's calibration
    window (the profiler's own rule): a profile's curve is measured at the profiler's thresholds, and a
    plan must be sized for the exits it serves. The setup as it is when the bundle has no window."""
    from exitplan.planner.tuning.initial import survival_at

    try:
        survival = survival_at(setup.bundle, setup.manifest, thresholds)
    except (OSError, ValueError, KeyError):  # BundleError (no window) is a ValueError; a ramp without a threshold
        return setup
    profiles = {
        pool: p.model_copy(update={"survival": [survival[r.name] for r in p.ramps]}) if p.ramps else p
        for pool, p in setup.profiles.items()
    }
    return replace(setup, profiles=profiles)


def planned(
    setup: ServiceSetup,
    thresholds: dict[str, float],
    reason: str = "initial",
    lengths: Sequence[int] | np.ndarray | None = None,
    routers: int = 1,
) -> Plan:
    """The planner's plan for this machine (`on_this_machine`), sized for the survival at `thresholds`;
    `lengths` (input lengths in tokens, e.g. a trace's) size the length buckets."""
    return planned_result(setup, thresholds, reason, lengths, routers).plan


def planned_result(
    setup: ServiceSetup,
    thresholds: dict[str, float],
    reason: str = "initial",
    lengths: Sequence[int] | np.ndarray | None = None,
    routers: int = 1,
) -> PlanResult:
    """`planned`'s whole planner result (the plan, its inputs and the solver's figures)."""
    from exitplan.planner import plan_service

    spec, pools = on_this_machine(setup, routers)
    sized = at_thresholds(setup, thresholds)
    raw = None if lengths is None else [int(n) for n in lengths]  # the planner takes a list of ints
    return plan_service(setup.name, spec, pools, sized.profiles, thresholds=thresholds, reason=reason, lengths=raw)


def single_split_plan(
    setup: ServiceSetup, *, thresholds: dict[str, float], replicas: int, batch_size: int, reason: str
) -> Plan:
    """The baselines: the whole model in one split, `replicas` workers per bucket on the first pool.

    vanilla = no exits (every threshold above 1); naive early exit = the tuned thresholds.
    """
    manifest = setup.manifest
    if manifest.seq_axis is None:
        buckets = [1]
    else:
        buckets = list(setup.spec.workload.length_buckets) or [int(manifest.max_length or 1)]
    pool = setup.spec.pools[0].name
    cells = [Cell(split=0, bucket=b, pool=pool, replicas=replicas, batch_size=batch_size) for b in buckets]
    return Plan(
        service=setup.name,
        model=setup.spec.model.name,
        splits=[SplitPlan(index=0, first_block=0, last_block=len(manifest.blocks) - 1)],
        buckets=buckets,
        cells=cells,
        thresholds=thresholds,
        reason=reason,
    )
