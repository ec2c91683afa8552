"""Reconcile a generation service (task text-generation, a decoder in stages): plan, build its children, apply, report.

`reconcile.reconcile` hands a service over here once its spec is valid and its pools exist. A generation
service needs no ModelProfile: the planner (exitplan.planner.generation) splits the decoder's blocks
into stages using the generation measurements kept beside the bundle
(`<bundle>/profiles/generation-<pool>.json`, written by `exitplan up` on a machine of that pool) when
the operator can read them, and otherwise plans one KV-recomputation stage that never exits
(threshold 1.0, exactly the full model's tokens) and says so in the status. The thresholds can be
changed live through the router's POST /v1/thresholds.

The stages and the router get a remote bundle (s3://, https://, pvc://, oci://) as a classification
service's pods do (builders._volumes: bundle_volumes.py's storage-init container and volume), but
planning needs the bundle's bundle.yaml here, in the operator, which reads only a path it can see:
a remote generation bundle is reported as an Infeasible plan (reason GenerationPlan) that says so,
and nothing is started.
"""

from __future__ import annotations

from pathlib import Path

from exitplan.api.bundle import BundleError, read_manifest
from exitplan.api.bundle_source import parse_bundle_uri
from exitplan.api.resources import EarlyExitServiceSpec
from exitplan.operator import builders, capacity, generation_builders
from exitplan.operator.executors import run_planner
from exitplan.operator.metrics import METRICS
from exitplan.operator.reconcile import Service, ServiceResources, _infeasible, current_plan, propose_or_apply
from exitplan.operator.status import ServiceStatus, set_condition
from exitplan.planner.errors import PlannerError
from exitplan.planner.generation import GenerationPlanResult, measurements_file, plan_generation, read_measurements

is_generation = generation_builders.is_generation


def plan_for(name: str, spec: EarlyExitServiceSpec, inputs: ServiceResources, reason: str) -> GenerationPlanResult:
    """The generation plan from the bundle's manifest and, when present, its measurements (blocking I/O)."""
    if parse_bundle_uri(spec.model.bundle).remote:  # the spec's validation accepted it
        shown = spec.model.bundle.split("?", 1)[0]  # never a presigned URL's signature
        raise BundleError(
            f"spec.model.bundle {shown!r} is a {shown.split('://', 1)[0]}:// bundle: the pods would fetch and "
            "verify it (storage-init), but the operator plans a generation service from the bundle's bundle.yaml "
            "(its blocks, exit ramps and context) and reads it only from a path it can see; give a directory "
            "the operator can read (a path under its allowed host paths)"
        )
    bundle = Path(builders.bundle_path(spec.model.bundle))
    manifest = read_manifest(bundle)
    if manifest.decoder is None:
        raise BundleError(f"{bundle}: spec.model.task is text-generation but the bundle has no decoder section")
    measured = measurements_file(bundle, spec.pools[0].name)
    profile, points = read_measurements(measured) if measured.is_file() else (None, [])
    return plan_generation(
        name,
        spec,
        inputs.pools,
        n_blocks=len(manifest.blocks),
        exit_ramps=[r.name for r in manifest.exit_ramps()],
        max_context=manifest.decoder.max_context,
        profile=profile,
        thresholds=points,
        reason=reason,
    )


async def reconcile_generation(
    svc: Service, spec: EarlyExitServiceSpec, inputs: ServiceResources, status: ServiceStatus, reason: str
) -> ServiceStatus:
    """Plan and apply on what other services leave of the pools (capacity.py), under the capacity lock."""
    async with svc.capacity_lock():
        room = await capacity.room(svc, inputs)
        return await _plan_and_apply(svc, spec, room.reduced(inputs), status, reason, room)


async def _plan_and_apply(
    svc: Service,
    spec: EarlyExitServiceSpec,
    inputs: ServiceResources,
    status: ServiceStatus,
    reason: str,
    room: capacity.Room,
) -> ServiceStatus:
    gen = svc.generation
    try:
        result = await run_planner(plan_for, svc.name, spec, inputs, reason)
    except (BundleError, PlannerError, OSError) as err:
        message = (
            f"cannot plan the generation service: {err}; the operator reads the bundle's bundle.yaml "
            f"(and profiles/generation-<pool>.json if present) from spec.model.bundle"
            + (f"; other services hold capacity: {room.describe()}" if room.shared() else "")
        )
        svc.event("Warning", "PlannerInput", message)
        status = _infeasible(status, gen, "GenerationPlan", message)
        await svc.write_status(status)
        return status
    METRICS.replans.labels(svc.namespace, svc.name, reason).inc()
    plan = result.plan
    previous = await current_plan(svc.client, svc.name, svc.namespace)
    if previous is not None and previous.content_hash() == plan.content_hash():
        plan = previous
    reason = plan.reason  # one reason per plan (reconcile._apply_plan)
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
