"""The dev-cluster's local pod runner with real processes: Deployments scale, report readiness,
roll make-before-break; ConfigMap volumes appear (and update) as files; Services get a local
proxy and headless Services an entry in the resolve file; Jobs run their containers in order."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import aiohttp
import pytest

from exitplan.devcluster.cluster import DevCluster, run_dev_cluster
from exitplan.operator.kube import ApiError, KubeClient, path

# A tiny "pod": serves its config file, its name and readiness on $EXITPLAN_PORT.
POD = r"""
import http.server, json, os, sys
conf = sys.argv[1]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = {"pod": os.environ["POD_NAME"], "conf": open(conf).read(), "ip": os.environ["POD_IP"],
                "resolve": os.environ["EXITPLAN_RESOLVE_FILE"]}
        self.send_response(200); self.end_headers(); self.wfile.write(json.dumps(body).encode())
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(os.environ["EXITPLAN_PORT"])), H).serve_forever()
"""

HANG_GUARD = 60.0  # stops a broken run from hanging; not a performance assertion


def deployment(name: str, replicas: int, version: str = "1") -> dict:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels, "annotations": {"v": version}},
                "spec": {
                    "containers": [
                        {
                            "name": "c",
                            "command": [sys.executable, "-c", POD],
                            "args": ["/etc/conf/value.txt"],
                            "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                            "readinessProbe": {"httpGet": {"path": "/ready", "port": 8080}},
                            "volumeMounts": [{"name": "conf", "mountPath": "/etc/conf"}],
                        }
                    ],
                    "volumes": [{"name": "conf", "configMap": {"name": "conf"}}],
                },
            },
        },
    }


async def wait_for(what: str, probe) -> object:
    deadline = time.monotonic() + HANG_GUARD
    last = None
    while time.monotonic() < deadline:
        last = await probe()
        if last:
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"never happened: {what} (last: {last!r})")


@pytest.fixture
async def dev(tmp_path):
    ready: asyncio.Future[DevCluster] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    task = asyncio.create_task(
        run_dev_cluster(tmp_path / "kubeconfig", tmp_path / "work", stop=stop, on_ready=lambda c: ready.set_result(c))
    )
    cluster = await asyncio.wait_for(ready, 30)
    async with KubeClient(cluster.url) as client:
        yield cluster, client
    stop.set()
    await task


async def get_json(url: str) -> dict:
    async with aiohttp.ClientSession() as session, session.get(url) as rsp:
        return await rsp.json(content_type=None)


async def test_deployments_run_scale_and_report(dev):
    cluster, client = dev
    await client.create(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "conf", "namespace": "default"},
            "data": {"value.txt": "first"},
        }
    )
    await client.create(deployment("web", 2))
    await client.create(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web", "namespace": "default"},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 8080}]},
        }
    )
    await client.create(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web-peers", "namespace": "default"},
            "spec": {"clusterIP": "None", "selector": {"app": "web"}, "ports": [{"port": 8080}]},
        }
    )
    url = path("Deployment", "default", "web")

    async def ready_count() -> int:
        return ((await client.get(url)).get("status") or {}).get("readyReplicas", 0)

    await wait_for("2 ready replicas", lambda: _eq(ready_count(), 2))
    svc = await wait_for("the Service's local endpoint", lambda: _ingress(client))
    # the Deployment's status and the Service's endpoints are synced apart (as in a cluster): wait for both
    await wait_for("both replicas in the Service's Endpoints", lambda: _eq(_ready_addresses(client), 2))
    seen = {(await get_json(f"http://127.0.0.1:{svc}/"))["pod"] for _ in range(6)}
    assert len(seen) == 2  # round robin over both replicas
    body = await get_json(f"http://127.0.0.1:{svc}/")
    assert body["conf"] == "first" and body["ip"] == "127.0.0.1"
    resolve = json.loads(open(body["resolve"]).read())
    assert len(resolve["web-peers.default.svc"]) == 2 and resolve["web.default.svc"] == [f"127.0.0.1:{svc}"]
    # ConfigMap change -> the mounted file changes in place (pods re-read it)
    await client.merge_patch(path("ConfigMap", "default", "conf"), {"data": {"value.txt": "second"}})
    await wait_for("the file follows the ConfigMap", lambda: _eq(_field(f"http://127.0.0.1:{svc}/", "conf"), "second"))
    # Scale down -> one process stops
    await client.merge_patch(url, {"spec": {"replicas": 1}})
    await wait_for("1 replica left", lambda: _eq(_status(client, url, "replicas"), 1))
    assert len([p for p in cluster.runner.pods.values() if p.owner == ("Deployment", "web")]) == 1
    # A new pod template replaces the pod, new one first
    old = {p.name for p in cluster.runner.pods.values() if p.owner == ("Deployment", "web")}
    await client.merge_patch(url, {"spec": {"template": {"metadata": {"annotations": {"v": "2"}}}}})
    await wait_for("rolled", lambda: _rolled(cluster, old))
    # the runner's pods changed; the Deployment's status follows at its next sync (beside two busy loops it
    # was read in between once, still counting the old pod): wait for the state it reports
    await wait_for("the rolled Deployment reports 1 ready replica", lambda: _eq(ready_count(), 1))


async def test_jobs_run_containers_in_order_and_report(dev, tmp_path):
    cluster, client = dev
    out = tmp_path / "out.txt"
    step = "import sys; open(sys.argv[1], 'a').write(sys.argv[2])"
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "j", "namespace": "default"},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "initContainers": [
                        {"name": "one", "command": [sys.executable, "-c", step], "args": [str(out), "a"]}
                    ],
                    "containers": [{"name": "two", "command": [sys.executable, "-c", step], "args": [str(out), "b"]}],
                }
            },
        },
    }
    await client.create(job)
    status = await wait_for("the Job completes", lambda: _job_done(client, "j"))
    assert status["succeeded"] == 1 and status["conditions"][0]["type"] == "Complete"
    assert out.read_text() == "ab"
    failing = {**job, "metadata": {"name": "bad", "namespace": "default"}}
    failing["spec"] = {
        "backoffLimit": 1,
        "template": {
            "spec": {
                "restartPolicy": "Never",
                "containers": [{"name": "x", "command": [sys.executable, "-c", "raise SystemExit(3)"]}],
            }
        },
    }
    await client.create(failing)
    status = await wait_for("the Job fails", lambda: _job_done(client, "bad"))
    assert status["conditions"][0]["type"] == "Failed" and status["failed"] == 2


async def _eq(coro, value) -> bool:
    return (await coro) == value


async def _status(client: KubeClient, url: str, key: str):
    return ((await client.get(url)).get("status") or {}).get(key)


async def _field(url: str, key: str):
    try:
        return (await get_json(url)).get(key)
    except aiohttp.ClientError:
        return None


async def _ready_addresses(client: KubeClient) -> int:
    try:
        endpoints = await client.get(path("Endpoints", "default", "web"))
    except ApiError:
        return 0
    return sum(len(subset.get("addresses") or []) for subset in endpoints.get("subsets") or [])


async def _ingress(client: KubeClient):
    svc = await client.get(path("Service", "default", "web"))
    ingress = ((svc.get("status") or {}).get("loadBalancer") or {}).get("ingress")
    return ingress[0]["ports"][0]["port"] if ingress else None


async def _rolled(cluster: DevCluster, old: set[str]) -> bool:
    names = {p.name for p in cluster.runner.pods.values() if p.owner == ("Deployment", "web")}
    pods = [p for p in cluster.runner.pods.values() if p.owner == ("Deployment", "web")]
    return bool(names) and not (names & old) and all(p.ready for p in pods)


async def _job_done(client: KubeClient, name: str):
    status = (await client.get(path("Job", "default", name))).get("status") or {}
    return status if status.get("conditions") else None


async def test_a_crash_looping_pod_stalls_the_rollout(dev):
    """A pod that keeps exiting (e.g. its bundle is unreachable) is restarted with backoff, and the
    Deployment reports Progressing=False with the pod's last log line, as a stalled rollout."""
    _, client = dev
    crash = (
        "import sys; print('loading bundle /nowhere/minilm', flush=True); "
        "print('error: bundle /nowhere/minilm: no bundle.yaml'); print('bye'); sys.exit(2)"
    )
    dep = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "crash", "namespace": "default"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "crash"}},
            "template": {
                "metadata": {"labels": {"app": "crash"}},
                "spec": {"containers": [{"name": "c", "command": [sys.executable, "-c", crash]}]},
            },
        },
    }
    await client.create(dep)

    async def stalled():
        status = (await client.get(path("Deployment", "default", "crash"))).get("status") or {}
        return next(
            (c for c in status.get("conditions", []) if c["type"] == "Progressing" and c["status"] == "False"), None
        )

    cond = await wait_for("the rollout stalls", stalled)
    assert cond["reason"] == "ProgressDeadlineExceeded"
    # the first line of the error (not the log's last line, nor the runner's header of the next run),
    # and the same message at every restart (what the operator's events aggregate by)
    assert cond["message"].endswith("its error: error: bundle /nowhere/minilm: no bundle.yaml"), cond
    pods = await client.list(path("Pod", "default"), "app=crash")

    async def restarted_again():
        now = await client.list(path("Pod", "default"), "app=crash")
        counts = [s.get("restartCount", 0) for p in now for s in p["status"].get("containerStatuses", [])]
        return now if counts and counts[0] > pods[0]["status"]["containerStatuses"][0]["restartCount"] else None

    (pod,) = await wait_for("another restart", restarted_again)
    assert (await stalled())["message"] == cond["message"]
    terminated = pod["status"]["containerStatuses"][0]["lastState"]["terminated"]
    assert terminated["message"].splitlines() == [  # the last run's tail, lines kept, no header
        "loading bundle /nowhere/minilm",
        "error: bundle /nowhere/minilm: no bundle.yaml",
        "bye",
    ]
    assert ((await client.get(path("Deployment", "default", "crash"))).get("status") or {}).get("readyReplicas") == 0
