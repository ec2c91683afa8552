"""The operator's manifests for a plan that runs split 0 in its routers (`Plan.colocate`,
`exitplan router --colocate`): no split-0 workers or Service, routers on split 0's pool with its image,
resources and placement, as many as the most split-0 replicas of a bucket, split 1's Service as their
peers; a plan with split 0 over several pools refused; the manifests valid (kubernetes-validate,
strict); the switch applied to the emulated API server (split 0's workers pruned) and the routers'
readiness counted for split 0's cells."""

from __future__ import annotations

import pytest

from exitplan.api.plan import Cell, Plan, SplitPlan
from exitplan.api.resources import EarlyExitServiceSpec, GPUPoolSpec
from exitplan.devcluster.apiserver import ApiServer
from exitplan.operator import apply as applying
from exitplan.operator import builders, colocation, disruption, names
from exitplan.operator.kube import KubeClient, path
from exitplan.operator.readiness import refresh_readiness
from exitplan.operator.service_state import Service
from exitplan.operator.status import parse_status, summarize

kv = pytest.importorskip("kubernetes_validate.utils", reason="kubernetes-validate is in the dev extra")

OWNER = {
    "apiVersion": "exitplan.io/v1alpha1",
    "kind": "EarlyExitService",
    "metadata": {"name": "minilm", "namespace": "default", "uid": "1234-uid"},
}
POOLS = {
    "gpu": GPUPoolSpec.model_validate(
        {
            "capacity": 8,
            "gpuResource": "nvidia.com/gpu",
            "nodeSelector": {"pool": "gpu"},
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "cpu": "4",
            "memory": "8Gi",
            "image": "registry.local/exitplan-worker:1-cuda",
            "imagePullPolicy": "Always",
            "imagePullSecrets": [{"name": "gpu-registry"}],
        }
    ),
    "cpu": GPUPoolSpec(capacity=4, gpu_resource=""),
}
SPLITS = [SplitPlan(index=0, first_block=0, last_block=2), SplitPlan(index=1, first_block=3, last_block=5)]
CELLS = [
    Cell(split=0, bucket=32, pool="gpu", replicas=3, batch_size=8),
    Cell(split=0, bucket=128, pool="gpu", replicas=1, batch_size=8),
    Cell(split=1, bucket=32, pool="cpu", replicas=2, batch_size=8),
    Cell(split=1, bucket=128, pool="gpu", replicas=1, batch_size=8),
]
APART = Plan(service="minilm", model="minilm", splits=SPLITS, buckets=[32, 128], cells=CELLS)
TOGETHER = APART.model_copy(update={"colocate": True})
ONE_SPLIT = Plan(
    service="minilm",
    model="minilm",
    splits=[SplitPlan(index=0, first_block=0, last_block=5)],
    buckets=[32],
    cells=[Cell(split=0, bucket=32, pool="gpu", replicas=2, batch_size=8)],
    colocate=True,
)


def spec(routers: int = 2) -> EarlyExitServiceSpec:
    return EarlyExitServiceSpec.model_validate(
        {
            "model": {"name": "minilm", "bundle": "file:///models/minilm"},
            "slo": {"latencyMs": 100},
            "pools": [{"name": "gpu"}, {"name": "cpu"}],
            "router": {"replicas": routers},
        }
    )


def children(plan: Plan, service_spec: EarlyExitServiceSpec | None = None) -> list[dict]:
    service_spec = service_spec or spec()
    built = builders.build_children(OWNER, service_spec, plan, POOLS)
    return disruption.with_router_budget(OWNER, service_spec, plan.layout_hash(), built)


def named(objs: list[dict]) -> dict[str, dict]:
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in objs}


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_the_routers_run_split_zero_and_no_split_zero_worker_is_built():
    objs = named(children(TOGETHER))
    assert set(objs) == {
        "ConfigMap/minilm-plan",
        "Deployment/minilm-router",
        "Service/minilm",
        "Service/minilm-control",
        "Service/minilm-split-1",
        "Deployment/minilm-s1-b32-cpu",
        "Deployment/minilm-s1-b128-gpu",
        "PodDisruptionBudget/minilm-router",
    }
    router = objs["Deployment/minilm-router"]
    (container,) = router["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert "--colocate" in args and flag(args, "--pool") == "gpu"
    assert flag(args, "--peers") == "minilm-split-1.default.svc:8080"
    assert args.count("--peers") == 1
    # the ConfigMap carries the plan's colocate; the split-1 workers still hand on nowhere / to nothing new
    held = Plan.model_validate_json(objs["ConfigMap/minilm-plan"]["data"]["plan.json"])
    assert held.colocate and held.content_hash() == TOGETHER.content_hash()
    assert (
        flag(objs["Deployment/minilm-s1-b32-cpu"]["spec"]["template"]["spec"]["containers"][0]["args"], "--next")
        is None
    )


def test_the_routers_are_as_many_as_the_most_split_zero_replicas_of_a_bucket():
    assert named(children(TOGETHER))["Deployment/minilm-router"]["spec"]["replicas"] == 3  # bucket 32: 3
    assert named(children(TOGETHER, spec(routers=5)))["Deployment/minilm-router"]["spec"]["replicas"] == 5
    # one router asked for, three run split 0: the budget follows the Deployment, not the spec
    objs = named(children(TOGETHER, spec(routers=1)))
    assert objs["Deployment/minilm-router"]["spec"]["replicas"] == 3
    assert objs["PodDisruptionBudget/minilm-router"]["spec"]["minAvailable"] == 1


def test_the_routers_take_split_zeros_pool_as_its_worker_did():
    worker = named(children(APART))["Deployment/minilm-s0-b32-gpu"]["spec"]["template"]["spec"]
    router_dep = named(children(TOGETHER))["Deployment/minilm-router"]
    router = router_dep["spec"]["template"]["spec"]
    (w,), (r,) = worker["containers"], router["containers"]
    for key in ("image", "imagePullPolicy", "resources", "volumeMounts", "securityContext"):
        assert r[key] == w[key], key
    assert r["resources"]["limits"]["nvidia.com/gpu"] == 1
    for key in ("nodeSelector", "tolerations", "imagePullSecrets", "volumes", "securityContext"):
        assert router[key] == worker[key], key
    # spread over the routers themselves (the split-0 worker's term would select no pod any more)
    (term,) = router["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == names.selector_labels("minilm", "router")
    # the router keeps its ports, labels and Services: the entry point and the control Service unchanged
    assert [p["name"] for p in r["ports"]] == ["http", "control"]
    apart, together = named(children(APART)), named(children(TOGETHER))
    for name in ("Service/minilm", "Service/minilm-control"):
        assert apart[name]["spec"] == together[name]["spec"]
    assert router_dep["spec"]["selector"] == apart["Deployment/minilm-router"]["spec"]["selector"]


def test_a_plan_apart_keeps_its_router_off_the_pools():
    router = named(children(APART))["Deployment/minilm-router"]
    (c,) = router["spec"]["template"]["spec"]["containers"]
    assert "--colocate" not in c["args"] and flag(c["args"], "--peers") == "minilm-split-0.default.svc:8080"
    assert "nodeSelector" not in router["spec"]["template"]["spec"]
    assert not colocation.runs_split_zero(router)
    assert colocation.runs_split_zero(named(children(TOGETHER))["Deployment/minilm-router"])


def test_a_one_split_plan_gives_its_routers_no_peers():
    objs = named(children(ONE_SPLIT))
    assert not [n for n in objs if n.startswith("Service/minilm-split-") or n.startswith("Deployment/minilm-s")]
    (c,) = objs["Deployment/minilm-router"]["spec"]["template"]["spec"]["containers"]
    assert "--peers" not in c["args"] and "--colocate" in c["args"] and flag(c["args"], "--pool") == "gpu"
    assert objs["Deployment/minilm-router"]["spec"]["replicas"] == 2


def test_split_zero_over_two_pools_is_refused_with_what_to_do():
    spread = TOGETHER.model_copy(
        update={"cells": [*CELLS, Cell(split=0, bucket=128, pool="cpu", replicas=1, batch_size=8)]}
    )
    with pytest.raises(ValueError, match=r"pools \['cpu', 'gpu'\].*one pool.*colocate: off"):
        builders.build_children(OWNER, spec(), spread, POOLS)


@pytest.fixture(scope="module")
def kube_versions() -> list[str]:
    from packaging.version import Version

    versions = sorted((v for v in kv.all_versions() if Version(v) >= Version("1.29")), key=Version)
    return [versions[0], versions[-1]]


@pytest.mark.parametrize("plan", [TOGETHER, ONE_SPLIT], ids=["two-splits", "one-split"])
def test_the_manifests_validate_strictly(plan, kube_versions):
    for obj in children(plan, spec(routers=1)):
        for version in kube_versions:
            kv.validate(obj, version, strict=True)


async def test_switching_to_colocation_prunes_split_zero_and_the_routers_count_for_it():
    async with ApiServer() as server:
        async with KubeClient(server.url) as client:
            await applying.apply_children(client, children(APART), "minilm", "default")
            report = await applying.apply_children(client, children(TOGETHER), "minilm", "default")
            assert {
                "Deployment/minilm-s0-b32-gpu",
                "Deployment/minilm-s0-b128-gpu",
                "Service/minilm-split-0",
            } <= set(report.deleted)
            assert "Deployment/minilm-router" in report.patched
            deps = await client.list(path("Deployment", "default"), f"{names.L_SERVICE}=minilm")
            assert sorted(d["metadata"]["name"] for d in deps) == [
                "minilm-router",
                "minilm-s1-b128-gpu",
                "minilm-s1-b32-cpu",
            ]
            for dep in deps:  # every Deployment reports its replicas ready
                want = dep["spec"]["replicas"]
                await client.merge_patch(
                    path("Deployment", "default", dep["metadata"]["name"], "status"),
                    {"status": {"replicas": want, "readyReplicas": want}},
                )
            body = {**OWNER, "spec": spec().model_dump(by_alias=True, mode="json")}
            body["status"] = {"phase": "Deploying", "plan": summarize(TOGETHER).model_dump(by_alias=True, mode="json")}
            status = await refresh_readiness(Service(body, client))
            assert status is not None  # no memo: every call refreshes
            ready = {(c.split, c.bucket): c.ready_replicas for c in status.plan.cells}
            assert ready == {(0, 32): 3, (0, 128): 1, (1, 32): 2, (1, 128): 1}
            assert any(c.type == "Ready" and c.status == "True" for c in status.conditions)
            assert parse_status(body["status"]).phase.value == "Ready"

            # and back: split 0's workers and Service return, the routers leave the pool
            report = await applying.apply_children(client, children(APART), "minilm", "default")
            assert {"Deployment/minilm-s0-b32-gpu", "Service/minilm-split-0"} <= set(report.created)
            router = await client.get(path("Deployment", "default", "minilm-router"))
            assert not colocation.runs_split_zero(router)
