"""The operator under kopf against the emulated API server over HTTP (tiers 2 of DESIGN.md).

Profiles are the synthetic ones in tests/test_operator_data/profiles.yaml; the planner is the
real one; observations for the drift tests come from a real tiny HTTP server in the test that
serves a crafted Observations window (that is the injected drift), published as the router
Service's load-balancer ingress the way the dev-cluster's Service stand-in publishes its port.
"""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from exitplan.api.plan import Plan
from exitplan.operator import builders
from test_operator_support import (ClusterThread, condition, install_profiles, mark_ready, operator, pool, service,
                                   status, wait_for, workers)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with ClusterThread(tmp_path_factory.mktemp("cluster")) as c:
        c.create(pool("gpu-a", 4, 3.0))
        c.create(pool("gpu-b", 6, 1.0))
        yield c


def plan_of(cluster: ClusterThread, ns: str, name: str) -> Plan | None:
    cm = cluster.get("ConfigMap", ns, builders.plan_configmap_name(name))
    return Plan.model_validate_json(cm["data"]["plan.json"]) if cm else None


def deployed(cluster: ClusterThread, ns: str, name: str) -> dict:
    st = status(cluster, ns, name)
    return st if st.get("plan") and st.get("phase") in ("Deploying", "Ready") else {}


def test_create_builds_every_child_with_the_right_specs(cluster):
    ns = "create"
    install_profiles(cluster, ns)
    with operator(cluster):
        svc = cluster.create(service("minilm", ns))
        st = wait_for("the service is planned and applied", lambda: deployed(cluster, ns, "minilm"))
        plan = plan_of(cluster, ns, "minilm")
        assert plan is not None and st["plan"]["hash"] == plan.content_hash()
        deps = workers(cluster, ns, "minilm")
        assert {builders.worker_name("minilm", c) for c in plan.cells} == set(deps)
        for cell in plan.cells:
            dep = deps[builders.worker_name("minilm", cell)]
            assert dep["spec"]["replicas"] == cell.replicas
            pod = dep["spec"]["template"]["spec"]
            assert pod["nodeSelector"] == {"exitplan.io/pool": cell.pool}
            assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
            assert dep["metadata"]["annotations"][builders.A_PLAN_HASH] == plan.content_hash()
        names = {o["metadata"]["name"] for o in cluster.list("Service", ns, "exitplan.io/service=minilm")}
        assert names == {"minilm"} | {builders.split_service_name("minilm", s.index) for s in plan.splits}
        router = cluster.get("Deployment", ns, "minilm-router")
        assert router["spec"]["template"]["spec"]["containers"][0]["command"] == ["exitplan", "router"]
        for kind in ("Deployment", "Service", "ConfigMap"):
            for obj in cluster.list(kind, ns, "exitplan.io/service=minilm"):
                assert obj["metadata"]["ownerReferences"][0]["uid"] == svc["metadata"]["uid"]
        assert condition(st, "Planned")["status"] == "True" and condition(st, "PlanInfeasible")["status"] == "False"
        assert st["observedGeneration"] == 1 and st["lastReplanReason"] == "initial"
        # Readiness: once the Deployments report ready replicas the service becomes Ready.
        mark_ready(cluster, ns, "minilm")
        st = wait_for("phase Ready", lambda: (s := status(cluster, ns, "minilm")).get("phase") == "Ready" and s)
        assert condition(st, "Ready")["status"] == "True" and condition(st, "Progressing")["status"] == "False"
        assert all(c["readyReplicas"] == c["replicas"] for c in st["plan"]["cells"])
        assert any(e["reason"] == "Applied" for e in cluster.events(ns, "minilm"))
