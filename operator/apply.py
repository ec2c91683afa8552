"""Idempotent apply of a service's children, make-before-break.

`apply_children` brings the cluster to the desired children of a plan in three phases:

1. grow: create new worker Deployments, raise replicas of existing ones to max(current, desired),
   create/patch the split Services; the old plan still serves (plan.json unchanged);
2. switch: patch the plan ConfigMap (routers and workers re-read plan.json), the router, its
   PodDisruptionBudget and the service's NetworkPolicies (network_policies.py);
3. shrink: set every worker Deployment to its exact desired replicas and delete the children the
   new plan no longer has.

A failure in phase 1 or 2 leaves the previous plan serving (its ConfigMap and Deployments are
untouched or only grown); a failure in phase 3 leaves extra capacity, fixed by the next reconcile.
Each object goes through `apply_one`: GET; 404 -> create (409 on a race -> patch instead);
otherwise a JSON merge patch carrying `metadata.resourceVersion` (409 on a concurrent write ->
re-read and retry), skipped when the object already holds every desired field. A caller that knows the
object's resourceVersion (the plan ConfigMap as this process last wrote it) patches without the GET.
"""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass, field
from typing import Any

from exitplan.api.manifest import Manifest
from exitplan.operator import names
from exitplan.operator.kube import ApiError, KubeClient, object_path, path

CONFLICT_RETRIES = 5
PLAN_KINDS = ("PodDisruptionBudget", "NetworkPolicy")
"""Children switched with the plan ConfigMap and pruned when a plan has none (disruption.py, network_policies.py)."""


@dataclass
class ApplyReport:
    created: list[str] = field(default_factory=list)
    patched: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)

    def changed(self) -> bool:
        return bool(self.created or self.patched or self.deleted)

    def summary(self) -> str:
        return (
            f"{len(self.created)} created, {len(self.patched)} patched, {len(self.deleted)} deleted, "
            f"{len(self.unchanged)} unchanged"
        )


def contains(current: Any, desired: Any) -> bool:
    """True when `current` already holds every field of `desired` (dicts: subset; lists: same
    length, element-wise contains)."""
    if isinstance(desired, dict):
        return isinstance(current, dict) and all(k in current and contains(current[k], v) for k, v in desired.items())
    if isinstance(desired, list):
        return (
            isinstance(current, list)
            and len(current) == len(desired)
            and all(contains(c, d) for c, d in zip(current, desired))
        )
    return current == desired or (
        isinstance(current, (int, float))
        and isinstance(desired, (int, float))
        and not isinstance(current, bool)
        and float(current) == float(desired)
    )


def _label(obj: Manifest) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def _body(desired: Manifest) -> Manifest:
    """What a patch may set of `desired` (not its kind, nor its status)."""
    return {k: v for k, v in desired.items() if k not in ("apiVersion", "kind", "status")}


def _patch(body: Manifest, resource_version: str) -> Manifest:
    """A merge patch of `body` that holds only against the object at `resource_version` (409 otherwise). Its own
    metadata; the rest is `body`'s (the patch is only serialised, never changed)."""
    return {**body, "metadata": {**body["metadata"], "resourceVersion": resource_version}}


async def apply_one(
    client: KubeClient, desired: Manifest, report: ApplyReport, known_version: str | None = None
) -> Manifest:
    """Create or patch one object to hold `desired` (see the module docstring). `known_version`: the object's
    resourceVersion as this process last read or wrote it, when it changes only what `desired` changes: the
    patch carries it without the GET first, and a conflict (someone wrote the object since) or its absence
    falls back to the GET."""
    url = object_path(desired)
    if known_version:
        try:
            patched = await client.merge_patch(url, _patch(_body(desired), known_version))
            report.patched.append(_label(desired))
            return patched
        except ApiError as err:
            if err.status not in (404, 409):
                raise
    for attempt in range(CONFLICT_RETRIES):
        try:
            current = await client.get(url)
        except ApiError as err:
            if err.status != 404:
                raise
            try:
                created = await client.create(desired)
                report.created.append(_label(desired))
                return created
            except ApiError as err2:
                if err2.status != 409:  # 409: created meanwhile by someone else -> patch it below
                    raise
                continue
        body = _body(desired)
        if contains(current, body):
            report.unchanged.append(_label(desired))
            return current
        try:
            patched = await client.merge_patch(url, _patch(body, current["metadata"]["resourceVersion"]))
            report.patched.append(_label(desired))
            return patched
        except ApiError as err:
            if err.status != 409:
                raise
            await asyncio.sleep(0.05 * (attempt + 1))  # concurrent write: re-read and try again
    raise ApiError(409, "Conflict", f"{_label(desired)}: still conflicting after {CONFLICT_RETRIES} attempts")


async def delete_one(client: KubeClient, obj: Manifest, report: ApplyReport) -> None:
    try:
        await client.delete(object_path(obj))
        report.deleted.append(_label(obj))
    except ApiError as err:
        if err.status != 404:  # already gone is what we wanted
            raise


async def list_children(client: KubeClient, service: str, namespace: str) -> dict[str, list[Manifest]]:
    """The service's existing children by kind (by the exitplan.io/service label)."""
    selector = f"{names.L_SERVICE}={service}"
    out: dict[str, list[Manifest]] = {}
    for kind in ("Deployment", "Service", "ConfigMap", "Job", "PodDisruptionBudget", "NetworkPolicy"):
        items = await client.list(path(kind, namespace), selector)
        for item in items:
            item.setdefault("kind", kind)
        out[kind] = items
    return out


async def apply_children(client: KubeClient, desired: list[Manifest], service: str, namespace: str) -> ApplyReport:
    """Make the cluster hold exactly `desired` (the children built for one plan), make-before-break."""
    report = ApplyReport()
    existing = await list_children(client, service, namespace)
    current_replicas = {
        d["metadata"]["name"]: int(d.get("spec", {}).get("replicas") or 0) for d in existing["Deployment"]
    }
    component = names.L_COMPONENT

    def is_worker(obj: Manifest) -> bool:
        return bool(obj["kind"] == "Deployment" and obj["metadata"]["labels"].get(component) == "worker")

    workers = [d for d in desired if is_worker(d)]
    services = [d for d in desired if d["kind"] == "Service"]
    switch = [
        d
        for d in desired
        if d["kind"] in ("ConfigMap", *PLAN_KINDS) or (d["kind"] == "Deployment" and not is_worker(d))
    ]

    # 1. grow
    for dep in workers:
        grown = copy.deepcopy(dep)
        grown["spec"]["replicas"] = max(dep["spec"]["replicas"], current_replicas.get(dep["metadata"]["name"], 0))
        await apply_one(client, grown, report)
    for svc in services:
        await apply_one(client, svc, report)
    # 2. switch
    for obj in switch:
        await apply_one(client, obj, report)
    # 3. shrink
    for dep in workers:
        if current_replicas.get(dep["metadata"]["name"], 0) > dep["spec"]["replicas"]:
            await apply_one(client, dep, report)
    wanted = {(d["kind"], d["metadata"]["name"]) for d in desired}
    for kind in ("Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "NetworkPolicy"):
        for obj in existing[kind]:
            if (kind, obj["metadata"]["name"]) not in wanted:
                await delete_one(client, obj, report)
    return report


def diff_children(existing: dict[str, list[Manifest]], desired: list[Manifest]) -> list[str]:
    """What applying `desired` would change, in words (advisory mode): one line per change."""
    have = {(o["kind"], o["metadata"]["name"]): o for objs in existing.values() for o in objs}
    out = []
    for obj in desired:
        key = (obj["kind"], obj["metadata"]["name"])
        cur = have.get(key)
        if cur is None:
            extra = f" with {obj['spec']['replicas']} replicas" if obj["kind"] == "Deployment" else ""
            out.append(f"create {obj['kind']} {key[1]}{extra}")
        elif obj["kind"] == "Deployment" and cur.get("spec", {}).get("replicas") != obj["spec"]["replicas"]:
            out.append(f"scale {key[1]}: {cur.get('spec', {}).get('replicas')} -> {obj['spec']['replicas']}")
        elif obj["kind"] == "ConfigMap" and cur.get("data") != obj.get("data"):
            out.append(f"update ConfigMap {key[1]} (plan {obj['metadata']['annotations'][names.A_PLAN_HASH]})")
    wanted = {(o["kind"], o["metadata"]["name"]) for o in desired}
    for key in sorted(have):
        if key[0] != "Job" and key not in wanted:
            out.append(f"delete {key[0]} {key[1]}")
    return out
