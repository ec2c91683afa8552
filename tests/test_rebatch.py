"""Rebatching splits: one fusion queue per block inside a split (the plan's `SplitPlan.rebatch`).

The queue policy (pure, shared with the simulator) and the worker's per-block queues, then a real
router + worker deployment of the MiniLM bundle whose one split rebatches: answers equal the model
run in one piece at the same thresholds, and every block runs full batches of rows gathered from
several entering batches.
"""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import aiohttp
import numpy as np
import pytest
from dataplane_helpers import control_headers, deployment, heldout_texts, ramp_names, service_spec
from tokenizers import Tokenizer

from exitplan.api.bundle import read_manifest
from exitplan.api.plan import Cell, Plan, SplitPlan
from exitplan.planner.dispatch import choose_queue
from exitplan.worker_image.bundle_runtime import BundleRuntime, bucket_for, pad_batch, softmax
from exitplan.worker_image.classify.fusion import FusionQueues

BATCH = 8


def test_choose_stage_runs_the_first_due_queue_then_the_deepest_full_one():
    due = {0: 5.0, 1: 3.0, 2: 9.0}
    assert choose_queue([8, 8, 3], 8, due.__getitem__, now=0.0) == (1, 0.0)  # nothing due: the deepest full
    assert choose_queue([9, 2, 3], 8, due.__getitem__, now=0.0) == (0, 0.0)
    assert choose_queue([2, 2, 3], 8, due.__getitem__, now=6.0) == (1, 6.0)  # 0 and 1 due, 1 since 3.0; 2 not yet
    assert choose_queue([8, 2, 3], 8, due.__getitem__, now=6.0) == (1, 6.0)  # a due queue goes before a full one
    assert choose_queue([2, 0, 3], 8, due.__getitem__, now=6.0) == (0, 6.0)
    assert choose_queue([2, 2, 3], 8, due.__getitem__, now=4.0) == (1, 4.0)
    assert choose_queue([2, 2, 3], 8, {0: 1.0, 1: 1.0, 2: 1.0}.__getitem__, now=4.0) == (2, 4.0)  # a tie: the deeper
    assert choose_queue([2, 0, 3], 8, due.__getitem__, now=4.0) == (-1, 5.0)
    assert choose_queue([0, 0, 0], 8, due.__getitem__, now=4.0) == (-1, math.inf)


def test_stage_queues_spans_survival_and_work():
    q = FusionQueues(2, 4, rebatch=True)
    assert [q.span(j) for j in range(3)] == [(2, 2), (3, 3), (4, 4)]
    for _ in range(200):  # half of the rows go on at every block
        q.record(0, 8, 4)
        q.record(1, 8, 4)
        q.record(2, 8, 4)
    assert q.survival() == pytest.approx(0.125, rel=1e-3)
    assert q.work_fraction() == pytest.approx((1 + 0.5 + 0.25) / 3, rel=1e-3)
    q.set_rebatch(False)
    assert [q.span(j) for j in range(3)] == [(2, 4), (3, 4), (4, 4)]
    assert q.work_fraction() == 1.0
    row = SimpleNamespace(enqueued=10.0, deadline=11.0)
    q.queues[1].append(row)
    assert q.held() == 1
    # max wait 0.1 s from entering the queue, or 1 s before the deadline, whichever comes first
    assert q.choose(BATCH, 10.05, lambda j: 0.5, 0.1) == (-1, pytest.approx(10.1))
    assert q.choose(BATCH, 10.2, lambda j: 0.5, None) == (-1, pytest.approx(10.5))
    assert q.choose(BATCH, 10.5, lambda j: 0.5, None) == (1, 10.5)


# ---------------------------------------------------------------- a real deployment


@pytest.fixture(scope="module")
def ramps(minilm_bundle):
    return ramp_names(minilm_bundle)


@pytest.fixture(scope="module")
def texts(minilm_bundle):
    return heldout_texts(minilm_bundle, 48)


THRESHOLD = 0.9


def rebatch_plan(ramps: list[str], n_blocks: int, buckets=(32, 128)) -> Plan:
    return Plan(
        service="test",
        model="minilm",
        splits=[SplitPlan(index=0, first_block=0, last_block=n_blocks - 1, rebatch=True)],
        buckets=list(buckets),
        cells=[Cell(split=0, bucket=b, pool="cpu", replicas=1, batch_size=BATCH) for b in buckets],
        thresholds={r: THRESHOLD for r in ramps},
    )


@pytest.fixture(scope="module")
def rebatched(minilm_bundle, ramps, tmp_path_factory):
    n_blocks = len(read_manifest(minilm_bundle).blocks)
    spec = service_spec(minilm_bundle, slo_ms=3000.0, shadow=0.0)
    dep = deployment(minilm_bundle, rebatch_plan(ramps, n_blocks), spec, tmp_path_factory.mktemp("rebatch"))
    dep.max_wait_ms = -1.0  # batches fill, or launch by the deadline rule (E3's rule, as on GPUs)
    dep.start()
    yield dep
    dep.stop()


def expected_answers(bundle, texts, buckets=(32, 128)):
    """Exit ramp and scores of each text, each bucket's texts run in one piece at the same thresholds."""
    tok = Tokenizer.from_file(str(bundle / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    ids = [e.ids for e in tok.encode_batch(texts)]
    runtime = BundleRuntime(bundle, buckets=list(buckets))
    ramp_of, scores = [None] * len(texts), np.zeros((len(texts), len(runtime.manifest.labels)), np.float32)
    for b in buckets:
        rows = [i for i, x in enumerate(ids) if bucket_for(len(x), buckets) == b]
        if not rows:
            continue
        result = runtime.run_range(
            pad_batch([ids[i] for i in rows], b), b, {r.name: THRESHOLD for r in runtime.manifest.exit_ramps()}
        )
        for ex in result.exits:
            ramp_of[rows[ex.row]] = ex.ramp
            scores[rows[ex.row]] = softmax(ex.logits[None])[0]
    return ramp_of, scores


@pytest.mark.slow
async def test_rebatching_split_answers_like_the_model_in_one_piece_and_runs_full_batches(
    rebatched, minilm_bundle, texts
):
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts)], "data": texts}]}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{rebatched.url}/v2/models/minilm/infer", json=body) as resp:
            assert resp.status == 200, await resp.text()
            answer = await resp.json()
        infos = []
        for proc in rebatched.procs:
            if "worker" in proc.name:
                async with s.get(f"http://127.0.0.1:{proc.port}/v1/info", headers=control_headers(rebatched)) as resp:
                    infos.append(await resp.json())
    out = {o["name"]: o for o in answer["outputs"]}
    ramp_of, scores = expected_answers(minilm_bundle, texts)
    assert out["exit_ramp"]["data"] == ramp_of
    got = np.asarray(out["scores"]["data"], np.float32).reshape(out["scores"]["shape"])
    assert np.abs(got - scores).max() <= 1e-4
    assert len(set(ramp_of)) > 2, "the thresholds should let inputs exit at several ramps"

    merged = False
    for info in infos:
        assert info["rebatch"] is True
        stages = info["stages"]
        assert stages[0]["rows"] == info["served"]
        for st in stages:
            # every block's batches are full but the last: rows wait for the rows of other entering batches
            assert st["batches"] == math.ceil(st["rows"] / BATCH), stages
        merged |= any(0 < st["batches"] < stages[0]["batches"] for st in stages[1:])
        assert info["queued"] == 0
    assert merged, "some block should have run fewer batches than entered the split, each merging their survivors"


@pytest.mark.slow
async def test_rows_left_inside_a_split_when_rebatching_turns_off_run_to_its_end(minilm_bundle, ramps, texts, tmp_path):
    """A plan update that turns rebatching off: rows already waiting at an inner block run from there
    to the end of the split and get the same answers."""
    from exitplan.worker_image.classify.worker import Pending, Row, SplitWorker
    from exitplan.worker_image.wire import HopItem

    n_blocks = len(read_manifest(minilm_bundle).blocks)
    plan = rebatch_plan(ramps, n_blocks, buckets=(128,))
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan.model_dump_json(by_alias=True))
    worker = SplitWorker(minilm_bundle, plan_path, split=0, bucket=128)
    tok = Tokenizer.from_file(str(minilm_bundle / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    sample = texts[:6]
    state = pad_batch([e.ids for e in tok.encode_batch(sample)], 128)
    # blocks 0 and 1 run by hand; the rows then wait at block 2's queue with their own state
    runtime = worker.runtime
    work = dict(state)
    for block in (0, 1):
        runtime.run_block(block, work, 128)
        work = {k: v for k, v in work.items() if k in runtime.manifest.live_after(block)}
    items = [HopItem(f"r{i}", deadline=time.time() + 60) for i in range(len(sample))]
    pending = Pending(items, len(runtime.manifest.labels))
    for i in range(len(sample)):
        worker.stages.queues[2].append(
            Row(
                pending, i, 0.0, items[i].deadline, items[i].deadline, items[i], 0.0, {k: v[i] for k, v in work.items()}
            )
        )
    worker.apply_plan(plan.model_copy(update={"splits": [plan.splits[0].model_copy(update={"rebatch": False})]}))
    assert worker.stages.span(2) == (2, n_blocks - 1)
    await worker.run_batch(worker.stages.take(2, BATCH), 2)
    assert worker.stages.held() == 0
    assert all(r is not None for r in pending.results)
    # the same rows, blocks 2.. run in one piece with the earlier ramps off (they passed them already)
    late = {r.name: THRESHOLD for r in runtime.manifest.exit_ramps() if r.after >= 2}
    direct = BundleRuntime(minilm_bundle, first_block=2, buckets=[128]).run_range(work, 128, late)
    assert sorted((ex.row, ex.ramp) for ex in direct.exits) == sorted(
        (i, r.ramp) for i, r in enumerate(pending.results)
    )
    worker.pool_exec.shutdown(wait=False)
