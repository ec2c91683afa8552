"""The control plane apart from the data plane (tracker issue 14), against real processes.

One deployment (a router and two split workers of the MiniLM bundle, bucket 32) serves every test
here: control requests without the run's token are refused (401) and with another token too (403), on
the router's control port and on a worker's internal routes; with the token they work; the router's
inference port serves no control route at all. Threshold posts out of range, for the final head or
for an unknown ramp are 400 and change nothing; a huge or free-text `reason` does not grow /metrics;
forged feedback does not reach the tuning window; a /v1/run frame whose reply_to is not a router of
the plan is refused (403) and nothing is posted there. A router or worker without a token does not start.
"""

from __future__ import annotations

import io
import json
import re

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from dataplane_helpers import control_headers, deployment, ramp_names, service_spec, two_split_plan
from typer.testing import CliRunner

from exitplan.api.bundle import read_manifest
from exitplan.cli import app
from exitplan.planner.tuning.feedback import DISABLED
from exitplan.worker_image import wire
from exitplan.worker_image.bundle_runtime import pad_batch
from exitplan.worker_image.control_bodies import DISABLED as DATA_PLANE_DISABLED
from exitplan.worker_image.control_bodies import MAX_FEEDBACK_SAMPLES
from exitplan.worker_image.wire import HopItem, HopRequest

pytestmark = pytest.mark.slow

WRONG = {"Authorization": "Bearer " + "x" * 43}


@pytest.fixture(scope="module")
def ramps(minilm_bundle):
    return ramp_names(minilm_bundle)


@pytest.fixture(scope="module")
def served(minilm_bundle, ramps, tmp_path_factory):
    plan = two_split_plan(ramps, thresholds=2.0, replicas={}, buckets=(32,))
    spec = service_spec(minilm_bundle, shadow=0.5)
    dep = deployment(minilm_bundle, plan, spec, tmp_path_factory.mktemp("control"), EXITPLAN_ENABLE_FAULTS="1")
    dep.start()
    yield dep
    dep.stop()


def worker(served, split: int):
    return next(p for p in served.procs if p.name.startswith(f"worker-s{split}-"))


async def call(session, method, url, **kw):
    async with session.request(method, url, **kw) as resp:
        body = await resp.read()
        return resp.status, body, resp.headers


ROUTER_CONTROL = [
    ("GET", "/v1/thresholds", None),
    ("POST", "/v1/thresholds", {"thresholds": {}}),
    ("POST", "/v1/feedback", {"samples": []}),
    ("GET", "/v1/window.npz", None),
    ("GET", "/v1/observations", None),
    ("GET", "/v1/peers", None),
]


async def test_router_control_routes_need_the_token_and_live_on_the_control_port(served, ramps):
    async with aiohttp.ClientSession() as s:
        for method, route, body in ROUTER_CONTROL:
            status, text, headers = await call(s, method, served.control_url + route, json=body)
            assert status == 401, (route, text)
            assert "Bearer" in headers["WWW-Authenticate"] and b"control token" in text
            status, text, _ = await call(s, method, served.control_url + route, json=body, headers=WRONG)
            assert status == 403 and b"not this service's control token" in text, (route, text)
            # the inference port serves no control route, token or not
            status, _, _ = await call(s, method, served.url + route, json=body, headers=control_headers(served))
            assert status in (404, 405), route
        if_ok = control_headers(served)
        status, text, _ = await call(s, "GET", served.control_url + "/v1/thresholds", headers=if_ok)
        assert status == 200 and set(ramps) <= set(json.loads(text)["thresholds"])
        status, text, _ = await call(s, "GET", served.control_url + "/v1/observations", headers=if_ok)
        assert status == 200 and b'"model"' in text
        for route in ("/v2/health/ready", "/v2/health/live", "/metrics", "/v2/models/minilm"):
            status, _, _ = await call(s, "GET", served.url + route)  # the data plane needs no token
            assert status == 200, route


async def test_worker_internal_routes_need_the_token(served):
    base = f"http://{worker(served, 1).address}"
    frame = wire.encode(HopRequest([HopItem("x")], 32).to_meta(), pad_batch([[101, 102]], 32))
    routes = [
        ("GET", "/v1/info", {}),
        ("GET", "/v1/peers", {}),
        ("POST", "/v1/thresholds", {"json": {"thresholds": {}}}),
        ("POST", "/v1/faults", {"json": {"slowdown": 50}}),
        ("POST", "/v1/run", {"data": frame, "headers": {"Content-Type": wire.CONTENT_TYPE}}),
    ]
    async with aiohttp.ClientSession() as s:
        for method, route, kw in routes:
            status, text, _ = await call(s, method, base + route, **kw)
            assert status == 401 and b"control token" in text, (route, text)
            headers = {**kw.get("headers", {}), **WRONG}
            status, text, _ = await call(s, method, base + route, **{**kw, "headers": headers})
            assert status == 403, (route, text)
        status, text, _ = await call(s, "GET", base + "/v1/info", headers=control_headers(served))
        assert status == 200 and b'"split": 1' in text
        async with s.get(base + "/v1/info", headers=control_headers(served)) as resp:
            assert (await resp.json())["thresholds"] == served.plan.thresholds  # no unauthenticated post took
        for route in ("/v2/health/live", "/metrics"):
            status, _, _ = await call(s, "GET", base + route)
            assert status == 200, route


async def test_threshold_values_are_checked(served, ramps, minilm_bundle):
    final = read_manifest(minilm_bundle).final_ramp().name
    url = served.control_url + "/v1/thresholds"
    bad = [
        ({ramps[0]: -5}, "within [0, 1]"),
        ({ramps[0]: 1e308}, "within [0, 1]"),
        ({ramps[0]: 1.5}, "within [0, 1]"),
        ({ramps[0]: True}, "a number"),
        ({ramps[0]: "0.5"}, "a number"),
        ({ramps[0]: None}, "a number"),
        ({final: 0.5}, "final head"),
        ({"ramp9": 0}, "unknown ramps"),
        ({"nope": 0.5, ramps[0]: 0.5}, "unknown ramps"),
    ]
    async with aiohttp.ClientSession(headers=control_headers(served)) as s:
        async with s.get(url) as resp:
            before = (await resp.json())["thresholds"]
        for thresholds, words in bad:
            async with s.post(url, json={"thresholds": thresholds}) as resp:
                assert resp.status == 400, thresholds
                assert words in (await resp.json())["error"], thresholds
        async with s.post(url, data=b"[1, 2]") as resp:
            assert resp.status == 400
        async with s.get(url) as resp:
            assert (await resp.json())["thresholds"] == before  # nothing changed
        worker_info = f"http://{worker(served, 1).address}/v1/info"
        given = {ramps[0]: 0, ramps[1]: 1, ramps[2]: "disabled"}
        async with s.post(url, json={"thresholds": given, "replace": True}) as resp:
            assert resp.status == 200
            assert (await resp.json())["thresholds"] == {ramps[0]: 0.0, ramps[1]: 1.0, ramps[2]: DISABLED}
        async with s.get(worker_info) as resp:  # pushed down the chain with the token
            assert (await resp.json())["thresholds"] == {ramps[0]: 0.0, ramps[1]: 1.0, ramps[2]: DISABLED}
        async with s.post(worker_info.replace("info", "thresholds"), json={"thresholds": {final: 0.1}}) as resp:
            assert resp.status == 400 and "final head" in await resp.text()  # workers check as well
        async with s.post(url, json={"thresholds": before, "replace": True}) as resp:
            assert resp.status == 200
    assert DATA_PLANE_DISABLED == DISABLED  # the data plane's "disabled" is the tuner's


def metric_lines(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name + "{")]


async def test_free_text_reasons_do_not_grow_the_metrics(served, ramps):
    url = served.control_url + "/v1/thresholds"
    async with aiohttp.ClientSession(headers=control_headers(served)) as s:
        async with s.get(served.url + "/metrics") as resp:
            before = await resp.text()
        async with s.post(url, json={"thresholds": {ramps[0]: 0.5}, "reason": "r" * (512 << 10)}) as resp:
            assert resp.status == 413  # the body limit of a threshold post
        for k in range(30):  # every post a real change, each with its own 40 KB reason
            reason = f"{k}-" + "why " * 10_000
            async with s.post(url, json={"thresholds": {ramps[0]: 0.5 + k / 100}, "reason": reason}) as resp:
                assert resp.status == 200
        async with s.get(served.url + "/metrics") as resp:
            after = await resp.text()
        async with s.post(url, json={"thresholds": {r: 2.0 for r in ramps}, "reason": "api"}) as resp:
            assert resp.status == 200
    assert len(after) - len(before) < 2048, len(after) - len(before)
    updates = metric_lines(after, "exitplan_threshold_updates_total")
    fixed = {"other", "api", "plan-update", "tune-accuracy", "tune-savings"}  # every one counted from zero
    assert {re.search(r'reason="([^"]*)"', line).group(1) for line in updates} <= fixed
    other = next(line for line in updates if 'reason="other"' in line)
    assert float(other.split()[-1]) >= 30


async def test_forged_feedback_does_not_reach_the_tuning_window(served, ramps, minilm_bundle):
    n_labels = len(read_manifest(minilm_bundle).labels)
    url = served.control_url + "/v1/feedback"

    def sample(i: int) -> dict:
        return {"id": f"forged-{i}", "final": 0, "conf": [0.99] * len(ramps), "pred": [1] * len(ramps)}

    async with aiohttp.ClientSession(headers=control_headers(served)) as s:
        async with s.get(served.control_url + "/v1/window.npz") as resp:
            before = np.load(io.BytesIO(await resp.read()))["final"].size
        async with s.post(url, json={"samples": [sample(i) for i in range(4096)]}) as resp:
            assert resp.status == 400 and str(MAX_FEEDBACK_SAMPLES) in (await resp.json())["error"]
        async with s.post(url, json={"samples": [sample(i) for i in range(MAX_FEEDBACK_SAMPLES)]}) as resp:
            assert resp.status == 200
            assert await resp.json() == {"accepted": 0, "ignored": MAX_FEEDBACK_SAMPLES}  # ids it never sampled
        malformed = [
            {**sample(0), "conf": [1.5] * len(ramps)},
            {**sample(0), "conf": [0.5]},
            {**sample(0), "pred": [n_labels] * len(ramps)},
            {**sample(0), "final": -1},
            {**sample(0), "id": "x" * 1000},
            "not a sample",
        ]
        for bad in malformed:
            async with s.post(url, json={"samples": [bad]}) as resp:
                assert resp.status == 400, bad
        async with s.post(url, data=b"{" * (2 << 20)) as resp:
            assert resp.status == 413
        async with s.get(served.control_url + "/v1/window.npz") as resp:
            after = np.load(io.BytesIO(await resp.read()))["final"].size
    assert after == before


async def test_reply_to_must_be_a_router_of_the_plan(served, minilm_bundle):
    posted: list[bytes] = []

    async def catch(request: web.Request) -> web.Response:
        posted.append(await request.read())
        return web.json_response({"accepted": 0})

    trap = web.Application()
    trap.router.add_post("/v1/feedback", catch)
    runner = web.AppRunner(trap)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    elsewhere = f"127.0.0.1:{runner.addresses[0][1]}"
    try:
        url = f"http://{worker(served, 0).address}/v1/run"
        headers = {**control_headers(served), "Content-Type": wire.CONTENT_TYPE}
        tensors = pad_batch([[101, 7592, 2088, 102], [101, 2307, 102]], 32)

        def frame(reply_to: str) -> bytes:
            items = [HopItem(f"t-{k}", None, None, True, reply_to) for k in range(2)]
            return wire.encode(HopRequest(items, 32).to_meta(), tensors)

        async with aiohttp.ClientSession() as s:
            async with s.post(url, data=frame(elsewhere), headers=headers) as resp:
                assert resp.status == 403, await resp.text()
                assert "not a router of this service's plan" in await resp.text()
            assert served.plan.routers == [served.control_url.removeprefix("http://")]
            async with s.post(url, data=frame(served.plan.routers[0]), headers=headers) as resp:
                assert resp.status == 200  # the plan's router: served
                meta, _ = wire.decode(await resp.read())
                assert len(meta["results"]) == 2
    finally:
        await runner.cleanup()
    assert posted == []


def test_router_and_worker_refuse_to_start_without_a_token(minilm_bundle, tmp_path, monkeypatch):
    monkeypatch.delenv("EXITPLAN_CONTROL_TOKEN_FILE", raising=False)
    monkeypatch.delenv("EXITPLAN_CONTROL_TOKEN", raising=False)
    plan = tmp_path / "plan.json"
    plan.write_text(two_split_plan(ramp_names(minilm_bundle), 2.0, {}, buckets=(32,)).to_json())
    common = ["--bundle", str(minilm_bundle), "--plan", str(plan)]
    runner = CliRunner()
    for argv in (
        ["router", *common, "--peers", "127.0.0.1:1"],
        ["worker", *common, "--split", "1", "--bucket", "32"],
    ):
        result = runner.invoke(app, argv)
        assert result.exit_code == 2, result.output
        assert "no control token" in result.output
    short = tmp_path / "token"
    short.write_text("abc")
    result = runner.invoke(app, ["router", *common, "--peers", "127.0.0.1:1", "--control-token-file", str(short)])
    assert result.exit_code == 2 and "at least 16 characters" in result.output


async def test_without_a_control_port_the_routes_stay_on_the_inference_port_behind_the_token(
    minilm_bundle, ramps, tmp_path
):
    """The in-process router app: `control_port` None keeps the control routes on its one port, still
    behind the token; a router given no token refuses every control request."""
    from aiohttp.test_utils import TestClient, TestServer

    from exitplan.worker_image.classify.router import Router

    plan = tmp_path / "plan.json"
    plan.write_text(two_split_plan(ramps, 2.0, {}, buckets=(32,)).to_json())
    token = "t" * 32
    for configured, expected in ((token, 200), (None, 403)):
        router = Router(minilm_bundle, plan, peers="127.0.0.1:1", slo_ms=100, control_token=configured)
        async with TestClient(TestServer(router.app())) as client:
            assert (await client.get("/v1/thresholds")).status == (401 if configured else 403)
            resp = await client.get("/v1/thresholds", headers={"Authorization": f"Bearer {token}"})
            assert resp.status == expected
            if configured:
                assert (await resp.json())["thresholds"] == {r: 2.0 for r in ramps}
            else:
                assert "no control token configured" in (await resp.json())["error"]
            assert (await client.get("/v2/health/live")).status == 200
