"""The GPU recipe (README "On a cluster with NVIDIA GPUs"): charts/exitplan/values-gpu.yaml renders,
lints and validates strictly; the example GPUPools (examples/gpu/, one per node type) and their
service validate against the generated CRD schemas and the typed models; and what the operator builds
on those pools (the workers and a profiling Job per pool) asks the device plugin for nvidia.com/gpu
on nodes of that type, tolerates their taint, and validates strictly too.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from test_chart import MONITOR_SCHEMAS, _expand, _parse_cli, kube_versions, validate, validate_monitor
from test_chart_support import CHART, NAMESPACE, ROOT, of_kind, one, operator_pod, render

from exitplan.api import load_resources
from exitplan.api.resources import EarlyExitService, GPUPool
from exitplan.devcluster.schema import Validator
from exitplan.operator import crdgen

helm_python = pytest.importorskip("helm_python", reason="helm-python-sdk is in the dev extra: pip install -e '.[dev]'")
kv = pytest.importorskip("kubernetes_validate.utils", reason="kubernetes-validate is in the dev extra")

VALUES = CHART / "values-gpu.yaml"
EXAMPLES = ROOT / "examples" / "gpu"
NODE_TYPE = "node.kubernetes.io/instance-type"


def gpu_values() -> dict[str, Any]:
    return yaml.safe_load(VALUES.read_text())


def examples() -> list[dict[str, Any]]:
    docs = [d for p in sorted(EXAMPLES.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]
    assert {d["kind"] for d in docs} == {"GPUPool", "EarlyExitService"}
    return docs


def test_values_gpu_render_lint_and_validate_strictly(monkeypatch: pytest.MonkeyPatch) -> None:
    values = gpu_values()
    report = helm_python.lint(CHART, values, strict=True, namespace=NAMESPACE, kube_version="v1.29.0")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []
    objs = render(values)
    checked = 0
    for obj in objs:
        if obj["kind"] in MONITOR_SCHEMAS:
            validate_monitor(obj)
            continue
        for version in (kube_versions()[0], kube_versions()[-1]):
            validate(obj, version, monkeypatch)
            checked += 1
    assert checked >= 2 * 15
    assert one(objs, "ServiceMonitor")["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    rule = one(objs, "PrometheusRule")  # the alerts, on what the monitors scrape
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack" and rule["spec"]["groups"]
    assert one(objs, "PodDisruptionBudget")  # two replicas: a node drain keeps one
    pod = operator_pod(objs)["spec"]
    (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": "nvidia.com/gpu.present", "operator": "DoesNotExist"}]
    container = pod["containers"][0]
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})  # the operator needs no GPU
    env = {e["name"]: e.get("value") for e in container["env"]}
    image = values["dataPlane"]["image"]
    assert env["EXITPLAN_IMAGE"] == f"{image['repository']}:{image['tag']}"  # the CUDA `worker` target
    params = _parse_cli(_expand(container["args"], {"POD_INDEX": "1"}))
    assert params["allow_host_path"] == ["/var/lib/exitplan/bundles"]
    assert {o["metadata"]["namespace"] for o in of_kind(objs, "ServiceAccount")} >= {"ml-serving"}
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "FROM cuda-base AS worker\n" in dockerfile  # the `worker` target, which values-gpu.yaml runs, is CUDA's
    assert "FROM ${CUDA_IMAGE} AS cuda-base" in dockerfile and "ARG CUDA_IMAGE=nvidia/cuda:" in dockerfile


@pytest.mark.parametrize("kind", ["GPUPool", "EarlyExitService"])
def test_example_resources_validate_against_the_crd_and_the_models(kind: str) -> None:
    schema = crdgen.build_crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    docs = [d for d in examples() if d["kind"] == kind]
    assert docs
    for doc in docs:
        assert Validator(schema).problems(doc) == [], doc["metadata"]["name"]
    bad = {**docs[0], "spec": {**docs[0]["spec"], "capacity" if kind == "GPUPool" else "slo": -1}}
    assert Validator(schema).problems(bad)  # the check can fail


def _pools_and_service() -> tuple[dict[str, GPUPool], EarlyExitService]:
    resources = [r for p in sorted(EXAMPLES.glob("*.yaml")) for r in load_resources(p)]
    pools = {r.metadata["name"]: r for r in resources if isinstance(r, GPUPool)}
    (service,) = [r for r in resources if isinstance(r, EarlyExitService)]
    return pools, service


def test_one_pool_per_node_type_with_the_device_plugins_resource() -> None:
    pools, service = _pools_and_service()
    assert sorted(pools) == ["a100", "t4"] == sorted(p.name for p in service.spec.pools)
    types = {name: pool.spec.node_selector[NODE_TYPE] for name, pool in pools.items()}
    assert len(set(types.values())) == 2  # one node type each
    for pool in pools.values():
        assert pool.spec.gpu_resource == "nvidia.com/gpu"
        assert any(t.key == "nvidia.com/gpu" and t.operator == "Exists" for t in pool.spec.tolerations)
    assert service.spec.model.bundle.startswith(gpu_values()["operator"]["allowedHostPathPrefixes"][0] + "/")
    assert service.metadata["namespace"] in gpu_values()["namespaces"]["services"]


def _built() -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, GPUPool]]:
    """The operator's children for a two-split plan over both pools, and a profiling Job per pool."""
    from exitplan.api.plan import Cell, Plan, SplitPlan
    from exitplan.operator import builders

    pools, service = _pools_and_service()
    plan = Plan(
        service="minilm",
        model="minilm",
        splits=[SplitPlan(index=0, first_block=0, last_block=2), SplitPlan(index=1, first_block=3, last_block=5)],
        buckets=[128],
        cells=[
            Cell(split=0, bucket=128, pool="t4", replicas=3, batch_size=8),
            Cell(split=1, bucket=128, pool="a100", replicas=1, batch_size=16),
        ],
    )
    owner = {
        "apiVersion": "exitplan.io/v1alpha1",
        "kind": "EarlyExitService",
        "metadata": {"name": "minilm", "namespace": "ml-serving", "uid": "0000-1111"},
    }
    specs = {name: pool.spec for name, pool in pools.items()}
    children = builders.build_children(owner, service.spec, plan, specs)
    jobs = [
        builders.build_profile_job(owner, service.spec, name, specs[name], builders.profile_name("minilm", name))
        for name in sorted(specs)
    ]
    return children, jobs, pools


def test_workers_and_profiling_jobs_land_on_their_pools_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    children, jobs, pools = _built()
    workers = [
        d
        for d in children
        if d["kind"] == "Deployment" and d["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"
    ]
    assert len(workers) == 2 and len(jobs) == 2
    for obj in workers + jobs:
        pod = obj["spec"]["template"]["spec"]
        selector = pod["nodeSelector"]
        (name,) = [n for n, p in pools.items() if p.spec.node_selector.items() <= selector.items()]
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"]), obj["metadata"]["name"]
        gpu_containers = [c for c in pod.get("initContainers", []) + pod["containers"] if "limits" in c["resources"]]
        assert any(c["resources"]["limits"].get("nvidia.com/gpu") == 1 for c in gpu_containers), (name, pod)
        for version in (kube_versions()[0], kube_versions()[-1]):
            validate(obj, version, monkeypatch)
    # the profiling Job measures with what a worker uses: the CLI's default providers, `auto` (CUDA first)
    for job in jobs:
        profile = next(
            c for c in job["spec"]["template"]["spec"].get("initContainers", []) if c["command"][-1] == "profile"
        )
        assert _parse_cli(["profile", *profile["args"]])["providers"] == "auto"


def test_readme_recipe_names_files_that_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## On a cluster with NVIDIA GPUs", 1)[1].split("\n## ", 1)[0]
    for path in ("charts/exitplan/values-gpu.yaml", *(f"examples/gpu/{p.name}" for p in EXAMPLES.glob("*.yaml"))):
        assert path in section, path
        assert (ROOT / path).is_file()
    assert "--target worker " in section and "nvidia.com/gpu" in section
