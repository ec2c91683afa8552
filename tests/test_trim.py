"""Batches padded only to their longest row's bucket (worker_image/classify/trim.py): the same answers as at
the worker's own bucket, computed at the shorter length, and only where nothing downstream sees it."""

from __future__ import annotations

import numpy as np
import pytest
from dataplane_helpers import heldout_texts, one_cell_plan, two_split_plan
from tokenizers import Tokenizer

from exitplan.api.bundle import read_manifest
from exitplan.worker.bundle_runtime import pad_batch
from exitplan.worker.classify.trim import longest_row, seq_axes, trim_buckets, trimmed


def test_a_batch_is_cut_to_the_smallest_bucket_that_holds_its_longest_row():
    mask = np.zeros((3, 128), dtype=np.int64)
    mask[0, :20], mask[1, :33], mask[2, :5] = 1, 1, 1
    ids = np.arange(3 * 128).reshape(3, 128)
    state = {"input_ids": ids, "attention_mask": mask, "other": np.ones((3, 4))}
    axes = {"input_ids": 1, "attention_mask": 1}
    assert longest_row(mask, 1) == 33
    cut, bucket = trimmed(state, "attention_mask", axes, [16, 32, 64, 128], 128)
    assert bucket == 64 and cut["input_ids"].shape == (3, 64) and cut["other"].shape == (3, 4)
    assert np.array_equal(cut["input_ids"], ids[:, :64])
    mask[1, :100] = 1  # a row needs the whole bucket: nothing to cut
    same, bucket = trimmed(state, "attention_mask", axes, [16, 32, 64, 128], 128)
    assert bucket == 128 and same["input_ids"] is ids
    assert seq_axes({"input_ids": ["batch", "seq"], "hidden": ["batch", "seq", 384], "x": ["batch", 10]}) == {
        "input_ids": 1,
        "hidden": 1,
    }


def test_trim_buckets_keep_the_default_buckets_below_the_workers(minilm_bundle, digits_bundle):
    assert trim_buckets(read_manifest(minilm_bundle), 128) == [16, 32, 64, 128]
    assert trim_buckets(read_manifest(minilm_bundle), 16) == [16]
    assert trim_buckets(read_manifest(digits_bundle), 1) == [1]


@pytest.mark.slow
async def test_a_trimming_worker_answers_as_the_untrimmed_one_at_a_shorter_length(minilm_bundle, tmp_path):
    from exitplan.worker.classify.worker import SplitWorker

    n_blocks = len(read_manifest(minilm_bundle).blocks)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(one_cell_plan("minilm", n_blocks, 128).model_dump_json(by_alias=True))
    trimming = SplitWorker(minilm_bundle, plan_path, split=0, bucket=128)
    plain = SplitWorker(minilm_bundle, plan_path, split=0, bucket=128, trim=False)
    assert trimming.runtime.buckets == (16, 32, 64, 128) and plain.runtime.buckets == (128,)
    tok = Tokenizer.from_file(str(minilm_bundle / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    texts = [t for t in heldout_texts(minilm_bundle, 200) if len(tok.encode(t).ids) <= 30][:6]
    state = pad_batch([e.ids for e in tok.encode_batch(texts)], 128)
    assert trimmed(state, "attention_mask", trimming.trim_axes, trimming.runtime.buckets, 128)[1] == 32
    n = len(texts)
    args = ({}, np.zeros(n, bool), np.zeros(n, bool), 0, n_blocks - 1)
    cut, full = trimming._execute(state, *args), plain._execute(state, *args)
    assert [a.row for a in cut.answers] == [a.row for a in full.answers] == list(range(n))
    for a, b in zip(cut.answers, full.answers):
        assert a.ramp == b.ramp and np.allclose(a.logits, b.logits, atol=1e-4)
    for worker in (trimming, plain):
        worker.pool_exec.shutdown(wait=False)


def test_only_a_last_split_that_runs_as_one_batch_trims(minilm_bundle, tmp_path):
    from exitplan.worker.classify.worker import SplitWorker

    ramps = [r.name for r in read_manifest(minilm_bundle).exit_ramps()]
    plan = two_split_plan(ramps, 0.9, {}, buckets=(32, 128))
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan.model_dump_json(by_alias=True))
    first = SplitWorker(minilm_bundle, plan_path, split=0, bucket=128, next_peers="127.0.0.1:1")
    last = SplitWorker(minilm_bundle, plan_path, split=1, bucket=128)
    assert first.runtime.buckets == (128,) and not first.trim_axes  # its survivors go on at the bucket's length
    assert last.runtime.buckets == (16, 32, 64, 128) and "attention_mask" in last.trim_axes
    rebatching = plan.model_copy(update={"splits": [s.model_copy(update={"rebatch": True}) for s in plan.splits]})
    plan_path.write_text(rebatching.model_dump_json(by_alias=True))
    stacked = SplitWorker(minilm_bundle, plan_path, split=1, bucket=128)
    assert stacked.runtime.buckets == (128,)  # its inner queues stack rows of one length
    for worker in (first, last, stacked):
        worker.pool_exec.shutdown(wait=False)
