"""No request can hurt another: every input is checked before it joins a batch, a batch that still
fails in ONNX Runtime is split so that only the input at fault fails (a 4xx naming why), and a
request that can never be admitted is refused for good (413 with the limit), not asked to retry.

Real components throughout: the MiniLM test bundle (its tokenizer and embedding table), a tiny
bundle whose model refuses some valid uint8 codes (`fragile_bundle`), a real worker fed fused
batches over HTTP, and a router + worker deployment answering concurrent requests.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import aiohttp
import numpy as np
import pytest
from aiohttp.test_utils import TestServer
from dataplane_helpers import free_port_block, one_cell_plan, service_spec
from fragile_bundle import GOOD_CODES, fragile_bundle, fragile_request
from tokenizers import Tokenizer

from exitplan.api.bundle import read_manifest
from exitplan.localrun.deployment import LocalDeployment
from exitplan.worker_image import wire
from exitplan.worker_image.auth import new_token
from exitplan.worker_image.bundle_runtime import BundleRuntime, StateError, pad_batch, softmax
from exitplan.worker_image.classify.admission import Admission, Admitted, Refusal
from exitplan.worker_image.classify.batch_bisect import execute_isolated, known_input_check
from exitplan.worker_image.classify.decode import BadRequest, decode_inputs
from exitplan.worker_image.classify.worker import SplitWorker
from exitplan.worker_image.hop_client import HopClient
from exitplan.worker_image.vocabulary import embedding_rows, vocabulary_size
from exitplan.worker_image.wire import HopAnswer, HopItem, HopRequest, HopResult

BATCH = 24
VOCAB = 30522
"""The MiniLM tokenizer's vocabulary and its embedding table's rows."""


@pytest.fixture(scope="module")
def fragile(tmp_path_factory):
    return fragile_bundle(tmp_path_factory.mktemp("fragile"))


def _tokenizer(bundle):
    tok = Tokenizer.from_file(str(bundle / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    return tok


def _ids_request(ids: list[list[int]], mask: list[list[int]] | None = None, datatype: str = "INT64") -> dict:
    shape = [len(ids), len(ids[0])]
    inputs = [{"name": "input_ids", "datatype": datatype, "shape": shape, "data": ids}]
    if mask is not None:
        inputs.append({"name": "attention_mask", "datatype": "INT64", "shape": shape, "data": mask})
    return {"inputs": inputs}


# ---------------------------------------------------------------- every input checked before it joins a batch


def test_the_vocabulary_is_read_from_the_tokenizer_and_the_embedding_table(minilm_bundle, digits_bundle):
    manifest = read_manifest(minilm_bundle)
    assert embedding_rows(minilm_bundle / manifest.blocks[0].file) == VOCAB
    assert embedding_rows(minilm_bundle / manifest.blocks[1].file) is None  # no token lookup in later blocks
    assert vocabulary_size(minilm_bundle, manifest, _tokenizer(minilm_bundle)) == VOCAB
    assert vocabulary_size(minilm_bundle, manifest) == VOCAB  # without a tokenizer: the embedding table alone
    assert vocabulary_size(digits_bundle, read_manifest(digits_bundle)) is None  # no token ids at all


@pytest.mark.parametrize(
    "ids, mask, datatype, reason",
    [
        ([[101, 999999, 102]], None, "INT64", r"value 999999 at position 1 .*allowed: token ids in \[0, 30521\]"),
        ([[101, 2000], [30522, 102]], None, "INT64", r"value 30522 at position 2 "),
        ([[101, -1, 102]], None, "INT32", r"value -1 at position 1 "),
        ([[101, 2000, 102]], [[1, 2, 1]], "INT64", r"'attention_mask': value 2 at position 1 .* 0 or 1"),
        ([[101, 2000, 102]], [[1, 1, -1]], "INT64", r"'attention_mask': value -1 at position 2 "),
    ],
)
def test_token_ids_outside_the_vocabulary_and_masks_other_than_0_1_are_refused_by_position(
    minilm_bundle, ids, mask, datatype, reason
):
    manifest = read_manifest(minilm_bundle)
    with pytest.raises(BadRequest, match=reason):
        decode_inputs(_ids_request(ids, mask, datatype), manifest, None, [32, 128], False, VOCAB)
    # the edges of the vocabulary and a 0/1 mask are fine
    good = decode_inputs(_ids_request([[0, VOCAB - 1, 102]], [[1, 1, 0]]), manifest, None, [32], False, VOCAB)
    assert [t.tolist() for t in good.tokens] == [[0, VOCAB - 1]]


# ---------------------------------------------------------------- a failed batch is bisected: the culprit fails alone


def _fragile_state(codes: list[int]) -> dict[str, np.ndarray]:
    n = len(codes)
    x = np.arange(n * 4, dtype=np.float32).reshape(n, 4) / 10
    return {"x": x, "code": np.asarray(codes, np.uint8).reshape(n, 1)}


def test_bisecting_answers_every_input_but_the_ones_the_model_refuses(fragile):
    runtime = BundleRuntime(fragile)
    codes = [1, 2, 250, 3, 4, 5, 255, 199, 0]
    state = _fragile_state(codes)
    n = len(codes)
    with pytest.raises(Exception, match="broadcast"):  # the fused batch fails as a whole
        runtime.run_range(state)
    outcome = execute_isolated(runtime, state, 1, {}, np.zeros(n, bool), np.zeros(n, bool))
    assert sorted(outcome.rejected) == [2, 6]
    assert all("the model cannot run this input" in why and "broadcast" in why for why in outcome.rejected.values())
    good = [i for i in range(n) if codes[i] < GOOD_CODES]
    assert sorted(a.row for a in outcome.answers) == good
    alone = runtime.run_range({k: v[good] for k, v in state.items()})  # the good ones as a batch of their own
    expected = {good[e.row]: e.logits for e in alone.exits}
    for answer in outcome.answers:
        np.testing.assert_allclose(answer.logits, expected[answer.row], rtol=1e-6)


def test_a_model_that_runs_nothing_is_the_workers_fault_not_the_inputs(fragile):
    runtime = BundleRuntime(fragile)
    bad = _fragile_state([250, 251, 252])
    flags = np.zeros(3, bool)
    with pytest.raises(Exception, match="broadcast"):  # every row fails and nothing says the model works
        execute_isolated(runtime, bad, 1, {}, flags, flags)
    broken = known_input_check(runtime, _fragile_state([254]), 1, 0, 0)  # a "known-good" input that fails too
    with pytest.raises(Exception, match="broadcast"):
        execute_isolated(runtime, bad, 1, {}, flags, flags, known_good=broken)
    works = known_input_check(runtime, _fragile_state([0]), 1, 0, 0)
    assert known_input_check(runtime, _fragile_state([0]), 1, 1, 1) is None  # a later stage has none
    outcome = execute_isolated(runtime, bad, 1, {}, flags, flags, known_good=works)
    assert sorted(outcome.rejected) == [0, 1, 2] and not outcome.answers
    # a state that does not fit the bundle is the frame's, raised at once
    wrong = {"x": bad["x"].astype(np.float64), "code": bad["code"]}
    with pytest.raises(StateError, match="float32"):
        execute_isolated(runtime, wrong, 1, {}, flags, flags, known_good=works)


def test_an_input_error_crosses_the_wire_and_an_old_pods_error_is_the_pods():
    own = HopResult.rejection("a", "the model cannot run this input")
    assert own.to_meta() == {"id": "a", "error": "the model cannot run this input", "input_error": True}
    assert HopResult.from_meta(own.to_meta()) == own
    assert HopResult.failure("b", "worker error").to_meta() == {"id": "b", "error": "worker error"}
    assert HopResult.from_meta({"id": "b", "error": "worker error"}).input_error is False
    assert HopResult.from_meta({"id": "c", "ramp": "head", "final": True, "input_error": True}).input_error is False
    with pytest.raises(wire.WireError, match="input_error"):
        HopResult.from_meta({"id": "d", "error": "x", "input_error": "yes"})


async def _post_frames(address: str, token: str, frames: list[tuple[list[HopItem], dict]], bucket: int):
    client = HopClient(token=token)
    try:

        async def one(items, tensors):
            body = wire.encode(HopRequest(items, bucket).to_meta(), tensors)
            status, payload = await client.post(address, "/v1/run", body, wire.CONTENT_TYPE, 120.0)
            assert status == 200, payload[:300]
            meta, out = wire.decode(payload)
            return HopAnswer.from_meta(meta), out

        return await asyncio.gather(*(one(items, tensors) for items, tensors in frames))
    finally:
        await client.close()


@pytest.mark.slow
async def test_an_out_of_vocabulary_id_past_the_router_fails_alone_in_a_fused_batch_of_24(minilm_bundle, tmp_path):
    """A real MiniLM worker (CPU) takes 24 one-input frames as one batch; one carries token id 999999,
    which ONNX Runtime's Gather refuses: that input gets an input error with the reason, the other 23
    their answers, equal to the model's on them alone."""
    manifest = read_manifest(minilm_bundle)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(one_cell_plan("minilm", len(manifest.blocks), 32, BATCH).to_json())
    token = new_token()
    worker = SplitWorker(minilm_bundle, plan_path, split=0, bucket=32, max_wait_ms=None, control_token=token)
    server = TestServer(worker.app(), host="127.0.0.1", port=free_port_block(1))
    await server.start_server()
    try:
        seqs = [[101, 2000 + 7 * i, 3000 + 11 * i, 102] for i in range(BATCH)]
        poisoned = 13
        seqs[poisoned] = [101, 999999, 102]
        state = pad_batch(seqs, 32)
        deadline = time.time() + 60  # the batch launches when full, long before this
        frames = [
            ([HopItem(f"in-{i}", deadline, deadline)], {k: v[i : i + 1] for k, v in state.items()})
            for i in range(BATCH)
        ]
        answers = await _post_frames(f"127.0.0.1:{server.port}", token, frames, 32)
    finally:
        await server.close()
        worker.pool_exec.shutdown(wait=False)
    results = [answer.results[0] for answer, _ in answers]
    bad = results[poisoned]
    assert bad.input_error and bad.ramp is None
    assert "the model cannot run this input" in bad.error and "idx=999999" in bad.error
    good = [i for i in range(BATCH) if i != poisoned]
    assert all(results[i].error is None and results[i].ramp == "head" for i in good)
    sample = worker.metrics.registry.get_sample_value
    assert sample("exitplan_worker_batch_inputs_count", worker.metrics.labels) == 1  # one fused batch of 24 ...
    assert sample("exitplan_worker_batch_inputs_sum", worker.metrics.labels) == BATCH
    assert sample("exitplan_worker_rejected_inputs_total", worker.metrics.labels) == 1  # ... split to find the one
    full = BundleRuntime(minilm_bundle, buckets=[32]).run_range({k: v[good] for k, v in state.items()}, 32)
    expected = {good[e.row]: e.logits for e in full.exits}
    for i in good:
        np.testing.assert_allclose(answers[i][1]["logits"][0], expected[i], atol=1e-4)


@pytest.fixture(scope="module")
def fragile_served(fragile, tmp_path_factory):
    """Router + one worker of the fragile bundle; the worker fuses up to 24 inputs and waits for a
    full batch (no max wait), so 24 concurrent requests run as one batch."""
    spec = service_spec(fragile, slo_ms=4000.0)
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"name": "fragile"})})
    base = free_port_block(3)
    dep = LocalDeployment(
        fragile,
        one_cell_plan("fragile", 1, 1, BATCH),
        spec,
        tmp_path_factory.mktemp("fragile-served"),
        port=base + 2,
        base_port=base,
        window_seconds=3600,
        max_wait_ms=-1.0,
    )
    with dep:
        yield dep


async def _worker_metric(dep: LocalDeployment, name: str) -> float:
    worker = next(p for p in dep.procs if p.name.startswith("worker"))
    async with aiohttp.ClientSession() as s, s.get(f"http://{worker.address}/metrics") as resp:
        text = await resp.text()
    found = re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M)
    assert found, f"{name} is not in the worker's metrics"
    return float(found.group(1))


@pytest.mark.slow
async def test_a_poisoned_request_among_24_concurrent_ones_gets_a_422_and_the_23_their_answers(fragile, fragile_served):
    """Code 250 is a valid uint8 for the router, but the model cannot run a batch that holds it: the
    worker's fused batch of 24 fails, is bisected, and only that request fails (422, with ONNX
    Runtime's reason); the 23 others are answered as the model answers them alone."""
    rng = np.random.default_rng(14)
    xs = rng.normal(size=(BATCH, 4)).round(3).astype(np.float32)
    codes = [int(c) for c in rng.integers(0, GOOD_CODES, BATCH)]
    poisoned = 9
    codes[poisoned] = 250
    url = f"{fragile_served.url}/v2/models/fragile/infer"
    async with aiohttp.ClientSession() as s:

        async def one(i):
            async with s.post(url, json=fragile_request(xs[i].tolist(), codes[i])) as resp:
                return resp.status, await resp.json()

        answers = await asyncio.gather(*(one(i) for i in range(BATCH)))
    status, body = answers[poisoned]
    assert status == 422, body
    assert "1 of 1 inputs failed; input 0: the model cannot run this input" in body["error"]
    assert "broadcast" in body["error"]  # ONNX Runtime's own reason
    good = [i for i in range(BATCH) if i != poisoned]
    assert [answers[i][0] for i in good] == [200] * len(good), [answers[i] for i in good if answers[i][0] != 200]
    alone = BundleRuntime(fragile).run_range(_fragile_state_of(xs[good], [codes[i] for i in good]))
    for e in alone.exits:
        out = {o["name"]: o for o in answers[good[e.row]][1]["outputs"]}
        np.testing.assert_allclose(out["scores"]["data"], softmax(e.logits[None])[0], atol=1e-6)  # JSON rounds
    assert await _worker_metric(fragile_served, "exitplan_worker_batch_inputs_count") == 1  # one fused batch
    assert await _worker_metric(fragile_served, "exitplan_worker_rejected_inputs_total") == 1
    # and the service goes on answering
    async with aiohttp.ClientSession() as s, s.post(url, json=fragile_request([0, 0, 0, 0], 7)) as resp:
        assert resp.status == 200, await resp.text()


def _fragile_state_of(xs: np.ndarray, codes: list[int]) -> dict[str, np.ndarray]:
    return {"x": np.asarray(xs, np.float32), "code": np.asarray(codes, np.uint8).reshape(-1, 1)}


@pytest.mark.slow
async def test_values_the_router_checks_never_reach_the_worker(fragile_served):
    url = f"{fragile_served.url}/v2/models/fragile/infer"
    cases = [
        (fragile_request([0, 0, 0, 0], 300), r"'code' \(UINT8\): value 300 at position 0 .*\[0, 255\]"),
        (fragile_request([0, 0, 0, 0], -1), r"'code' \(UINT8\): value -1 at position 0 "),
        (fragile_request([0, 1e39, 0, 0], 1), r"'x' \(FP32\): value 1e\+39 at position 1 .*out of range"),
        (fragile_request([0, 0, "NaN", 0], 1), r"'x' \(FP32\): value 'NaN' at position 2 .*not a number"),
    ]
    computed = await _worker_metric(fragile_served, "exitplan_worker_inputs_total")
    async with aiohttp.ClientSession() as s:
        for body, reason in cases:
            async with s.post(url, data=json.dumps(body)) as resp:
                assert resp.status == 400
                assert re.search(reason, (await resp.json())["error"]), body
    assert await _worker_metric(fragile_served, "exitplan_worker_inputs_total") == computed


# ---------------------------------------------------------------- a request that can never be admitted: 413


def test_more_inputs_than_the_in_flight_limit_is_413_without_retry_after():
    adm = Admission([16, 64], 0.1, lambda b: 100.0, max_inflight=8)
    verdict = adm.admit([10] * 9)
    assert isinstance(verdict, Refusal) and verdict.status == 413 and verdict.retry_after_s == 0
    assert "9 inputs" in verdict.reason and "limit of 8 inputs in flight" in verdict.reason
    assert "send at most 8 inputs per request" in verdict.reason
    assert adm.inflight == 0 and adm.outstanding == [0, 0]
    assert isinstance(adm.admit([10] * 8), Admitted)  # exactly the limit fits
    # while the router is busy, a request that fits the limit is asked to retry (503), not refused for good
    busy = adm.admit([10])
    assert isinstance(busy, Refusal) and busy.status == 503 and busy.retry_after_s >= 1


def test_more_inputs_than_the_service_answers_before_the_timeout_is_413_with_that_number():
    capacities = [100.0, 50.0]  # inputs/s the pods of each bucket report
    adm = Admission([16, 64], 0.1, lambda b: capacities[b], timeout_s=2.0)
    verdict = adm.admit([10] * 301)
    assert isinstance(verdict, Refusal) and verdict.status == 413 and verdict.retry_after_s == 0
    assert "timeout of 2 s" in verdict.reason and "send at most 300 inputs per request" in verdict.reason
    assert isinstance(adm.admit([10] * 300), Admitted)  # an idle bucket takes one that can finish in time
    capacities[1] = 0.0  # a bucket without a ready pod answers nothing
    verdict = Admission([16, 64], 0.1, lambda b: capacities[b], timeout_s=2.0).admit([10] * 201)
    assert isinstance(verdict, Refusal) and verdict.status == 413 and "send at most 200 inputs" in verdict.reason
    capacities[0] = 0.0  # no ready pod at all: the usual refusal says so (429, retry later)
    verdict = Admission([16, 64], 0.1, lambda b: capacities[b], timeout_s=2.0).admit([10] * 201)
    assert isinstance(verdict, Refusal) and verdict.status == 429 and verdict.retry_after_s >= 1
