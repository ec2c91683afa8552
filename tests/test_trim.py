"""Batches padded only to their longest row (worker_image/classify/trim.py): the same answers as at
the worker's own bucket, computed at the shorter length, and only where nothing downstream sees it."""

from __future__ import annotations

import numpy as np
import pytest
from dataplane_helpers import heldout_texts, one_cell_plan, two_split_plan
from tokenizers import Tokenizer

from exitplan.api.bundle import read_manifest
from exitplan.worker_image.bundle_runtime import pad_batch
from exitplan.worker_image.classify.trim import TRIM_STEP, longest_row, seq_axes, trimmed


def test_a_batch_is_cut_to_its_longest_row_rounded_up_to_the_step():
    mask = np.zeros((3, 128), dtype=np.int64)
    mask[0, :20], mask[1, :33], mask[2, :5] = 1, 1, 1
    ids = np.arange(3 * 128).reshape(3, 128)
    state = {"input_ids": ids, "attention_mask": mask, "other": np.ones((3, 4))}
    axes = {"input_ids": 1, "attention_mask": 1}
    assert longest_row(mask, 1) == 33
    cut, length = trimmed(state, "attention_mask", axes, 128)
    assert length == 40 == TRIM_STEP * 5 and cut["input_ids"].shape == (3, 40) and cut["other"].shape == (3, 4)
    assert np.array_equal(cut["input_ids"], ids[:, :40]) and cut["attention_mask"][:, 33:].sum() == 0
    mask[1, :125] = 1  # rounded up past the bucket: nothing to cut
    same, length = trimmed(state, "attention_mask", axes, 128)
    assert length == 128 and same["input_ids"] is ids
    assert seq_axes({"input_ids": ["batch", "seq"], "hidden": ["batch", "seq", 384], "x": ["batch", 10]}) == {
        "input_ids": 1,
        "hidden": 1,
    }


@pytest.mark.slow
async def test_a_trimming_worker_answers_as_the_untrimmed_one_at_a_shorter_length(minilm_bundle, tmp_path):
    from exitplan.worker_image.classify.worker import SplitWorker

    n_blocks = len(read_manifest(minilm_bundle).blocks)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(one_cell_plan("minilm", n_blocks, 128).model_dump_json(by_alias=True))
    trimming = SplitWorker(minilm_bundle, plan_path, split=0, bucket=128)
    plain = SplitWorker(minilm_bundle, plan_path, split=0, bucket=128, trim=False)
    assert trimming.runtime.free_length and not plain.runtime.free_length
    assert trimming.runtime.buckets == plain.runtime.buckets == (128,)
    tok = Tokenizer.from_file(str(minilm_bundle / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    texts = [t for t in heldout_texts(minilm_bundle, 200) if len(tok.encode(t).ids) <= 30][:6]
    state = pad_batch([e.ids for e in tok.encode_batch(texts)], 128)
    longest = max(len(e.ids) for e in tok.encode_batch(texts))
    assert trimmed(state, "attention_mask", trimming.trim_axes, 128)[1] == -(-longest // TRIM_STEP) * TRIM_STEP < 128
    n = len(texts)
    args = ({}, np.zeros(n, bool), np.zeros(n, bool), 0, n_blocks - 1)
    cut, full = trimming._execute(state, *args), plain._execute(state, *args)
    assert [a.row for a in cut.answers] == [a.row for a in full.answers] == list(range(n))
    for a, b in zip(cut.answers, full.answers):
        assert a.ramp == b.ramp and np.allclose(a.logits, b.logits, atol=1e-4)
    for worker in (trimming, plain):
        worker.pool_exec.shutdown(wait=False)


def test_only_a_last_split_that_runs_as_one_batch_trims(minilm_bundle, tmp_path):
    from exitplan.worker_image.classify.worker import SplitWorker

    ramps = [r.name for r in read_manifest(minilm_bundle).exit_ramps()]
    plan = two_split_plan(ramps, 0.9, {}, buckets=(32, 128))
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan.model_dump_json(by_alias=True))
    first = SplitWorker(minilm_bundle, plan_path, split=0, bucket=128, next_peers="127.0.0.1:1")
    last = SplitWorker(minilm_bundle, plan_path, split=1, bucket=128)
    assert first.runtime.buckets == (128,) and not first.trim_axes  # its survivors go on at the bucket's length
    assert last.runtime.free_length and "attention_mask" in last.trim_axes and not first.runtime.free_length
    rebatching = plan.model_copy(update={"splits": [s.model_copy(update={"rebatch": True}) for s in plan.splits]})
    plan_path.write_text(rebatching.model_dump_json(by_alias=True))
    stacked = SplitWorker(minilm_bundle, plan_path, split=1, bucket=128)
    assert not stacked.runtime.free_length and not stacked.trim_axes  # its inner queues stack rows of one length
    for worker in (first, last, stacked):
        worker.pool_exec.shutdown(wait=False)


def test_service_time_interpolates_in_length_and_follows_the_lengths_batches_ran_at():
    from exitplan.worker_image.classify.service_time import Fit, ServiceTime

    times = ServiceTime(128, {128: Fit(2.0, 10.0), 16: Fit(1.0, 2.0)})
    assert times.expected_ms(4) == 42.0 and times.expected_ms(4, 16) == 9.0
    assert times.expected_ms(4, 72) == pytest.approx((9.0 + 42.0) / 2)  # halfway between 16 and 128
    assert times.expected_ms(4, 8) == 9.0 and times.typical_ms(4) == 42.0  # below the shortest fit: its time
    for _ in range(200):
        times.ran_at(16)
    assert times.mean_length == pytest.approx(16, abs=0.01) and times.typical_ms(4) == pytest.approx(9.0, abs=0.01)
    assert Fit.of(3.0, 10.0, 8) == Fit(2.0, 1.0)


@pytest.mark.slow
def test_a_trimming_worker_reports_its_capacity_at_the_lengths_it_runs(minilm_bundle, tmp_path):
    from exitplan.worker_image.classify.worker import SplitWorker

    n_blocks = len(read_manifest(minilm_bundle).blocks)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(one_cell_plan("minilm", n_blocks, 128, batch=4).model_dump_json(by_alias=True))
    worker = SplitWorker(minilm_bundle, plan_path, split=0, bucket=128)
    try:
        worker.warm_up()
        assert set(worker.times.fits) == {2 * TRIM_STEP, 128}
        assert worker.times.fits[16].at(4) < worker.times.fits[128].at(4)  # measured, not assumed
        at_bucket = worker.capacity()
        for _ in range(200):  # batches of short texts
            worker.times.ran_at(16)
        assert worker.capacity() > 1.5 * at_bucket
        assert worker.expected_ms(4) == worker.times.fits[128].at(4)  # the deadline rule keeps the worst case
    finally:
        worker.pool_exec.shutdown(wait=False)
