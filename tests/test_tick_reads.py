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

from exitplan.operator import plan_memory, tick_reads
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
        self.seen: dict[int, tuple[kmock.Request, str, bool]] = {}  # each request once (kmock may show one twice)
        self.named: dict[int, tuple[kmock.Request, str]] = {}
        cluster.api[lambda req: self._count(req)] << 500  # the filter never matches: it only counts

    def _count(self, req: kmock.Request) -> bool:
        if req.method == "GET" and req.resource is not None and req.name is None:
            self.seen[id(req)] = (
                req,
                req.resource.plural,
                "fieldSelector" in (req.params or {}),
            )  # kept: ids stay unique
        elif req.method == "GET" and req.resource is not None and not req.subresource:
            self.named[id(req)] = (req, req.resource.plural)
        return False

    def gets(self, plural: str) -> int:
        return sum(1 for _, p in self.named.values() if p == plural)

    def count(self, plural: str, *, by_name: bool | None = None) -> int:
        return sum(1 for _, p, named in self.seen.values() if p == plural and (by_name is None or named == by_name))


def memo_for(reads: tick_reads.TickReads) -> kopf.Memo:
    memo = kopf.Memo()
    memo.tick_reads = reads
    return memo


def test_one_list_per_namespace_serves_every_tick_and_is_never_older_than_a_write(cluster):
    for ns, names in (("team-a", ["s1", "s2", "s3"]), ("team-b", ["s4", "s5"])):
        for name in names:
            cluster.create(service(name, ns))
    lists = Lists(cluster)

    async def scenario() -> None:
        client = KubeClient(cluster.server.url)
        try:
            reads = tick_reads.TickReads(client, max_age=60.0)
            memos = {name: memo_for(reads) for name in ("s1", "s2", "s3", "s4", "s5")}
            delivered = {
                name: await client.get(path("EarlyExitService", ns, name))
                for ns, names in (("team-a", ["s1", "s2", "s3"]), ("team-b", ["s4", "s5"]))
                for name in names
            }
            got = await asyncio.gather(*(tick_reads.service_body(memos[n], delivered[n]) for n in delivered))
            assert [(known, body["metadata"]["name"]) for known, body in got] == [(True, n) for n in delivered]
            assert reads.requests == 2 and lists.count("earlyexitservices") == 2  # one per namespace, for five

            # the operator writes s1's status: its tick sees that, not the older list's copy
            svc = Service(body=dict(delivered["s1"]), client=client, memo=memos["s1"])
            st = parse_status(svc.body.get("status"))
            st.message = "written after the list"
            await svc.write_status(st)
            known, body = await tick_reads.service_body(memos["s1"], delivered["s1"])
            assert known and body["status"]["message"] == "written after the list"
            assert lists.count("earlyexitservices") == 2  # still the shared list (and the write's answer)

            # someone changed s2's spec after the list: kopf delivers the new generation, the list is too old
            changed = await client.merge_patch(
                path("EarlyExitService", "team-a", "s2"), {"spec": {"slo": {"latencyMs": 80}}}
            )
            assert (await tick_reads.service_body(memos["s2"], changed))[0] is False

            # a service created after the list is not in it: its own read
            fresh = await client.create(service("s6", "team-a"))
            assert (await tick_reads.service_body(memo_for(reads), fresh))[0] is False

            # Deployments: the shared list, until the operator writes the service's children after it was asked
            await client.create(_deployment("team-a", "s1-router", "s1"))
            reads.lists.clear()
            deps = await tick_reads.service_deployments(memos["s1"], "team-a", "s1")
            assert [d["metadata"]["name"] for d in deps or []] == ["s1-router"]
            assert await tick_reads.service_deployments(memos["s3"], "team-a", "s3") == []
            plan_memory.children_written(memos["s1"])
            assert await tick_reads.service_deployments(memos["s1"], "team-a", "s1") is None
            assert await tick_reads.service_deployments(memos["s3"], "team-a", "s3") == []  # s3 wrote nothing

            # a list that fails is not kept: each tick reads on its own, and the next asks for the list again
            reads.lists.clear()
            failing["on"] = True
            assert (await tick_reads.service_body(memos["s3"], delivered["s3"]))[0] is False
            assert await tick_reads.service_deployments(memos["s3"], "team-a", "s3") is None
            assert reads.lists == {}
            failing["on"] = False
            assert (await tick_reads.service_body(memos["s3"], delivered["s3"]))[0] is True
        finally:
            await client.close()

    failing = {"on": False}
    (
        cluster.api[
            lambda req: failing["on"] and req.method == "GET" and req.namespace == "team-a" and req.name is None
        ]
        << 500
    )
    asyncio.run(scenario())


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
            root = memo_for(tick_reads.TickReads(client, max_age=60.0))
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


def test_the_operator_ticks_ask_for_lists_that_do_not_grow_with_the_services(cluster):
    """Eight services in one namespace, Ready, ticking every 0.5 s: over the window the ticks list the
    namespace's services and Deployments about once a tick each (a bound independent of the services),
    where one read per service and tick would be eight times that."""
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
        before = (lists.count("earlyexitservices"), lists.count("deployments"), time.monotonic())
        time.sleep(4.0)
        services = lists.count("earlyexitservices") - before[0]
        deployments = lists.count("deployments") - before[1]
        elapsed = time.monotonic() - before[2]
    from exitplan.operator.handlers import TICK

    bound = elapsed / (0.8 * TICK) + 2  # the lists one namespace's ticks may ask for in `elapsed`
    per_service = len(names) * elapsed / TICK  # what one read per service and tick would have asked for
    assert services <= bound < per_service / 2, (services, bound, per_service)
    assert deployments <= bound, (deployments, bound, per_service)
    assert services > 0 and deployments > 0  # the ticks ran (and read)


@pytest.mark.parametrize("answer", [503, 401])
def test_the_drift_loop_looks_the_routers_up_from_the_namespaces_lists(cluster, answer):
    """Six services whose routers answer 503 (their control Service published at one stand-in), so every drift
    read misses and looks the routers up again: the Endpoints, router Pods, router Deployment and control
    Service come from one list of each per namespace and tick, not from reads of each service's own (four
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
            before = {k: lists.count(k) for k in ("endpoints", "pods")} | {f"get {k}": lists.gets(k) for k in kinds}
            read_before, start = len(reads), time.monotonic()
            wait_for(  # every service has read (and missed) its routers at least twice since
                "two drift reads of every service",
                lambda: len(reads) - read_before >= 2 * len(names) and time.monotonic() - start > 11,
                guard=120,
            )
            elapsed = time.monotonic() - start
            gets = {k: lists.gets(k) - before[f"get {k}"] for k in kinds}
            endpoint_lists = lists.count("endpoints") - before["endpoints"]
    finally:
        stand_in.shutdown()
    from exitplan.operator.handlers import TICK

    bound = elapsed / (0.8 * TICK) + 2  # the lists one namespace's ticks may ask for in `elapsed`
    tokens = gets.pop("secrets")
    assert gets == {k: 0 for k in kinds if k != "secrets"}, gets
    assert tokens == 0 if answer == 503 else tokens >= len(names), tokens
    assert 1 <= endpoint_lists <= bound, (endpoint_lists, bound)
