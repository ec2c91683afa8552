"""The serving path for real: router + split workers as processes, the MiniLM bundle, HTTP.

One deployment (2 splits x 2 buckets, two replicas of split 1 for bucket 32) serves every test of
this module, in order: outputs, bad input, hot threshold updates, shadow feedback, stragglers, and
last a worker killed under load.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import numpy as np
import pytest
from dataplane_helpers import control_headers, deployment, heldout_texts, ramp_names, service_spec, two_split_plan
from tokenizers import Tokenizer

from exitplan.api.bundle import read_manifest
from exitplan.worker_image.bundle_runtime import BundleRuntime, pad_batch, softmax
from exitplan.worker_image.peer_choice import StragglerPolicy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ramps(minilm_bundle):
    return ramp_names(minilm_bundle)


@pytest.fixture(scope="module")
def texts(minilm_bundle):
    return heldout_texts(minilm_bundle, 40)


@pytest.fixture(scope="module")
def served(minilm_bundle, ramps, tmp_path_factory):
    plan = two_split_plan(ramps, thresholds=2.0, replicas={(1, 32): 2})
    spec = service_spec(minilm_bundle, shadow=0.5, max_body=64 * 1024)
    dep = deployment(minilm_bundle, plan, spec, tmp_path_factory.mktemp("dataplane"), EXITPLAN_ENABLE_FAULTS="1")
    dep.start()
    yield dep
    dep.stop()


def infer_body(texts, **params):
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts)], "data": list(texts)}]}
    if params:
        body["parameters"] = params
    return body


async def post(session, url, body, **kw):
    async with session.post(url, json=body, **kw) as resp:
        return resp.status, await resp.json(), resp.headers


async def post_each(session, url, texts, concurrency=4):
    """One request per text, `concurrency` at a time (a steady load the bucket admits, not a burst)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(t):
        async with gate:
            return await post(session, url, infer_body([t]))

    return await asyncio.gather(*(one(t) for t in texts))


def outputs(answer):
    return {o["name"]: o for o in answer["outputs"]}


async def test_chained_splits_give_the_full_models_outputs(served, minilm_bundle, texts):
    """No exits: the answer through router -> split 0 -> split 1 equals the whole model run in one piece."""
    tok = Tokenizer.from_file(str(minilm_bundle / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    full = BundleRuntime(minilm_bundle, buckets=[128])
    state = pad_batch([e.ids for e in tok.encode_batch(texts)], 128)
    result = full.run_range(state, 128, None)
    expected = np.zeros((len(texts), 3), np.float32)
    for ex in result.exits:
        expected[ex.row] = softmax(ex.logits[None])[0]
    async with aiohttp.ClientSession() as s:
        t0 = time.perf_counter()
        status, answer, headers = await post(s, f"{served.url}/v2/models/minilm/infer", infer_body(texts))
        client_ms = (time.perf_counter() - t0) * 1000
    assert status == 200, answer
    # Server-Timing: the router's latency holds split 0's compute, and the client's holds both.
    timing = dict(part.strip().split(";dur=") for part in headers["Server-Timing"].split(","))
    router_ms, split0_ms = float(timing["router"]), float(timing["split0"])
    assert 0 < split0_ms < router_ms < client_ms
    assert router_ms == pytest.approx(answer["parameters"]["latency_ms"], abs=1e-3)
    out = outputs(answer)
    got = np.asarray(out["scores"]["data"], np.float32).reshape(out["scores"]["shape"])
    assert np.abs(got - expected).max() <= 1e-4
    assert set(out["exit_ramp"]["data"]) == {read_manifest(minilm_bundle).final_ramp().name}
    labels = read_manifest(minilm_bundle).labels
    assert out["label"]["data"] == [labels[i] for i in expected.argmax(1)]


@pytest.mark.parametrize(
    "body, status, reason",
    [
        ("not json", 400, "not valid JSON"),
        ({"inputs": []}, 400, "non-empty"),
        ({"inputs": [{"name": "text", "datatype": "FP32", "shape": [1], "data": [1.0]}]}, 400, "BYTES"),
        ({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": ["one"]}]}, 400, "needs 2 values"),
        ({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["   "]}]}, 400, "empty"),
        (
            {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, 3], "data": [101, "x", 102]}]},
            400,
            "INT64",
        ),
        ({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1], "data": [0]}]}, 400, "'text'"),
        (
            {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["word " * 300]}]},
            400,
            "largest bucket",
        ),
    ],
)
async def test_bad_requests_get_400_with_the_reason(served, body, status, reason):
    async with aiohttp.ClientSession() as s:
        data = body if isinstance(body, str) else json.dumps(body)
        async with s.post(f"{served.url}/v2/models/minilm/infer", data=data) as resp:
            assert resp.status == status
            assert reason in (await resp.json())["error"]


async def test_truncation_on_request_serves_long_text(served):
    async with aiohttp.ClientSession() as s:
        status, answer, _ = await post(
            s, f"{served.url}/v2/models/minilm/infer", infer_body(["word " * 300], truncate=True)
        )
    assert status == 200 and outputs(answer)["label"]["data"][0]


async def test_unknown_model_is_404_and_big_body_is_413(served):
    async with aiohttp.ClientSession() as s:
        status, answer, _ = await post(s, f"{served.url}/v2/models/gpt9/infer", infer_body(["hi"]))
        assert status == 404 and "gpt9" in answer["error"]
        async with s.get(f"{served.url}/v2/models/gpt9") as resp:
            assert resp.status == 404
        status, answer, _ = await post(s, f"{served.url}/v2/models/minilm/infer", infer_body(["x" * (80 * 1024)]))
        assert status == 413 and "limit" in answer["error"]


async def test_token_ids_are_accepted(served):
    async with aiohttp.ClientSession() as s:
        body = {
            "inputs": [
                {
                    "name": "input_ids",
                    "datatype": "INT64",
                    "shape": [2, 4],
                    "data": [101, 2307, 2154, 102, 101, 6659, 102, 0],
                },
                {"name": "attention_mask", "datatype": "INT64", "shape": [2, 4], "data": [1, 1, 1, 1, 1, 1, 1, 0]},
            ]
        }
        status, answer, _ = await post(s, f"{served.url}/v2/models/minilm/infer", body)
    assert status == 200 and outputs(answer)["label"]["shape"] == [2]


async def test_model_metadata_and_health(served, ramps):
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{served.url}/v2/models/minilm") as resp:
            meta = await resp.json()
        assert meta["parameters"]["ramps"] == ramps and meta["parameters"]["buckets"] == [32, 128]
        for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/minilm/ready"):
            async with s.get(served.url + path) as resp:
                assert resp.status == 200, path
        async with s.get(f"{served.url}/metrics") as resp:
            assert "exitplan_router_requests_total" in await resp.text()


async def test_hot_threshold_update_changes_exits_without_dropping_requests(served, texts, ramps):
    url = f"{served.url}/v2/models/minilm/infer"
    async with aiohttp.ClientSession(headers=control_headers(served)) as s:

        async def load():
            return await post_each(s, url, texts)

        before = asyncio.create_task(load())
        status, _, _ = await post(
            s, f"{served.control_url}/v1/thresholds", {"thresholds": {ramps[0]: 0.0}, "reason": "test"}
        )
        assert status == 200
        during = await before
        assert all(st == 200 for st, _, _ in during)  # nothing dropped while thresholds changed
        after = await load()
        assert {outputs(a)["exit_ramp"]["data"][0] for _, a, _ in after} == {ramps[0]}
        status, _, _ = await post(
            s, f"{served.control_url}/v1/thresholds", {"thresholds": {r: 2.0 for r in ramps}, "reason": "test"}
        )
        assert status == 200
        bad, answer, _ = await post(s, f"{served.control_url}/v1/thresholds", {"thresholds": {"nope": 0.5}})
        assert bad == 400 and "nope" in answer["error"]
        async with s.get(f"{served.url}/metrics") as resp:
            text = await resp.text()
        updates = [
            line
            for line in text.splitlines()
            if line.startswith("exitplan_threshold_updates_total{") and 'reason="other"' in line
        ]  # the free-text reason "test" is not a label value: it counts as "other"
        assert updates and float(updates[0].split()[-1]) >= 2


async def test_shadow_feedback_fills_the_tuning_window(served, texts, ramps):
    url = f"{served.url}/v2/models/minilm/infer"
    async with aiohttp.ClientSession(headers=control_headers(served)) as s:
        await post(s, f"{served.control_url}/v1/thresholds", {"thresholds": {ramps[0]: 0.0}, "reason": "test"})
        results = await post_each(s, url, texts)
        assert all(st == 200 for st, _, _ in results)
        await asyncio.sleep(1.0)  # feedback arrives after the answers
        async with s.get(f"{served.control_url}/v1/window.npz") as resp:
            raw = await resp.read()
        async with s.get(f"{served.control_url}/v1/window.npz?format=safetensors") as resp:
            as_safetensors = await resp.read()
        async with s.get(f"{served.control_url}/v1/window.npz?format=csv") as resp:
            refused = (resp.status, await resp.text())
        await post(s, f"{served.control_url}/v1/thresholds", {"thresholds": {r: 2.0 for r in ramps}, "reason": "test"})
    import io

    from exitplan.worker_image.control_bodies import FeedbackArrays

    assert refused[0] == 400 and "safetensors" in refused[1]
    window = np.load(io.BytesIO(raw))
    other = FeedbackArrays.from_body(as_safetensors)  # the same window, asked for as safetensors
    assert other.added is not None and other.final.size >= len(window["final"])
    assert np.array_equal(other.conf[: len(window["final"])], window["conf"])
    n = len(window["final"])
    assert n >= 5  # shadow fraction 0.5 (x4 while short of samples) of 40 inputs, plus the earlier tests
    assert window["conf"].shape == (n, len(ramps)) and window["pred"].shape == (n, len(ramps))
    assert ((window["conf"] > 0) & (window["conf"] <= 1)).all()
    # Exited at ramp 0 and kept running: the final answer is the full model's, which the last ramp mostly agrees with.
    assert (window["pred"][:, -1] == window["final"]).mean() > 0.6


async def test_a_followed_feedback_read_carries_only_the_new_samples_and_adds_up_to_the_whole_window(
    served, texts, ramps
):
    """The re-tune's read of a router's feedback (router_fleet.FeedbackFollower): after a first whole read, the
    next asks for the samples since (`?after=`), gets only those, and the window it keeps equals a whole read."""
    from exitplan.worker_image.control_client import ControlClient
    from exitplan.worker_image.router_fleet import FeedbackFollower, fleet_feedback

    url = f"{served.url}/v2/models/minilm/infer"
    async with aiohttp.ClientSession(headers=control_headers(served)) as s:
        client = ControlClient(served.control_url, session=s, token=served.control_token)
        await post(s, f"{served.control_url}/v1/thresholds", {"thresholds": {ramps[0]: 0.0}, "reason": "test"})
        await post_each(s, url, texts[:20])
        await asyncio.sleep(1.0)  # feedback arrives after the answers
        follower = FeedbackFollower(1024)
        first, _ = await fleet_feedback([client], 1024, follower)
        whole = await client.feedback(1024)
        assert first is not None and whole is not None and first.final.size == whole.final.size > 0
        held = follower.after(served.control_url)
        assert held is not None and held[1] == whole.added
        await post_each(s, url, texts[20:])
        await asyncio.sleep(1.0)
        new = await client.feedback(1024, held)
        assert new is not None and 0 < new.final.size < 1024 and new.added == held[1] + new.final.size
        second, _ = await fleet_feedback([client], 1024, follower)  # reads what `new` read, and none since
        whole = await client.feedback(1024)
        await post(s, f"{served.control_url}/v1/thresholds", {"thresholds": {r: 2.0 for r in ramps}, "reason": "test"})
    assert second is not None and whole is not None and follower.after(served.control_url) == (whole.ring, whole.added)
    for name in ("conf", "pred", "final"):
        assert np.array_equal(getattr(second, name), getattr(whole, name))


async def test_autotune_step_reads_the_window_and_pushes_to_every_worker(served, ramps, texts):
    from dataclasses import replace

    from exitplan.localrun.autotune import AutoTuner
    from exitplan.planner.tuning.autotune import LIVE
    from exitplan.worker_image.control_client import ControlClient

    async with aiohttp.ClientSession(headers=control_headers(served)) as s:  # feedback to tune on (shadow fraction 0.5)
        await post_each(s, f"{served.url}/v2/models/minilm/infer", texts)
    await asyncio.sleep(1.0)

    tuner = AutoTuner(
        served.control_url,
        ramps,
        budget=0.05,
        config=replace(LIVE, min_samples=5, savings_samples=5),
        token=served.control_token,
    )
    decision = await asyncio.to_thread(tuner.step)
    await asyncio.to_thread(tuner.stop)  # closes its client and event loop
    assert decision.samples >= 5 and decision.reason in {"accuracy", "savings", "no-gain", "hold"}
    if decision.thresholds is None:  # nothing to gain on this window: make a change to see it travel
        decision_thresholds = {r: 0.97 for r in ramps}
        async with ControlClient(served.control_url, token=served.control_token) as control:
            await control.push_thresholds(decision_thresholds, "test")
    else:
        decision_thresholds = decision.thresholds
    async with aiohttp.ClientSession(headers=control_headers(served)) as s:
        for proc in served.procs:
            if proc.name.startswith("worker"):
                async with s.get(f"http://{proc.address}/v1/info") as resp:
                    assert (await resp.json())["thresholds"] == decision_thresholds, proc.name
        await post(s, f"{served.control_url}/v1/thresholds", {"thresholds": {r: 2.0 for r in ramps}, "reason": "test"})


async def test_straggler_is_marked_skipped_and_recovers(served, texts):
    split1_b32 = [p for p in served.procs if p.name.startswith("worker-s1-b32")]
    split0_b32 = next(p for p in served.procs if p.name.startswith("worker-s0-b32"))
    slow, fast = split1_b32
    short = [t for t in texts if len(t.split()) < 12][:10] or texts[:10]
    url = f"{served.url}/v2/models/minilm/infer"
    async with aiohttp.ClientSession(headers=control_headers(served)) as s:
        await post(s, f"http://{slow.address}/v1/faults", {"slowdown": 8})

        async def marked() -> bool:
            async with s.get(f"http://{split0_b32.address}/v1/peers") as resp:
                peers = {p["address"]: p for p in await resp.json()}
            return peers[slow.address]["straggler"]

        for _ in range(40):
            await asyncio.gather(*(post(s, url, infer_body([t])) for t in short[:4]))
            if await marked():
                break
        assert await marked()
        async with s.get(f"http://{slow.address}/v1/info") as resp:
            served_before = (await resp.json())["served"]
        t0 = time.monotonic()
        for _ in range(10):  # 40 inputs, 4 at a time: without the mark about half would reach it
            await asyncio.gather(*(post(s, url, infer_body([t])) for t in short[:4]))
        elapsed = time.monotonic() - t0
        async with s.get(f"http://{slow.address}/v1/info") as resp:
            served_after = (await resp.json())["served"]
        async with s.get(f"http://{fast.address}/v1/info") as resp:
            assert (await resp.json())["ready"]
        # Only the probes reach it: one frame (at most 4 rows) per probe interval, +1 for one due at
        # the start. A round that waits on a probe takes longer, so this bound counts time, not rounds.
        probes = int(elapsed / StragglerPolicy().probe_seconds) + 1
        assert served_after - served_before <= 4 * probes, (served_after - served_before, elapsed)
        await post(s, f"http://{slow.address}/v1/faults", {"slowdown": 1})
        for _ in range(150):  # a hang guard: recovery takes a few 2 s probes, more on a loaded machine
            await asyncio.gather(*(post(s, url, infer_body([t])) for t in short[:4]))
            if not await marked():
                break
            await asyncio.sleep(0.3)
        assert not await marked()


async def test_a_worker_killed_under_load_loses_no_request(served, texts):
    """SIGKILL one of two split-1 replicas mid-load: every request still gets an answer or an explicit error."""
    victim = next(p for p in served.procs if p.name.startswith("worker-s1-b32"))
    short = [t for t in texts if len(t.split()) < 12] or texts
    url = f"{served.url}/v2/models/minilm/infer"
    async with aiohttp.ClientSession() as s:

        async def one(t):
            try:
                return (await post(s, url, infer_body([t]), timeout=aiohttp.ClientTimeout(total=30)))[0]
            except TimeoutError:
                return "lost"

        tasks = []
        for i in range(120):
            tasks.append(asyncio.create_task(one(short[i % len(short)])))
            if i == 30:
                os.kill(victim.popen.pid, signal.SIGKILL)
            await asyncio.sleep(0.01)
        statuses = await asyncio.gather(*tasks)
    assert "lost" not in statuses
    assert set(statuses) <= {200, 502, 503, 504, 429}
    assert statuses.count(200) >= 100, {s: statuses.count(s) for s in set(statuses)}  # the other replica takes over
    assert statuses[-20:].count(200) == 20
