"""Pool capacity cannot be forged (issue 28, "a forged ConfigMap starves other tenants").

The attack, as tried against the first round: a tenant writes a ConfigMap with the managed labels named
`<x>-plan` holding a 100,000-replica plan on a shared pool. Pool accounting counted it as held, and a
victim service planned later got 0 of the pool's 8 replicas. Now only a plan owned (controlling
ownerReference, with the uid) by an EarlyExitService that exists counts; the forged ones are ignored and
reported with one Warning event each (reason IgnoredPlan). Figures: with a forged 100,000-replica plan and
a ghost-owned one on a pool of capacity 8, the victim gets 8 of 8 replicas; a newcomer that does not fit
is PlanInfeasible (PoolCapacity) and the victim keeps its plan and conditions.

Against the emulated API server with the real operator under kopf (test_operator_support).
"""

from __future__ import annotations

import pytest
from test_guard_rails import deployed, held_on, infeasible, publish_profile_as, warnings
from test_operator_support import ClusterThread, condition, operator, pool, service, status, wait_for

from exitplan.api.plan import Cell, Plan, SplitPlan
from exitplan.operator import capacity, names

POOL = "shared"
ONE_BUCKET = {"pools": [{"name": POOL}], "workload": {"rps": 200, "lengthBuckets": [128]}}


@pytest.fixture
def cluster(tmp_path):
    with ClusterThread(tmp_path) as c:
        c.create(pool(POOL, 8, 1.0))
        yield c


def forged_plan(name: str, namespace: str, owner_refs: list[dict]) -> dict:
    """A ConfigMap that looks like the operator's plan of service `name`: 100,000 replicas on the pool."""
    plan = Plan(
        service=name,
        model="minilm",
        splits=[SplitPlan(index=0, first_block=0, last_block=5)],
        buckets=[128],
        cells=[Cell(split=0, bucket=128, pool=POOL, replicas=100_000, batch_size=8)],
    )
    labels = {**names.MANAGED, "exitplan.io/service": name}
    meta = {"name": names.plan_configmap_name(name), "namespace": namespace, "labels": labels}
    if owner_refs:
        meta["ownerReferences"] = owner_refs
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"plan.json": plan.model_dump_json()}}


def test_a_forged_plan_configmap_holds_no_capacity_and_is_reported(cluster: ClusterThread):
    publish_profile_as(cluster, "victim", POOL)
    publish_profile_as(cluster, "late", POOL)
    # No owner at all; and one whose ownerReference names a service that does not exist (a made-up uid).
    cluster.create(forged_plan("hog", "evil", []))
    ghost = {"apiVersion": "exitplan.io/v1alpha1", "kind": "EarlyExitService", "name": "ghost"}
    cluster.create(forged_plan("ghost", "evil", [{**ghost, "uid": "0000-forged", "controller": True}]))
    with operator(cluster):
        cluster.create(service("victim", "victim", **ONE_BUCKET))
        st = wait_for("the victim planned", lambda: deployed(cluster, "victim", "victim"))
        assert held_on(cluster, POOL) == {"victim": 8}  # before the fix: {} (0 of 8), PlanInfeasible PoolCapacity
        assert st["plan"]["replicas"] == 8
        for forged in ("hog-plan", "ghost-plan"):
            (event,) = wait_for(
                f"a Warning on {forged}", lambda f=forged: warnings(cluster, "evil", f, capacity.IGNORED)
            )
            assert "no existing EarlyExitService owns it" in event["message"]
            assert event["involvedObject"]["kind"] == "ConfigMap"

        # A newcomer that does not fit fails on itself; the victim keeps its replicas and its conditions.
        cluster.create(service("late", "late", **ONE_BUCKET))
        wait_for("the newcomer refused", lambda: infeasible(cluster, "late", "late", capacity.REASON))
        message = condition(status(cluster, "late", "late"), "PlanInfeasible")["message"]
        assert "held by other services 8 (victim/victim: 8)" in message and "left 0" in message, message
        assert condition(status(cluster, "victim", "victim"), "PlanInfeasible").get("status") != "True"
        assert held_on(cluster, POOL) == {"victim": 8}
        assert not warnings(cluster, "victim", "victim", capacity.REASON)
        # Each forged ConfigMap was reported once, however often plans were made since.
        assert len(warnings(cluster, "evil", "hog-plan", capacity.IGNORED)) == 1


def test_only_a_controlling_owner_reference_with_the_live_uid_counts():
    cm = forged_plan("svc", "ns", [])
    ref = {"apiVersion": "exitplan.io/v1alpha1", "kind": "EarlyExitService", "name": "svc", "uid": "u1"}
    live = {"svc": "u1"}
    assert capacity.owner_of(cm, live) is None  # no owner
    cm["metadata"]["ownerReferences"] = [ref]
    assert capacity.owner_of(cm, live) is None  # not the controller
    cm["metadata"]["ownerReferences"] = [{**ref, "controller": True}]
    assert capacity.owner_of(cm, live) == "svc"
    assert capacity.owner_of(cm, {"svc": "u2"}) is None  # a service of that name recreated: another uid
    assert capacity.owner_of(cm, {}) is None  # the service is gone
    cm["metadata"]["ownerReferences"] = [{**ref, "controller": True, "kind": "Deployment"}]
    assert capacity.owner_of(cm, live) is None
    other = forged_plan("other", "ns", [{**ref, "controller": True}])  # owned by svc, but not svc's plan name
    assert capacity.owner_of(other, live) is None
