"""A generation service with a remote bundle, end to end in the dev-cluster (`exitplan dev-cluster` and
`exitplan operator` as processes): the decoder bundle, with generation measurements beside it, pushed as
a tarball (`exitplan bundle push`) into the folder a real HTTP server serves; the service names its URL
and sha256. The operator's bundle-info Job (run by the pod runner: storage-init, then `exitplan
operator publish-bundle-info`) downloads and verifies it and publishes bundle.yaml and the measurements
as a ConfigMap; the operator plans from it (two pipeline stages at the measured threshold), and the
stage and router pods download the tarball themselves and answer what the local copy answers. A wrong
sha256 is a ProfilingFailed condition quoting storage-init, and nothing is started."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from devcluster_stack import stop_and_print
from generation_helpers import PROMPTS, post, tiny_decoder_bundle
from test_bundle_devcluster import web_server
from test_generation_devcluster import NS, Api
from test_operator_support import wait_for

from exitplan.api.bundle import record_digests
from exitplan.operator.bundle_volumes import STORAGE_INIT
from exitplan.storage.push import push
from exitplan.worker_image.generate.decoder import DecoderModel, full_greedy

EXITPLAN = [sys.executable, "-P", "-c", "from exitplan.cli import app; app()"]
GUARD = 180.0  # only stops a broken run from hanging the suite; not a performance assertion
MEASURED = {  # compute-bound recomputation: two pipeline stages win (test_generation_devcluster.py's)
    "profile": {
        "block_ms": [4.0, 4.0, 4.0],
        "head_ms": {"0": 0.1, "1": 0.1, "2": 0.1},
        "decide_share": {"2": 1.0},
        "hop_ms": 0.1,
        "recompute_ratio": 1.0,
    },
    "thresholds": [{"threshold": 0.8, "disagreement": 0.0, "decide_share": {"0": 0.5, "1": 0.1, "2": 0.4}}],
}


def wait(what: str, probe, guard: float = GUARD):
    return wait_for(what, probe, guard)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gen-remote")
    bundle = tmp / "decoder"
    shutil.copytree(tiny_decoder_bundle(), bundle, ignore=shutil.ignore_patterns("profiles"))
    (bundle / "profiles").mkdir()
    (bundle / "profiles" / "generation-local.json").write_text(json.dumps(MEASURED))
    record_digests(bundle)
    pushed = push(bundle, str(tmp / "www" / "models"))  # what `exitplan bundle push BUNDLE DIR` writes
    kubeconfig = tmp / "kubeconfig"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    logs = {name: (tmp / f"{name}.log").open("wb") for name in ("dev-cluster", "operator")}
    procs: list[subprocess.Popen] = []
    try:
        for name, args in (
            ("dev-cluster", ["dev-cluster", "--kubeconfig", str(kubeconfig), "--workdir", str(tmp / "work")]),
            # a 1 s profiling re-check: the operator looks for the Job's ConfigMap at each tick
            ("operator", ["operator", "--kubeconfig", str(kubeconfig), "--tick", "1", "--metrics-port", "0"]),
        ):
            procs.append(
                subprocess.Popen(
                    [*EXITPLAN, *args, *(["--profile-retry-seconds", "1"] if name == "operator" else [])],
                    stdout=logs[name],
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            )
            wait("the dev-cluster's kubeconfig", kubeconfig.exists, 60)
        api = Api(kubeconfig)
        pool = {"capacity": 3, "gpuResource": "", "cpu": "1", "memory": "1Gi"}
        api(
            api.client.create(
                {"apiVersion": "exitplan.io/v1alpha1", "kind": "GPUPool", "metadata": {"name": "local"}, "spec": pool}
            )
        )
        with web_server(tmp / "www") as (base, asked):
            yield {"api": api, "bundle": bundle, "pushed": pushed, "base": base, "asked": asked, "operator": procs[-1]}
        api.close()
    finally:
        stop_and_print(procs, logs, tmp)


def create_service(api: Api, name: str, url: str, sha256: str) -> None:
    model = {"name": name, "bundle": url, "bundleSha256": sha256, "task": "text-generation"}
    spec = {"model": model, "slo": {"latencyMs": 1000}, "pools": [{"name": "local"}], "planner": {"maxSplits": 2}}
    body = {
        "apiVersion": "exitplan.io/v1alpha1",
        "kind": "EarlyExitService",
        "metadata": {"name": name, "namespace": NS},
    }
    api(api.client.create({**body, "spec": spec}))


def status(api: Api, name: str) -> dict:
    return (api.get("EarlyExitService", name) or {}).get("status") or {}


def test_a_remote_generation_bundle_is_read_by_a_job_planned_and_served(stack):
    api: Api = stack["api"]
    tarball = "/models/tweet-decoder.tar.gz"  # push names it after the bundle's model
    assert stack["pushed"].uri.endswith(tarball)
    url = stack["base"] + tarball
    create_service(api, "remote", url, stack["pushed"].sha256)
    st = wait("the service is Ready", lambda: (s := status(api, "remote")).get("phase") == "Ready" and s)
    job = api.get("Job", "remote-bundle-info")
    assert job["status"]["succeeded"] == 1
    assert [c["name"] for c in job["spec"]["template"]["spec"]["initContainers"]] == [STORAGE_INIT]
    info = api.get("ConfigMap", "remote-bundle-info")
    assert set(info["data"]) == {"bundle.yaml", "generation-local.json"}
    assert json.loads(info["data"]["generation-local.json"]) == MEASURED
    assert st["plan"]["splits"] == 2  # planned from the measurements the Job published
    stage = api.get("Deployment", "remote-s0-b512-local")
    assert stage["spec"]["template"]["spec"]["initContainers"][0]["name"] == STORAGE_INIT
    # the Job and every pod (a router, two stages) downloaded the tarball from this server
    assert stack["asked"].count(tarball) >= 4
    port = wait(
        "the router Service's local endpoint",
        lambda: ((api.get("Service", "remote") or {}).get("status") or {}).get("loadBalancer", {}).get("ingress"),
    )[0]["ports"][0]["port"]
    base = f"http://127.0.0.1:{port}/v2/models/remote"
    model = DecoderModel(stack["bundle"])
    expected = full_greedy(model, model.codec.encode(PROMPTS[2]), 10, ignore_eos=True)[0]
    full = {"max_tokens": 10, "threshold": 1.0, "ignore_eos": True}
    code, answer = post(f"{base}/generate", {"text_input": PROMPTS[2], "parameters": full})
    assert code == 200 and answer["token_ids"] == expected, answer
    code, answer = post(f"{base}/generate", {"text_input": PROMPTS[2], "parameters": {"max_tokens": 4}})
    assert code == 200 and answer["threshold"] == 0.8, answer  # the measured threshold, read through the ConfigMap


def test_a_wrong_sha256_is_a_condition_quoting_storage_init_and_nothing_starts(stack):
    api: Api = stack["api"]
    create_service(api, "badsha", stack["base"] + "/models/tweet-decoder.tar.gz", "0" * 64)
    st = wait(
        "ProfilingFailed with reason BundleFetchFailed",
        lambda: (
            (s := status(api, "badsha"))
            and any(
                c["type"] == "ProfilingFailed" and c["reason"] == "BundleFetchFailed" for c in s.get("conditions", [])
            )
            and s
        ),
    )
    message = next(c["message"] for c in st["conditions"] if c["type"] == "ProfilingFailed")
    assert f"the tarball's sha256 is {stack['pushed'].sha256}, not {'0' * 64}" in message, message
    assert "container storage-init exited 1" in message and "badsha-bundle-info" in message
    assert api.get("ConfigMap", "badsha-bundle-info") is None and api.get("Deployment", "badsha-router") is None
    assert stack["operator"].poll() is None  # the operator reports; it does not crash
    assert status(api, "remote")["phase"] == "Ready"  # nor does the trouble reach another service
