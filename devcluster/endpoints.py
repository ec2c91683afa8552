"""The dev-cluster's stand-in for the endpoints controller: a v1 Endpoints object per Service with a
selector, named like the Service, listing every pod it selects, as a cluster does, so that a client
that must reach each replica (the operator reading every router's observations: operator/router_endpoints.py)
finds them without going through the Service's proxy.

Pods of the dev cluster all listen on the same host at ports of their own, so each pod is a subset of
its own (its address and its port), which the Endpoints API allows; in a cluster the pods of a
Service share one subset (their IPs, the one target port). Ready pods are `addresses`, the others that
run are `notReadyAddresses` (`addresses` too where the Service publishes not-ready addresses).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from exitplan.api.manifest import Manifest
from exitplan.operator.kube import ApiError, KubeClient, path


@dataclass(frozen=True)
class Member:
    """One pod a Service selects: its name, the local port its target port maps to, ready or not."""

    pod: str
    port: int
    ready: bool


def endpoints_object(svc: Manifest, host: str, members: list[Member]) -> Manifest:
    """The Endpoints of Service `svc` whose selected pods are `members`, all reached at `host`."""
    meta = svc["metadata"]
    spec = svc.get("spec") or {}
    port_name = ((spec.get("ports") or [{}])[0]).get("name")
    publish = bool(spec.get("publishNotReadyAddresses"))
    subsets = []
    for m in sorted(members, key=lambda m: m.pod):
        address = {"ip": host, "targetRef": {"kind": "Pod", "name": m.pod, "namespace": meta["namespace"]}}
        port = {"port": m.port, "protocol": "TCP", **({"name": port_name} if port_name else {})}
        key = "addresses" if m.ready or publish else "notReadyAddresses"
        subsets.append({key: [address], "ports": [port]})
    return {
        "apiVersion": "v1",
        "kind": "Endpoints",
        "metadata": {"name": meta["name"], "namespace": meta["namespace"], "labels": dict(meta.get("labels") or {})},
        "subsets": subsets,
    }


class EndpointsWriter:
    """Writes the Endpoints objects when they change; deletes those of Services that went."""

    def __init__(self, client: KubeClient) -> None:
        self.client = client
        self.written: dict[tuple[str, str], Manifest] = {}

    async def write(self, obj: Manifest) -> None:
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        if self.written.get(key) == obj:
            return
        with contextlib.suppress(ApiError):
            try:
                await self.client.create(obj)
            except ApiError as err:
                if err.status != 409:
                    raise
                await self.client.merge_patch(path("Endpoints", *key), {"subsets": obj["subsets"]})
            self.written[key] = obj

    async def prune(self, live: set[tuple[str, str]]) -> None:
        for key in [k for k in self.written if k not in live]:
            del self.written[key]
            with contextlib.suppress(ApiError):
                await self.client.delete(path("Endpoints", *key))
