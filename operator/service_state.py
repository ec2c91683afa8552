"""One EarlyExitService as the operator sees it: the object, what it reads for it, what it reports.

Owns `Service` (the object as read, the operator's API client and settings, its events and its status
write), `ServiceResources` (the GPUPools and ModelProfiles the service names, as read), `read_inputs`,
`current_plan` (the plan the data plane runs: its ConfigMap), `pools_changed`, and the PlanInfeasible
report every path that refuses to plan ends in (`mark_infeasible`, `report_infeasible`). Every step of
a reconcile (reconcile.py, generation_reconcile.py, capacity.py, profiling.py, the drift loop) takes
its service from here; nothing here plans or builds children.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from exitplan.api.manifest import Manifest
from exitplan.api.plan import Plan
from exitplan.api.resources import EarlyExitServiceSpec, GPUPoolSpec, ModelProfileSpec
from exitplan.operator import events, guards, tick_reads
from exitplan.operator.kube import ApiError, KubeClient, path
from exitplan.operator.metrics import METRICS
from exitplan.operator.names import plan_configmap_name
from exitplan.operator.status import Phase, ServiceStatus, parse_status, set_condition, with_columns

log = logging.getLogger("exitplan.operator")


@dataclass
class ServiceResources:
    """The GPUPools and ModelProfiles one service names, as read (read_inputs)."""

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
        body: dict[str, Any] = {name: pool.model_dump(mode="json") for name, pool in sorted(self.pools.items())}
        body.update({name: None for name in self.unknown_pools})
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]


SERVICE_MEMOS = "service_memos"
"""The operator-wide memo's key for each service's own memo, by (namespace, name, uid): a service deleted
and created again under its name starts with a memo of its own, not its predecessor's plan in force."""


def service_memo(memo: Any, body: Mapping[str, Any]) -> Any:
    """The service's own memo (`body`: the service as read, with its uid): the same object whichever handler asks. kopf gives each handler the memo of
    the object it watches, so a GPUPool or ModelProfile event that re-plans a service would keep what it
    learned (the plan in force, the status it wrote, that it wrote the children) in that pool's memo, and
    the service's timer would go on from older copies. The service's memo is a shallow copy of the
    operator-wide one (the client, settings, locks and shared reads are the same objects), made on first
    use; without the operator's memo (tests, one-off calls) `memo` itself."""
    memos = memo.get(SERVICE_MEMOS) if memo is not None else None
    if not isinstance(memos, dict):
        return memo
    meta = body["metadata"]
    key = (meta.get("namespace") or "", meta["name"], meta.get("uid") or "")
    own = memos.get(key)
    if own is None:
        own = memos[key] = copy.copy(memo)
    return own


def forget_service_memo(memo: Any, body: Mapping[str, Any]) -> None:
    """A deleted service's memo goes with it."""
    memos = memo.get(SERVICE_MEMOS) if memo is not None else None
    if isinstance(memos, dict):
        meta = body["metadata"]
        memos.pop((meta.get("namespace") or "", meta["name"], meta.get("uid") or ""), None)


@dataclass
class Service:
    """One EarlyExitService as the reconcile sees it."""

    body: Manifest
    client: KubeClient
    memo: Any = None
    """kopf's per-object memo (None outside kopf): the operator's settings and capacity lock, the drift state."""

    @property
    def name(self) -> str:
        return str(self.body["metadata"]["name"])

    @property
    def namespace(self) -> str:
        return str(self.body["metadata"]["namespace"])

    @property
    def generation(self) -> int:
        return int(self.body["metadata"].get("generation") or 0)

    @property
    def settings(self) -> guards.Settings:
        """The operator's settings: kopf's memo holds them from startup (handlers.configure), else the env's."""
        settings: guards.Settings | None = getattr(self.memo, "settings", None)
        return settings or guards.Settings.from_env()

    def capacity_lock(self) -> asyncio.Lock:
        """The operator-wide lock under which a service reads what other services hold on the pools,
        plans and applies (capacity.py): two services never plan into the same free capacity."""
        lock: asyncio.Lock | None = getattr(self.memo, "capacity_lock", None)
        return lock if lock is not None else asyncio.Lock()

    def event(self, kind: str, reason: str, message: str) -> None:
        """An event about the service, posted in the background and aggregated (events.py)."""
        log.info("%s/%s %s %s: %s", self.namespace, self.name, kind, reason, message[:300])
        events.RECORDER.record(self.client, self.body, kind, reason, message)

    async def write_status(self, status: ServiceStatus) -> None:
        """Write the status (its `ready` and `reason` derived here, for kubectl's columns)."""
        patch = {"status": with_columns(status).model_dump(by_alias=True, mode="json")}
        try:
            written = await self.client.merge_patch(
                path("EarlyExitService", self.namespace, self.name, "status"), patch
            )
        except ApiError as err:
            if err.status != 404:  # deleted meanwhile: nothing to report on
                raise
        else:  # the conditions as written, as metrics (a deleted service's series are gone: handlers.py)
            tick_reads.status_written(self.memo, written)
            METRICS.record_conditions(self.namespace, self.name, [(c.type, c.status) for c in status.conditions])
            measured = status.drift.goodput_rps if status.drift is not None and status.drift.observed_at else None
            planned = status.plan.goodput_rps if status.plan is not None else None
            METRICS.record_goodput(self.namespace, self.name, planned, measured)
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


async def current_plan(client: KubeClient, name: str, namespace: str) -> Plan | None:
    """The plan the data plane runs now: the plan ConfigMap's plan.json (None before the first apply)."""
    return (await read_plan(client, name, namespace))[0]


async def read_plan(client: KubeClient, name: str, namespace: str) -> tuple[Plan | None, str]:
    """`current_plan` and the plan ConfigMap's resourceVersion ('' when there is none)."""
    try:
        cm = await client.get(path("ConfigMap", namespace, plan_configmap_name(name)))
    except ApiError as err:
        if err.status == 404:
            return None, ""
        raise
    version = str((cm.get("metadata") or {}).get("resourceVersion") or "")
    try:
        return Plan.model_validate_json((cm.get("data") or {}).get("plan.json", "")), version
    except ValidationError:
        return None, version


async def pools_changed(svc: Service) -> bool:
    """True when the service's GPUPools, as read now, differ from those its last plan was made
    with (status.poolsDigest)."""
    try:
        spec = EarlyExitServiceSpec.model_validate(svc.body.get("spec") or {})
    except ValidationError:
        return False  # reported by the spec handlers; a pool change does not fix it
    inputs = await read_inputs(svc.client, spec, svc.namespace)
    return inputs.digest() != parse_status(svc.body.get("status")).pools_digest


def mark_infeasible(status: ServiceStatus, gen: int, reason: str, message: str) -> ServiceStatus:
    """`status` as PlanInfeasible with `reason` and `message` (not Planned, not Progressing, phase
    Infeasible) for spec generation `gen`; nothing is written or posted (report_infeasible does both)."""
    status.conditions = set_condition(status.conditions, "PlanInfeasible", True, reason, message, gen)
    status.conditions = set_condition(status.conditions, "Planned", False, reason, message, gen)
    status.conditions = set_condition(status.conditions, "Progressing", False, reason, message, gen)
    status.phase, status.message, status.observed_generation = Phase.infeasible, message, gen
    return status


async def report_infeasible(svc: Service, status: ServiceStatus, reason: str, message: str) -> ServiceStatus:
    """PlanInfeasible with `reason`, written; the Warning event only when the condition says something
    new (a resume or a re-check that finds the same refusal posts nothing)."""
    same = any(
        c.type == "PlanInfeasible" and c.status == "True" and (c.reason, c.message) == (reason, message)
        for c in status.conditions
    )
    if not same:
        svc.event("Warning", reason, message)
    status = mark_infeasible(status, svc.generation, reason, message)
    await svc.write_status(status)
    return status
