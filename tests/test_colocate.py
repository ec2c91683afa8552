"""The router with split 0 in its own process (`exitplan router --colocate`, issue 15 item 5): the same
answers as the model run in one piece, no split-0 worker process, thresholds that reach split 0 in the
router and split 1's pods, shadow feedback, the merged metrics, and a clear error where it cannot run."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import numpy as np
import pytest
from dataplane_helpers import (
    control_headers,
    deployment,
    heldout_texts,
    one_cell_plan,
    ramp_names,
    service_spec,
    two_split_plan,
)
from tokenizers import Tokenizer

from exitplan.api.bundle import read_manifest
from exitplan.worker_image.bundle_runtime import BundleRuntime, pad_batch, softmax

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ramps(minilm_bundle):
    return ramp_names(minilm_bundle)


@pytest.fixture(scope="module")
def texts(minilm_bundle):
    return heldout_texts(minilm_bundle, 24)


@pytest.fixture(scope="module")
def served(minilm_bundle, ramps, tmp_path_factory):
    plan = two_split_plan(ramps, thresholds=2.0, replicas={(0, 32): 2})
    dep = deployment(minilm_bundle, plan, service_spec(minilm_bundle, shadow=0.5), tmp_path_factory.mktemp("co"))
    dep.colocate = True
    dep.start()
    yield dep
    dep.stop()


def infer_body(texts):
    return {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts)], "data": list(texts)}]}


async def post(session, url, body):
    async with session.post(url, json=body) as resp:
        return resp.status, await resp.json()


def full_model_scores(bundle, texts):
    tok = Tokenizer.from_file(str(bundle / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    result = BundleRuntime(bundle, buckets=[128]).run_range(
        pad_batch([e.ids for e in tok.encode_batch(texts)], 128), 128, None
    )
    expected = np.zeros((len(texts), len(read_manifest(bundle).labels)), np.float32)
    for ex in result.exits:
        expected[ex.row] = softmax(ex.logits[None])[0]
    return expected


def test_no_split0_process_and_a_router_per_split0_replica(served):
    names = sorted(p.name for p in served.procs)
    assert not [n for n in names if n.startswith("worker-s0")], names
    assert sorted(n for n in names if n.startswith("worker-s1")) == ["worker-s1-b128-cpu-0", "worker-s1-b32-cpu-0"]
    assert [n for n in names if n.startswith("router")] == ["router-0", "router-1"]  # bucket 32 has 2 split-0 replicas
    assert all("--colocate" in p.args for p in served.router_procs())


async def test_answers_equal_the_whole_model(served, minilm_bundle, texts):
    expected = full_model_scores(minilm_bundle, texts)
    async with aiohttp.ClientSession() as s:
        status, answer = await post(s, f"{served.url}/v2/models/minilm/infer", infer_body(texts))
        assert status == 200, answer
        one = await asyncio.gather(*(post(s, f"{served.url}/v2/models/minilm/infer", infer_body([t])) for t in texts))
    out = {o["name"]: o for o in answer["outputs"]}
    got = np.asarray(out["scores"]["data"], np.float32).reshape(out["scores"]["shape"])
    assert np.abs(got - expected).max() <= 1e-4
    assert set(out["exit_ramp"]["data"]) == {read_manifest(minilm_bundle).final_ramp().name}
    for k, (status, a) in enumerate(one):  # one input per request: each through its own bucket's split 0
        assert status == 200, a
        scores = {o["name"]: o for o in a["outputs"]}["scores"]["data"]
        assert np.abs(np.asarray(scores, np.float32) - expected[k]).max() <= 1e-4


async def test_thresholds_reach_split0_in_the_router_and_split1(served, texts, ramps):
    router = served.router_procs()[0]  # the router whose control port takes the push (each router holds its own)
    url = f"http://{router.address}/v2/models/minilm/infer"
    async with aiohttp.ClientSession(headers=control_headers(served)) as s:
        status, _ = await post(s, f"{served.control_url}/v1/thresholds", {"thresholds": {ramps[0]: 0.0}})
        assert status == 200
        results = [await post(s, url, infer_body([t])) for t in texts]
        for proc in served.procs:
            if proc.name.startswith("worker-s1"):
                async with s.get(f"http://{proc.address}/v1/info") as resp:
                    assert (await resp.json())["thresholds"][ramps[0]] == 0.0
        async with s.get(f"http://{router.address}/metrics") as resp:
            metrics = await resp.text()
        await post(s, f"{served.control_url}/v1/thresholds", {"thresholds": {r: 2.0 for r in ramps}})
    # Every answer exited at ramp 0: split 0 in the router itself took the push.
    assert all(st == 200 for st, _ in results)
    assert {{o["name"]: o for o in a["outputs"]}["exit_ramp"]["data"][0] for _, a in results} == {ramps[0]}
    # One HELP/TYPE per family, a series per bucket's split 0 in the router's own exposition.
    assert metrics.count("# TYPE exitplan_worker_inputs_total counter") == 1
    served_by_split0 = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("exitplan_worker_inputs_total{") and 'split="0"' in line
    ]
    assert len(served_by_split0) == 2 and sum(served_by_split0) > 0


async def test_shadow_feedback_comes_back_to_the_router(served, texts, ramps):
    async with aiohttp.ClientSession(headers=control_headers(served)) as s:
        await post(s, f"{served.control_url}/v1/thresholds", {"thresholds": {ramps[0]: 0.0}})
        for t in texts:
            await post(s, f"{served.url}/v2/models/minilm/infer", infer_body([t]))
        await asyncio.sleep(1.0)  # the last split posts feedback after the answers
        async with s.get(f"{served.control_url}/v1/observations?window=current") as resp:
            obs = await resp.json()
        await post(s, f"{served.control_url}/v1/thresholds", {"thresholds": {r: 2.0 for r in ramps}})
    assert sum(a["samples"] for a in obs["agreement"]) > 0


def test_one_split_plan_needs_no_peers(minilm_bundle, tmp_path):
    blocks = len(read_manifest(minilm_bundle).blocks)
    dep = deployment(minilm_bundle, one_cell_plan("minilm", blocks, 128), service_spec(minilm_bundle), tmp_path)
    dep.colocate = True
    dep.start()
    try:
        assert [p.name for p in dep.procs] == ["router"]
        import json
        import urllib.request

        req = urllib.request.Request(
            f"{dep.url}/v2/models/minilm/infer",
            data=json.dumps(infer_body(["a fine day"])).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200 and json.loads(resp.read())["outputs"][0]["data"]
    finally:
        dep.stop()


def test_colocating_a_two_split_plan_without_split1_peers_says_what_is_missing(minilm_bundle, ramps, tmp_path):
    from exitplan.worker_image.classify.colocated import Colocation
    from exitplan.worker_image.classify.router import Router

    path = tmp_path / "plan.json"
    path.write_text(two_split_plan(ramps, thresholds=2.0, replicas={}).to_json())
    with pytest.raises(ValueError, match="--peers must name split 1's workers"):
        Router(minilm_bundle, path, peers="", slo_ms=100, colocate=Colocation())
    with pytest.raises(ValueError, match="--peers must name the split-0 workers"):
        Router(minilm_bundle, path, peers="", slo_ms=100)


async def test_split0_in_the_router_that_gives_no_answer_before_the_timeout_fails_the_request(minilm_bundle, tmp_path):
    """A co-located split 0 whose batch waits (here: for 24 inputs, no maximum wait) past the request's
    timeout answers HopFailed naming the timeout (the router's 504), not a hang; the row stays queued and
    is failed when the runtime stops."""
    from exitplan.worker_image.classify.colocated import run_local
    from exitplan.worker_image.classify.worker import SplitWorker
    from exitplan.worker_image.hop_client import HopFailed
    from exitplan.worker_image.wire import HopItem

    plan_path = tmp_path / "plan.json"
    plan_path.write_text(one_cell_plan("minilm", len(read_manifest(minilm_bundle).blocks), 32, 24).to_json())
    worker = SplitWorker(minilm_bundle, plan_path, split=0, bucket=32, max_wait_ms=None)
    await worker.start()
    try:
        far = time.time() + 60  # the deadline rule would launch the batch (and answer it) only near this
        state = pad_batch([[101, 2023, 2003, 102]], 32)
        with pytest.raises(HopFailed, match="gave no answer before the request's timeout"):
            await run_local(worker, [HopItem("in-0", far, far)], state, timeout_at=time.time() + 0.3)
        assert sum(len(q) for q in worker.stages.queues) == 1  # still queued, unanswered
    finally:
        await worker.stop()
