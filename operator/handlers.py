"""kopf handlers: decorators only; the work lives in reconcile.py (a change) and driftloop.py (the timer tick).

Run with `exitplan operator` (or `kopf run -m exitplan.operator.handlers`). The operator adds no
finalizer of its own: every child carries an ownerReference, so the garbage collector removes it
with the service, and nothing outside Kubernetes needs cleaning (the delete handler is optional).
kopf itself keeps its marker finalizer on each service while the drift loop's daemon (`ticks`) runs, so that
it can stop the daemon before the object goes; a service deleted while no operator runs waits for one.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

import aiohttp
import kopf

from exitplan.api.resources import GROUP, VERSION
from exitplan.operator import driftloop, essence, guards, heap, http_ports, reconcile, router_resolver, tick_reads
from exitplan.operator.kube import KubeClient, bearer, load_config, path
from exitplan.operator.metrics import METRICS
from exitplan.operator.service_state import SERVICE_MEMOS, Service, forget_service_memo, pools_changed, service_memo

EES, PROFILES, POOLS = "earlyexitservices", "modelprofiles", "gpupools"
"""The plurals of the kinds the handlers watch (group GROUP, version VERSION)."""
TICK = float(os.environ.get(guards.ENV_TICK, "5"))
"""Timer tick: readiness every tick; the routers are read the settings' drift_reads times per
spec.planner.periodSeconds (at most once a tick; driftloop.py)."""

# Per operator (kopf's operator-wide memo, shared by reference into every object's memo):
# memo.client, the API client; memo.locks, one asyncio.Lock per (namespace, name); memo.settings,
# the operator's guards.Settings; memo.capacity_lock, held while a service plans on shared pools;
# memo.ignored_plans, the unowned plan ConfigMaps already reported (one Warning each). Several
# operators in one process (tests, peering) each keep their own. Per object, the drift loop keeps
# its drift_policy.DriftState in the object's memo (driftloop.drift_state creates it at the first tick).


async def _service(memo: Any, body: Mapping[str, Any]) -> Service | None:
    """The service as the API has it now (None when gone). Handlers run under the per-object lock
    and re-read the object, so a status written from an older snapshot never overwrites a newer one."""
    client: KubeClient = memo.client
    meta = body["metadata"]
    items = await client.list(path("EarlyExitService", meta.get("namespace")), fields=f"metadata.name={meta['name']}")
    if not items:
        return None
    return Service(body=items[0], client=client, memo=service_memo(memo, items[0]))  # a pool event's ref has no uid


def _lock(memo: Any, body: Mapping[str, Any]) -> asyncio.Lock:
    """The per-object lock (kopf's operator-wide memo holds one per namespace and name)."""
    lock: asyncio.Lock = memo.locks[(body["metadata"].get("namespace"), body["metadata"]["name"])]
    return lock


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    """kopf's credentials from the same config the operator's client uses ($KUBECONFIG at run time)."""
    cfg = load_config(os.environ.get("KUBECONFIG") or None)
    token = bearer(cfg)
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        scheme="Bearer" if token else None,
        token=token.split(" ", 1)[1] if token else None,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
    )


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="exitplan.io")
    settings.persistence.diffbase_storage = essence.LeanDiffBaseStorage(prefix="exitplan.io")
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    settings.networking.error_backoffs = [1, 2, 5, 10]
    settings.background.instant_exit_timeout = 5.0  # graceful shutdown: let a running tick finish
    memo.client = KubeClient.from_config(os.environ.get("KUBECONFIG") or None)
    memo.locks = collections.defaultdict(asyncio.Lock)
    memo.settings = guards.Settings.from_env()  # allowed bundle host paths, served namespaces, profiling retries
    memo.capacity_lock = asyncio.Lock()  # one service at a time plans into the pools' free capacity (capacity.py)
    # the drift loop's router reads keep their connections (a new session per read connected anew each time);
    # their name lookups are bounded, so they cannot hold up the API server's connections (router_resolver.py)
    resolver = router_resolver.BoundedResolver()
    memo.router_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, resolver=resolver))
    memo.ignored_plans = set()  # plan-like ConfigMaps no service owns, already reported (capacity.py)
    memo.tick_reads = tick_reads.TickReads(memo.client)  # one list and watch per kind and namespace, for every tick
    memo[SERVICE_MEMOS] = {}  # each service's own memo, whichever handler asks (service_state.service_memo)
    env = os.environ.get
    if heap.wanted():  # the operator's own process (exitplan operator): long-lived objects out of the collector's scans
        memo.heap = heap.FrozenHeap()
        memo.heap.start()
    memo.http_ports = await http_ports.start(  # /metrics and /healthz, guarded (exitplan operator sets the env)
        env(http_ports.ENV_LISTEN) or "127.0.0.1",
        int(env(http_ports.ENV_METRICS_PORT) or 0),
        int(env(http_ports.ENV_HEALTH_PORT) or 0),
    )


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    if (reads := tick_reads.shared_reads(memo)) is not None:
        await reads.forget()
    if getattr(memo, "client", None) is not None:
        await memo.client.close()
    if getattr(memo, "router_session", None) is not None:
        await memo.router_session.close()
    if getattr(memo, "http_ports", None) is not None:
        await memo.http_ports.cleanup()
    if getattr(memo, "heap", None) is not None:
        await memo.heap.stop()


@kopf.on.create(group=GROUP, version=VERSION, plural=EES)
async def created(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    async with _lock(memo, body):
        if (svc := await _service(memo, body)) is not None:
            await reconcile.reconcile(svc, reason="initial")


@kopf.on.update(group=GROUP, version=VERSION, plural=EES, field="spec")
async def spec_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    async with _lock(memo, body):
        if (svc := await _service(memo, body)) is not None:
            await reconcile.reconcile(svc, reason="spec-change")


@kopf.on.resume(group=GROUP, version=VERSION, plural=EES)
async def resumed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    async with _lock(memo, body):
        if (svc := await _service(memo, body)) is not None:
            await reconcile.reconcile(svc, reason="resume")


@kopf.on.delete(group=GROUP, version=VERSION, plural=EES, optional=True)
async def deleted(body: kopf.Body, name: str, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
    METRICS.forget(namespace or "", name)  # the per-cell and per-service gauges; counters keep their history
    forget_service_memo(memo, body)


async def tick(body: Mapping[str, Any], memo: Any) -> None:
    """One tick of one service (readiness, the drift read: driftloop.on_tick), under its lock; skipped while a
    reconcile holds the lock (the next tick looks again)."""
    lock = _lock(memo, body)
    if lock.locked():
        return
    async with lock:
        own = service_memo(memo, body)
        known, fresh = await tick_reads.service_body(own, body)  # the namespace's list, shared by every tick
        svc = Service(body=dict(fresh), client=memo.client, memo=own) if known and fresh else await _service(memo, body)
        if svc is None:
            return
        await driftloop.on_tick(svc, own)


RETRY_SECONDS = 60.0
"""A tick that failed unexpectedly is followed by the next one after this long (kopf's own retry delay for a
handler; a kopf.TemporaryError names its own delay)."""


@kopf.daemon(
    group=GROUP, version=VERSION, plural=EES, initial_delay=TICK, cancellation_backoff=TICK, cancellation_timeout=TICK
)
async def ticks(body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped, logger: Any, **_: Any) -> None:
    """The service's timer: a tick every TICK seconds on a grid of the event loop's clock (the multiples of TICK,
    shifted by the service's point within a tick on a large fleet: driftloop.tick_phase; at least a tenth of a tick
    after the previous tick ends) until kopf stops it -- the service deleted, the operator pausing for a peer (peering.py) or
    exiting; a tick under way is given the instant-exit timeout (configure) and then TICK to end before kopf
    cancels it. One kopf daemon per service rather than a kopf timer: a timer runs kopf's handler machinery
    around every tick (its invocation, an empty patch checked, a new Patch left in a reference cycle for the
    collector), ~0.5 ms and ~26 garbage objects a tick, 800 ticks a period at 200 services
    (bench/operator_scale.py); the daemon runs it once. `body` is kopf's live view of the service (each event
    updates it).

    Between ticks it waits on one task that waits for kopf's stop flag for the daemon's life (`asyncio.wait` with a
    timeout: nothing raised when the time is up). `await stopped.wait(TICK)` returned just as soon, but its time
    limit ends in a TimeoutError (asyncio.wait_for, a task per wait): ~50 objects in reference cycles a tick -- at
    200 services nearly all the garbage the operator made, and the collector's passes that it set off
    (bench/operator_scale.py --cpu-profile garbage:PREFIX; BENCHMARKS.md, issue 31).

    The services that share a point of the grid tick back to back, in one burst of the event loop, rather than
    each on its own at whatever moment it was created (800 wake-ups a period at 200 services, each running the
    tick's code on its own): a period cost the operator a half to two thirds of the CPU (bench/operator_scale.py;
    BENCHMARKS.md, issue 31). The drift reads follow the ticks (driftloop.check_drift: a read is taken up to half
    a tick early, so a service's place within its burst does not push a read to the next tick)."""
    stop = asyncio.ensure_future(_stop_flag(stopped))
    loop = asyncio.get_running_loop()
    uid, services = str((body.get("metadata") or {}).get("uid") or ""), memo.get(SERVICE_MEMOS)  # filled as they come
    try:
        while not stopped:
            wait: float | None = None
            try:
                await tick(body, memo)
            except kopf.TemporaryError as err:  # a reconcile the tick started could not apply: retry after its delay
                logger.warning("tick failed: %s; the next one in %s s", err, err.delay or TICK)
                wait = float(err.delay or TICK)
            except Exception:  # noqa: BLE001 -- logged whole; the service's next tick tries again
                logger.exception("tick failed; the next one in %s s", RETRY_SECONDS)
                wait = RETRY_SECONDS
            if wait is None:  # the grid's next point (a failure's delay counts from now)
                phase = driftloop.tick_phase(uid, TICK, driftloop.tick_points(len(services or ())))
                wait = driftloop.next_tick(loop.time(), TICK, phase)
            await asyncio.wait([stop], timeout=wait)  # the next tick, or at once when kopf stops the daemon
    finally:
        stop.cancel()


async def _stop_flag(stopped: kopf.DaemonStopped) -> None:
    """Until kopf stops the daemon (no time limit: no timeout raised)."""
    await stopped.wait()


@kopf.on.event(group=GROUP, version=VERSION, plural=PROFILES)
async def profile_event(body: kopf.Body, type: str | None, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
    """A ModelProfile appeared, changed or went: the services of its model and pool plan again
    (a service waiting for it plans now; one whose profile was rejected or deleted re-profiles)."""
    if type not in ("ADDED", "MODIFIED", "DELETED"):
        return
    client: KubeClient = memo.client
    spec = body.get("spec") or {}
    for raw in await client.list(path("EarlyExitService", namespace)):
        svc_spec = raw.get("spec") or {}
        uses = spec.get("pool") in {p.get("name") for p in svc_spec.get("pools", [])}
        if uses and (svc_spec.get("model") or {}).get("name") == spec.get("model"):
            async with _lock(memo, raw):
                if (svc := await _service(memo, raw)) is not None:
                    await reconcile.reconcile(svc, reason="profile-change")


@kopf.index(group=GROUP, version=VERSION, plural=EES)
async def services_by_pool(
    namespace: str | None, name: str, spec: kopf.Spec, **_: Any
) -> dict[str, tuple[str | None, str]]:
    """kopf's in-memory index of the services that name each GPUPool (no API call to find them). Async, so that
    kopf runs it on the event loop: a sync one goes to a thread on every event of every service (each status
    write), a thread hand-off that cost more than the index itself."""
    return {
        ref["name"]: (namespace, name) for ref in spec.get("pools", []) if isinstance(ref, dict) and ref.get("name")
    }


ServicesByPool = kopf.Index[str, tuple[str | None, str]]
"""kopf's index `services_by_pool`: pool name -> the (namespace, name) of each service naming it."""


@kopf.on.event(group=GROUP, version=VERSION, plural=POOLS)
async def pool_event(
    name: str, type: str | None, memo: kopf.Memo, services_by_pool: ServicesByPool | None = None, **_: Any
) -> None:
    """A GPUPool was created, changed or deleted: every service that names it plans again (reason
    `pool-changed`) when what its plan depends on in its pools (capacity, cost, ...; status.poolsDigest)
    differs from what it was planned with. A created pool a service named unknown plans it; a deleted
    one makes it PlanInfeasible while its children keep serving."""
    if type not in ("ADDED", "MODIFIED", "DELETED"):
        return  # the initial listing: the resume handlers plan every service anyway
    named: Iterable[tuple[str | None, str]] = services_by_pool.get(name, []) if services_by_pool is not None else []
    for namespace, service in sorted(set(named), key=lambda ref: (ref[0] or "", ref[1])):
        ref = {"metadata": {"namespace": namespace, "name": service}}
        async with _lock(memo, ref):
            svc = await _service(memo, ref)
            if svc is None:
                continue
            if await pools_changed(svc):
                await reconcile.reconcile(svc, reason="pool-changed")
