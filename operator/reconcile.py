"""Reconcile one EarlyExitService: read pools and profiles, plan (executor thread), apply, report.

Handlers (handlers.py) call `reconcile` on create/update/resume and `check_drift` from the timer;
both end by writing the fixed status (status.py) through the status subresource and posting
events. Nothing here raises for bad user input: unknown pools, missing profiles and infeasible
SLOs become conditions and events; API failures become Degraded and a `kopf.TemporaryError`
so kopf retries with backoff while the previous plan keeps serving.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import kopf
from pydantic import ValidationError

from exitplan.api.observations import Observations
from exitplan.api.plan import Plan
from exitplan.api.resources import EarlyExitServiceSpec, GPUPoolSpec, Mode, ModelProfileSpec
from exitplan.operator import apply as applying
from exitplan.operator import builders, bundle_health, capacity, colocation, control_token, disruption, drift, guards
from exitplan.operator.executors import run_planner
from exitplan.operator.kube import ApiError, KubeClient, path
from exitplan.operator.metrics import METRICS
from exitplan.operator.status import (
    Phase,
    Proposal,
    ServiceStatus,
    now_iso,
    parse_status,
    set_condition,
    summarize,
    with_columns,
)

log = logging.getLogger("exitplan.operator")
RETRY_DELAY = 10.0
"""Seconds before kopf retries a reconcile whose apply failed (kopf.TemporaryError)."""


@dataclass
class ServiceResources:
    pools: dict[str, GPUPoolSpec] = field(default_factory=dict)
    profiles: dict[str, ModelProfileSpec] = field(default_factory=dict)
    unknown_pools: list[str] = field(default_factory=list)
    missing_profiles: list[str] = field(default_factory=list)
    bad_profiles: list[str] = field(default_factory=list)
    capacity: dict[str, int] = field(default_factory=dict)
    """Each GPUPool's own capacity (before the service's maxGpus): what services share (capacity.py)."""

    def digest(self) -> str:
        """What the plan depends on in the service's GPUPools (their specs as read, after the
        service's caps; unknown ones named): a pool event re-plans only when this changes."""
        body = {name: pool.model_dump(mode="json") for name, pool in sorted(self.pools.items())}
        body.update({name: None for name in self.unknown_pools})
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]


@dataclass
class Service:
    """One EarlyExitService as the reconcile sees it."""

    body: dict[str, Any]
    client: KubeClient
    memo: Any = None

    @property
    def name(self) -> str:
        return self.body["metadata"]["name"]

    @property
    def namespace(self) -> str:
        return self.body["metadata"]["namespace"]

    @property
    def generation(self) -> int:
        return int(self.body["metadata"].get("generation") or 0)

    @property
    def settings(self) -> guards.Settings:
        """The operator's settings: kopf's memo holds them from startup (handlers.configure), else the env's."""
        return getattr(self.memo, "settings", None) or guards.Settings.from_env()

    def capacity_lock(self) -> asyncio.Lock:
        """The operator-wide lock under which a service reads what other services hold on the pools,
        plans and applies (capacity.py): two services never plan into the same free capacity."""
        lock = getattr(self.memo, "capacity_lock", None)
        return lock if lock is not None else asyncio.Lock()

    def event(self, kind: str, reason: str, message: str) -> None:
        log.info("%s/%s %s %s: %s", self.namespace, self.name, kind, reason, message[:300])
        kopf.event(self.body, type=kind, reason=reason, message=message[:1000])

    async def write_status(self, status: ServiceStatus) -> None:
        """Write the status (its `ready` and `reason` derived here, for kubectl's columns)."""
        patch = {"status": with_columns(status).model_dump(by_alias=True, mode="json")}
        try:
            await self.client.merge_patch(path("EarlyExitService", self.namespace, self.name, "status"), patch)
        except ApiError as err:
            if err.status != 404:  # deleted meanwhile: nothing to report on
                raise
        else:  # the conditions as written, as metrics (a deleted service's series are gone: handlers.py)
            METRICS.record_conditions(self.namespace, self.name, [(c.type, c.status) for c in status.conditions])
        self.body["status"] = patch["status"]


async def read_inputs(client: KubeClient, spec: EarlyExitServiceSpec, namespace: str) -> ServiceResources:
    """The service's GPUPools (by name) and its model's ModelProfiles (by pool)."""
    inputs = ServiceResources()
    for ref in spec.pools:
        try:
            raw = await client.get(path("GPUPool", None, ref.name))
        except ApiError as err:
            if err.status == 404:
                inputs.unknown_pools.append(ref.name)
                continue
            raise
        pool = GPUPoolSpec.model_validate(raw.get("spec", {}))
        inputs.capacity[ref.name] = pool.capacity
        if ref.max_gpus is not None:
            pool = pool.model_copy(update={"capacity": min(pool.capacity, ref.max_gpus)})
        inputs.pools[ref.name] = pool
    for raw in await client.list(path("ModelProfile", namespace)):
        try:
            prof = ModelProfileSpec.model_validate(raw.get("spec", {}))
        except ValidationError as err:
            inputs.bad_profiles.append(f"{raw['metadata']['name']}: {err.errors()[0]['msg']}")
            continue
        if prof.model == spec.model.name and prof.pool in inputs.pools and prof.pool not in inputs.profiles:
            inputs.profiles[prof.pool] = prof
    inputs.missing_profiles = [p for p in inputs.pools if p not in inputs.profiles]
    return inputs


def initial_thresholds(spec: EarlyExitServiceSpec, bounds: list[int] | None = None) -> dict[str, float] | None:
    """Thresholds for a first plan: tuned on the bundle's calibration window under the accuracy
    budget in every length stratum (`bounds`: the service's length buckets; calibration.py) when
    the operator can read the bundle (a local path: the dev-cluster, a mounted volume); else None,
    and the live tuner in the drift loop sets them from the routers' feedback."""
    from pathlib import Path

    from exitplan.planner.tuning.initial import initial_thresholds as tune_initial

    bundle = Path(builders.bundle_path(spec.model.bundle))
    if not (bundle / "bundle.yaml").is_file():
        return None
    try:
        thresholds, strata = tune_initial(bundle, spec.accuracy.max_drop, bounds or [])
    except (ValueError, OSError, KeyError) as err:
        log.warning("initial thresholds not tuned (%s); the drift loop tunes them from live feedback", err)
        return None
    log.info(
        "initial thresholds %s: disagreement per length stratum on the calibration window %s (budget %g)",
        {k: round(v, 4) for k, v in thresholds.items()},
        [(n, round(d, 4)) for n, d in strata],
        spec.accuracy.max_drop,
    )
    return thresholds


async def plan_in_executor(
    name: str,
    namespace: str,
    spec: EarlyExitServiceSpec,
    inputs: ServiceResources,
    *,
    reason: str,
    previous: Plan | None = None,
    observations: Observations | None = None,
    keep_layout: bool = False,
) -> Plan:
    """The planner's entry point in a worker thread (never on the event loop); solve time is a metric."""
    from exitplan.planner import plan_service

    thresholds = dict(observations.thresholds) if observations and observations.thresholds else None
    if thresholds is None and previous is None:
        bounds = list(spec.workload.length_buckets) or sorted(
            {int(n) for p in inputs.profiles.values() for n in p.seq_lens}
        )
        thresholds = await run_planner(initial_thresholds, spec, bounds)

    def solve() -> Plan:
        started = time.perf_counter()
        try:
            result = plan_service(
                name,
                spec,
                inputs.pools,
                inputs.profiles,
                thresholds=thresholds,
                observations=observations,
                previous=previous,
                reason=reason,
                keep_layout=keep_layout,
            )
        finally:
            METRICS.record_solve(namespace, name, time.perf_counter() - started)
        return result.plan

    plan = await run_planner(solve)  # the planner's own threads (executors.py)
    METRICS.replans.labels(namespace, name, reason).inc()
    return plan


async def current_plan(client: KubeClient, name: str, namespace: str) -> Plan | None:
    """The plan the data plane runs now: the plan ConfigMap's plan.json (None before the first apply)."""
    try:
        cm = await client.get(path("ConfigMap", namespace, builders.plan_configmap_name(name)))
    except ApiError as err:
        if err.status == 404:
            return None
        raise
    try:
        return Plan.model_validate_json((cm.get("data") or {}).get("plan.json", ""))
    except ValidationError:
        return None


def _infeasible(status: ServiceStatus, gen: int, reason: str, message: str) -> ServiceStatus:
    status.conditions = set_condition(status.conditions, "PlanInfeasible", True, reason, message, gen)
    status.conditions = set_condition(status.conditions, "Planned", False, reason, message, gen)
    status.conditions = set_condition(status.conditions, "Progressing", False, reason, message, gen)
    status.phase, status.message, status.observed_generation = Phase.infeasible, message, gen
    return status


async def report_infeasible(svc: Service, status: ServiceStatus, reason: str, message: str) -> ServiceStatus:
    """PlanInfeasible with `reason`; the Warning event only when the condition says something new
    (a resume or a re-check that finds the same refusal posts nothing)."""
    same = any(
        c.type == "PlanInfeasible" and c.status == "True" and (c.reason, c.message) == (reason, message)
        for c in status.conditions
    )
    if not same:
        svc.event("Warning", reason, message)
    status = _infeasible(status, svc.generation, reason, message)
    await svc.write_status(status)
    return status


async def pools_changed(svc: Service) -> bool:
    """True when the service's GPUPools, as read now, differ from those its last plan was made
    with (status.poolsDigest)."""
    try:
        spec = EarlyExitServiceSpec.model_validate(svc.body.get("spec") or {})
    except ValidationError:
        return False  # reported by the spec handlers; a pool change does not fix it
    inputs = await read_inputs(svc.client, spec, svc.namespace)
    return inputs.digest() != parse_status(svc.body.get("status")).pools_digest


async def reconcile(svc: Service, reason: str) -> ServiceStatus:
    """Plan and apply the service from scratch (create, spec change, resume, a profile arrived)."""
    METRICS.zero(svc.namespace, svc.name)
    gen = svc.generation
    status = parse_status(svc.body.get("status"))
    try:
        spec = EarlyExitServiceSpec.model_validate(svc.body.get("spec") or {})
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors())
        message = f"spec is invalid: {problems}; fix the EarlyExitService spec"
        svc.event("Warning", "InvalidSpec", message)
        status = _infeasible(status, gen, "InvalidSpec", message)
        await svc.write_status(status)
        return status
    if (refusal := guards.bundle_refusal(spec, svc.settings)) is not None:
        return await report_infeasible(svc, status, guards.REFUSED, refusal)  # nothing is read, built or run

    inputs = await read_inputs(svc.client, spec, svc.namespace)
    status.pools_digest = inputs.digest()
    if inputs.unknown_pools:
        message = (
            f"spec.pools names GPUPool(s) {inputs.unknown_pools} that do not exist; create them "
            f"(kubectl get gpupools lists the pools) or remove them from spec.pools"
        )
        svc.event("Warning", "UnknownPool", message)
        status = _infeasible(status, gen, "UnknownPool", message)
        await svc.write_status(status)
        return status

    from exitplan.operator.generation_reconcile import is_generation, reconcile_generation

    if is_generation(spec):  # text generation: a decoder's stages, planned without ModelProfiles
        return await reconcile_generation(svc, spec, inputs, status, reason)

    from exitplan.operator import profiling

    if inputs.missing_profiles:
        return await profiling.wait_for_profiles(svc, spec, inputs, status)
    profiling.profiles_present(status, gen)

    previous = await current_plan(svc.client, svc.name, svc.namespace)
    return await plan_and_apply(svc, spec, inputs, status, reason=reason, previous=previous)


async def plan_and_apply(
    svc: Service,
    spec: EarlyExitServiceSpec,
    inputs: ServiceResources,
    status: ServiceStatus,
    *,
    reason: str,
    previous: Plan | None,
    observations: Observations | None = None,
    max_move_fraction: float | None = None,
) -> ServiceStatus:
    """Plan, then apply (active) or propose (advisory); the status says which and why.

    The planner sees the service's pools less what other services' running plans hold on them
    (capacity.py); reading that, planning and applying happen under the operator's capacity lock.
    A bundle host path the operator does not allow plans nothing (guards.py; the drift loop re-plans
    specs too, not only reconcile)."""
    from exitplan.planner.errors import PlannerError

    if (refusal := guards.bundle_refusal(spec, svc.settings)) is not None:
        return await report_infeasible(svc, status, guards.REFUSED, refusal)
    async with svc.capacity_lock():
        room = await capacity.room(svc, inputs)
        left = room.reduced(inputs)
        try:
            plan = await plan_in_executor(
                svc.name, svc.namespace, spec, left, reason=reason, previous=previous, observations=observations
            )
        except PlannerError as err:
            return await capacity.not_planned(svc, spec, inputs, status, room, err, previous)
        return await _apply_plan(
            svc,
            spec,
            left,
            status,
            plan,
            reason=reason,
            previous=previous,
            observations=observations,
            max_move_fraction=max_move_fraction,
        )


async def _apply_plan(
    svc: Service,
    spec: EarlyExitServiceSpec,
    inputs: ServiceResources,
    status: ServiceStatus,
    plan: Plan,
    *,
    reason: str,
    previous: Plan | None,
    observations: Observations | None,
    max_move_fraction: float | None,
) -> ServiceStatus:
    """Apply (or propose) a plan the planner made, capped by maxMoveFraction."""
    gen = svc.generation
    corrected = False
    if previous is not None and plan.content_hash() == previous.content_hash():
        if reason == "plan-mismatch" and plan.prediction != previous.prediction:
            # the same workers, re-planned on measured profiles (plan_accuracy.py): the plan in force
            # takes the corrected prediction (what kubectl's GOODPUT shows) and says why it changed
            plan, corrected = previous.model_copy(update={"prediction": plan.prediction, "reason": plan.reason}), True
        else:
            plan = previous  # the same plan: keep the applied one (its reason, its ConfigMap bytes)
    reason = plan.reason  # one reason per plan: its events, conditions, status and proposal all say it
    if corrected and spec.planner.mode == Mode.active:
        status.last_replan_time, status.last_replan_reason = now_iso(), reason
    status.conditions = set_condition(
        status.conditions, "PlanInfeasible", False, "Planned", "a plan meets the spec", gen
    )
    held_back = ""
    target = plan
    if max_move_fraction is not None and max_move_fraction < 1.0 and previous is not None:  # 1.0: no cap
        plan, target, held_back = await _cap_moves(
            svc,
            spec,
            inputs,
            plan,
            previous=previous,
            reason=reason,
            observations=observations,
            max_move_fraction=max_move_fraction,
        )
    children = builders.build_children(svc.body, spec, plan, inputs.pools)
    return await propose_or_apply(
        svc,
        spec,
        status,
        children,
        plan=plan,
        target=target,
        previous=previous,
        reason=reason,
        what=f"plan {plan.content_hash()} ({reason})",
        held_back=held_back,
    )


async def _cap_moves(
    svc: Service,
    spec: EarlyExitServiceSpec,
    inputs: ServiceResources,
    plan: Plan,
    *,
    previous: Plan,
    reason: str,
    observations: Observations | None,
    max_move_fraction: float,
) -> tuple[Plan, Plan, str]:
    """`plan` limited to `max_move_fraction` of `previous`'s replicas moved: (what to apply now,
    where the steps lead, what is held back for later periods ("" when nothing is))."""
    from exitplan.planner.errors import PlanInfeasible, PlannerError

    target = plan
    budget = drift.move_budget(previous, max_move_fraction)
    if not drift.same_layout(previous, plan) and drift.moved_replicas(previous, plan) > budget:
        # A new layout replaces every instance at once, which the cap forbids: move within the
        # current layout instead; the new layout stays a proposal (raise maxMoveFraction to take it).
        try:
            within = await plan_in_executor(
                svc.name,
                svc.namespace,
                spec,
                inputs,
                reason=reason,
                previous=previous,
                observations=observations,
                keep_layout=True,
            )
        except (PlanInfeasible, PlannerError):
            within = None
        if within is not None and drift.same_layout(previous, within):
            svc.event(
                "Normal",
                "LayoutHeldBack",
                f"plan {plan.content_hash()} ({reason}) changes the split "
                f"layout, moving {drift.moved_replicas(previous, plan)} replicas at once; maxMoveFraction "
                f"{max_move_fraction:g} allows {budget}: moving within the current layout instead",
            )
            target = plan = within
    plan, remaining = drift.limit_moves(previous, plan, max_move_fraction)
    held_back = f"move cap: {remaining} more replica move(s) follow in later periods" if remaining else ""
    return plan, target, held_back


async def propose_or_apply(
    svc: Service,
    spec: EarlyExitServiceSpec,
    status: ServiceStatus,
    children: list[dict[str, Any]],
    *,
    plan: Plan,
    target: Plan,
    previous: Plan | None,
    reason: str,
    what: str,
    held_back: str = "",
) -> ServiceStatus:
    """Advisory: diff the children and report what would change. Active: apply them and report.

    `plan` is what is applied now, `target` where the steps lead (they differ under a move cap, when
    `held_back` says what follows); `what` names the plan in messages and events. A failed apply leaves
    the previous plan serving, marks the service Degraded and retries with backoff. The routers'
    PodDisruptionBudget (disruption.py) joins the children here, for every kind of service.
    """
    gen = svc.generation
    desired = disruption.with_router_budget(svc.body, spec, plan.content_hash(), children)
    if spec.planner.mode == Mode.advisory:
        await control_token.ensure_token(svc.client, svc.body)  # to read the routers (nothing else changes)
        existing = await applying.list_children(svc.client, svc.name, svc.namespace)
        changes = applying.diff_children(existing, desired)
        status.proposal = Proposal(
            reason=reason, hash=target.content_hash(), changes=changes, held_back="advisory mode: nothing applied"
        )
        status.plan = summarize(plan)
        status.phase = Phase.advisory
        status.message = f"advisory: would apply {what}: {len(changes)} change(s)"
        status.conditions = set_condition(status.conditions, "Planned", True, "Advisory", status.message, gen)
        status.conditions = set_condition(status.conditions, "Progressing", False, "Advisory", status.message, gen)
        status.observed_generation = gen
        svc.event("Normal", "WouldApply", f"{what} would: " + "; ".join(changes or ["change nothing"]))
        await svc.write_status(status)
        return status

    try:
        await control_token.ensure_token(svc.client, svc.body)  # before the pods that mount it
        report = await applying.apply_children(svc.client, desired, svc.name, svc.namespace)
    except ApiError as err:
        METRICS.applies_failed.labels(svc.namespace, svc.name).inc()
        message = (
            f"applying {what} failed ({err}); the previous plan "
            f"{previous.content_hash() if previous else '(none)'} keeps serving; retrying"
        )
        status.conditions = set_condition(status.conditions, "Degraded", True, "ApplyFailed", message, gen)
        status.phase, status.message = Phase.degraded, message
        svc.event("Warning", "ApplyFailed", message)
        await svc.write_status(status)
        raise kopf.TemporaryError(message, delay=RETRY_DELAY) from err

    status.plan = summarize(plan)
    status.proposal = Proposal(reason=reason, hash=target.content_hash(), held_back=held_back) if held_back else None
    if previous is None or previous.content_hash() != plan.content_hash():
        status.last_replan_time, status.last_replan_reason = now_iso(), reason
    status.endpoint = f"http://{builders.dns_name(svc.name)}.{svc.namespace}.svc:{builders.PORT}"
    status.conditions = set_condition(status.conditions, "Planned", True, "Planned", what, gen)
    status.conditions = set_condition(status.conditions, "Degraded", False, "Applied", report.summary(), gen)
    status.conditions = set_condition(
        status.conditions, "Progressing", True, "Rollout", f"applied: {report.summary()}", gen
    )
    status.phase, status.message, status.observed_generation = Phase.deploying, f"applied: {report.summary()}", gen
    if report.changed():
        svc.event("Normal", "Applied", f"{what}: {report.summary()}")
    await svc.write_status(status)
    return status


async def refresh_readiness(svc: Service) -> ServiceStatus:
    """Ready / Progressing from the Deployments' status (the timer calls it every tick)."""
    status = parse_status(svc.body.get("status"))
    idle = (Phase.infeasible, Phase.advisory, Phase.profiling, Phase.profiling_failed)
    if status.plan is None or status.phase in idle:
        return status
    gen = svc.generation
    deployments = await svc.client.list(path("Deployment", svc.namespace), f"{builders.L_SERVICE}={svc.name}")
    ready: dict[tuple[int, int, str], int] = {}
    all_ready = True
    colocated_routers = None  # ready routers that run split 0 (a co-located plan), else None
    for dep in deployments:
        labels = dep["metadata"].get("labels", {})
        want = int(dep.get("spec", {}).get("replicas") or 0)
        have = int((dep.get("status") or {}).get("readyReplicas") or 0)
        all_ready &= have >= want
        if labels.get(builders.L_COMPONENT) == "worker":
            ready[(int(labels[builders.L_SPLIT]), int(labels[builders.L_BUCKET]), labels[builders.L_POOL])] = have
        elif labels.get(builders.L_COMPONENT) == "router" and colocation.runs_split_zero(dep):
            colocated_routers = have
    for cell in status.plan.cells:
        cell.ready_replicas = ready.get((cell.split, cell.bucket, cell.pool), 0)
        if colocated_routers is not None and cell.split == 0:  # every ready router holds split 0 of each bucket
            cell.ready_replicas = min(cell.replicas, colocated_routers)
    METRICS.record_plan(
        svc.namespace,
        svc.name,
        status.plan.cost_per_hour,
        [(c.split, c.bucket, c.pool, c.replicas, c.ready_replicas) for c in status.plan.cells],
    )
    all_ready &= bool(deployments)
    stalled = [
        f"Deployment {d['metadata']['name']}: {c.get('message') or c.get('reason')}"
        for d in deployments
        for c in (d.get("status") or {}).get("conditions") or []
        if c.get("type") == "Progressing" and c.get("status") == "False"
    ]
    before = json.dumps(parse_status(svc.body.get("status")).model_dump(mode="json"), sort_keys=True)
    degraded = any(c.type == "Degraded" and c.status == "True" for c in status.conditions)
    if stalled:
        bundle = builders.bundle_path((svc.body.get("spec") or {}).get("model", {}).get("bundle", ""))
        message = (
            "; ".join(stalled) + f". Pods of the plan do not start: check that the bundle {bundle} is "
            "reachable from the pods and their logs; the replicas that run keep serving"
        )
        if not degraded or status.message != message:
            svc.event("Warning", "RolloutStalled", message)
        status.conditions = set_condition(status.conditions, "Degraded", True, "RolloutStalled", message, gen)
        status.phase, status.message, degraded = Phase.degraded, message, True
    elif degraded and any(c.type == "Degraded" and c.reason == "RolloutStalled" for c in status.conditions):
        status.conditions = set_condition(status.conditions, "Degraded", False, "Recovered", "rollout progresses", gen)
        status.phase, degraded = Phase.deploying, False
    degraded = await bundle_health.surface(svc, status, degraded)
    if all_ready:
        status.conditions = set_condition(
            status.conditions, "Ready", True, "AllReady", "every Deployment is ready", gen
        )
        status.conditions = set_condition(status.conditions, "Progressing", False, "Complete", "rollout complete", gen)
        if not degraded:
            status.phase = Phase.ready
    else:
        status.conditions = set_condition(
            status.conditions, "Ready", False, "Waiting", "some Deployments have fewer ready replicas than desired", gen
        )
    if json.dumps(status.model_dump(mode="json"), sort_keys=True) != before:
        await svc.write_status(status)
    return status
