"""GPUPool capacity shared by every service that uses a pool.

A GPUPool's `capacity` is what all services together may run on it. Before a service plans, the
operator reads what the other services hold -- the cells of the plan each one runs now, its plan
ConfigMap (`<svc>-plan`, plan.json), in every namespace the operator serves -- and hands the planner
the pools with only what is left (the planner itself knows nothing of other services or of
Kubernetes). Reading, planning and applying happen under one operator-wide lock
(service_state.Service.capacity_lock), so two services never plan into the same free capacity.

Only a plan the operator wrote counts: a ConfigMap named `<svc>-plan` whose controlling
ownerReference is the EarlyExitService `<svc>` that exists now (same uid) in the same namespace. Any other
ConfigMap that looks like a plan (the managed labels, a `-plan` name: forged by a tenant, or left over by a
deleted service) holds nothing; the operator ignores it and posts one Warning event (`IgnoredPlan`) on it per
version, so a 100,000-replica plan written by hand cannot starve the services that share its pools.

A service that does not fit in what is left is PlanInfeasible with reason PoolCapacity and the
numbers: per pool its capacity, what each other service holds, what is left, and what this service
would need with the pools to itself (its least-cost plan for its target rate). Its timer looks
again when the capacity left changes (driftloop.on_tick -> `recheck`), e.g. when another service
is deleted or scales down.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import kopf
from pydantic import ValidationError

from exitplan.api.manifest import Manifest
from exitplan.api.plan import Plan
from exitplan.api.resources import GROUP, EarlyExitServiceSpec, Objective
from exitplan.operator.executors import run_planner
from exitplan.operator.kube import path
from exitplan.operator.names import MANAGED, plan_configmap_name
from exitplan.operator.ownership import kopf_body
from exitplan.operator.service_state import (
    Service,
    ServiceResources,
    mark_infeasible,
    read_inputs,
    report_infeasible,
)
from exitplan.operator.status import ServiceStatus
from exitplan.planner import PlanInfeasible, PlannerError, plan_service

log = logging.getLogger("exitplan.operator")

REASON = "PoolCapacity"
"""The reason of the PlanInfeasible condition of a service that does not fit in what is left."""
RECHECK_SECONDS = 10.0
"""How often the timer of a service refused for capacity looks at what is left."""
MEMO_KEY = "capacity_left"
IGNORED = "IgnoredPlan"
"""The reason of the Warning event on a plan-like ConfigMap that no existing EarlyExitService owns."""


@dataclass
class PoolRoom:
    capacity: int
    """The pool's own capacity."""
    held: dict[str, int] = field(default_factory=dict)
    """`namespace/name` of another service -> replicas its running plan has on the pool."""

    @property
    def left(self) -> int:
        return max(0, self.capacity - sum(self.held.values()))


@dataclass
class Room:
    """What is left for one service on each of its pools."""

    pools: dict[str, PoolRoom] = field(default_factory=dict)

    def shared(self) -> bool:
        """Some other service holds replicas on one of the pools."""
        return any(room.held for room in self.pools.values())

    def left(self) -> dict[str, int]:
        return {name: room.left for name, room in sorted(self.pools.items())}

    def reduced(self, inputs: ServiceResources) -> ServiceResources:
        """`inputs` with each pool's capacity cut to what is left (and the service's maxGpus)."""
        pools = {
            name: pool.model_copy(update={"capacity": min(pool.capacity, self.pools[name].left)})
            if name in self.pools
            else pool
            for name, pool in inputs.pools.items()
        }
        return dataclasses.replace(inputs, pools=pools)

    def describe(self) -> str:
        parts = []
        for name, room in sorted(self.pools.items()):
            holders = ", ".join(f"{who}: {n}" for who, n in sorted(room.held.items()))
            parts.append(
                f"pool {name}: capacity {room.capacity}, held by other services {sum(room.held.values())}"
                + (f" ({holders})" if holders else "")
                + f", left {room.left}"
            )
        return "; ".join(parts)


def owner_of(cm: Manifest, services: dict[str, str]) -> str | None:
    """The name of the existing service (`services`: name -> uid, the ConfigMap's namespace) whose plan
    `cm` is, or None: the controlling ownerReference must name that service and its uid, and the
    ConfigMap must carry the service's plan name."""
    meta = cm["metadata"]
    for ref in meta.get("ownerReferences") or []:
        name = ref.get("name", "")
        if (
            ref.get("kind") == "EarlyExitService"
            and str(ref.get("apiVersion", "")).split("/")[0] == GROUP
            and ref.get("controller")
            and services.get(name) == ref.get("uid")
            and meta["name"] == plan_configmap_name(name)
        ):
            return str(name)
    return None


async def _services(svc: Service, namespace: str | None) -> dict[tuple[str, str], str]:
    """(namespace, name) -> uid of the EarlyExitServices that exist now (not being deleted)."""
    out: dict[tuple[str, str], str] = {}
    for item in await svc.client.list(path("EarlyExitService", namespace)):
        meta = item["metadata"]
        if not meta.get("deletionTimestamp"):
            out[(str(meta.get("namespace")), str(meta["name"]))] = str(meta.get("uid", ""))
    return out


def _report_ignored(svc: Service, cm: Manifest) -> None:
    """One Warning event on a plan-like ConfigMap no existing service owns, per version of it."""
    meta = cm["metadata"]
    seen: set[tuple[str, str, str]] | None = getattr(svc.memo, "ignored_plans", None)
    key = (str(meta.get("namespace")), str(meta["name"]), str(meta.get("resourceVersion", "")))
    if seen is not None:
        if key in seen:
            return
        seen.add(key)
    message = (
        f"ConfigMap {key[0]}/{key[1]} looks like a plan (managed labels, a -plan name) but no existing "
        f"EarlyExitService owns it (controller ownerReference with its uid): it holds no pool capacity; "
        f"delete it (the operator writes every plan it counts)"
    )
    log.warning("%s", message)
    kopf.event(kopf_body(cm), type="Warning", reason=IGNORED, message=message)


async def held_by_others(svc: Service) -> dict[str, dict[str, int]]:
    """pool -> {`namespace/name` -> replicas} of every other service's running plan (its plan
    ConfigMap, owned by that service), over the namespaces the operator serves."""
    held: dict[str, dict[str, int]] = defaultdict(dict)
    selector = ",".join(f"{k}={v}" for k, v in MANAGED.items())
    for namespace in svc.settings.namespaces or (None,):
        services = await _services(svc, namespace)
        for cm in await svc.client.list(path("ConfigMap", namespace), selector):
            meta = cm["metadata"]
            if not str(meta["name"]).endswith("-plan") or meta.get("deletionTimestamp"):
                continue
            in_ns = {name: uid for (ns, name), uid in services.items() if ns == meta.get("namespace")}
            owner = owner_of(cm, in_ns)
            if owner is None:
                _report_ignored(svc, cm)
                continue
            if (meta.get("namespace"), owner) == (svc.namespace, svc.name):
                continue
            try:
                plan = Plan.model_validate_json((cm.get("data") or {}).get("plan.json", ""))
            except ValidationError:
                continue
            who = f"{meta.get('namespace')}/{owner}"
            for cell in plan.cells:
                held[cell.pool][who] = held[cell.pool].get(who, 0) + cell.replicas
    return held


async def room(svc: Service, inputs: ServiceResources) -> Room:
    """What other services leave of the service's pools. Call under svc.capacity_lock()."""
    held = await held_by_others(svc)
    return Room(
        {
            name: PoolRoom(inputs.capacity.get(name, pool.capacity), dict(held.get(name, {})))
            for name, pool in inputs.pools.items()
        }
    )


async def explain(
    spec: EarlyExitServiceSpec, inputs: ServiceResources, room: Room, thresholds: dict[str, float] | None
) -> str | None:
    """Why a service that the planner found infeasible on what is left does not fit, with the numbers;
    None when capacity is not the cause (no other service holds any, or it would not fit on whole pools)."""
    if not room.shared():
        return None
    target = spec.planner.target_rps or spec.workload.rps
    least = spec.model_copy(
        update={"planner": spec.planner.model_copy(update={"objective": Objective.min_cost, "target_rps": target})}
    )

    def alone() -> Plan | None:
        try:
            return plan_service("capacity-check", least, inputs.pools, inputs.profiles, thresholds=thresholds).plan
        except PlannerError:
            return None

    plan = await run_planner(alone)
    if plan is None:
        return None
    need: dict[str, int] = defaultdict(int)
    for cell in plan.cells:
        need[cell.pool] += cell.replicas
    needs = ", ".join(f"{p}: {n}" for p, n in sorted(need.items()))
    return (
        f"no room left on the pools for this service: {room.describe()}. With the pools to itself it needs "
        f"{sum(need.values())} replica(s) ({needs}) for {target:g} req/s. Free capacity (delete or scale down "
        f"another service, raise the GPUPool's capacity) and it plans again"
    )


async def recheck(svc: Service, memo: Any) -> bool:
    """For a service refused for capacity (PlanInfeasible, reason PoolCapacity): True when what is
    left of its pools changed since the timer last looked (the caller re-plans it)."""
    conditions = (svc.body.get("status") or {}).get("conditions") or []
    if not any(c.get("type") == "PlanInfeasible" and c.get("reason") == REASON for c in conditions):
        return False
    now = time.monotonic()
    last_at, last_left = memo.get(MEMO_KEY) or (0.0, None)
    if now - last_at < RECHECK_SECONDS:
        return False
    try:
        spec = EarlyExitServiceSpec.model_validate(svc.body.get("spec") or {})
    except ValidationError:
        return False
    inputs = await read_inputs(svc.client, spec, svc.namespace)
    left = (await room(svc, inputs)).left()
    memo[MEMO_KEY] = (now, left)
    return last_left is None or left != last_left


async def not_planned(
    svc: Service,
    spec: EarlyExitServiceSpec,
    inputs: ServiceResources,
    status: ServiceStatus,
    room: Room,
    err: Exception,
    previous: Plan | None,
) -> ServiceStatus:
    """The status and event of a planner error (reconcile.plan_and_apply): PoolCapacity when the
    service would fit on its pools if other services did not hold them (with the numbers), else what
    the planner said."""
    gen = svc.generation
    if isinstance(err, PlanInfeasible):
        why = await explain(spec, inputs, room, previous.thresholds if previous else None)
        if why is not None:
            return await report_infeasible(svc, status, REASON, why)
        message = f"no plan meets the spec: {err}" + (f" ({room.describe()})" if room.shared() else "")
        svc.event("Warning", "PlanInfeasible", message)
        status = mark_infeasible(status, gen, "PlanInfeasible", message)
    else:
        message = f"cannot plan: {err}"
        svc.event("Warning", "PlannerInput", message)
        status = mark_infeasible(status, gen, type(err).__name__, message)
    await svc.write_status(status)
    return status
