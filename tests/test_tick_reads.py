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


def test_the_drift_loop_looks_the_routers_up_from_the_namespaces_lists(cluster):
    """Six services whose routers never answer (their control Service published at a closed port), so every
    drift read looks the routers up again: the Endpoints, router Pods, router Deployment and control Service
    come from one list of each per namespace and tick, not from a read of each service's own (four requests
    per service and read before)."""
    import socket

    from exitplan.operator import names as op_names

    ns, names = "routers", [f"svc-{i}" for i in range(6)]
    install_profiles(cluster, ns)
    with socket.socket() as s:  # a port nothing listens on: connection refused at once
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    lists = Lists(cluster)
    drift = {"periodSeconds": 5}
    with operator(cluster):
        for name in names:
            cluster.create(
                service(
                    name,
                    ns,
                    planner=drift,
                    pools=[{"name": "gpu-a", "maxGpus": 4}, {"name": "gpu-b", "maxGpus": 6}],
                )
            )
        for name in names:
            wait_for(f"{name} planned", lambda n=name: status(cluster, ns, n).get("plan"))
            mark_ready(cluster, ns, name)
            control = op_names.control_service_name(name)
            wait_for(f"{name}'s control Service", lambda c=control: cluster.get("Service", ns, c))
            ingress = {"loadBalancer": {"ingress": [{"ip": "127.0.0.1", "ports": [{"port": closed}]}]}}
            cluster.patch("Service", ns, control, {"status": ingress}, "status")
        wait_for("every service Ready", lambda: all(status(cluster, ns, n).get("phase") == "Ready" for n in names))
        before = {k: lists.count(k) for k in ("endpoints", "pods")} | {
            f"get {k}": lists.gets(k) for k in ("endpoints", "services", "deployments", "secrets")
        }
        start = time.monotonic()
        wait_for(  # every service has read (and missed) its routers, each read reading its token again
            "two drift reads of every service",
            lambda: lists.gets("secrets") - before["get secrets"] >= 2 * len(names) and time.monotonic() - start > 11,
            guard=120,
        )
        elapsed = time.monotonic() - start
        endpoint_lists = lists.count("endpoints") - before["endpoints"]
        endpoint_gets = lists.gets("endpoints") - before["get endpoints"]
        service_gets = lists.gets("services") - before["get services"]
        deployment_gets = lists.gets("deployments") - before["get deployments"]
        token_reads = lists.gets("secrets") - before["get secrets"]
    from exitplan.operator.handlers import TICK

    bound = elapsed / (0.8 * TICK) + 2  # the lists one namespace's ticks may ask for in `elapsed`
    reads = len(names) * 2  # at least two reads of each service in the window, each looking the routers up
    assert endpoint_gets == 0 and service_gets == 0 and deployment_gets == 0, (
        endpoint_gets,
        service_gets,
        deployment_gets,
    )
    assert 2 <= endpoint_lists <= bound, (endpoint_lists, bound, reads)
    assert token_reads >= len(names), token_reads  # every service read (a missed read reads its token again)
