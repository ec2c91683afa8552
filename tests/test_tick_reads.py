"""The timer ticks' shared reads (operator/tick_reads.py) on the emulated API: one list per kind and
namespace serves every service's tick, never older than what the operator itself wrote, and a list that
fails leaves each service to read on its own. Then the operator itself: with many services in a namespace,
its ticks ask for a number of lists that does not grow with the services, and the drift loop looks the
routers up (operator/router_endpoints.py) from the namespace's lists, not with requests of each service."""

from __future__ import annotations

import asyncio
import time

import kmock
import kopf
import pytest
from test_operator_support import (
    ClusterThread,
    install_profiles,
    mark_ready,
    operator,
    pool,
    service,
    status,
    wait_for,
)

from exitplan.operator import tick_reads
from exitplan.operator.kube import KubeClient, path
from exitplan.operator.names import L_SERVICE
from exitplan.operator.service_state import Service
from exitplan.operator.status import parse_status


@pytest.fixture
def cluster(tmp_path):
    with ClusterThread(tmp_path) as c:
        c.create(pool("gpu-a", 40, 3.0))
        c.create(pool("gpu-b", 60, 1.0))
        yield c


class Lists:
    """Counts the list requests the API server gets, per resource plural and with or without a field selector,
    and the reads of one object by name (`gets`)."""

    def __init__(self, cluster: ClusterThread) -> None:
        self.seen: dict[int, tuple[kmock.Request, str, bool, bool]] = {}  # each once (kmock may show one twice)
        self.named: dict[int, tuple[kmock.Request, str]] = {}
        cluster.api[lambda req: self._count(req)] << 500  # the filter never matches: it only counts

    def _count(self, req: kmock.Request) -> bool:
        if req.method == "GET" and req.resource is not None and req.name is None:
            params = req.params or {}
            self.seen[id(req)] = (
                req,
                req.resource.plural,
                "fieldSelector" in params,
                "watch" in params,
            )  # ids stay unique
        elif req.method == "GET" and req.resource is not None and not req.subresource:
            self.named[id(req)] = (req, req.resource.plural)
        return False

    def gets(self, plural: str) -> int:
        return sum(1 for _, p in self.named.values() if p == plural)

    def count(self, plural: str, *, by_name: bool | None = None, watch: bool | None = None) -> int:
        """List (and, unless watch=False, watch) requests of `plural`."""
        return sum(
            1
            for _, p, named, watching in self.seen.values()
            if p == plural and (by_name is None or named == by_name) and (watch is None or watching == watch)
        )


def memo_for(reads: tick_reads.TickReads) -> kopf.Memo:
    memo = kopf.Memo()
    memo.tick_reads = reads
    return memo


async def until(what: str, probe, guard: float = 30.0):
    """Await `probe()` until it returns something truthy (the watch delivers in the background)."""
    deadline = time.monotonic() + guard
    while time.monotonic() < deadline:
        if got := await probe():
            return got
        await asyncio.sleep(0.02)
    raise AssertionError(f"never happened: {what}")


def test_one_list_and_watch_per_namespace_serve_every_tick_and_follow_changes(cluster):
    for ns, names in (("team-a", ["s1", "s2", "s3"]), ("team-b", ["s4", "s5"])):
        for name in names:
            cluster.create(service(name, ns))
    lists = Lists(cluster)

    async def scenario() -> None:
        client, other = KubeClient(cluster.server.url), KubeClient(cluster.server.url)  # other: not the operator
        try:
            reads = tick_reads.TickReads(client)
            memos = {name: memo_for(reads) for name in ("s1", "s2", "s3", "s4", "s5")}
            delivered = {
                name: await client.get(path("EarlyExitService", ns, name))
                for ns, names in (("team-a", ["s1", "s2", "s3"]), ("team-b", ["s4", "s5"]))
                for name in names
            }
            got = await asyncio.gather(*(tick_reads.service_body(memos[n], delivered[n]) for n in delivered))
            assert [(known, body["metadata"]["name"]) for known, body in got] == [(True, n) for n in delivered]
            assert reads.requests == 2 and lists.count("earlyexitservices", watch=False) == 2  # one per namespace

            # the operator writes s1's status: its tick never sees an older copy (the write's, then the watch's)
            svc = Service(body=dict(delivered["s1"]), client=client, memo=memos["s1"])
            st = parse_status(svc.body.get("status"))
            st.message = "written after the list"
            await svc.write_status(st)
            known, body = await tick_reads.service_body(memos["s1"], delivered["s1"])
            assert known and body["status"]["message"] == "written after the list"

            # someone changes s2's spec: never the older generation; the watch brings the new one
            changed = await other.merge_patch(
                path("EarlyExitService", "team-a", "s2"), {"spec": {"slo": {"latencyMs": 80}}}
            )
            known, body = await tick_reads.service_body(memos["s2"], changed)
            assert not known or body["metadata"]["generation"] == changed["metadata"]["generation"]
            await until("s2's new spec watched", lambda: _spec_latency(reads, memos["s2"], changed, 80))

            # a service created later: read on its own until the watch delivers it
            fresh = await other.create(service("s6", "team-a"))
            await until("s6 watched", lambda: _known(memo_for(reads), fresh))

            # Deployments: the watched copy, grouped by service (a Deployment someone else creates comes in)
            await other.create(_deployment("team-a", "s1-router", "s1"))
            deps = await until("s1's Deployment", lambda: tick_reads.service_deployments(memos["s1"], "team-a", "s1"))
            assert [d["metadata"]["name"] for d in deps] == ["s1-router"]
            assert await tick_reads.service_deployments(memos["s3"], "team-a", "s3") == []
            assert lists.count("earlyexitservices", watch=False) == 2  # still the first lists: the rest came by watch
            assert lists.count("deployments", watch=False) == 1

            # a list that fails serves nothing: each tick reads on its own, and the list is asked for again
            failing["on"] = True
            reads.services("team-a")._relist()
            reads.deployments("team-a")._relist()
            assert (await tick_reads.service_body(memos["s3"], delivered["s3"]))[0] is False
            assert await tick_reads.service_deployments(memos["s3"], "team-a", "s3") is None
            failing["on"] = False
            await until("the list again", lambda: _known(memos["s3"], delivered["s3"]))
            assert await until("the Deployments again", lambda: _listed(memos["s1"], "team-a", "s1"))
        finally:
            await reads.forget()
            await client.close()
            await other.close()

    failing = {"on": False}
    (
        cluster.api[
            lambda req: failing["on"] and req.method == "GET" and req.namespace == "team-a" and req.name is None
        ]
        << 500
    )
    asyncio.run(scenario())


async def _known(memo: kopf.Memo, delivered: dict) -> bool:
    return (await tick_reads.service_body(memo, delivered))[0]


async def _listed(memo: kopf.Memo, namespace: str, name: str) -> bool:
    return bool(await tick_reads.service_deployments(memo, namespace, name))


async def _spec_latency(reads: tick_reads.TickReads, memo: kopf.Memo, delivered: dict, latency: int) -> bool:
    known, body = await tick_reads.service_body(memo, delivered)
    return known and body["spec"]["slo"]["latencyMs"] == latency


class Gate:
    """Holds a real watch's events until opened: what a watch that lags behind a write looks like."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.open.set()

    def wrap(self, watcher):
        async def gated(rv, seconds):
            async for event in watcher(rv, seconds):
                await self.open.wait()
                yield event

        return gated


def test_a_write_the_watch_has_not_delivered_yet_is_never_read_older(cluster):
    """The operator writes a service's status and one of its Deployments while the watch lags: the tick
    reads the status write's own copy (never the watch's older one), the Deployments on their own; once the
    watch delivers both writes, the copies serve again. A write of someone else's changes nothing."""
    cluster.create(service("s1", "ns"))
    cluster.create(_deployment("ns", "s1-router", "s1"))

    async def scenario() -> None:
        client, other = KubeClient(cluster.server.url), KubeClient(cluster.server.url)  # other: not the operator
        try:
            reads, gate = tick_reads.TickReads(client), Gate()
            memo = memo_for(reads)
            for w in (reads.services("ns"), reads.deployments("ns")):
                w.watcher = gate.wrap(w.watcher)
            delivered = await client.get(path("EarlyExitService", "ns", "s1"))
            assert (await tick_reads.service_body(memo, delivered))[0]
            assert len(await tick_reads.service_deployments(memo, "ns", "s1") or []) == 1
            gate.open.clear()

            svc = Service(body=dict(delivered), client=client, memo=memo)
            st = parse_status(delivered.get("status"))
            st.message = "while the watch lags"
            await svc.write_status(st)
            await client.merge_patch(path("Deployment", "ns", "s1-router"), {"spec": {"replicas": 3}})
            await asyncio.sleep(0.3)  # the watch has the events, the gate holds them
            assert not reads.services("ns").fresh("s1") and not reads.deployments("ns").fresh("s1")
            known, body = await tick_reads.service_body(memo, delivered)
            assert known and body["status"]["message"] == "while the watch lags"  # the write's own copy
            assert await tick_reads.service_deployments(memo, "ns", "s1") is None  # read on its own

            # someone else writes the status after the operator: the operator's copy is no longer the newest
            await other.merge_patch(
                path("EarlyExitService", "ns", "s1", "status"), {"status": {"message": "someone else"}}
            )
            await client.merge_patch(path("EarlyExitService", "ns", "s1"), {"metadata": {"labels": {"x": "y"}}})
            assert (await tick_reads.service_body(memo, delivered))[0] is False  # the last write is not the status's

            gate.open.set()
            await until("the watch delivered the writes", lambda: _fresh(reads))
            known, body = await tick_reads.service_body(memo, delivered)
            assert known and body["status"]["message"] == "someone else"
            assert body["metadata"]["labels"] == {"x": "y"}
            (dep,) = await tick_reads.service_deployments(memo, "ns", "s1") or [None]
            assert dep["spec"]["replicas"] == 3
        finally:
            await reads.forget()
            await client.close()
            await other.close()

    asyncio.run(scenario())


async def _fresh(reads: tick_reads.TickReads) -> bool:
    return reads.services("ns").fresh("s1") and reads.deployments("ns").fresh("s1")


def _deployment(namespace: str, name: str, service_name: str) -> dict:
    labels = {L_SERVICE: service_name, "app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [{"name": "c", "image": "x"}]}},
        },
    }


def test_every_handler_of_a_service_keeps_what_it_learned_in_the_services_one_memo(cluster):
    """kopf gives each handler the memo of the object it watches: a GPUPool event that re-plans a service
    must leave what it wrote (the status, the children) where the service's timer looks, or the timer goes
    on from the shared list's older copy (and writes an older status back)."""
    import copy

    from exitplan.operator.service_state import SERVICE_MEMOS, forget_service_memo, service_memo

    cluster.create(service("s", "ns"))

    async def scenario() -> None:
        client = KubeClient(cluster.server.url)
        try:
            root = memo_for(tick_reads.TickReads(client))
            root[SERVICE_MEMOS] = {}
            pool_memo, service_handlers_memo = copy.copy(root), copy.copy(root)  # as kopf makes them
            delivered = await client.get(path("EarlyExitService", "ns", "s"))
            ours = service_memo(service_handlers_memo, delivered)
            assert service_memo(pool_memo, delivered) is ours and ours is not root
            assert ours.tick_reads is root.tick_reads  # the operator's objects are shared
            assert (await tick_reads.service_body(ours, delivered))[0]  # the list is asked for now
            # a pool event re-plans the service and writes its status: the timer sees that write
            svc = Service(body=dict(delivered), client=client, memo=service_memo(pool_memo, delivered))
            st = parse_status(delivered.get("status"))
            st.pools_digest = "after-the-pool-event"
            await svc.write_status(st)
            known, body = await tick_reads.service_body(service_memo(service_handlers_memo, delivered), delivered)
            assert known and body["status"]["poolsDigest"] == "after-the-pool-event"
            forget_service_memo(pool_memo, delivered)
            assert service_memo(service_handlers_memo, delivered) is not ours  # deleted: a new one
        finally:
            await client.close()

    cluster.run(scenario(), 60)


def test_the_operator_ticks_read_the_watched_copies_not_the_api(cluster):
    """Eight services in one namespace, Ready, ticking every 0.5 s. Then a Deployment of one of them loses its
    ready replicas: that service's tick reports it (Ready False) from the watched copy, and over the window
    the ticks asked the API for no list of the namespace's services or Deployments and read no service on
    its own, where one read per service and tick would have been 2 x 8 requests a tick."""
    ns, names = "fleet", [f"svc-{i}" for i in range(8)]
    install_profiles(cluster, ns)
    lists = Lists(cluster)
    with operator(cluster):
        for name in names:  # each within its share of the pools
            cluster.create(service(name, ns, pools=[{"name": "gpu-a", "maxGpus": 4}, {"name": "gpu-b", "maxGpus": 6}]))
        for name in names:
            wait_for(f"{name} planned", lambda n=name: status(cluster, ns, n).get("plan"))
            mark_ready(cluster, ns, name)
        wait_for("every service Ready", lambda: all(status(cluster, ns, n).get("phase") == "Ready" for n in names))
        (dep, *_) = cluster.list("Deployment", ns, f"exitplan.io/service={names[3]}")
        before = (lists.count("earlyexitservices", watch=False), lists.count("deployments", watch=False))
        cluster.patch("Deployment", ns, dep["metadata"]["name"], {"status": {"readyReplicas": 0}}, "status")
        wait_for("the tick saw the Deployment lose its replicas", lambda: _ready(cluster, ns, names[3]) == "False")
        time.sleep(2.0)  # four more ticks of every service
        services = lists.count("earlyexitservices", watch=False) - before[0]
        deployments = lists.count("deployments", watch=False) - before[1]
        assert all(_ready(cluster, ns, n) == "True" for n in names if n != names[3])
    assert (services, deployments) == (0, 0)  # (the test reads each status by name: not counted here)


def _ready(cluster: ClusterThread, ns: str, name: str) -> str | None:
    """The service's Ready condition's status."""
    return next((c["status"] for c in status(cluster, ns, name).get("conditions") or [] if c["type"] == "Ready"), None)


@pytest.mark.parametrize("answer", [503, 401])
def test_the_drift_loop_looks_the_routers_up_from_the_namespaces_watched_copies(cluster, answer):
    """Six services whose routers answer 503 (their control Service published at one stand-in), so every drift
    read misses and looks the routers up again: the Endpoints, router Pods, router Deployment and control
    Service come from the namespace's watched copies (no list in the window), not from reads of each service's own (four
    requests per service and read before), and the control token is read once, not again after each miss.
    Routers that answer 401 (a rotated token) have it read again before each next read."""
    import http.server
    import threading

    from exitplan.operator import names as op_names

    reads: list[str] = []

    class Unavailable(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 -- http.server's name
            reads.append(self.path)
            self.send_response(answer)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    stand_in = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Unavailable)
    threading.Thread(target=stand_in.serve_forever, daemon=True).start()
    ns, names = "routers", [f"svc-{i}" for i in range(6)]
    install_profiles(cluster, ns)
    lists = Lists(cluster)
    try:
        with operator(cluster):
            for name in names:
                pools = [{"name": "gpu-a", "maxGpus": 4}, {"name": "gpu-b", "maxGpus": 6}]
                cluster.create(service(name, ns, planner={"periodSeconds": 5}, pools=pools))
            for name in names:
                wait_for(f"{name} planned", lambda n=name: status(cluster, ns, n).get("plan"))
                mark_ready(cluster, ns, name)
                control = op_names.control_service_name(name)
                wait_for(f"{name}'s control Service", lambda c=control: cluster.get("Service", ns, c))
                ingress = [{"ip": "127.0.0.1", "ports": [{"port": stand_in.server_address[1]}]}]
                cluster.patch("Service", ns, control, {"status": {"loadBalancer": {"ingress": ingress}}}, "status")
            wait_for("every service Ready", lambda: all(status(cluster, ns, n).get("phase") == "Ready" for n in names))
            kinds = ("endpoints", "services", "deployments", "secrets")
            before = {"endpoints": lists.count("endpoints", watch=False)} | {f"get {k}": lists.gets(k) for k in kinds}
            read_before, start = len(reads), time.monotonic()
            wait_for(  # every service has read (and missed) its routers at least twice since
                "two drift reads of every service",
                lambda: len(reads) - read_before >= 2 * len(names) and time.monotonic() - start > 11,
                guard=120,
            )
            gets = {k: lists.gets(k) - before[f"get {k}"] for k in kinds}
            endpoint_lists = lists.count("endpoints", watch=False) - before["endpoints"]
    finally:
        stand_in.shutdown()
    tokens = gets.pop("secrets")
    assert gets == {k: 0 for k in kinds if k != "secrets"}, gets
    assert tokens == 0 if answer == 503 else tokens >= len(names), tokens
    assert endpoint_lists == 0, endpoint_lists  # listed once before the window, then followed by its watch


def test_a_watch_the_api_refuses_backs_off_and_the_ticks_read_on_their_own(cluster):
    """An operator whose role lacks `watch` (a chart older than the code): the list works, the watch answers
    403. The copy lists again with a growing backoff (not once per failed watch at once), and meanwhile
    serves nothing, so each tick reads on its own, as without the copies."""
    cluster.create(service("s1", "ns"))
    lists = Lists(cluster)
    cluster.api[lambda req: req.method == "GET" and "watch" in (req.params or {}) and req.namespace == "ns"] << 403

    async def scenario() -> int:
        client = KubeClient(cluster.server.url)
        reads = tick_reads.TickReads(client)
        try:
            delivered = await client.get(path("EarlyExitService", "ns", "s1"))
            memo = memo_for(reads)
            start = time.monotonic()
            answers = []
            while time.monotonic() - start < 4.0:
                answers.append((await tick_reads.service_body(memo, delivered))[0])
                await asyncio.sleep(0.05)
            assert answers.count(False) > answers.count(True), answers.count(True)  # mostly read on its own
            return reads.services("ns").lists
        finally:
            await reads.forget()
            await client.close()

    listed = asyncio.run(scenario())
    # backoff 0.5, 1, 2 s (then 5 s) after each refused watch: at most 4 lists in 4 s, where a relist at once
    # after every refusal would list tens of times
    assert 2 <= listed <= 4 and lists.count("earlyexitservices", watch=False) == listed, listed
