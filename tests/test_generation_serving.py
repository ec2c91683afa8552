"""Early-exit generation over HTTP: the generate / generate_stream routes on a real aiohttp server."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from generation_helpers import PROMPTS, tiny_decoder_bundle

from exitplan.worker_image.generate.decoder import DecoderModel, RecomputeEngine, full_greedy
from exitplan.worker_image.generate.local_pipeline import PipelineEngine
from exitplan.worker_image.generate.routes import generation_app

NAME = "tiny"


@pytest.fixture(scope="module")
def bundle():
    return tiny_decoder_bundle()


@pytest.fixture(params=["recompute", "pipeline"])
async def served(request, bundle):
    engine = RecomputeEngine(DecoderModel(bundle)) if request.param == "recompute" else PipelineEngine(bundle, splits=2)
    server = TestServer(generation_app(engine, NAME, threshold=1.0))
    await server.start_server()
    async with aiohttp.ClientSession(base_url=str(server.make_url(""))) as session:
        yield engine, session
    await server.close()


async def read_events(response: aiohttp.ClientResponse) -> list[dict]:
    events = []
    async for line in response.content:
        if line.startswith(b"data: "):
            events.append(json.loads(line[6:]))
    return events


async def test_generate_matches_plain_greedy_and_counts_metrics(served, bundle):
    engine, session = served
    model = DecoderModel(bundle)
    expected, _, _ = full_greedy(model, model.codec.encode(PROMPTS[0]), 10, ignore_eos=True)
    body = {"text_input": PROMPTS[0], "parameters": {"max_tokens": 10, "ignore_eos": True}}
    async with session.post(f"/v2/models/{NAME}/generate", json=body) as response:
        assert response.status == 200
        answer = await response.json()
    assert answer["token_ids"] == expected
    assert answer["exits"] == ["head"] * 10 and answer["finish_reason"] == "length"
    assert answer["text_output"] == bytes(t for t in expected if t < 256).decode("utf-8", errors="replace")
    body["parameters"]["threshold"] = 0.0
    async with session.post(f"/v2/models/{NAME}/generate", json=body) as response:
        early = await response.json()
    exited = early["exits"].count("exit0")
    assert early["exits"][0] == "head" and exited >= 5  # threshold 0: exit0 unless a full pass is forced
    async with session.get("/metrics") as response:
        text = await response.text()
    assert (
        f'exitplan_generation_tokens_total{{mode="{engine.mode}",ramp="exit0",service="{NAME}"}} {exited:.1f}' in text
    )
    assert "exitplan_generation_token_seconds_count" in text and 'code="200"' in text
    assert engine.active_caches == 0


async def test_stream_sends_one_event_per_token_then_done(served):
    engine, session = served
    body = {"text_input": PROMPTS[1], "parameters": {"max_tokens": 6, "threshold": 1.0, "ignore_eos": True}}
    async with session.post(f"/v2/models/{NAME}/generate_stream", json=body) as response:
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
        events = await read_events(response)
    tokens, done = events[:-1], events[-1]
    assert [e["index"] for e in tokens] == list(range(6))
    assert done["done"] and done["token_ids"] == [e["token_id"] for e in tokens]
    assert done["text_output"] == "".join(e["text"] for e in tokens)
    assert engine.active_caches == 0


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"text_input": "", "parameters": {"max_tokens": 4}}, "prompt is empty"),
        ({"text_input": "x" * 600, "parameters": {"max_tokens": 4}}, "shorten it"),
        ({"text_input": "hi", "parameters": {"max_tokens": 0}}, "max_tokens must be an integer in 1.."),
        ({"text_input": "hi", "parameters": {"max_tokens": 10_000}}, "max_tokens must be an integer in 1.."),
        ({"text_input": "hi", "parameters": {"threshold": 2}}, "threshold must be a number in 0..1"),
        ({"text_input": "hi", "parameters": {"temperature": 2}}, "unknown parameters"),
        ({"prompt": "hi"}, "unknown fields"),
        ([1, 2], "must be a JSON object"),
    ],
)
async def test_bad_requests_are_400_with_a_clear_error(served, body, message):
    engine, session = served
    for route in ("generate", "generate_stream"):
        async with session.post(f"/v2/models/{NAME}/{route}", json=body) as response:
            assert response.status == 400
            assert message in (await response.json())["error"]
    async with session.post("/v2/models/other/generate", json={"text_input": "hi"}) as response:
        assert response.status == 404 and "not served here" in (await response.json())["error"]
    assert engine.active_caches == 0


async def test_client_disconnect_mid_stream_stops_and_releases_the_cache(served):
    engine, session = served
    body = {"text_input": PROMPTS[2], "parameters": {"max_tokens": 480, "threshold": 1.0, "ignore_eos": True}}
    response = await session.post(f"/v2/models/{NAME}/generate_stream", json=body)
    first = await response.content.readline()
    assert first.startswith(b"data: ")
    assert engine.active_caches == 1
    response.close()  # drops the connection mid-stream
    for _ in range(2000):  # the server notices at its next write; wait for it (bounded, no timing assertion)
        if engine.active_caches == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.active_caches == 0
    async with session.get("/metrics") as metrics:
        text = await metrics.text()
    assert "exitplan_generation_disconnects_total" in text

    def value(prefix: str) -> float:
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix + "{"))

    assert value("exitplan_generation_disconnects_total") == 1.0
    assert value("exitplan_generation_tokens_total") < 480, "the generation must stop when the client goes away"


def test_cli_generate_prints_tokens_and_rejects_bad_input(bundle, tmp_path):
    from typer.testing import CliRunner

    from exitplan.cli import app

    runner = CliRunner()
    out = tmp_path / "tokens.json"
    result = runner.invoke(
        app,
        [
            "generate",
            PROMPTS[0],
            "--bundle",
            str(bundle),
            "--max-tokens",
            "6",
            "--threshold",
            "0.0",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    events = json.loads(out.read_text())
    assert 1 <= len(events) <= 6 and events[0]["exit"] == "head"
    result = runner.invoke(app, ["generate", "", "--bundle", str(bundle)])
    assert result.exit_code == 2 and "prompt is empty" in " ".join(result.output.split())
    result = runner.invoke(app, ["generate", "hi", "--bundle", str(tmp_path)])
    assert result.exit_code == 2 and "no bundle.yaml here" in " ".join(result.output.split())
