"""The open-loop generator against a deliberately misbehaving HTTP server: every request ends as one outcome.

The real router should never hang, drop a connection or answer garbage; this server does each on
purpose (chosen by the request's text) so that the generator is shown to classify them, and that a
request hanging forever does not hold back the requests after it (open loop).
"""

import asyncio
import json

import pytest
from aiohttp import web

from exitplan.client.loadgen import parse_answer, replay
from exitplan.client.texts import text_body


def _answer(label="positive", ramp="ramp0"):
    return {
        "model_name": "m",
        "outputs": [
            {"name": "label", "datatype": "BYTES", "shape": [1], "data": [label]},
            {"name": "scores", "datatype": "FP32", "shape": [1, 2], "data": [0.1, 0.9]},
            {"name": "exit_ramp", "datatype": "BYTES", "shape": [1], "data": [ramp]},
        ],
        "parameters": {"latency_ms": 1.0},
    }


@pytest.fixture
async def server():
    later_arrived = asyncio.Event()
    never = asyncio.Event()

    async def infer(request: web.Request) -> web.StreamResponse:
        if request.match_info["name"] != "m":
            return web.json_response({"error": "unknown model"}, status=404)
        mode = (await request.json())["inputs"][0]["data"][0]
        if mode == "wait-for-later":  # answers only once a request sent after it has arrived
            await later_arrived.wait()
            return web.json_response(_answer(ramp="final"))
        if mode == "later":
            later_arrived.set()
            return web.json_response(_answer())
        if mode == "hang":
            await never.wait()
        if mode == "shed":
            return web.json_response({"error": "bucket 16 is full"}, status=429, headers={"Retry-After": "1"})
        if mode == "shed-bare":
            return web.json_response({"error": "too many in flight"}, status=503)
        if mode == "bad":
            return web.json_response({"error": "text 0 is empty"}, status=400)
        if mode == "boom":
            return web.json_response({"error": "worker died"}, status=502)
        if mode == "garbage":
            return web.Response(text="<html>not an answer</html>")
        if mode == "drop":
            request.transport.close()
            await never.wait()
        return web.json_response(_answer())

    app = web.Application()
    app.add_routes([web.post("/v2/models/{name}/infer", infer)])
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    never.set()
    await runner.cleanup()


async def test_every_request_ends_as_exactly_one_classified_outcome(server):
    modes = ["ok", "wait-for-later", "hang", "shed", "shed-bare", "bad", "boom", "garbage", "drop", "later", "ok"]
    bodies = [text_body(m) for m in modes]
    arrivals = [0.02 * i for i in range(len(modes))]
    seen = []
    outcomes = await replay(server, "m", bodies, arrivals, timeout_s=2.0, on_done=seen.append)
    assert [o.index for o in outcomes] == list(range(len(modes)))
    assert len(seen) == len(modes)
    kinds = {m: o.kind for m, o in zip(modes, outcomes)}
    assert kinds == {
        "ok": "ok",
        "wait-for-later": "ok",
        "hang": "lost",
        "shed": "overload",
        "shed-bare": "overload",
        "bad": "bad_request",
        "boom": "server_error",
        "garbage": "invalid",
        "drop": "transport",
        "later": "ok",
    }
    by_mode = dict(zip(modes, outcomes))
    assert by_mode["shed"].retry_after == "1" and by_mode["shed-bare"].retry_after is None
    assert by_mode["bad"].error == "text 0 is empty" and by_mode["bad"].status == 400
    assert by_mode["hang"].done_s is None and by_mode["hang"].latency_s is None
    assert by_mode["wait-for-later"].ramp == "final"
    # open loop: the request after the hanging one was sent while it still hung
    assert by_mode["later"].sent_s < by_mode["wait-for-later"].done_s


async def test_unknown_model_is_a_bad_request(server):
    (outcome,) = await replay(server, "other", [text_body("ok")], [0.0], timeout_s=2.0)
    assert outcome.kind == "bad_request" and outcome.status == 404


async def test_unreachable_router_is_a_transport_error_per_request():
    outcomes = await replay("http://127.0.0.1:9", "m", [text_body("ok")] * 3, [0.0, 0.0, 0.0], timeout_s=2.0)
    assert [o.kind for o in outcomes] == ["transport"] * 3


async def test_bad_schedules_are_rejected():
    with pytest.raises(ValueError, match="bodies"):
        await replay("http://127.0.0.1:9", "m", [b"{}"], [0.0, 1.0])
    with pytest.raises(ValueError, match="non-decreasing"):
        await replay("http://127.0.0.1:9", "m", [b"{}", b"{}"], [1.0, 0.0])


def test_parse_answer_rejects_malformed_answers():
    assert parse_answer(json.dumps(_answer("neg", "ramp2")).encode()) == ("neg", "ramp2")
    broken = _answer()
    broken["outputs"] = broken["outputs"][:1]
    with pytest.raises(ValueError, match="exit_ramp"):
        parse_answer(json.dumps(broken).encode())
    two = _answer()
    two["outputs"][0]["data"] = ["a", "b"]
    with pytest.raises(ValueError, match="2 labels"):
        parse_answer(json.dumps(two).encode())
