"""Images per pool (issue 16): the data-plane image, its pull policy and pull Secrets come from the
chart's values (the operator's env) and may be set per GPUPool; the worker, stage and profiling pods on
a pool run the pool's, the routers (on no pool) the defaults. The GPUPool CRD and the typed spec agree
on the new fields, and the manifests validate strictly."""

from __future__ import annotations

import kubernetes_validate.utils as kv
import pytest
from packaging.version import Version
from pydantic import ValidationError
from test_chart_support import operator_pod, render

from exitplan.api.plan import Cell, Plan, SplitPlan
from exitplan.api.resources import EarlyExitServiceSpec, GPUPool, GPUPoolSpec
from exitplan.devcluster.schema import Validator
from exitplan.operator import builders, crdgen
from exitplan.operator import images as operator_images
from exitplan.operator.images import DEFAULT_IMAGE, Images

DEFAULTS = Images("registry.local/exitplan-worker-cpu:1", "IfNotPresent", ("regcred",))
OWNER = {
    "apiVersion": "exitplan.io/v1alpha1",
    "kind": "EarlyExitService",
    "metadata": {"name": "minilm", "namespace": "ml", "uid": "1234-uid"},
}
SPEC = EarlyExitServiceSpec.model_validate(
    {
        "model": {"name": "minilm", "bundle": "s3://bundles/minilm", "bundleSecret": "s3-creds"},
        "slo": {"latencyMs": 100},
        "pools": [{"name": "gpu"}, {"name": "cpu"}],
    }
)
POOLS = {
    "gpu": GPUPoolSpec.model_validate(
        {
            "capacity": 8,
            "gpuResource": "nvidia.com/gpu",
            "nodeSelector": {"pool": "gpu"},
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "image": "registry.local/exitplan-worker:1-cuda",
            "imagePullPolicy": "Always",
            "imagePullSecrets": [{"name": "gpu-registry"}, {"name": "regcred"}],
        }
    ),
    "cpu": GPUPoolSpec(capacity=4, gpu_resource=""),
}
PLAN = Plan(
    service="minilm",
    model="minilm",
    splits=[SplitPlan(index=0, first_block=0, last_block=5)],
    buckets=[128],
    cells=[Cell(split=0, bucket=128, pool=p, replicas=1, batch_size=8) for p in ("gpu", "cpu")],
)


@pytest.fixture
def defaults(monkeypatch):
    monkeypatch.setattr(operator_images, "IMAGES", DEFAULTS)


def containers(pod: dict) -> list[dict]:
    return pod.get("initContainers", []) + pod["containers"]


def test_each_pool_runs_its_image_and_the_router_the_defaults(defaults):
    children = {c["metadata"]["name"]: c for c in builders.build_children(OWNER, SPEC, PLAN, POOLS)}
    gpu = children["minilm-s0-b128-gpu"]["spec"]["template"]["spec"]
    cpu = children["minilm-s0-b128-cpu"]["spec"]["template"]["spec"]
    router = children["minilm-router"]["spec"]["template"]["spec"]
    for c in containers(gpu):  # storage-init too: it is the pod's image that holds `exitplan storage-init`
        assert (c["image"], c["imagePullPolicy"]) == ("registry.local/exitplan-worker:1-cuda", "Always")
    assert gpu["imagePullSecrets"] == [{"name": "regcred"}, {"name": "gpu-registry"}]
    assert gpu["nodeSelector"] == {"pool": "gpu"} and gpu["tolerations"][0]["key"] == "gpu"
    assert gpu["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    for pod in (cpu, router):
        assert {(c["image"], c["imagePullPolicy"]) for c in containers(pod)} == {(DEFAULTS.image, "IfNotPresent")}
        assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    job = builders.build_profile_job(OWNER, SPEC, "gpu", POOLS["gpu"], "minilm-gpu")["spec"]["template"]["spec"]
    assert {c["image"] for c in containers(job)} == {"registry.local/exitplan-worker:1-cuda"}
    assert job["imagePullSecrets"] == gpu["imagePullSecrets"] and job["nodeSelector"] == {"pool": "gpu"}


def test_without_pull_secrets_the_pods_name_none(monkeypatch):
    monkeypatch.setattr(operator_images, "IMAGES", Images("exitplan:1"))
    children = builders.build_children(OWNER, SPEC, PLAN, {**POOLS, "gpu": GPUPoolSpec(capacity=8)})
    for dep in (c for c in children if c["kind"] == "Deployment"):
        pod = dep["spec"]["template"]["spec"]
        assert "imagePullSecrets" not in pod and {c["image"] for c in containers(pod)} == {"exitplan:1"}


def test_the_manifests_validate_strictly(defaults):
    versions = sorted((v for v in kv.all_versions() if Version(v) >= Version("1.29")), key=Version)
    objs = [c for c in builders.build_children(OWNER, SPEC, PLAN, POOLS) if c["kind"] == "Deployment"]
    objs.append(builders.build_profile_job(OWNER, SPEC, "gpu", POOLS["gpu"], "minilm-gpu"))
    for obj in objs:
        for version in (versions[0], versions[-1]):
            kv.validate(obj, version, strict=True)


def test_the_chart_values_reach_the_builders_through_the_operator_env():
    values = {
        "dataPlane": {
            "image": {"repository": "registry.local/exitplan-worker", "tag": "e2e", "pullPolicy": "Always"},
            "imagePullSecrets": [{"name": "regcred"}, {"name": "mirror"}],
        }
    }
    env = {e["name"]: e.get("value") for e in operator_pod(render(values))["spec"]["containers"][0]["env"]}
    images = Images.from_env(DEFAULT_IMAGE, env)
    assert images == Images("registry.local/exitplan-worker:e2e", "Always", ("regcred", "mirror"))
    plain = {e["name"]: e.get("value") for e in operator_pod(render())["spec"]["containers"][0]["env"]}
    assert "EXITPLAN_IMAGE_PULL_SECRETS" not in plain
    assert Images.from_env(DEFAULT_IMAGE, plain).pull_policy == "IfNotPresent"
    with pytest.raises(ValueError, match="EXITPLAN_IMAGE_PULL_POLICY"):
        Images.from_env(DEFAULT_IMAGE, {"EXITPLAN_IMAGE_PULL_POLICY": "Sometimes"})


@pytest.mark.parametrize(
    "field,value,ok",
    [
        ("image", "registry.local/w:1", True),
        ("imagePullPolicy", "Never", True),
        ("imagePullSecrets", [{"name": "regcred"}], True),
        ("image", "has space", False),
        ("image", "", False),
        ("imagePullPolicy", "Sometimes", False),
        ("imagePullSecrets", [{"name": "Bad_Name"}], False),
        ("imagePullSecrets", ["regcred"], False),
    ],
)
def test_the_gpupool_crd_and_the_typed_spec_agree(field, value, ok):
    doc = {"apiVersion": "exitplan.io/v1alpha1", "kind": "GPUPool", "metadata": {"name": "p"}}
    doc["spec"] = {"capacity": 2, field: value}
    schema = crdgen.build_crd("GPUPool")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    problems = Validator(schema).problems(doc)
    if ok:
        GPUPool.model_validate(doc)
        assert problems == []
    else:
        with pytest.raises(ValidationError):
            GPUPool.model_validate(doc)
        assert problems, f"the CRD accepts {field}={value!r}, the typed spec refuses it"
