"""What every service's timer tick reads from the API, kept by one watch per kind and namespace for all of them.

Each tick of each EarlyExitService needs the service as the API has it now (handlers.tick), its
Deployments (readiness.py) and its routers' addresses (router_endpoints.py). Asked per service, that is
several requests per service and tick; asked as one list per namespace and tick (as this module did
before), the lists were still most of the operator's CPU at 200 services (each parsed whole, 40 a
period). Here each kind of a namespace is listed once and then followed by its watch (watched.py): a tick
reads the copy in memory, and only what changed crosses the wire.

The copy is never older than what this process itself wrote (watched.py's expectations: the API client
reports each write, and the group it touched is not fresh until the watch has delivered it):
- the service: while its last status write is unseen, the copy the API returned to that write
  (`status_written`, service_state.Service.write_status); a copy whose generation is older than the one
  kopf delivered (a spec change the watch has not delivered yet) is read again on its own;
- the Deployments: while a write to one of the service's Deployments is unseen, the service's own list.
A collection whose list fails serves nothing: each service then reads on its own, as without this module.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from exitplan.api.manifest import Manifest
from exitplan.operator.kube import KubeClient, path
from exitplan.operator.names import L_COMPONENT, L_SERVICE
from exitplan.operator.watched import Key, Lister, Watched, Watcher

STATUS_WRITTEN_KEY = "status_written"
"""The per-object memo's key for (monotonic time, the service as the API returned it) of the last status write."""


def _by_name(item: Manifest) -> str:
    return str(item["metadata"]["name"])


def _by_service(item: Manifest) -> str:
    return str(((item.get("metadata") or {}).get("labels") or {}).get(L_SERVICE, ""))


@dataclass
class TickReads:
    """The watched collections the timer ticks share (kept in the operator-wide memo as `tick_reads`)."""

    client: KubeClient
    watched: dict[str, Watched] = field(default_factory=dict)
    """By collection URL (path(kind, namespace))."""

    def __post_init__(self) -> None:
        self.client.observers.append(self._wrote)

    @property
    def requests(self) -> int:
        """Lists the collections asked the API for (tests/test_tick_reads.py counts them)."""
        return sum(w.lists for w in self.watched.values())

    def _collection(self, url: str, lister: Lister, watcher: Watcher, key: Key) -> Watched:
        w = self.watched.get(url)
        if w is None:
            w = self.watched[url] = Watched(lister, watcher, key)
            w.start()
        return w

    def services(self, namespace: str) -> Watched:
        """The namespace's EarlyExitServices, by name."""
        url = path("EarlyExitService", namespace)
        return self._collection(
            url, lambda: self.client.list_at(url), lambda rv, s: self.client.watch(url, rv, s), _by_name
        )

    def endpoints(self, namespace: str) -> Watched:
        """Every Endpoints of the namespace, by name (the routers' addresses: router_endpoints.py). Not by
        label: a cluster copies a Service's labels onto its Endpoints, one made by hand need not carry them,
        and a control Service's Endpoints missing from the copy must mean that there are none."""
        url = path("Endpoints", namespace)
        return self._collection(
            url, lambda: self.client.list_at(url), lambda rv, s: self.client.watch(url, rv, s), _by_name
        )

    def kube_services(self, namespace: str) -> Watched:
        """The namespace's (core/v1) Services of any exitplan service (router, control, split Services), by name."""
        url = path("Service", namespace)
        return self._collection(
            url,
            lambda: self.client.list_at(url, L_SERVICE),
            lambda rv, s: self.client.watch(url, rv, s, L_SERVICE),
            _by_name,
        )

    def router_pods(self, namespace: str) -> Watched:
        """The namespace's router Pods, by the service they belong to."""
        url = path("Pod", namespace)
        selector = f"{L_SERVICE},{L_COMPONENT}=router"
        return self._collection(
            url,
            lambda: self.client.list_at(url, selector),
            lambda rv, s: self.client.watch(url, rv, s, selector),
            _by_service,
        )

    def deployments(self, namespace: str) -> Watched:
        """The namespace's Deployments of any service, by the service they belong to."""
        url = path("Deployment", namespace)
        return self._collection(
            url,
            lambda: self.client.list_at(url, L_SERVICE),
            lambda rv, s: self.client.watch(url, rv, s, L_SERVICE),
            _by_service,
        )

    def _wrote(self, method: str, url: str, answer: Manifest) -> None:
        """The client wrote `url` (POST to a collection; PATCH or DELETE of an object or its status)."""
        parts = url.split("/")
        for cut in (len(parts), len(parts) - 1, len(parts) - 2):
            w = self.watched.get("/".join(parts[:cut]))
            if w is None:
                continue
            meta = answer.get("metadata") if answer.get("kind") != "Status" else None
            name = str(meta.get("name")) if isinstance(meta, dict) and meta.get("name") else None
            name = name or (parts[cut] if cut < len(parts) else None)
            if name:
                w.wrote(answer if meta else None, name, deleted=method == "DELETE")
            return

    async def forget(self) -> None:
        """Stop every watch and wait for it to end (the operator stops: no connection outlives its loop)."""
        watched, self.watched = list(self.watched.values()), {}
        await asyncio.gather(*(w.stopped() for w in watched), return_exceptions=True)
        if self._wrote in self.client.observers:
            self.client.observers.remove(self._wrote)


def shared_reads(memo: Any) -> TickReads | None:
    """The operator's TickReads (handlers.configure keeps one in the operator-wide memo), else None."""
    reads = getattr(memo, "tick_reads", None) if memo is not None else None
    return reads if isinstance(reads, TickReads) else None


def status_written(memo: Any, body: Manifest) -> None:
    """After a status write: the service as the API returned it, the newest copy this process has."""
    if memo is not None and isinstance(body, dict) and body.get("metadata"):
        memo[STATUS_WRITTEN_KEY] = (time.monotonic(), body)


def _uid(body: Mapping[str, Any]) -> str:
    return str((body.get("metadata") or {}).get("uid") or "")


def _generation(body: Mapping[str, Any]) -> int:
    return int((body.get("metadata") or {}).get("generation") or 0)


async def service_body(memo: Any, delivered: Mapping[str, Any]) -> tuple[bool, Manifest | None]:
    """(known, the service as new as this process knows it) from the watched copy; known=False: read it on
    its own (no shared reads, a failed list, a copy older than what kopf delivered, or not in the copy)."""
    reads = shared_reads(memo)
    meta = delivered["metadata"]
    if reads is None:
        return False, None
    watched = reads.services(str(meta.get("namespace")))
    name = str(meta["name"])
    try:
        listed = await watched.group(name)
    except Exception:  # noqa: BLE001 -- the service's own read reports what is wrong
        return False, None
    if not listed:
        return False, None  # created after the copy was last updated, or gone: its own read says which
    body = listed[0]
    if not watched.fresh(name):  # this process wrote it and the watch has not delivered that yet
        written = memo.get(STATUS_WRITTEN_KEY)
        if written is None or _uid(written[1]) != _uid(body) or not watched.expects(name, written[1]):
            return False, None
        body = written[1]
    if _generation(body) < _generation(delivered):
        return False, None
    return True, body


async def service_deployments(memo: Any, namespace: str, name: str) -> list[Manifest] | None:
    """The service's Deployments from the watched copy, or None: read them on their own (no shared reads,
    a failed list, or a write of this process to one of them that the watch has not delivered yet)."""
    reads = shared_reads(memo)
    if reads is None:
        return None
    watched = reads.deployments(namespace)
    try:
        deployments = await watched.group(name)
    except Exception:  # noqa: BLE001 -- the service's own read reports what is wrong
        return None
    return deployments if watched.fresh(name) else None
