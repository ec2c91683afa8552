"""Cluster end-to-end (DESIGN.md tier 4): the chart, the operator and the data plane on a real
Kubernetes cluster (kind), with real traffic from the Azure trace through the router Service.

Run it with `e2e/cluster/run.sh` (creates the kind cluster with the bundle mounted into its nodes,
builds and loads the CPU images, then runs this module). Without a reachable cluster with nodes
the module is skipped with the reason below.

Environment (run.sh sets it): KUBECONFIG; EXITPLAN_E2E_OPERATOR_IMAGE and EXITPLAN_E2E_WORKER_IMAGE
(repository:tag loaded into the nodes); EXITPLAN_E2E_BUNDLE (the bundle directory on this machine,
the same files the nodes mount); EXITPLAN_E2E_KEEP=1 leaves everything installed.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

SKIP_REASON = "no Kubernetes cluster reachable (set KUBECONFIG to a kind cluster to run)"
ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
RELEASE, RELEASE_NS = "exitplan", "exitplan-system"
GROUP, VERSION = "exitplan.io", "v1alpha1"


def _kubeconfig() -> str | None:
    """The kubeconfig of a reachable cluster that has nodes, else None (checked once, 5 s at most)."""
    path = os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
    if not os.path.exists(path.split(os.pathsep)[0]):
        return None
    try:
        from kubernetes import client, config

        cfg = client.Configuration()
        config.load_kube_config(config_file=path.split(os.pathsep)[0], client_configuration=cfg)
        nodes = client.CoreV1Api(client.ApiClient(cfg)).list_node(_request_timeout=5)
    except Exception:  # no server, no credentials, an emulated API without nodes: not a cluster to use
        return None
    return path.split(os.pathsep)[0] if nodes.items else None


KUBECONFIG = _kubeconfig()
if KUBECONFIG is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

pytestmark = pytest.mark.cluster
SERVICE = yaml.safe_load((HERE / "manifests" / "service.yaml").read_text())
POOL = yaml.safe_load((HERE / "manifests" / "gpupool.yaml").read_text())
NAMESPACE = SERVICE["metadata"]["namespace"]


@pytest.fixture(scope="module")
def api() -> Any:
    from kubernetes import client, config

    cfg = client.Configuration()
    config.load_kube_config(config_file=KUBECONFIG, client_configuration=cfg)
    return client.ApiClient(cfg)


def _image(env: str, default: str) -> dict[str, str]:
    repository, _, tag = os.environ.get(env, default).rpartition(":")
    return {"repository": repository, "tag": tag}


@pytest.fixture(scope="module")
def release(api: Any) -> Any:
    """`helm install` of charts/exitplan (Helm's Go SDK through helm-python-sdk), waited for."""
    import helm_python
    from kubernetes import client

    core = client.CoreV1Api(api)
    if NAMESPACE not in {n.metadata.name for n in core.list_namespace().items}:
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE)))
    values = yaml.safe_load((HERE / "values.yaml").read_text())
    values["operator"]["image"].update(_image("EXITPLAN_E2E_OPERATOR_IMAGE", "exitplan-operator:e2e"))
    values["dataPlane"]["image"].update(_image("EXITPLAN_E2E_WORKER_IMAGE", "exitplan-worker-cpu:e2e"))
    config = helm_python.Config(kubeconfig_path=KUBECONFIG, namespace=RELEASE_NS)
    chart = helm_python.Chart.load(ROOT / "charts" / "exitplan")
    if config.list(all_states=True, name_filter=f"^{RELEASE}$"):  # a leftover from an interrupted run
        config.uninstall(RELEASE, wait="watcher", timeout=300)
    config.install(chart, RELEASE, values, namespace=RELEASE_NS, create_namespace=True, wait="watcher", timeout=600)
    yield config
    if not os.environ.get("EXITPLAN_E2E_KEEP"):
        config.uninstall(RELEASE, wait="watcher", timeout=300)
    config.close()


def _wait(what: str, check: Any, timeout_s: float, every_s: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what} (last: {last!r})")


@pytest.fixture(scope="module")
def service(api: Any, release: Any) -> dict[str, Any]:
    """The GPUPool and the EarlyExitService applied, and the service Ready (profiling Job included)."""
    from kubernetes import client

    custom = client.CustomObjectsApi(api)
    for body, namespaced in ((POOL, False), (SERVICE, True)):
        plural = {"GPUPool": "gpupools", "EarlyExitService": "earlyexitservices"}[body["kind"]]
        try:
            if namespaced:
                custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, plural, body)
            else:
                custom.create_cluster_custom_object(GROUP, VERSION, plural, body)
        except client.ApiException as err:
            if err.status != 409:
                raise

    def ready() -> dict[str, Any] | None:
        obj = custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "earlyexitservices", "minilm")
        return obj if (obj.get("status") or {}).get("phase") == "Ready" else None

    obj = _wait("EarlyExitService minilm to be Ready", ready, timeout_s=1500)
    yield obj
    if not os.environ.get("EXITPLAN_E2E_KEEP"):
        custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "earlyexitservices", "minilm")
        apps = client.AppsV1Api(api)
        _wait(
            "the children to be garbage-collected",
            lambda: not apps.list_namespaced_deployment(NAMESPACE, label_selector="exitplan.io/service=minilm").items,
            timeout_s=300,
        )
        custom.delete_cluster_custom_object(GROUP, VERSION, "gpupools", POOL["metadata"]["name"])


@pytest.fixture(scope="module")
def router_url(service: dict[str, Any]) -> str:
    """The router Service on localhost through `kubectl port-forward`."""
    if shutil.which("kubectl") is None:
        pytest.fail("kubectl is needed for the port-forward to the router Service; install it")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        ["kubectl", "--kubeconfig", KUBECONFIG, "-n", NAMESPACE, "port-forward", "svc/minilm", f"{port}:8080"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=2) as rsp:
                return rsp.status == 200
        except OSError:
            return False

    try:
        _wait("the port-forward to svc/minilm", up, timeout_s=60, every_s=1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_operator_runs_with_the_chart(api: Any, release: Any) -> None:
    from kubernetes import client

    sts = client.AppsV1Api(api).read_namespaced_stateful_set("exitplan-operator", RELEASE_NS)
    assert sts.status.ready_replicas == sts.spec.replicas == 1
    crds = {c.metadata.name for c in client.ApiextensionsV1Api(api).list_custom_resource_definition().items}
    assert {
        "gpupools.exitplan.io",
        "earlyexitservices.exitplan.io",
        "modelprofiles.exitplan.io",
        "clusterkopfpeerings.kopf.dev",
    } <= crds


def test_service_is_planned_and_rolled_out(api: Any, service: dict[str, Any]) -> None:
    from kubernetes import client

    status = service["status"]
    assert status["plan"]["replicas"] >= 1 and status["endpoint"].startswith("http://minilm.")
    deployments = (
        client.AppsV1Api(api).list_namespaced_deployment(NAMESPACE, label_selector="exitplan.io/service=minilm").items
    )
    components = {d.metadata.labels["app.kubernetes.io/component"] for d in deployments}
    assert components == {"router", "worker"}
    assert all(d.status.ready_replicas == d.spec.replicas for d in deployments)
    profiles = client.CustomObjectsApi(api).list_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "modelprofiles")
    assert any(p["spec"]["pool"] == POOL["metadata"]["name"] for p in profiles["items"]), (
        "the profiling Job published no profile"
    )


def test_trace_through_the_service(router_url: str) -> None:
    """Replay the Azure trace (200 requests at 5 rps) through the Service: every request answered."""
    from exitplan.client.bench import run_bench

    bundle = Path(os.environ.get("EXITPLAN_E2E_BUNDLE", ROOT / "artifacts" / "bundles" / "minilm"))
    report = run_bench(router_url, "minilm", bundle, rps=5.0, limit=200, timeout_s=30.0)
    assert report.requests == 200
    assert report.results + report.error_total + report.lost == report.requests
    assert report.lost == 0, report.error_samples
    assert report.results >= 0.95 * report.requests, report.errors
    assert report.agreement is not None and report.agreement >= 1 - SERVICE["spec"]["accuracy"]["maxDrop"] - 0.05


def test_router_metrics_feed_the_dashboard(router_url: str) -> None:
    """The router's /metrics (what the PodMonitor scrapes) carries the series the dashboard queries (a
    gauge that exists only with evidence, such as a window's agreement, at least declared)."""
    import json
    import re

    with urllib.request.urlopen(f"{router_url}/metrics", timeout=5) as rsp:
        text = rsp.read().decode()
    exposed = set(re.findall(r"^(exitplan_[a-z_]+?)(?:\{| )", text, flags=re.M))
    gauges = set(re.findall(r"^# TYPE (exitplan_[a-z_]+) gauge$", text, flags=re.M))
    exposed |= {g for g in gauges if "agreement" in g or g.endswith(("_load_ratio", "threshold_ratio"))}
    dashboard = json.loads((ROOT / "charts" / "exitplan" / "dashboards" / "exitplan-overview.json").read_text())
    queried = {
        m
        for p in dashboard["panels"]
        for t in p.get("targets", [])
        for m in re.findall(r"exitplan_router_[a-z_]+", t["expr"])
    }
    assert queried and queried <= exposed, sorted(queried - exposed)
