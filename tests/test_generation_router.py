"""Early-exit generation through the real router process: `exitplan router` with a decoder bundle drives
`exitplan generate-stage` processes, started by `exitplan up`'s LocalDeployment; everything over real HTTP."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from generation_helpers import PROMPTS, post, tiny_decoder_bundle

from exitplan.api.resources import EarlyExitServiceSpec, GPUPoolSpec
from exitplan.localrun.deployment import LocalDeployment
from exitplan.localrun.ports import free_port, free_port_block
from exitplan.planner.generation import plan_generation
from exitplan.worker_image.generate.decoder import DecoderModel, RecomputeEngine, full_greedy
from exitplan.worker_image.generate.local_pipeline import PipelineEngine

NAME = "tweets"
HANG_GUARD = 120.0  # only stops a broken run from hanging the suite; not a performance assertion


def service_spec(bundle: Path) -> EarlyExitServiceSpec:
    return EarlyExitServiceSpec.model_validate(
        {
            "model": {"name": NAME, "bundle": str(bundle), "task": "text-generation"},
            "slo": {"latencyMs": 1000},
            "accuracy": {"maxDrop": 0.02},
            "pools": [{"name": "cpu"}],
        }
    )


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def stream(url: str, body: object) -> list[dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        return [json.loads(line[6:]) for line in r if line.startswith(b"data: ")]


def stage_caches(deployment: LocalDeployment) -> list[int]:
    return [
        json.loads(get(f"http://{p.address}/v1/generation/stats")[1])["active_caches"]
        for p in deployment.procs
        if p.name.startswith("stage")
    ]


@pytest.fixture(scope="module")
def bundle() -> Path:
    return tiny_decoder_bundle()


@pytest.fixture(scope="module", params=[2, 1], ids=["pipeline-2-stages", "recompute-1-stage"])
def deployment(request, bundle, tmp_path_factory):
    spec = service_spec(bundle)
    manifest = DecoderModel(bundle, last_block=0).manifest
    plan = plan_generation(
        NAME,
        spec,
        {"cpu": GPUPoolSpec(capacity=4)},
        n_blocks=len(manifest.blocks),
        exit_ramps=[r.name for r in manifest.exit_ramps()],
        max_context=manifest.decoder.max_context,
        stages=request.param,
    ).plan
    deployment = LocalDeployment(
        bundle, plan, spec, tmp_path_factory.mktemp("up"), port=free_port(), base_port=free_port_block(3)
    )
    deployment.start(timeout=HANG_GUARD)
    try:
        yield deployment
    finally:
        deployment.stop()


def test_threshold_one_gives_plain_greedy_tokens_over_http(deployment, bundle):
    model = DecoderModel(bundle)
    assert len([p for p in deployment.procs if p.name.startswith("stage")]) == len(deployment.plan.splits)
    for prompt in PROMPTS:
        expected, _, _ = full_greedy(model, model.codec.encode(prompt), 12, ignore_eos=True)
        code, answer = post(
            f"{deployment.url}/v2/models/{NAME}/generate",
            {"text_input": prompt, "parameters": {"max_tokens": 12, "ignore_eos": True}},
        )
        assert code == 200, answer
        assert answer["token_ids"] == expected and answer["threshold"] == 1.0
        assert set(answer["exits"]) == {"head"} and answer["finish_reason"] == "length"
    assert stage_caches(deployment) == [0] * len(deployment.plan.splits)


def test_exits_match_the_in_process_engine_of_the_same_mode(deployment, bundle):
    splits = [(s.first_block, s.last_block) for s in deployment.plan.splits]
    local = RecomputeEngine(DecoderModel(bundle)) if len(splits) == 1 else PipelineEngine(bundle, splits=splits)
    try:
        for threshold in (0.0, 0.3):
            body = {
                "text_input": PROMPTS[2],
                "parameters": {"max_tokens": 16, "threshold": threshold, "ignore_eos": True},
            }
            code, answer = post(f"{deployment.url}/v2/models/{NAME}/generate", body)
            assert code == 200, answer
            expected = [(e.token_id, e.exit) for e in local.generate(PROMPTS[2], 16, threshold, ignore_eos=True)]
            assert list(zip(answer["token_ids"], answer["exits"])) == [tuple(e) for e in expected]
            if threshold == 0.0:
                assert answer["exits"].count("exit0") >= 8
    finally:
        getattr(local, "close", lambda: None)()
    assert stage_caches(deployment) == [0] * len(deployment.plan.splits)


def test_concurrent_sequences_interleave_on_the_stages_without_mixing_caches(deployment):
    from concurrent.futures import ThreadPoolExecutor

    bodies = [
        {"text_input": prompt, "parameters": {"max_tokens": 20, "threshold": threshold, "ignore_eos": True}}
        for prompt in PROMPTS
        for threshold in (0.3, 1.0)
    ]
    alone = [post(f"{deployment.url}/v2/models/{NAME}/generate", b)[1]["token_ids"] for b in bodies]
    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(lambda b: post(f"{deployment.url}/v2/models/{NAME}/generate", b), bodies))
    assert [code for code, _ in together] == [200] * len(bodies)
    assert [answer["token_ids"] for _, answer in together] == alone
    assert stage_caches(deployment) == [0] * len(deployment.plan.splits)


def test_stream_sends_tokens_as_server_sent_events(deployment):
    events = stream(
        f"{deployment.url}/v2/models/{NAME}/generate_stream",
        {"text_input": PROMPTS[1], "parameters": {"max_tokens": 8, "ignore_eos": True}},
    )
    tokens, done = events[:-1], events[-1]
    assert [e["index"] for e in tokens] == list(range(8)) and done["done"]
    assert done["token_ids"] == [e["token_id"] for e in tokens]
    assert done["text_output"] == "".join(e["text"] for e in tokens)
    status, text = get(f"{deployment.url}/metrics")
    assert status == 200 and b"exitplan_generation_token_seconds_count" in text
    mode = "recompute" if len(deployment.plan.splits) == 1 else "pipeline"
    assert f'mode="{mode}"'.encode() in text


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"text_input": "", "parameters": {"max_tokens": 4}}, "prompt is empty"),
        ({"text_input": "x" * 600, "parameters": {"max_tokens": 4}}, "shorten it"),
        ({"text_input": "hi", "parameters": {"max_tokens": 0}}, "max_tokens must be an integer in 1.."),
        ({"text_input": "hi", "parameters": {"max_tokens": 100_000}}, "max_tokens must be an integer in 1.."),
        ({"text_input": "hi", "parameters": {"threshold": -1}}, "threshold must be a number in 0..1"),
    ],
)
def test_bad_input_is_400_with_the_reason(deployment, body, message):
    for route in ("generate", "generate_stream"):
        code, answer = post(f"{deployment.url}/v2/models/{NAME}/{route}", body)
        assert code == 400 and message in answer["error"], answer
    code, answer = post(f"{deployment.url}/v2/models/{NAME}/infer", {"inputs": []})
    assert code == 400 and "/generate" in answer["error"]
    assert stage_caches(deployment) == [0] * len(deployment.plan.splits)


def test_client_disconnect_mid_stream_stops_and_releases_every_stage_cache(deployment):
    host, port = deployment.url.removeprefix("http://").split(":")
    body = json.dumps({"text_input": PROMPTS[0], "parameters": {"max_tokens": 480, "ignore_eos": True}}).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v2/models/%s/generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (NAME.encode(), len(body), body)
        )
        received = b""
        while b"data: " not in received:
            received += sock.recv(4096)
        assert b"200" in received.split(b"\r\n")[0]
        assert sum(stage_caches(deployment)) >= 1  # the sequence holds its cache while it streams
    deadline = time.monotonic() + HANG_GUARD
    while sum(stage_caches(deployment)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stage_caches(deployment) == [0] * len(deployment.plan.splits)
    text = get(f"{deployment.url}/metrics")[1].decode()
    tokens = sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("exitplan_generation_tokens_total{")
    )
    disconnects = sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("exitplan_generation_disconnects_total{")
    )
    assert disconnects == 1.0
    code, answer = post(
        f"{deployment.url}/v2/models/{NAME}/generate", {"text_input": "ok", "parameters": {"max_tokens": 2}}
    )
    assert code == 200  # the service goes on
    assert tokens < 480 * 2, "the generation stops when the client goes away"


def test_threshold_is_hot_updated_through_the_router(deployment):
    auth = {"Authorization": f"Bearer {deployment.control_token}"}
    code, answer = post(f"{deployment.control_url}/v1/thresholds", {"threshold": 0.0})
    assert code == 401  # the control endpoints take the run's token
    code, answer = post(f"{deployment.control_url}/v1/thresholds", {"threshold": 0.0}, auth)
    assert code == 200 and answer["threshold"] == 0.0
    try:
        code, answer = post(
            f"{deployment.url}/v2/models/{NAME}/generate",
            {"text_input": PROMPTS[0], "parameters": {"max_tokens": 6, "ignore_eos": True}},
        )
        assert code == 200 and answer["threshold"] == 0.0 and "exit0" in answer["exits"]
        code, answer = post(f"{deployment.control_url}/v1/thresholds", {"thresholds": {"nope": 0.5}}, auth)
        assert code == 400 and "unknown ramps" in answer["error"]
    finally:
        post(f"{deployment.control_url}/v1/thresholds", {"threshold": 1.0}, auth)


def test_exitplan_up_plans_and_serves_a_decoder_service(bundle, tmp_path):
    """The CLI end to end: measure (cached in the bundle), plan, start stages + router, generate, stop."""
    port, base = free_port(), free_port_block(4)
    service = tmp_path / "service.yaml"
    service.write_text(
        yaml.safe_dump_all(
            [
                {
                    "apiVersion": "exitplan.io/v1alpha1",
                    "kind": "GPUPool",
                    "metadata": {"name": "cpu"},
                    "spec": {"capacity": 2, "gpuResource": ""},
                },
                {
                    "apiVersion": "exitplan.io/v1alpha1",
                    "kind": "EarlyExitService",
                    "metadata": {"name": "gen"},
                    "spec": {
                        "model": {"name": NAME, "bundle": str(bundle), "task": "text-generation"},
                        "slo": {"latencyMs": 1000},
                        "pools": [{"name": "cpu"}],
                    },
                },
            ]
        )
    )
    log = (tmp_path / "up.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from exitplan.cli import app; app()",
            "up",
            str(service),
            "--port",
            str(port),
            "--base-port",
            str(base),
            "--workdir",
            str(tmp_path / "work"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + HANG_GUARD
        while get_ready(f"http://127.0.0.1:{port}") is False:
            assert proc.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "up.log").read_text()[-3000:]
            time.sleep(0.2)
        code, answer = post(
            f"http://127.0.0.1:{port}/v2/models/{NAME}/generate",
            {"text_input": PROMPTS[0], "parameters": {"max_tokens": 5, "threshold": 1.0, "ignore_eos": True}},
        )
        model = DecoderModel(bundle)
        assert (
            code == 200
            and answer["token_ids"] == full_greedy(model, model.codec.encode(PROMPTS[0]), 5, ignore_eos=True)[0]
        )
        code, meta = get(f"http://127.0.0.1:{port}/v2/models/{NAME}")
        assert code == 200 and json.loads(meta)["parameters"]["mode"] in ("recompute", "pipeline")
        measured = json.loads((bundle / "profiles" / "generation-cpu.json").read_text())
        assert len(measured["profile"]["block_ms"]) == model.n_blocks and measured["thresholds"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()
    assert "generation plan:" in (tmp_path / "up.log").read_text()


def get_ready(url: str) -> bool:
    try:
        return get(f"{url}/v2/health/ready")[0] == 200
    except OSError:
        return False


async def test_no_reachable_stage_is_503_with_the_reason_not_a_hang(bundle, tmp_path):
    import aiohttp
    from aiohttp.test_utils import TestServer

    from exitplan.worker_image.generate.router import GenerationRouter

    manifest = DecoderModel(bundle, last_block=0).manifest
    plan = plan_generation(
        NAME,
        service_spec(bundle),
        {"cpu": GPUPoolSpec(capacity=1)},
        n_blocks=len(manifest.blocks),
        exit_ramps=[r.name for r in manifest.exit_ramps()],
        max_context=manifest.decoder.max_context,
    ).plan
    (tmp_path / "plan.json").write_text(plan.to_json())
    router = GenerationRouter(bundle, tmp_path / "plan.json", peers=f"127.0.0.1:{free_port()}")  # nothing listens there
    server = TestServer(router.app())
    await server.start_server()
    try:
        async with aiohttp.ClientSession(base_url=str(server.make_url(""))) as session:
            async with session.get("/v2/health/ready") as r:
                assert r.status == 503 and "does not answer" in (await r.json())["reason"]
            async with session.post(
                f"/v2/models/{NAME}/generate", json={"text_input": "hi", "parameters": {"max_tokens": 2}}
            ) as r:
                assert r.status == 503 and "no ready stages" in (await r.json())["error"]
            async with session.post(f"/v2/models/{NAME}/generate", json={"text_input": ""}) as r:
                assert r.status == 400  # bad input is still named first
        assert router.engine.active_caches == 0
    finally:
        await server.close()
