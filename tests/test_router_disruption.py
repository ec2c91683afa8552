"""Routers in a cluster: two by default, a PodDisruptionBudget over them, a preStop pause before the
drain (operator/disruption.py, operator/builders.py); the manifests valid for every Kubernetes
version the chart supports (kubernetes-validate, strict); the budget applied to and pruned from the
emulated API server with the other children."""

from __future__ import annotations

import pytest

from exitplan.api.plan import Cell, Plan, SplitPlan
from exitplan.api.resources import EarlyExitServiceSpec, GPUPoolSpec
from exitplan.devcluster.apiserver import ApiServer
from exitplan.operator import apply as applying
from exitplan.operator import builders, disruption, names, pod_template
from exitplan.operator.kube import KubeClient, path
from exitplan.worker_image.serve import ServerLimits

kv = pytest.importorskip("kubernetes_validate.utils", reason="kubernetes-validate is in the dev extra")

OWNER = {
    "apiVersion": "exitplan.io/v1alpha1",
    "kind": "EarlyExitService",
    "metadata": {"name": "minilm", "namespace": "default", "uid": "1234-uid"},
}
POOLS = {"cpu": GPUPoolSpec(capacity=4, gpu_resource="")}
PLAN = Plan(
    service="minilm",
    model="minilm",
    splits=[SplitPlan(index=0, first_block=0, last_block=5)],
    buckets=[32],
    cells=[Cell(split=0, bucket=32, pool="cpu", replicas=1, batch_size=8)],
)


def spec(**router) -> EarlyExitServiceSpec:
    return EarlyExitServiceSpec.model_validate(
        {
            "model": {"name": "minilm", "bundle": "file:///models/minilm"},
            "slo": {"latencyMs": 100},
            "pools": [{"name": "cpu"}],
            **({"router": router} if router else {}),
        }
    )


def children(service_spec: EarlyExitServiceSpec) -> list[dict]:
    built = builders.build_children(OWNER, service_spec, PLAN, POOLS)
    return disruption.with_router_budget(OWNER, service_spec, PLAN.layout_hash(), built)


def one(objs: list[dict], kind: str, component: str | None = None) -> dict:
    (found,) = [
        o
        for o in objs
        if o["kind"] == kind and (component is None or o["metadata"]["labels"].get(names.L_COMPONENT) == component)
    ]
    return found


def test_two_routers_by_default_under_a_budget_that_keeps_one():
    objs = children(spec())
    router = one(objs, "Deployment", "router")
    assert router["spec"]["replicas"] == 2
    budget = one(objs, "PodDisruptionBudget")
    assert budget["apiVersion"] == "policy/v1" and budget["metadata"]["name"] == "minilm-router"
    assert budget["spec"]["minAvailable"] == 1
    pod_labels = router["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    workers = [o for o in objs if o["kind"] == "Deployment" and o is not router]
    assert not any(
        budget["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
        for w in workers
    )
    (owner,) = budget["metadata"]["ownerReferences"]
    assert owner["uid"] == "1234-uid" and owner["kind"] == "EarlyExitService"
    assert budget["metadata"]["annotations"][names.A_PLAN_HASH] == PLAN.layout_hash()


def test_one_router_gets_no_budget_that_would_block_every_eviction():
    objs = children(spec(replicas=1))
    assert one(objs, "Deployment", "router")["spec"]["replicas"] == 1
    assert not [o for o in objs if o["kind"] == "PodDisruptionBudget"]


def test_routers_and_workers_pause_before_the_drain_within_the_grace_period():
    objs = children(spec())
    limits = ServerLimits()
    for component in ("router", "worker"):
        pod = one(objs, "Deployment", component)["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        pause = container["lifecycle"]["preStop"]["exec"]["command"]
        assert pause == ["sleep", str(pod_template.PRESTOP_SLEEP_S)]
        # the kubelet's grace period counts the preStop hook too: the pause and the longest drain fit
        assert pod["terminationGracePeriodSeconds"] > pod_template.PRESTOP_SLEEP_S + limits.drain_timeout_s + 1


@pytest.fixture(scope="module")
def kube_versions() -> list[str]:
    from packaging.version import Version

    versions = sorted((v for v in kv.all_versions() if Version(v) >= Version("1.29")), key=Version)
    return [versions[0], versions[-1]]


@pytest.mark.parametrize("kind", ["PodDisruptionBudget", "Deployment", "Service"])
def test_the_manifests_validate_strictly(kind, kube_versions):
    objs = [o for o in children(spec()) if o["kind"] == kind]
    assert objs
    for obj in objs:
        for version in kube_versions:
            kv.validate(obj, version, strict=True)


def test_strict_validation_refuses_a_bad_budget(kube_versions):
    budget = one(children(spec()), "PodDisruptionBudget")
    budget["spec"]["minAvailabel"] = 1
    with pytest.raises(kv.ValidationError):
        kv.validate(budget, kube_versions[-1], strict=True)


async def test_the_budget_is_applied_with_the_children_and_pruned_with_one_router():
    async with ApiServer() as server:
        async with KubeClient(server.url) as client:
            report = await applying.apply_children(client, children(spec()), "minilm", "default")
            assert "PodDisruptionBudget/minilm-router" in report.created
            stored = await client.get(path("PodDisruptionBudget", "default", "minilm-router"))
            assert stored["spec"]["minAvailable"] == 1
            again = await applying.apply_children(client, children(spec()), "minilm", "default")
            assert "PodDisruptionBudget/minilm-router" in again.unchanged and not again.changed()
            shrunk = await applying.apply_children(client, children(spec(replicas=1)), "minilm", "default")
            assert "PodDisruptionBudget/minilm-router" in shrunk.deleted
            assert await client.list(path("PodDisruptionBudget", "default"), f"{names.L_SERVICE}=minilm") == []
