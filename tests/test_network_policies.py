"""Each service's own NetworkPolicies (operator/network_policies.py), evaluated against the pods the
operator's builders label: for a plan of 2 splits and a co-located one they admit exactly the router to
the split it sends to, split 0 to split 1, the operator and the service's workers to the routers' control
port, and nothing from another service's pods; they validate strictly (kubernetes-validate); and the
operator on the emulated API server creates them as children of the service, changes them with a
re-plan that changes the splits and lets them go with the service.
"""

from __future__ import annotations

import pytest
from netpol_eval import Pod, allowed
from test_operator_support import ClusterThread, install_profiles, operator, pool, service, wait_for

from exitplan.api.plan import Cell, Plan, SplitPlan
from exitplan.api.resources import EarlyExitServiceSpec, GPUPoolSpec
from exitplan.operator import builders, guards, names, network_policies

kv = pytest.importorskip("kubernetes_validate.utils", reason="kubernetes-validate is in the dev extra")

NS, OP_NS = "ml", "exitplan-system"
SETTINGS = guards.Settings(network_policies=True, operator_namespace=OP_NS)
POOLS = {"gpu-a": GPUPoolSpec(capacity=8)}
SPEC = EarlyExitServiceSpec.model_validate(
    {"model": {"name": "m", "bundle": "/models/m"}, "slo": {"latencyMs": 100}, "pools": [{"name": "gpu-a"}]}
)
OPERATOR = Pod("exitplan-operator-0", OP_NS, dict(guards.OPERATOR_LABELS))
PORT, CONTROL = names.PORT, names.CONTROL_PORT


def plan(service: str, splits: int, colocate: bool = False) -> Plan:
    return Plan(
        service=service,
        model="m",
        splits=[SplitPlan(index=i, first_block=i, last_block=i) for i in range(splits)],
        buckets=[128],
        cells=[Cell(split=i, bucket=128, pool="gpu-a", replicas=1, batch_size=8) for i in range(splits)],
        colocate=colocate,
    )


def owner(service: str) -> dict:
    meta = {"name": service, "namespace": NS, "uid": f"uid-{service}"}
    return {"apiVersion": "exitplan.io/v1alpha1", "kind": "EarlyExitService", "metadata": meta}


def children(service: str, the_plan: Plan) -> list[dict]:
    built = builders.build_children(owner(service), SPEC, the_plan, POOLS)
    return network_policies.with_network_policies(owner(service), the_plan, SETTINGS, built)


def pods(objs: list[dict]) -> dict[str, Pod]:
    """`router` and `split<S>`: one pod of each Deployment, labelled as its template says."""
    out = {}
    for dep in (o for o in objs if o["kind"] == "Deployment"):
        labels = dep["spec"]["template"]["metadata"]["labels"]
        key = "router" if labels[names.L_COMPONENT] == "router" else f"split{labels[names.L_SPLIT]}"
        out[key] = Pod(dep["metadata"]["name"], NS, labels)
    return out


def admitted(policies: list[dict], everyone: dict[str, Pod]) -> set[tuple[str, str, int]]:
    """Every (source, destination, port) the policies let through, over the pods given."""
    return {
        (src, dst, port)
        for src, a in everyone.items()
        for dst, b in everyone.items()
        for port in (PORT, CONTROL)
        if src != dst and allowed(policies, a, b, port)
    }


def data_plane(svc: str, objs: list[dict]) -> tuple[list[dict], dict[str, Pod]]:
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    return policies, {f"{svc}/{k}": p for k, p in pods(objs).items()}


@pytest.mark.parametrize(
    ("colocate", "paths"),
    [
        (False, {("router", "split0", PORT), ("split0", "split1", PORT)}),
        (True, {("router", "split1", PORT)}),
    ],
)
def test_policies_admit_exactly_the_services_own_paths(colocate, paths):
    """A 2-split plan, and the same co-located: exactly the data path, the workers' feedback and the
    operator on the control port; no pair that involves another service (a 2-split one in the same
    namespace) or a stranger pod."""
    mine, mine_pods = data_plane("a", children("a", plan("a", 2, colocate)))
    theirs, their_pods = data_plane("b", children("b", plan("b", 2)))
    stranger = Pod("intruder", NS, {"app": "x", **names.MANAGED})
    policies = mine + theirs
    everyone = {**mine_pods, **their_pods, "stranger": stranger, "operator": OPERATOR}
    feedback = {(w, "a/router", CONTROL) for w in mine_pods if w != "a/router"}
    expected = {(f"a/{s}", f"a/{d}", p) for s, d, p in paths} | feedback | {("operator", "a/router", CONTROL)}
    got = {t for t in admitted(policies, everyone) if "a/" in t[0] or "a/" in t[1]}
    assert got == expected
    # the pods the policies name: each Deployment's pods are selected by some policy of both types
    for pod in mine_pods.values():
        assert any(set(p["spec"]["policyTypes"]) >= {"Ingress"} for p in mine if _selects(p, pod))


def _selects(policy: dict, pod: Pod) -> bool:
    from netpol_eval import selects

    return selects(policy["spec"]["podSelector"], pod.labels)


def test_a_router_that_still_runs_split_0_reaches_split_1_while_it_rolls():
    """Switching co-location off: until its router pods are replaced, a router that ran split 0 itself
    (labelled sends-to 1) still reaches split 1; the new routers (sends-to 0) reach split 0 only."""
    objs = children("a", plan("a", 3))
    policies, now = data_plane("a", objs)
    old_router = pods(children("a", plan("a", 3, colocate=True)))["router"]
    assert old_router.labels[names.L_SENDS_TO] == "1" and now["a/router"].labels[names.L_SENDS_TO] == "0"
    assert allowed(policies, old_router, now["a/split1"], PORT)
    assert not allowed(policies, old_router, now["a/split2"], PORT)
    assert not allowed(policies, now["a/router"], now["a/split1"], PORT)


def test_the_policies_are_children_of_the_service_and_validate_strictly(kube_versions):
    objs = children("a", plan("a", 3))
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    assert sorted(p["metadata"]["name"] for p in policies) == [
        "a-net-router",
        "a-net-router-to-split-0",
        "a-net-router-to-split-1",
        "a-net-split-0",
        "a-net-split-1",
        "a-net-split-2",
    ]
    for p in policies:
        assert p["metadata"]["ownerReferences"][0]["uid"] == "uid-a"
        assert p["metadata"]["labels"][names.L_SERVICE] == "a"
        assert p["metadata"]["annotations"][names.A_PLAN_HASH] == plan("a", 3).layout_hash()
        for version in kube_versions:
            kv.validate(p, version, strict=True)
    broken = {**policies[0], "spec": {**policies[0]["spec"], "podSelectr": {}}}
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, kube_versions[-1], strict=True)


def test_off_by_default_and_the_operator_labels_come_from_the_env():
    assert not guards.Settings.from_env({}).network_policies
    built = builders.build_children(owner("a"), SPEC, plan("a", 2), POOLS)
    assert network_policies.with_network_policies(owner("a"), plan("a", 2), guards.Settings(), built) == built
    env = {
        guards.ENV_NETWORK_POLICIES: "true",
        guards.ENV_OPERATOR_NAMESPACE: "ops",
        guards.ENV_OPERATOR_LABELS: "app.kubernetes.io/name=exitplan, app.kubernetes.io/instance=prod",
    }
    settings = guards.Settings.from_env(env)
    assert settings.network_policies and network_policies.operator_peer(settings) == {
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "exitplan", "app.kubernetes.io/instance": "prod"}},
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}},
    }
    with pytest.raises(ValueError, match=guards.ENV_OPERATOR_LABELS):
        guards.Settings.from_env({guards.ENV_OPERATOR_LABELS: "app.kubernetes.io/name"})


@pytest.fixture(scope="module")
def kube_versions() -> list[str]:
    from packaging.version import Version

    versions = sorted((v for v in kv.all_versions() if Version(v) >= Version("1.29")), key=Version)
    return [versions[0], versions[-1]]


# ------------------------------------------------------------------ the operator, on the emulated API


def policy_names(cluster: ClusterThread, ns: str, name: str) -> set[str]:
    return {o["metadata"]["name"] for o in cluster.list("NetworkPolicy", ns, f"{names.L_SERVICE}={name}")}


def applied_plan(cluster: ClusterThread, ns: str, name: str) -> Plan | None:
    cm = cluster.get("ConfigMap", ns, names.plan_configmap_name(name))
    return Plan.model_validate_json(cm["data"]["plan.json"]) if cm else None


def test_the_operator_applies_replaces_and_drops_the_policies(tmp_path):
    ns = "netpol"
    with ClusterThread(tmp_path) as cluster:
        cluster.create(pool("gpu-a", 4, 3.0))
        cluster.create(pool("gpu-b", 6, 1.0))
        install_profiles(cluster, ns)
        with operator(cluster, env={guards.ENV_NETWORK_POLICIES: "true", guards.ENV_OPERATOR_NAMESPACE: OP_NS}):
            svc = cluster.create(service("minilm", ns, planner={"colocate": "off"}))
            first = wait_for("a plan of 2+ splits applied", lambda: (p := applied_plan(cluster, ns, "minilm")) and p)
            expected = {
                p["metadata"]["name"] for p in network_policies.build_network_policies("minilm", ns, first, SETTINGS)
            }
            wait_for("the policies applied", lambda: policy_names(cluster, ns, "minilm") == expected)
            assert len(first.splits) >= 2, f"the profiles plan {len(first.splits)} split(s)"
            for obj in cluster.list("NetworkPolicy", ns, f"{names.L_SERVICE}=minilm"):
                assert obj["metadata"]["ownerReferences"][0]["uid"] == svc["metadata"]["uid"]
            router = cluster.get("NetworkPolicy", ns, "minilm-net-router")
            peer = router["spec"]["ingress"][0]["from"][0]
            assert peer["namespaceSelector"]["matchLabels"] == {network_policies.NS_NAME_LABEL: OP_NS}
            # a re-plan to one split: the later splits' policies go, the router's to split 1 too
            cluster.patch("EarlyExitService", ns, "minilm", {"spec": {"planner": {"colocate": "off", "maxSplits": 1}}})
            one = {"minilm-net-router", "minilm-net-router-to-split-0", "minilm-net-split-0"}
            wait_for("the policies of a one-split plan", lambda: policy_names(cluster, ns, "minilm") == one)
            split0 = cluster.get("NetworkPolicy", ns, "minilm-net-split-0")
            assert [r["to"][0]["podSelector"]["matchLabels"][names.L_COMPONENT] for r in split0["spec"]["egress"]] == [
                "router"  # no next split to send to: only the routers' control port
            ]
            cluster.delete("EarlyExitService", ns, "minilm")
            wait_for("the policies gone with the service", lambda: not cluster.list("NetworkPolicy", ns))


def test_a_generation_services_stages_get_the_same_paths():
    """A generation service's stages are its workers (generation_builders.py): router -> stage 0 -> stage 1."""
    from exitplan.operator import generation_builders

    spec = SPEC.model_copy(update={"model": SPEC.model.model_copy(update={"task": "text-generation"})})
    assert generation_builders.is_generation(spec)
    the_plan = plan("g", 2)
    built = generation_builders.build_children(owner("g"), spec, the_plan, POOLS)
    policies, everyone = data_plane("g", network_policies.with_network_policies(owner("g"), the_plan, SETTINGS, built))
    data = {t for t in admitted(policies, everyone) if t[2] == PORT}
    assert data == {("g/router", "g/split0", PORT), ("g/split0", "g/split1", PORT)}
