"""The dev cluster serves what kubectl needs, tested by running kubectl against it: `kubectl get ns`,
`kubectl get deploy,events` with their columns (server-side tables), `kubectl delete ees NAME` of an
object a finalizer holds (kubectl watches it go); its ports are the ones asked for (`--pod-ports`,
`--service-ports`) and every listening port is on 127.0.0.1 (the pods, even with `--host 0.0.0.0` in
their args; the operator's metrics and health ports); `exitplan up --routers 2` gives its routers
control ports from `--control-port` on."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_devcluster_runner import wait_for

from exitplan.devcluster.cluster import DevCluster, run_dev_cluster
from exitplan.localrun.deployment import LocalDeployment
from exitplan.localrun.ports import free_port_block
from exitplan.operator import crdgen
from exitplan.operator.kube import KubeClient, path

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")

# A "pod" that listens where its args say (`--host H`), on $EXITPLAN_PORT, answering 200.
POD = r"""
import http.server, os, sys
host = sys.argv[sys.argv.index("--host") + 1]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer((host, int(os.environ["EXITPLAN_PORT"])), H).serve_forever()
"""


def listening(port: int) -> set[str]:
    """The local addresses something listens on at `port` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:
                raw = bytes.fromhex(address)
                words = [raw[i : i + 4][::-1] for i in range(0, width // 2, 4)]
                found.add(socket.inet_ntop(socket.AF_INET if width == 8 else socket.AF_INET6, b"".join(words)))
    return found


async def kubectl(cluster: DevCluster, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    proc = await asyncio.create_subprocess_exec(
        "kubectl",
        f"--kubeconfig={cluster.kubeconfig}",
        f"--cache-dir={tmp / 'cache'}",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    return subprocess.CompletedProcess(args, proc.returncode or 0, out.decode(), err.decode())


@pytest.fixture
async def dev(tmp_path):
    if not Path("/proc/net/tcp").exists():
        pytest.skip("reads listening sockets from /proc/net/tcp (Linux)")
    pods, services = free_port_block(40), free_port_block(10)
    ready: asyncio.Future[DevCluster] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    task = asyncio.create_task(
        run_dev_cluster(
            tmp_path / "kubeconfig",
            tmp_path / "work",
            stop=stop,
            on_ready=lambda c: ready.set_result(c),
            pod_ports=pods,
            service_ports=services,
        )
    )
    cluster = await asyncio.wait_for(ready, 30)
    async with KubeClient(cluster.url) as client:
        yield cluster, client, pods, services
    stop.set()
    await task


def deployment() -> dict:
    labels = {"app": "web"}
    container = {
        "name": "c",
        "command": [sys.executable, "-c", POD],
        "args": ["--host", "0.0.0.0"],
        "readinessProbe": {"httpGet": {"path": "/", "port": 8080}},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}},
        },
    }


async def test_kubectl_get_ns_deploy_events_and_the_ports_asked_for(dev, tmp_path):
    cluster, client, pod_ports, service_ports = dev
    ns = await kubectl(cluster, tmp_path, "get", "ns")
    assert ns.returncode == 0, ns.stderr
    assert ns.stdout.split()[:3] == ["NAME", "STATUS", "AGE"] and "default" in ns.stdout and "Active" in ns.stdout
    await client.create(deployment())
    await client.create(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web", "namespace": "default"},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
        }
    )
    await client.create(
        {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": "web.1", "namespace": "default"},
            "involvedObject": {"kind": "Deployment", "name": "web", "namespace": "default"},
            "type": "Normal",
            "reason": "ScalingReplicaSet",
            "message": "Scaled up to 1",
            "lastTimestamp": "2026-01-01T00:00:00Z",
        }
    )

    async def ready():
        got = await kubectl(cluster, tmp_path, "get", "deploy,events")
        return got if "1/1" in got.stdout else None

    got = await wait_for("kubectl shows the Deployment ready", ready)
    tables = got.stdout.split("\n\n")
    assert tables[0].splitlines()[0].split() == ["NAME", "READY", "UP-TO-DATE", "AVAILABLE", "AGE"], got.stdout
    assert tables[0].splitlines()[1].split()[:4] == ["deployment.apps/web", "1/1", "1", "1"], got.stdout
    assert tables[1].splitlines()[0].split() == ["LAST", "SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"], got.stdout
    assert "deployment/web" in tables[1] and "Scaled up to 1" in tables[1]
    # Ports: the pod's from --pod-ports on, the Service's proxy from --service-ports on, all on 127.0.0.1.
    (pod,) = await client.list(path("Pod", "default"), "app=web")
    port = next(iter(cluster.runner.pods.values())).port
    assert pod_ports <= port < pod_ports + 40 and listening(port) == {"127.0.0.1"}
    svc = await client.get(path("Service", "default", "web"))
    proxy = svc["status"]["loadBalancer"]["ingress"][0]["ports"][0]["port"]
    assert service_ports <= proxy < service_ports + 10 and listening(proxy) == {"127.0.0.1"}
    host, api_port = cluster.url.removeprefix("http://").split(":")
    assert listening(int(api_port)) == {"127.0.0.1"}, host
    assert pod["metadata"]["name"]


async def test_kubectl_deletes_a_custom_resource_that_a_finalizer_holds(dev, tmp_path):
    cluster, client, _, _ = dev
    crd = crdgen.build_crd("EarlyExitService")
    ees = {
        "apiVersion": f"{crd['spec']['group']}/v1alpha1",
        "kind": "EarlyExitService",
        "metadata": {"name": "held", "namespace": "default", "finalizers": ["test.exitplan.io/hold"]},
        "spec": {"model": {"name": "m", "bundle": "/models/m"}, "slo": {"latencyMs": 100}, "pools": [{"name": "p"}]},
    }
    await client.create(ees)
    delete = asyncio.create_task(kubectl(cluster, tmp_path, "delete", "ees", "held", "--timeout=120s"))
    url = path("EarlyExitService", "default", "held")

    async def marked():
        return (await client.get(url))["metadata"].get("deletionTimestamp")

    await wait_for("kubectl asked for the deletion", marked)
    await asyncio.sleep(0.5)  # kubectl now watches the object (what used to fail: "no stream serializers")
    await client.merge_patch(url, {"metadata": {"finalizers": None}})
    done = await asyncio.wait_for(delete, 120)
    assert done.returncode == 0 and 'earlyexitservice.exitplan.io "held" deleted' in done.stdout, done
    assert "serializer" not in done.stderr, done.stderr
    assert (await kubectl(cluster, tmp_path, "get", "ees")).stdout == ""


def _the_operators_ports_are_guarded(metrics: int, health: int) -> None:
    """/metrics and /healthz answer; an unknown path is a JSON 404; a connection that never finishes its
    request's head is closed by the server (the header timeout), never held (operator/http_ports.py)."""
    import json
    import socket
    import urllib.error
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=30).read().decode()
    assert "exitplan_operator" in text or "exitplan_" in text, text[:500]
    assert json.loads(urllib.request.urlopen(f"http://127.0.0.1:{health}/healthz", timeout=30).read()) == {"ok": True}
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(f"http://127.0.0.1:{health}/nothing", timeout=30)
    assert missing.value.code == 404 and "error" in json.loads(missing.value.read())
    with socket.create_connection(("127.0.0.1", metrics), timeout=120) as slow:  # 120 s: a hang guard
        slow.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # the head never ends
        assert slow.recv(1024) == b""  # closed at the header timeout, no answer


def test_the_operator_listens_on_127_0_0_1(tmp_path):
    if not Path("/proc/net/tcp").exists():
        pytest.skip("reads listening sockets from /proc/net/tcp (Linux)")
    from test_operator_support import ClusterThread

    metrics = free_port_block(2)
    health = metrics + 1
    with ClusterThread(tmp_path) as cluster:
        env = {
            **os.environ,
            "EXITPLAN_OPERATOR_METRICS_PORT": str(metrics),
            "EXITPLAN_OPERATOR_HEALTH_PORT": str(health),
        }
        proc = subprocess.Popen(
            [sys.executable, "-P", "-c", "from exitplan.cli import app; app()", "operator"]
            + ["--kubeconfig", str(cluster.kubeconfig)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 120  # a hang guard, not a performance assertion
            while not (listening(metrics) and listening(health)) and time.monotonic() < deadline:
                assert proc.poll() is None, "the operator exited"
                time.sleep(0.2)
            assert listening(metrics) == {"127.0.0.1"} and listening(health) == {"127.0.0.1"}
            _the_operators_ports_are_guarded(metrics, health)
        finally:
            proc.terminate()
            proc.wait(30)


def test_a_second_router_takes_the_control_port_after_the_first(tmp_path):
    plan = SimpleNamespace(cells=[SimpleNamespace(replicas=2)], splits=[0])
    dep = LocalDeployment(
        bundle=tmp_path, plan=plan, spec=None, workdir=tmp_path, routers=3, control_port=9200, base_port=9100
    )  # type: ignore[arg-type]
    dep._choose_control_ports()
    assert dep.control_ports == [9200, 9201, 9202] and dep.control_port == 9200
    inside = LocalDeployment(
        bundle=tmp_path, plan=plan, spec=None, workdir=tmp_path, routers=2, control_port=9101, base_port=9100
    )  # type: ignore[arg-type]
    inside._choose_control_ports()  # 9100-9105 are the workers' and routers': the ports after them
    assert inside.control_ports == [9106, 9107]
