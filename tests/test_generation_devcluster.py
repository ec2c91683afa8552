"""A generation service end to end in the dev-cluster: `exitplan dev-cluster` and `exitplan operator`
as processes; the operator builds the stage Deployments, the pod runner starts `exitplan generate-stage` and
`exitplan router` from them (the same commands pods run), and requests go through the router Service's local
endpoint over HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from devcluster_stack import stop_and_print
from generation_helpers import PROMPTS, post, tiny_decoder_bundle
from test_operator_support import wait_for

from exitplan.operator.kube import ApiError, KubeClient, path
from exitplan.worker_image.generate.decoder import DecoderModel, full_greedy

EXITPLAN = [sys.executable, "-c", "from exitplan.cli import app; app()"]
GUARD = 180.0  # only stops a broken run from hanging the suite; not a performance assertion
NS = "default"


def wait(what: str, probe, guard: float = GUARD):
    return wait_for(what, probe, guard)


class Api:
    """A blocking KubeClient for the test body."""

    def __init__(self, kubeconfig: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.client = KubeClient.from_config(str(kubeconfig))

    def __call__(self, coro):
        return self.loop.run_until_complete(coro)

    def get(self, kind: str, name: str) -> dict | None:
        try:
            return self(self.client.get(path(kind, NS if kind != "GPUPool" else None, name)))
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    def close(self) -> None:
        self(self.client.close())
        self.loop.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gen-dev")
    bundle = tmp / "decoder"  # a copy: the operator plans without measurements (none are kept beside it)
    shutil.copytree(tiny_decoder_bundle(), bundle, ignore=shutil.ignore_patterns("profiles"))
    kubeconfig = tmp / "kubeconfig"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    logs = {name: (tmp / f"{name}.log").open("wb") for name in ("dev-cluster", "operator")}
    cluster = subprocess.Popen(
        [*EXITPLAN, "dev-cluster", "--kubeconfig", str(kubeconfig), "--workdir", str(tmp / "work")],
        stdout=logs["dev-cluster"],
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    procs = [cluster]
    try:
        wait("the dev-cluster's kubeconfig", kubeconfig.exists, 60)
        procs.append(
            subprocess.Popen(
                [
                    *EXITPLAN,
                    "operator",
                    "--kubeconfig",
                    str(kubeconfig),
                    "--tick",
                    "1",
                    "--metrics-port",
                    "0",
                    "--allow-host-path",  # the decoder bundles are copies under tmp: host paths of the "node"
                    str(tmp),
                ],
                stdout=logs["operator"],
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        )
        api = Api(kubeconfig)
        yield {"tmp": tmp, "bundle": bundle, "api": api}
        api.close()
    finally:
        stop_and_print(procs, logs, tmp)


def test_operator_runs_a_generation_service_that_answers_over_http(stack):
    api: Api = stack["api"]
    api(
        api.client.create(
            {
                "apiVersion": "exitplan.io/v1alpha1",
                "kind": "GPUPool",
                "metadata": {"name": "local"},
                "spec": {"capacity": 3, "gpuResource": "", "cpu": "1", "memory": "1Gi"},  # shared: 1 + 2 stages
            }
        )
    )
    api(
        api.client.create(
            {
                "apiVersion": "exitplan.io/v1alpha1",
                "kind": "EarlyExitService",
                "metadata": {"name": "tweets", "namespace": NS},
                "spec": {
                    "model": {"name": "tweets", "bundle": str(stack["bundle"]), "task": "text-generation"},
                    "slo": {"latencyMs": 1000},
                    "pools": [{"name": "local"}],
                },
            }
        )
    )
    st = wait(
        "the generation service is Ready",
        lambda: (
            ((api.get("EarlyExitService", "tweets") or {}).get("status") or {}).get("phase") == "Ready"
            and api.get("EarlyExitService", "tweets")["status"]
        ),
    )
    assert st["plan"]["splits"] == 1 and "recompute" in st["message"] + json.dumps(st["conditions"])
    stage = api.get("Deployment", "tweets-s0-b512-local")
    assert stage["spec"]["template"]["spec"]["containers"][0]["command"] == ["exitplan", "generate-stage"]
    port = wait(
        "the router Service's local endpoint",
        lambda: ((api.get("Service", "tweets") or {}).get("status") or {}).get("loadBalancer", {}).get("ingress"),
    )[0]["ports"][0]["port"]
    url = f"http://127.0.0.1:{port}/v2/models/tweets"
    model = DecoderModel(stack["bundle"])
    expected = full_greedy(model, model.codec.encode(PROMPTS[0]), 10, ignore_eos=True)[0]
    code, answer = post(
        f"{url}/generate", {"text_input": PROMPTS[0], "parameters": {"max_tokens": 10, "ignore_eos": True}}
    )
    assert code == 200 and answer["token_ids"] == expected, answer
    request = urllib.request.Request(
        f"{url}/generate_stream",
        headers={"Content-Type": "application/json"},
        data=json.dumps({"text_input": PROMPTS[1], "parameters": {"max_tokens": 5}}).encode(),
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r if line.startswith(b"data: ")]
    assert events[-1]["done"] and len(events) == len(events[-1]["token_ids"]) + 1
    code, answer = post(f"{url}/generate", {"text_input": "", "parameters": {"max_tokens": 3}})
    assert code == 400 and "prompt is empty" in answer["error"]


def test_a_pipeline_plan_runs_chained_stage_pods(stack):
    """Measurements beside the bundle (crafted: compute-bound recomputation) make the operator plan two
    pipeline stages; the first stage's --next resolves the second's headless Service in the dev-cluster."""
    api: Api = stack["api"]
    bundle = stack["tmp"] / "decoder-measured"
    shutil.copytree(stack["bundle"], bundle)
    (bundle / "profiles").mkdir(exist_ok=True)
    (bundle / "profiles" / "generation-local.json").write_text(
        json.dumps(
            {
                "profile": {
                    "block_ms": [4.0, 4.0, 4.0],
                    "head_ms": {"0": 0.1, "1": 0.1, "2": 0.1},
                    "decide_share": {"2": 1.0},
                    "hop_ms": 0.1,
                    "recompute_ratio": 1.0,
                },
                "thresholds": [{"threshold": 0.8, "disagreement": 0.0, "decide_share": {"0": 0.5, "1": 0.1, "2": 0.4}}],
            }
        )
    )
    if api.get("GPUPool", "local") is None:
        api(
            api.client.create(
                {
                    "apiVersion": "exitplan.io/v1alpha1",
                    "kind": "GPUPool",
                    "metadata": {"name": "local"},
                    "spec": {"capacity": 3, "gpuResource": "", "cpu": "1", "memory": "1Gi"},  # shared: 1 + 2 stages
                }
            )
        )
    api(
        api.client.create(
            {
                "apiVersion": "exitplan.io/v1alpha1",
                "kind": "EarlyExitService",
                "metadata": {"name": "piped", "namespace": NS},
                "spec": {
                    "model": {"name": "piped", "bundle": str(bundle), "task": "text-generation"},
                    "slo": {"latencyMs": 1000},
                    "pools": [{"name": "local"}],
                    "planner": {"maxSplits": 2},
                },
            }
        )
    )
    st = wait(
        "the pipeline service is Ready",
        lambda: (
            ((api.get("EarlyExitService", "piped") or {}).get("status") or {}).get("phase") == "Ready"
            and api.get("EarlyExitService", "piped")["status"]
        ),
    )
    assert st["plan"]["splits"] == 2
    port = wait(
        "the router Service's local endpoint",
        lambda: ((api.get("Service", "piped") or {}).get("status") or {}).get("loadBalancer", {}).get("ingress"),
    )[0]["ports"][0]["port"]
    url = f"http://127.0.0.1:{port}/v2/models/piped"
    model = DecoderModel(bundle)
    expected = full_greedy(model, model.codec.encode(PROMPTS[2]), 10, ignore_eos=True)[0]
    code, answer = post(
        f"{url}/generate",
        {"text_input": PROMPTS[2], "parameters": {"max_tokens": 10, "threshold": 1.0, "ignore_eos": True}},
    )
    assert code == 200 and answer["token_ids"] == expected, answer
    code, answer = post(
        f"{url}/generate", {"text_input": PROMPTS[2], "parameters": {"max_tokens": 10, "ignore_eos": True}}
    )
    assert code == 200 and answer["threshold"] == 0.8, answer  # the plan's threshold is the service default
    with urllib.request.urlopen(f"{url}", timeout=30) as r:
        meta = json.loads(r.read())
    assert meta["parameters"]["mode"] == "pipeline" and meta["parameters"]["splits"] in (
        [[0, 0], [1, 2]],
        [[0, 1], [2, 2]],
    )
