"""Reconcile a generation service (task text-generation, a decoder in stages): plan, build its children, apply, report.

`reconcile.reconcile` hands a service over here once its spec is valid and its pools exist. A generation
service needs no ModelProfile: the planner (exitplan.planner.generation) splits the decoder's blocks
into stages using the generation measurements kept beside the bundle
(`<bundle>/profiles/generation-<pool>.json`, written by `exitplan up` on a machine of that pool) when
the operator can read them, and otherwise plans one KV-recomputation stage that never exits
(threshold 1.0, exactly the full model's tokens) and says so in the status. The thresholds can be
changed live through the router's POST /v1/thresholds.

The stages and the router get a remote bundle (s3://, https://, pvc://, oci://) as a classification
service's pods do (pod_template.on_pool: bundle_volumes.py's storage-init container and volume). The
plan needs the bundle's bundle.yaml and measurements, which the operator cannot read there: a Job
fetches the bundle as the pods do and publishes them as ConfigMap `<svc>-bundle-info`, and the plan
is made from that ConfigMap, with the same parsing as from a directory (bundle_info.py; while the
Job runs the phase is Profiling, reason FetchingBundleInfo; a failed Job is condition ProfilingFailed).
"""

from __future__ import annotations

from exitplan.api.bundle import BundleError
from exitplan.api.bundle_source import parse_bundle_uri
from exitplan.api.resources import EarlyExitServiceSpec
from exitplan.operator import bundle_info, capacity, generation_builders
from exitplan.operator.bundle_info import BundleTexts
from exitplan.operator.executors import run_planner
from exitplan.operator.metrics import METRICS
from exitplan.operator.names import bundle_path
from exitplan.operator.rollout import propose_or_apply
from exitplan.operator.service_state import Service, ServiceResources, current_plan, mark_infeasible
from exitplan.operator.status import ServiceStatus, set_condition
from exitplan.planner import PlannerError
from exitplan.planner.generation import GenerationPlanResult, plan_bundle_generation


def plan_for(
    name: str, spec: EarlyExitServiceSpec, inputs: ServiceResources, reason: str, texts: BundleTexts | None = None
) -> GenerationPlanResult:
    """The generation plan from the bundle's manifest and, when present, its measurements for the first
    pool: from `texts` (a remote bundle's, bundle_info.wait) or else read from the bundle directory
    (blocking I/O)."""
    if texts is None:
        if parse_bundle_uri(spec.model.bundle).remote:  # reconcile_generation reads its ConfigMap first
            raise BundleError(f"spec.model.bundle {bundle_info.shown(spec.model.bundle)!r}: no bundle info read yet")
        texts = bundle_info.read_dir(bundle_path(spec.model.bundle))
    manifest = bundle_info.manifest_of(texts)
    if manifest.decoder is None:
        raise BundleError(f"{texts.where}: spec.model.task is text-generation but the bundle has no decoder section")
    profile, points = bundle_info.measurements_of(texts, spec.pools[0].name)
    return plan_bundle_generation(name, spec, inputs.pools, manifest, profile=profile, thresholds=points, reason=reason)


async def reconcile_generation(
    svc: Service, spec: EarlyExitServiceSpec, inputs: ServiceResources, status: ServiceStatus, reason: str
) -> ServiceStatus:
    """Plan and apply on what other services leave of the pools (capacity.py), under the capacity lock."""
    texts = None
    if parse_bundle_uri(spec.model.bundle).remote:  # the spec's validation accepted it
        texts = await bundle_info.wait(svc, spec, status)
        if texts is None:  # its Job runs, or failed: the status says which
            return status
    async with svc.capacity_lock():
        room = await capacity.room(svc, inputs)
        return await _plan_and_apply(svc, spec, room.reduced(inputs), status, reason, room, texts)


async def _plan_and_apply(
    svc: Service,
    spec: EarlyExitServiceSpec,
    inputs: ServiceResources,
    status: ServiceStatus,
    reason: str,
    room: capacity.Room,
    texts: BundleTexts | None,
) -> ServiceStatus:
    gen = svc.generation
    try:
        result = await run_planner(plan_for, svc.name, spec, inputs, reason, texts)
    except (BundleError, PlannerError, OSError) as err:
        message = (
            f"cannot plan the generation service: {err}; the operator reads the bundle's bundle.yaml "
            "(and profiles/generation-<pool>.json if present) from spec.model.bundle"
            + (f" (a remote one through ConfigMap {bundle_info.configmap_name(svc.name)})" if texts else "")
            + (f"; other services hold capacity: {room.describe()}" if room.shared() else "")
        )
        svc.event("Warning", "PlannerInput", message)
        status = mark_infeasible(status, gen, "GenerationPlan", message)
        await svc.write_status(status)
        return status
    METRICS.replans.labels(svc.namespace, svc.name, reason).inc()
    plan = result.plan
    previous = await current_plan(svc.client, svc.name, svc.namespace)
    if previous is not None and previous.content_hash() == plan.content_hash():
        plan = previous
    reason = plan.reason  # one reason per plan (as reconcile.py's)
    children = generation_builders.build_children(svc.body, spec, plan, inputs.pools)
    what = (
        f"generation plan {plan.content_hash()} ({reason}): {result.mode}, {len(plan.splits)} stage(s), "
        f"threshold {result.threshold}" + (f"; {result.note}" if result.note else "")
    )
    status.conditions = set_condition(
        status.conditions, "PlanInfeasible", False, "Planned", "a plan meets the spec", gen
    )
    status.waiting_for_profiles = []
    return await propose_or_apply(
        svc, spec, status, children, plan=plan, target=plan, previous=previous, reason=reason, what=what
    )
