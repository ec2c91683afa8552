"""Rolling a plan's children out: apply them (active mode) or propose them (advisory), and say which.

Owns the last hop of every reconcile, classification and generation alike (`propose_or_apply`): the
routers' PodDisruptionBudget and the service's NetworkPolicies join the children (`all_children`:
disruption.py, network_policies.py), the control token exists before the
pods that mount it (control_token.py), apply.py creates, patches and prunes the children, and the
status (Planned, Progressing, Degraded, the plan summary, the proposal) and the events say what
happened. A failed apply leaves the previous plan serving and retries with backoff (kopf.TemporaryError).
"""

from __future__ import annotations

import kopf

from exitplan.api.manifest import Manifest
from exitplan.api.plan import Plan
from exitplan.api.resources import EarlyExitServiceSpec, Mode
from exitplan.operator import apply as applying
from exitplan.operator import control_token, disruption, network_policies, plan_memory
from exitplan.operator.kube import ApiError
from exitplan.operator.metrics import METRICS
from exitplan.operator.names import PORT, dns_name
from exitplan.operator.service_state import Service
from exitplan.operator.status import Phase, Proposal, ServiceStatus, now_iso, set_condition, summarize

RETRY_DELAY = 10.0
"""Seconds before kopf retries a reconcile whose apply failed (kopf.TemporaryError)."""


def all_children(svc: Service, spec: EarlyExitServiceSpec, plan: Plan, children: list[Manifest]) -> list[Manifest]:
    """A plan's children (builders.py, generation_builders.py) with the routers' PodDisruptionBudget and,
    when the operator's settings ask for them, the service's NetworkPolicies: what every apply applies
    (an apply without them would prune them)."""
    budgeted = disruption.with_router_budget(svc.body, spec, plan.layout_hash(), children)
    return network_policies.with_network_policies(svc.body, plan, svc.settings, budgeted)


async def propose_or_apply(
    svc: Service,
    spec: EarlyExitServiceSpec,
    status: ServiceStatus,
    children: list[Manifest],
    *,
    plan: Plan,
    target: Plan,
    previous: Plan | None,
    reason: str,
    what: str,
    held_back: str = "",
    ramps: int | None = None,
) -> ServiceStatus:
    """Advisory: diff the children and report what would change. Active: apply them and report.

    `plan` is what is applied now, `target` where the steps lead (they differ under a move cap, when
    `held_back` says what follows); `what` names the plan in messages and events, `ramps` the bundle's exit ramps
    (kubectl's EXITS). A failed apply leaves
    the previous plan serving, marks the service Degraded and retries with backoff. The routers'
    PodDisruptionBudget and the NetworkPolicies join the children here, for every kind of service.
    """
    gen = svc.generation
    desired = all_children(svc, spec, plan, children)
    if spec.planner.mode == Mode.advisory:
        await control_token.ensure_token(svc.client, svc.body)  # to read the routers (nothing else changes)
        existing = await applying.list_children(svc.client, svc.name, svc.namespace)
        changes = applying.diff_children(existing, desired)
        status.proposal = Proposal(
            reason=reason, hash=target.content_hash(), changes=changes, held_back="advisory mode: nothing applied"
        )
        status.plan = summarize(plan, ramps=ramps)
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
        plan_memory.children_written(svc.memo)  # the plan ConfigMap was written: read the plan in force again
    except ApiError as err:
        plan_memory.children_written(svc.memo)  # some of them may have been written
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

    status.plan = summarize(plan, ramps=ramps)
    status.proposal = Proposal(reason=reason, hash=target.content_hash(), held_back=held_back) if held_back else None
    if previous is None or previous.content_hash() != plan.content_hash():
        status.last_replan_time, status.last_replan_reason = now_iso(), reason
    status.endpoint = f"http://{dns_name(svc.name)}.{svc.namespace}.svc:{PORT}"
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
