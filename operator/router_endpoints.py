"""Where the operator reaches each router replica's control endpoints (`/v1/observations`,
`/v1/window.npz`, `/v1/thresholds`), so that every router's observations are read and summed: a read
through one Service address reaches one router per connection, and the windows of the others are
never seen (MEASURED under-reads by the number of routers).

First that gives addresses:
1. the Endpoints of the routers' control Service (`<svc>-control`, headless, publishing not-ready
   addresses): one address per router pod, at the control port (in a cluster the pods' IPs; the dev
   cluster publishes each pod's local port: devcluster/endpoints.py);
2. router Pods with a podIP, at the control port;
3. one address for all of them: the control Service's `status.loadBalancer.ingress` ip:port, else its
   cluster DNS name. Such a read is not per replica: with more than one router it is reported as
   partial (`Routers.shortfall`) and not used to judge the plan (condition PlanAccurate).

Under the operator (kopf), these come from the watched copies the timer ticks share (tick_reads.py): the
namespace's Endpoints and its exitplan router Pods, Deployments and Services, each listed once and then
followed by a watch, instead of up to four requests per service and read (at 200 services, 800 of the
drift period's 1,131 API requests). A collection whose list fails falls back to the service's own reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from exitplan.api.manifest import Manifest
from exitplan.operator import names, tick_reads
from exitplan.operator.kube import ApiError, path
from exitplan.operator.service_state import Service


@dataclass(frozen=True)
class Routers:
    urls: list[str]
    """The control endpoints to read (one per router replica when `per_replica`)."""
    per_replica: bool
    """Each URL is one router pod (Endpoints or pod IPs), not a Service address that reaches any."""
    replicas: int
    """Router pods whose observations a whole read holds: the URLs' count when `per_replica`, else the
    router Deployment's replicas."""

    def shortfall(self, answered: int) -> str:
        """Why a read of `answered` routers does not hold every router's observations ('' when it does)."""
        if not self.per_replica and self.replicas > 1:
            return f"routers read through one Service address (one of {self.replicas} routers per read)"
        if answered < self.replicas:
            return f"{answered} of {self.replicas} routers read"
        return ""


def endpoint_urls(endpoints: Manifest) -> list[str]:
    """Every address of an Endpoints object, ready or not, at its subset's control port."""
    urls = []
    for subset in endpoints.get("subsets") or []:
        ports = subset.get("ports") or []
        port = next((p["port"] for p in ports if p.get("name") == "control"), ports[0]["port"] if ports else None)
        if port is None:
            continue
        for address in (subset.get("addresses") or []) + (subset.get("notReadyAddresses") or []):
            urls.append(f"http://{address['ip']}:{port}")
    return sorted(set(urls))


async def _get(svc: Service, kind: str, name: str) -> Manifest | None:
    try:
        return await svc.client.get(path(kind, svc.namespace, name))
    except ApiError as err:
        if err.status == 404:
            return None
        raise


def _first(items: list[Manifest]) -> Manifest | None:
    return next(iter(items), None)


class OwnReads:
    """The lookups as the service's own requests (no operator memo, or a shared list that failed)."""

    def __init__(self, svc: Service) -> None:
        self.svc = svc

    async def endpoints(self) -> Manifest | None:
        return await _get(self.svc, "Endpoints", names.control_service_name(self.svc.name))

    async def router_pods(self) -> list[Manifest]:
        selector = f"{names.L_SERVICE}={self.svc.name},{names.L_COMPONENT}=router"
        return await self.svc.client.list(path("Pod", self.svc.namespace), selector)

    async def router_deployment(self) -> Manifest | None:
        return await _get(self.svc, "Deployment", names.router_name(self.svc.name))

    async def control_service(self) -> Manifest | None:
        return await _get(self.svc, "Service", names.control_service_name(self.svc.name))


class SharedReads(OwnReads):
    """The lookups from the namespace's lists the ticks share (tick_reads.TickReads)."""

    def __init__(self, svc: Service, reads: tick_reads.TickReads) -> None:
        super().__init__(svc)
        self.reads = reads

    async def endpoints(self) -> Manifest | None:
        return _first(await self.reads.endpoints(self.svc.namespace).group(names.control_service_name(self.svc.name)))

    async def router_pods(self) -> list[Manifest]:
        return await self.reads.router_pods(self.svc.namespace).group(self.svc.name)

    async def router_deployment(self) -> Manifest | None:
        name = names.router_name(self.svc.name)
        deployments = await self.reads.deployments(self.svc.namespace).group(self.svc.name)
        return next((d for d in deployments if d["metadata"]["name"] == name), None)

    async def control_service(self) -> Manifest | None:
        return _first(
            await self.reads.kube_services(self.svc.namespace).group(names.control_service_name(self.svc.name))
        )


def _service_address(svc: Service, service: Manifest | None) -> list[str]:
    """The control Service's load-balancer ingress, else its DNS name ([] when there is no Service)."""
    if service is None:
        return []
    for ingress in ((service.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []:
        host = ingress.get("ip") or ingress.get("hostname")
        ports = ingress.get("ports") or [{"port": names.CONTROL_PORT}]
        if host:
            return [f"http://{host}:{ports[0]['port']}"]
    return [f"http://{names.control_host(svc.name, svc.namespace)}"]


async def _find(svc: Service, reads: OwnReads) -> Routers:
    endpoints = await reads.endpoints()
    urls = endpoint_urls(endpoints) if endpoints is not None else []
    if not urls:
        ips = [(p.get("status") or {}).get("podIP") for p in await reads.router_pods()]
        urls = [f"http://{ip}:{names.CONTROL_PORT}" for ip in ips if ip]
    if urls:  # every router pod that runs (the Service publishes not-ready ones): one that does not, answers nothing
        return Routers(urls, True, len(urls))
    deployment = await reads.router_deployment()
    urls = _service_address(svc, await reads.control_service())
    return Routers(urls, False, int(((deployment or {}).get("spec") or {}).get("replicas") or len(urls)))


async def find_routers(svc: Service) -> Routers:
    """The routers' control endpoints (see the module docstring for the order)."""
    shared = tick_reads.shared_reads(svc.memo)
    if shared is not None:
        try:
            return await _find(svc, SharedReads(svc, shared))
        except Exception:  # noqa: BLE001 -- a list failed (tick_reads drops it): the own reads say what is wrong
            pass
    return await _find(svc, OwnReads(svc))


async def router_urls(svc: Service) -> list[str]:
    """The routers' control endpoints (find_routers' URLs)."""
    return (await find_routers(svc)).urls
