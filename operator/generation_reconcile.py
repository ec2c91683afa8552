"""Reconcile a generation service (task text-generation; issue 7): plan, build its children, apply, report.

`reconcile.reconcile` hands a service over here once its spec is valid and its pools exist. A generation
service needs no ModelProfile: the planner (exitplan.planner.generation) splits the decoder's blocks
into stages using the generation measurements kept beside the bundle
(`<bundle>/profiles/generation-<pool>.json`, written by `exitplan up` on a machine of that pool) when
the operator can read them, and otherwise plans one KV-recomputation stage that never exits
(threshold 1.0, exactly the full model's tokens) and says so in the status. The thresholds can be
changed live through the router's POST /v1/thresholds.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import kopf

from exitplan.api.bundle import BundleError, read_manifest
from exitplan.api.resources import EarlyExitServiceSpec, Mode
from exitplan.operator import apply as applying
from exitplan.operator import builders, generation_builders
from exitplan.operator.kube import ApiError
from exitplan.operator.metrics import METRICS
from exitplan.operator.reconcile import RETRY_DELAY, Inputs, Service, _infeasible, current_plan
from exitplan.operator.status import Phase, Proposal, ServiceStatus, now_iso, set_condition, summarize
from exitplan.planner.errors import PlannerError
from exitplan.planner.generation import GenerationPlanResult, measurements_file, plan_generation, read_measurements

is_generation = generation_builders.is_generation


def plan_for(name: str, spec: EarlyExitServiceSpec, inputs: Inputs, reason: str) -> GenerationPlanResult:
    """The generation plan from the bundle's manifest and, when present, its measurements (blocking I/O)."""
    bundle = Path(builders.bundle_path(spec.model.bundle))
    manifest = read_manifest(bundle)
    if manifest.decoder is None:
        raise BundleError(f"{bundle}: spec.model.task is text-generation but the bundle has no decoder section")
    measured = measurements_file(bundle, spec.pools[0].name)
    profile, points = read_measurements(measured) if measured.is_file() else (None, [])
    return plan_generation(name, spec, inputs.pools, n_blocks=len(manifest.blocks),
                           exit_ramps=[r.name for r in manifest.exit_ramps()], max_context=manifest.decoder.max_context,
                           profile=profile, thresholds=points, reason=reason)


async def reconcile_generation(svc: Service, spec: EarlyExitServiceSpec, inputs: Inputs, status: ServiceStatus,
                               reason: str) -> ServiceStatus:
    gen = svc.generation
    try:
        result = await asyncio.get_running_loop().run_in_executor(None, plan_for, svc.name, spec, inputs, reason)
    except (BundleError, PlannerError, OSError) as err:
        message = (f"cannot plan the generation service: {err}; the operator reads the bundle's bundle.yaml "
                   f"(and profiles/generation-<pool>.json if present) from spec.model.bundle")
        svc.event("Warning", "PlannerInput", message)
        status = _infeasible(status, gen, "GenerationPlan", message)
        await svc.write_status(status)
        return status
    METRICS.replans.labels(svc.name, reason).inc()
    plan = result.plan
    previous = await current_plan(svc.client, svc.name, svc.namespace)
    if previous is not None and previous.content_hash() == plan.content_hash():
        plan = previous
    children = generation_builders.build_children(svc.body, spec, plan, inputs.pools)
    what = (f"generation plan {plan.content_hash()} ({reason}): {result.mode}, {len(plan.splits)} stage(s), "
            f"threshold {result.threshold}" + (f"; {result.note}" if result.note else ""))
    status.conditions = set_condition(status.conditions, "PlanInfeasible", False, "Planned", "a plan meets the spec", gen)
    status.waiting_for_profiles = []
    if spec.planner.mode == Mode.advisory:
        changes = applying.diff_children(await applying.list_children(svc.client, svc.name, svc.namespace), children)
        status.proposal = Proposal(reason=reason, hash=plan.content_hash(), changes=changes, held_back="advisory mode: nothing applied")
        status.plan, status.phase, status.observed_generation = summarize(plan), Phase.advisory, gen
        status.message = f"advisory: would apply {what}: {len(changes)} change(s)"
        status.conditions = set_condition(status.conditions, "Planned", True, "Advisory", status.message, gen)
        status.conditions = set_condition(status.conditions, "Progressing", False, "Advisory", status.message, gen)
        svc.event("Normal", "WouldApply", f"{what} would: " + "; ".join(changes or ["change nothing"]))
        await svc.write_status(status)
        return status
    try:
        report = await applying.apply_children(svc.client, children, svc.name, svc.namespace)
    except ApiError as err:
        METRICS.applies_failed.labels(svc.name).inc()
        message = f"applying {what} failed ({err}); the previous plan keeps serving; retrying"
        status.conditions = set_condition(status.conditions, "Degraded", True, "ApplyFailed", message, gen)
        status.phase, status.message = Phase.degraded, message
        svc.event("Warning", "ApplyFailed", message)
        await svc.write_status(status)
        raise kopf.TemporaryError(message, delay=RETRY_DELAY) from err
    status.plan, status.proposal = summarize(plan), None
    if previous is None or previous.content_hash() != plan.content_hash():
        status.last_replan_time, status.last_replan_reason = now_iso(), reason
    status.endpoint = f"http://{builders.dns_name(svc.name)}.{svc.namespace}.svc:{builders.PORT}"
    status.conditions = set_condition(status.conditions, "Planned", True, "Planned", what, gen)
    status.conditions = set_condition(status.conditions, "Degraded", False, "Applied", report.summary(), gen)
    status.conditions = set_condition(status.conditions, "Progressing", True, "Rollout", f"applied: {report.summary()}", gen)
    status.phase, status.message, status.observed_generation = Phase.deploying, f"applied {what}: {report.summary()}", gen
    if report.changed():
        svc.event("Normal", "Applied", f"{what}: {report.summary()}")
    await svc.write_status(status)
    return status
