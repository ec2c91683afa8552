"""A service whose bundle lives in an S3-compatible store, end to end in the dev-cluster: `exitplan
dev-cluster` and `exitplan operator` as processes, a real S3 server (moto), the bundle pushed with
`exitplan bundle push`. The profiling Job's and every router's and worker's storage-init container
(the pod runner runs init containers before the pod's container, as a kubelet does) fetch it with the
credentials of the Secret spec.model.bundleSecret names, verify its digests, and the pods serve it:
an inference through the router Service answers what the bundle answers locally. A second service
whose copy in the store has one corrupted file never starts: the service is Degraded with reason
BundleFetchFailed and the file named, from the Pod statuses the runner reports."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from s3_server import bundle_with_digests, s3_server
from test_generation_devcluster import Api
from test_operator_support import wait_for

from exitplan.operator.bundle_volumes import STORAGE_INIT
from exitplan.worker.bundle_runtime import BundleRuntime

EXITPLAN = [sys.executable, "-P", "-c", "from exitplan.cli import app; app()"]
GUARD = 240.0  # only stops a broken run from hanging the suite; not a performance assertion
NS = "default"
BUCKET = "bundles"


def wait(what: str, probe, guard: float = GUARD):
    return wait_for(what, probe, guard)


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
                        "spec": {"capacity": 4, "gpuResource": "", "cpu": "1", "memory": "1Gi"},
                    }
                )
            )
            yield {"api": api, "bundle": bundle, "s3": s3, "tmp": tmp}
            api.close()
        finally:
            for proc in reversed(procs):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            for name, log in logs.items():
                log.close()
                text = (tmp / f"{name}.log").read_text(errors="replace").splitlines()[-40:]
                print(f"---- {name} ----\n" + "\n".join(text))


def create_service(api: Api, name: str, bundle: str) -> None:
    api(
        api.client.create(
            {
                "apiVersion": "exitplan.io/v1alpha1",
                "kind": "EarlyExitService",
                "metadata": {"name": name, "namespace": NS},
                "spec": {
                    "model": {"name": "digits-cnn", "bundle": bundle, "bundleSecret": "s3-creds"},
                    "slo": {"latencyMs": 1000},
                    "pools": [{"name": "local", "maxGpus": 1}],
                    "router": {"replicas": 1},
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
    port = wait(
        "the router Service's local endpoint",
        lambda: ((api.get("Service", "digits") or {}).get("status") or {}).get("loadBalancer", {}).get("ingress"),
    )[0]["ports"][0]["port"]
    with np.load(stack["bundle"] / "data" / "heldout.npz") as held:
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
    assert len(labels) == len(x) and st["plan"]["replicas"] >= 1
    exits = next(o for o in answer["outputs"] if o["name"] == "exit_ramp")["data"]
    local = ramp_logits(stack["bundle"], x)  # what each ramp of the local copy answers
    for row, ramp in enumerate(exits):
        assert int(np.argmax(scores[row])) == int(np.argmax(local[ramp][row])), (row, ramp)
        assert labels[row] == str(int(np.argmax(local[ramp][row])))


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
