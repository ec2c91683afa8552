"""A service whose bundle lives in an S3-compatible store, end to end in the dev-cluster: `exitplan
dev-cluster` and `exitplan operator` as processes, a real S3 server (moto), the bundle pushed with
`exitplan bundle push`. The profiling Job's and every router's and worker's storage-init container
(the pod runner runs init containers before the pod's container, as a kubelet does) fetch it with the
credentials of the Secret spec.model.bundleSecret names, verify its digests, and the pods serve it:
an inference through the router Service answers what the bundle answers locally. A second service
whose copy in the store has one corrupted file never starts: the service is Degraded with reason
BundleFetchFailed and the file named, from the Pod statuses the runner reports.

The same over HTTP: the bundle pushed as a tarball (`exitplan bundle push BUNDLE FILE.tar.gz`) into
the folder a real HTTP server serves, the service naming its URL and sha256: storage-init downloads
it, checks the tarball's sha256 and every file's digest, and the pods serve it. A wrong sha256 or a
server that does not answer is a Degraded/BundleFetchFailed condition with the reason, while the
operator keeps running and the pods retry with back-off; once the server answers, they start."""

from __future__ import annotations

import base64
import functools
import http.server
import json
import os
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from devcluster_stack import stop_and_print
from s3_server import bundle_with_digests, free_port, s3_server
from test_bundle_limits import zeros_tarball
from test_generation_devcluster import Api
from test_operator_support import wait_for

from exitplan.api.bundle import file_sha256
from exitplan.operator.bundle_volumes import STORAGE_INIT
from exitplan.storage.push import push
from exitplan.worker_image.bundle_runtime import BundleRuntime

EXITPLAN = [sys.executable, "-P", "-c", "from exitplan.cli import app; app()"]
GUARD = 240.0  # only stops a broken run from hanging the suite; not a performance assertion
NS = "default"
BUCKET = "bundles"


def wait(what: str, probe, guard: float = GUARD):
    return wait_for(what, probe, guard)


class _Counting(http.server.SimpleHTTPRequestHandler):
    """Serves a folder; remembers the paths it was asked for."""

    asked: list[str]

    def log_message(self, *args: object) -> None:
        self.asked.append(self.path)


@contextmanager
def web_server(root: Path, port: int = 0) -> Iterator[tuple[str, list[str]]]:
    """A real HTTP server over `root` on 127.0.0.1 (what hosting a pushed tarball looks like): its base
    URL, and the request paths it logged."""
    asked: list[str] = []
    handler = type("Handler", (_Counting,), {"asked": asked})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), functools.partial(handler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, digits_bundle):
    tmp = tmp_path_factory.mktemp("bundle-dev")
    bundle = bundle_with_digests(digits_bundle, tmp / "digits")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}  # the pods get the Secret's, only
    logs = {name: (tmp / f"{name}.log").open("wb") for name in ("dev-cluster", "operator")}
    procs: list[subprocess.Popen] = []
    with s3_server(tmp / "moto.log") as s3:
        s3.client().make_bucket(BUCKET)
        pushed = subprocess.run(
            [*EXITPLAN, "bundle", "push", str(bundle), f"s3://{BUCKET}/digits"],
            env={**env, **s3.env},
            capture_output=True,
        )
        assert pushed.returncode == 0, pushed.stderr
        try:
            kubeconfig = tmp / "kubeconfig"
            for name, args in (
                ("dev-cluster", ["dev-cluster", "--kubeconfig", str(kubeconfig), "--workdir", str(tmp / "work")]),
                ("operator", ["operator", "--kubeconfig", str(kubeconfig), "--tick", "1", "--metrics-port", "0"]),
            ):
                procs.append(
                    subprocess.Popen(
                        [*EXITPLAN, *args], stdout=logs[name], stderr=subprocess.STDOUT, env=env, start_new_session=True
                    )
                )
                wait("the dev-cluster's kubeconfig", kubeconfig.exists, 60)
            api = Api(kubeconfig)
            secret = {k: base64.b64encode(v.encode()).decode() for k, v in s3.env.items()}
            api(
                api.client.create(
                    {
                        "apiVersion": "v1",
                        "kind": "Secret",
                        "metadata": {"name": "s3-creds", "namespace": NS},
                        "data": secret,
                    }
                )
            )
            api(
                api.client.create(
                    {
                        "apiVersion": "exitplan.io/v1alpha1",
                        "kind": "GPUPool",
                        "metadata": {"name": "local"},
                        "spec": {"capacity": 8, "gpuResource": "", "cpu": "1", "memory": "1Gi"},
                    }
                )
            )
            yield {"api": api, "bundle": bundle, "s3": s3, "tmp": tmp, "operator": procs[-1]}
            api.close()
        finally:
            stop_and_print(procs, logs, tmp)


def create_service(api: Api, name: str, bundle: str, **model: str) -> None:
    """A service of the digits bundle at `bundle`; `model`: more spec.model fields (default: the S3
    Secret, as bundleSecret)."""
    model = model or {"bundleSecret": "s3-creds"}
    api(
        api.client.create(
            {
                "apiVersion": "exitplan.io/v1alpha1",
                "kind": "EarlyExitService",
                "metadata": {"name": name, "namespace": NS},
                "spec": {
                    "model": {"name": "digits-cnn", "bundle": bundle, **model},
                    "slo": {"latencyMs": 1000},
                    "pools": [{"name": "local", "maxGpus": 1}],
                    "router": {"replicas": 1},
                    # a router pod and worker pods, each of which must fetch the bundle (the planner would
                    # otherwise run this one-split model in the router alone: planner/serving_path.py)
                    "planner": {"colocate": "off"},
                },
            }
        )
    )


def ramp_logits(bundle: Path, x: np.ndarray) -> dict[str, np.ndarray]:
    """Every ramp's logits (the final head's too) on `x`, from a local copy of the bundle."""
    runtime = BundleRuntime(bundle)
    state, out = {"x": x}, {}
    for index in range(len(runtime.manifest.blocks)):
        runtime.run_block(index, state)
        for ramp in runtime.manifest.ramps_in(index, index):
            out[ramp.name] = runtime.run_ramp(ramp.name, state)
    return out


def phase(api: Api, name: str) -> dict | None:
    obj = api.get("EarlyExitService", name) or {}
    return obj.get("status")


def answers_like_the_local_copy(api: Api, name: str, bundle: Path) -> None:
    """An inference through service `name`'s router Service answers what each ramp of the local copy does."""
    port = wait(
        "the router Service's local endpoint",
        lambda: ((api.get("Service", name) or {}).get("status") or {}).get("loadBalancer", {}).get("ingress"),
    )[0]["ports"][0]["port"]
    with np.load(bundle / "data" / "heldout.npz") as held:
        x = held["x"][:4].astype(np.float32)
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v2/models/digits-cnn/infer",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        answer = json.loads(r.read())
    labels = next(o for o in answer["outputs"] if o["name"] == "label")["data"]
    scores = np.array(next(o for o in answer["outputs"] if o["name"] == "scores")["data"]).reshape(len(x), -1)
    assert len(labels) == len(x)
    exits = next(o for o in answer["outputs"] if o["name"] == "exit_ramp")["data"]
    local = ramp_logits(bundle, x)  # what each ramp of the local copy answers
    for row, ramp in enumerate(exits):
        assert int(np.argmax(scores[row])) == int(np.argmax(local[ramp][row])), (row, ramp)
        assert labels[row] == str(int(np.argmax(local[ramp][row])))


def test_an_s3_bundle_is_fetched_verified_and_served(stack):
    api: Api = stack["api"]
    create_service(api, "digits", f"s3://{BUCKET}/digits")
    st = wait("the service is Ready", lambda: (s := phase(api, "digits")) and s.get("phase") == "Ready" and s)
    profile = api.get("ModelProfile", "digits-cnn-local")  # measured by a Job that fetched the bundle from S3
    assert profile and profile["spec"]["model"] == "digits-cnn"
    router = api.get("Deployment", "digits-router")
    assert router["spec"]["template"]["spec"]["initContainers"][0]["name"] == STORAGE_INIT
    pods = api(api.client.list("/api/v1/namespaces/default/pods", "exitplan.io/service=digits"))
    assert pods and all(p["status"]["phase"] == "Running" for p in pods)
    for pod in pods:
        (init,) = pod["status"]["initContainerStatuses"]
        assert init["name"] == STORAGE_INIT and init["state"]["terminated"]["exitCode"] == 0
    assert st["plan"]["replicas"] >= 1
    answers_like_the_local_copy(api, "digits", stack["bundle"])


def test_a_corrupted_copy_makes_the_service_degraded_naming_the_file(stack):
    api: Api = stack["api"]
    wait("the first service's profile", lambda: api.get("ModelProfile", "digits-cnn-local"))  # planning uses it
    s3 = stack["s3"]
    client = s3.client()
    bundle: Path = stack["bundle"]
    for obj in client.list_objects(BUCKET, prefix="digits/", recursive=True):
        rel = obj.object_name[len("digits/") :]
        data = bytearray((bundle / rel).read_bytes())
        if rel == "ramps/ramp1.onnx":
            data[len(data) // 2] ^= 0xFF
        path = stack["tmp"] / "upload"
        path.write_bytes(bytes(data))
        client.fput_object(BUCKET, f"corrupt/{rel}", str(path))
    create_service(api, "broken", f"s3://{BUCKET}/corrupt")
    st = wait(
        "Degraded: BundleFetchFailed",
        lambda: (
            (s := phase(api, "broken"))
            and any(c["type"] == "Degraded" and c["reason"] == "BundleFetchFailed" for c in s.get("conditions", []))
            and s
        ),
    )
    message = next(c["message"] for c in st["conditions"] if c["type"] == "Degraded")
    assert "ramps/ramp1.onnx" in message and "s3://bundles/corrupt" in message and st["phase"] == "Degraded"
    pods = api(api.client.list("/api/v1/namespaces/default/pods", "exitplan.io/service=broken"))
    assert pods and all(p["status"]["phase"] == "Pending" for p in pods)  # stuck in Init, as in a cluster
    (init,) = pods[0]["status"]["initContainerStatuses"]
    assert "ramps/ramp1.onnx" in (init["state"].get("terminated") or init["lastState"]["terminated"])["message"]
    assert not (api.get("Deployment", "broken-router") or {}).get("status", {}).get("readyReplicas")


def degraded_by_the_bundle(api: Api, name: str) -> dict | None:
    """The service's status once it is Degraded with reason BundleFetchFailed (None before)."""
    s = phase(api, name)
    if s and any(c["type"] == "Degraded" and c["reason"] == "BundleFetchFailed" for c in s.get("conditions", [])):
        return s
    return None


def init_messages(api: Api, name: str) -> list[str]:
    """What each of the service's pods' storage-init container said when it last failed."""
    pods = api(api.client.list("/api/v1/namespaces/default/pods", f"exitplan.io/service={name}"))
    out = []
    for pod in pods:
        for init in pod["status"].get("initContainerStatuses") or []:
            term = init["state"].get("terminated") or (init.get("lastState") or {}).get("terminated") or {}
            out.append(str(term.get("message") or ""))
    return out


def test_an_http_tarball_is_fetched_checked_against_its_sha256_and_served(stack):
    api: Api = stack["api"]
    wait("the first service's profile", lambda: api.get("ModelProfile", "digits-cnn-local"))  # planning uses it
    root = stack["tmp"] / "www"
    pushed = push(stack["bundle"], str(root / "models"))  # what `exitplan bundle push BUNDLE DIR` writes
    assert pushed.sha256 and Path(pushed.uri) == root / "models" / "digits-cnn.tar.gz"
    with web_server(root) as (base, asked):
        url = f"{base}/models/digits-cnn.tar.gz"
        create_service(api, "webbundle", url, bundleSha256=pushed.sha256)
        wait("the service is Ready", lambda: (s := phase(api, "webbundle")) and s.get("phase") == "Ready" and s)
        router = api.get("Deployment", "webbundle-router")
        (init,) = router["spec"]["template"]["spec"]["initContainers"]
        assert init["name"] == STORAGE_INIT and init["args"][:2] == [url, "/var/run/exitplan-bundle"]
        assert init["args"][init["args"].index("--sha256") + 1] == pushed.sha256 and "--allow-http" in init["args"]
        pods = api(api.client.list("/api/v1/namespaces/default/pods", "exitplan.io/service=webbundle"))
        assert len(pods) >= 2 and all(p["status"]["phase"] == "Running" for p in pods)  # the router, the workers
        for pod in pods:
            (status,) = pod["status"]["initContainerStatuses"]
            assert status["state"]["terminated"]["exitCode"] == 0
        # every pod downloaded the tarball from this server (none read the bundle from elsewhere)
        assert asked.count("/models/digits-cnn.tar.gz") >= len(pods)
        answers_like_the_local_copy(api, "webbundle", stack["bundle"])
        api(api.client.delete(f"/apis/exitplan.io/v1alpha1/namespaces/{NS}/earlyexitservices/webbundle"))


def test_a_wrong_sha256_or_an_unreachable_server_is_a_condition_and_the_pods_retry(stack):
    api: Api = stack["api"]
    wait("the first service's profile", lambda: api.get("ModelProfile", "digits-cnn-local"))
    root = stack["tmp"] / "www2"
    pushed = push(stack["bundle"], str(root / "digits.tar.gz"))
    port = free_port()  # nothing listens here yet
    with web_server(root) as (base, _):
        create_service(api, "badsha", f"{base}/digits.tar.gz", bundleSha256="0" * 64)
        create_service(api, "noserver", f"http://127.0.0.1:{port}/digits.tar.gz", bundleSha256=pushed.sha256)
        wrong = wait("badsha: Degraded, BundleFetchFailed", lambda: degraded_by_the_bundle(api, "badsha"))
    down = wait("noserver: Degraded, BundleFetchFailed", lambda: degraded_by_the_bundle(api, "noserver"))
    message = next(c["message"] for c in wrong["conditions"] if c["type"] == "Degraded")
    assert f"the tarball's sha256 is {pushed.sha256}, not {'0' * 64}" in message and wrong["phase"] == "Degraded"
    assert any(pushed.sha256 in m for m in init_messages(api, "badsha"))
    message = next(c["message"] for c in down["conditions"] if c["type"] == "Degraded")
    assert f"http://127.0.0.1:{port}/digits.tar.gz: cannot reach the server" in message
    assert "retry with back-off" in message and down["phase"] == "Degraded"
    for name in ("badsha", "noserver"):
        pods = api(api.client.list("/api/v1/namespaces/default/pods", f"exitplan.io/service={name}"))
        assert pods and all(p["status"]["phase"] == "Pending" for p in pods)  # held in Init, as in a cluster
    assert stack["operator"].poll() is None  # the operator reports; it does not crash
    assert phase(api, "digits")["phase"] == "Ready"  # nor does the trouble reach another service
    # the pods keep retrying storage-init with back-off: once the server answers, they fetch and start
    with web_server(root, port):
        wait("noserver recovers: Ready", lambda: (s := phase(api, "noserver")) and s.get("phase") == "Ready" and s)
        st = phase(api, "noserver")
        degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
        assert degraded["status"] == "False" and degraded["reason"] == "BundleFetched"
    assert degraded_by_the_bundle(api, "badsha")  # a wrong sha256 stays wrong
    for name in ("badsha", "noserver"):
        api(api.client.delete(f"/apis/exitplan.io/v1alpha1/namespaces/{NS}/earlyexitservices/{name}"))


def test_an_archive_bomb_is_a_condition_naming_the_limit(stack):
    """Issue 28 item 6 end to end: a 194 KB tar.gz of 200 MB, pinned by its right sha256. Every pod's
    storage-init refuses it after about 1 MiB read; the service is Degraded, BundleFetchFailed, with the
    limit and how to raise it; the bundle's emptyDir carries its sizeLimit."""
    api: Api = stack["api"]
    wait("the first service's profile", lambda: api.get("ModelProfile", "digits-cnn-local"))
    root = stack["tmp"] / "www3"
    root.mkdir()
    bomb = zeros_tarball(root / "bomb.tar.gz", [("weights.onnx", 200 * 1000 * 1000)])
    with web_server(root) as (base, _):
        create_service(api, "bomb", f"{base}/bomb.tar.gz", bundleSha256=file_sha256(bomb))
        st = wait("bomb: Degraded, BundleFetchFailed", lambda: degraded_by_the_bundle(api, "bomb"))
    message = next(c["message"] for c in st["conditions"] if c["type"] == "Degraded")
    print(f"bomb ({bomb.stat().st_size} B): {message}")
    assert "above the limit of 100:1" in message and "--max-ratio" in message, message
    assert any("before refusing" in m for m in init_messages(api, "bomb"))
    router = api.get("Deployment", "bomb-router")
    (volume,) = [v for v in router["spec"]["template"]["spec"]["volumes"] if v["name"] == "bundle"]
    assert volume["emptyDir"]["sizeLimit"] == f"{2 * 20 * 1024 + 64}Mi"  # the default bound, twice for a tarball
    assert stack["operator"].poll() is None and phase(api, "digits")["phase"] == "Ready"
    api(api.client.delete(f"/apis/exitplan.io/v1alpha1/namespaces/{NS}/earlyexitservices/bomb"))
