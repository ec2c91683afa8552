"""What every service's timer tick reads from the API, read once per namespace and tick for all of them.

Each tick of each EarlyExitService needs the service as the API has it now (handlers.tick) and its
Deployments (readiness.py). Asked per service, that is two requests per service and tick: at 200
services and a 5 s tick, 80 requests a second that the API server answers and the operator parses, most
of the operator's CPU. Here one list per kind and namespace serves every service of the namespace for
`max_age` seconds (less than a tick): the EarlyExitServices of the namespace, and its Deployments that
carry the exitplan.io/service label, grouped by service.

A shared list is older than a read of one's own, so it is used only where it cannot be older than what
this process itself did:
- the service: the newest of the list's copy and the copy the API returned to this process's last status
  write (`status_written`, service_state.Service.write_status); a copy whose generation is older than
  the one kopf delivered (a spec change the list missed) is read again on its own;
- the Deployments: only a list asked for after this process last wrote the service's children
  (`children_written`, plan_memory.py): right after an apply the service's own list is read.
A list that fails is not kept: each service then reads on its own, as it would without this module.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from exitplan.api.manifest import Manifest
from exitplan.operator.kube import KubeClient, path
from exitplan.operator.names import L_COMPONENT, L_SERVICE

STATUS_WRITTEN_KEY = "status_written"
"""The per-object memo's key for (monotonic time, the service as the API returned it) of the last status write."""
CHILDREN_WRITTEN_KEY = "children_written_at"
"""The per-object memo's key for the monotonic time this process last wrote the service's children."""


@dataclass
class _Shared:
    """One list in flight or done: when it was asked for, and its result grouped by service name."""

    asked: float
    task: asyncio.Task[dict[str, list[Manifest]]]


@dataclass
class TickReads:
    """The lists the timer ticks share (kept in the operator-wide memo as `tick_reads`)."""

    client: KubeClient
    max_age: float
    """Seconds a list serves the ticks that ask for it (a fraction of the timer's tick)."""
    lists: dict[tuple[str, str], _Shared] = field(default_factory=dict)
    requests: int = 0
    """Lists this cache asked the API for (tests/test_tick_reads.py counts them)."""

    async def _grouped(
        self, kind: str, namespace: str, fetch: Callable[[], Awaitable[list[Manifest]]], key: Callable[[Manifest], str]
    ) -> tuple[float, dict[str, list[Manifest]]]:
        """(when the list was asked for, its items by `key`), asked for again once older than max_age."""
        now = time.monotonic()
        shared = self.lists.get((kind, namespace))
        if shared is None or now - shared.asked > self.max_age or (shared.task.done() and shared.task.exception()):

            async def grouped() -> dict[str, list[Manifest]]:
                out: dict[str, list[Manifest]] = defaultdict(list)
                for item in await fetch():
                    out[key(item)].append(item)
                return dict(out)

            self.requests += 1
            shared = self.lists[(kind, namespace)] = _Shared(now, asyncio.create_task(grouped()))
        try:
            return shared.asked, await asyncio.shield(shared.task)
        except Exception:
            if self.lists.get((kind, namespace)) is shared:
                del self.lists[(kind, namespace)]  # the next tick asks again; this one reads on its own
            raise

    async def services(self, namespace: str) -> tuple[float, dict[str, list[Manifest]]]:
        """The namespace's EarlyExitServices by name, and when the list was asked for."""
        return await self._grouped(
            "EarlyExitService",
            namespace,
            lambda: self.client.list(path("EarlyExitService", namespace)),
            lambda item: str(item["metadata"]["name"]),
        )

    async def endpoints(self, namespace: str) -> tuple[float, dict[str, list[Manifest]]]:
        """Every Endpoints of the namespace, by name (the routers' addresses: router_endpoints.py). Not by
        label: a cluster copies a Service's labels onto its Endpoints, one made by hand need not carry them,
        and a control Service's Endpoints missing from the list must mean that there are none."""
        return await self._grouped(
            "Endpoints",
            namespace,
            lambda: self.client.list(path("Endpoints", namespace)),
            lambda item: str(item["metadata"]["name"]),
        )

    async def kube_services(self, namespace: str) -> tuple[float, dict[str, list[Manifest]]]:
        """The namespace's (core/v1) Services of any exitplan service (router, control, split Services), by name."""
        return await self._grouped(
            "Service",
            namespace,
            lambda: self.client.list(path("Service", namespace), L_SERVICE),
            lambda item: str(item["metadata"]["name"]),
        )

    async def router_pods(self, namespace: str) -> tuple[float, dict[str, list[Manifest]]]:
        """The namespace's router Pods, by the service they belong to."""
        return await self._grouped(
            "Pod",
            namespace,
            lambda: self.client.list(path("Pod", namespace), f"{L_SERVICE},{L_COMPONENT}=router"),
            lambda item: str(((item.get("metadata") or {}).get("labels") or {}).get(L_SERVICE, "")),
        )

    async def deployments(self, namespace: str) -> tuple[float, dict[str, list[Manifest]]]:
        """The namespace's Deployments of any service, by the service they belong to."""
        return await self._grouped(
            "Deployment",
            namespace,
            lambda: self.client.list(path("Deployment", namespace), L_SERVICE),
            lambda item: str(((item.get("metadata") or {}).get("labels") or {}).get(L_SERVICE, "")),
        )

    def forget(self) -> None:
        """Drop every list (the operator stops; in-flight ones are cancelled)."""
        for shared in self.lists.values():
            shared.task.cancel()
        self.lists.clear()


def shared_reads(memo: Any) -> TickReads | None:
    """The operator's TickReads (handlers.configure keeps one in the operator-wide memo), else None."""
    reads = getattr(memo, "tick_reads", None) if memo is not None else None
    return reads if isinstance(reads, TickReads) else None


def status_written(memo: Any, body: Manifest) -> None:
    """After a status write: the service as the API returned it, the newest copy this process has."""
    if memo is not None and isinstance(body, dict) and body.get("metadata"):
        memo[STATUS_WRITTEN_KEY] = (time.monotonic(), body)


def children_written(memo: Any) -> None:
    """After this process wrote the service's children: a shared Deployment list asked before is too old."""
    if memo is not None:
        memo[CHILDREN_WRITTEN_KEY] = time.monotonic()


def _uid(body: Mapping[str, Any]) -> str:
    return str((body.get("metadata") or {}).get("uid") or "")


def _generation(body: Mapping[str, Any]) -> int:
    return int((body.get("metadata") or {}).get("generation") or 0)


async def service_body(memo: Any, delivered: Mapping[str, Any]) -> tuple[bool, Manifest | None]:
    """(known, the service as new as this process knows it) from the shared list; known=False: read it on
    its own (no shared reads, a failed list, a copy older than what kopf delivered, or not in the list)."""
    reads = shared_reads(memo)
    meta = delivered["metadata"]
    if reads is None:
        return False, None
    try:
        asked, by_name = await reads.services(str(meta.get("namespace")))
    except Exception:  # noqa: BLE001 -- the service's own read reports what is wrong
        return False, None
    listed = by_name.get(str(meta["name"]))
    if not listed:
        return False, None  # created after the list, or gone: its own read says which
    body = listed[0]
    written = memo.get(STATUS_WRITTEN_KEY)
    if written is not None and written[0] > asked and _uid(written[1]) == _uid(body):
        body = written[1]  # this process wrote the status after the list was asked for (same object, not a namesake)
    if _generation(body) < _generation(delivered):
        return False, None
    return True, body


async def service_deployments(memo: Any, namespace: str, name: str) -> list[Manifest] | None:
    """The service's Deployments from the shared list, or None: read them on their own (no shared reads,
    a failed list, or one asked for before this process last wrote the service's children)."""
    reads = shared_reads(memo)
    if reads is None:
        return None
    try:
        asked, by_service = await reads.deployments(namespace)
    except Exception:  # noqa: BLE001 -- the service's own read reports what is wrong
        return None
    if asked <= float(memo.get(CHILDREN_WRITTEN_KEY) or 0.0):
        return None
    return by_service.get(name, [])
