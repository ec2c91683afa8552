"""Reconcile one EarlyExitService: validate, read its pools and profiles, plan, apply, report.

The walk of a service from its kopf handler (handlers.py) to its applied children starts here:
`reconcile` (create, update, resume, a profile or pool event) refuses what cannot be planned
(an invalid spec, a bundle path the operator does not allow, unknown pools), hands a text-generation
service to generation_reconcile.py and a service still without ModelProfiles to profiling.py, and
plans the rest with `plan_and_apply`: the planner (planning.py) on what other services leave of the
pools (capacity.py), the move cap on a re-plan (drift.py), the children (builders.py), and their
rollout (rollout.py). The drift loop (driftloop.py) re-plans through `plan_and_apply` too.

Nothing here raises for bad user input: unknown pools, missing profiles and infeasible SLOs become
conditions and events; API failures become Degraded and a `kopf.TemporaryError` (rollout.py) so kopf
retries with backoff while the previous plan keeps serving.
"""

from __future__ import annotations

from pydantic import ValidationError

from exitplan.api.observations import Observations
from exitplan.api.plan import Plan
from exitplan.api.resources import EarlyExitServiceSpec, Mode
from exitplan.operator import builders, capacity, drift, generation_reconcile, guards, plan_memory, profiling
from exitplan.operator.generation_builders import is_generation
from exitplan.operator.metrics import METRICS
from exitplan.operator.planning import plan_in_executor
from exitplan.operator.rollout import propose_or_apply
from exitplan.operator.service_state import (
    Service,
    ServiceResources,
    current_plan,
    mark_infeasible,
    read_inputs,
    report_infeasible,
)
from exitplan.operator.status import ServiceStatus, now_iso, parse_status, set_condition
from exitplan.planner import PlanInfeasible, PlannerError


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
        status = mark_infeasible(status, gen, "InvalidSpec", message)
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
        status = mark_infeasible(status, gen, "UnknownPool", message)
        await svc.write_status(status)
        return status
    if (no_room := guards.capacity_refusal(inputs.pools, inputs.capacity)) is not None:
        return await report_infeasible(svc, status, capacity.REASON, no_room)  # no profiling Job, no plan

    if is_generation(spec):  # text generation: a decoder's stages, planned without ModelProfiles
        return await generation_reconcile.reconcile_generation(svc, spec, inputs, status, reason)
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
    if (refusal := guards.bundle_refusal(spec, svc.settings)) is not None:
        return await report_infeasible(svc, status, guards.REFUSED, refusal)
    async with svc.capacity_lock():
        room = await capacity.room(svc, inputs)
        left = room.reduced(inputs)
        try:
            plan = await plan_in_executor(
                svc.name,
                svc.namespace,
                spec,
                left,
                reason=reason,
                previous=previous,
                observations=observations,
                cache=plan_memory.plan_cache(svc.memo),
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
        elif reason == "spec-change":  # the same workers for a changed spec: the plan now answers to it
            plan, corrected = previous.model_copy(update={"prediction": plan.prediction, "reason": reason}), True
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
        ramps=max((len(p.ramps) for p in inputs.profiles.values()), default=None),
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
                cache=plan_memory.plan_cache(svc.memo),
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
