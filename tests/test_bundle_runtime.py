"""BundleRuntime on the real bundles: split chaining, exits, buckets, agreement with PyTorch."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from exitplan.api.bundle import read_manifest
from exitplan.worker_image.bundle_runtime import (
    BundleRuntime,
    StateError,
    bucket_for,
    default_buckets,
    pad_batch,
    softmax,
)

pytestmark = pytest.mark.slow

BUCKET = 64


@pytest.fixture(scope="module")
def heldout_ids(minilm_bundle):
    from tokenizers import Tokenizer

    with np.load(minilm_bundle / "data" / "heldout.npz") as data:
        texts = [str(t) for t in data["text"][:24]]
    tokenizer = Tokenizer.from_file(str(minilm_bundle / "tokenizer.json"))
    return [enc.ids for enc in tokenizer.encode_batch(texts)], texts


@pytest.fixture(scope="module")
def minilm_state(heldout_ids):
    ids, _ = heldout_ids
    assert max(len(s) for s in ids) <= BUCKET
    return pad_batch(ids, BUCKET)


@pytest.fixture(scope="module")
def full_runtime(minilm_bundle):
    return BundleRuntime(minilm_bundle, buckets=[BUCKET])


def _final_logits(result, n: int, classes: int = 3) -> np.ndarray:
    out = np.full((n, classes), np.nan, dtype=np.float32)
    for ex in result.exits:
        out[ex.row] = ex.logits
    return out


def _cuts(n_blocks: int, max_splits: int = 3):
    """Every way to cut blocks 0..n-1 into 1..max_splits contiguous ranges."""
    for k in range(max_splits):
        for cut in itertools.combinations(range(1, n_blocks), k):
            edges = (0, *cut, n_blocks)
            yield [(edges[i], edges[i + 1] - 1) for i in range(len(edges) - 1)]


def _chain(runtimes, ranges, state, thresholds=None):
    """Run the ranges in order, forwarding survivors; return {original row: (ramp, logits)}."""
    answers = {}
    rows = np.arange(next(iter(state.values())).shape[0])
    for rng in ranges:
        result = runtimes[rng].run_range(state, BUCKET, thresholds)
        for ex in result.exits:
            answers[int(rows[ex.row])] = (ex.ramp, ex.logits)
        rows = rows[result.rows]
        state = result.state
    assert rows.size == 0
    return answers


def test_every_split_of_minilm_chains_to_the_full_model(minilm_bundle, minilm_state, full_runtime):
    n = minilm_state["input_ids"].shape[0]
    full = _final_logits(full_runtime.run_range(minilm_state, BUCKET), n)
    n_blocks = len(full_runtime.manifest.blocks)
    runtimes: dict[tuple[int, int], BundleRuntime] = {}
    splits = list(_cuts(n_blocks))
    assert len(splits) == 1 + 5 + 10
    worst = 0.0
    for ranges in splits:
        for rng in ranges:
            if rng not in runtimes:
                runtimes[rng] = BundleRuntime(minilm_bundle, first_block=rng[0], last_block=rng[1], buckets=[BUCKET])
        answers = _chain(runtimes, ranges, minilm_state)
        assert sorted(answers) == list(range(n))
        assert {ramp for ramp, _ in answers.values()} == {"head"}
        chained = np.stack([answers[i][1] for i in range(n)])
        worst = max(worst, float(np.abs(chained - full).max()))
    assert worst <= 1e-4, f"chained splits differ from the full model by {worst}"


def test_chained_splits_with_exits_answer_like_one_runtime(minilm_bundle, minilm_state, full_runtime):
    probs = {name: softmax(v) for name, v in full_runtime.run_all_ramps(minilm_state, BUCKET)[0].items()}
    # thresholds at each ramp's median confidence: some rows exit at every ramp
    thresholds = {name: float(np.median(p.max(1))) for name, p in probs.items() if name != "head"}
    single = _chain({(0, 5): full_runtime}, [(0, 5)], minilm_state, thresholds)
    ranges = [(0, 1), (2, 3), (4, 5)]
    runtimes = {r: BundleRuntime(minilm_bundle, first_block=r[0], last_block=r[1], buckets=[BUCKET]) for r in ranges}
    chained = _chain(runtimes, ranges, minilm_state, thresholds)
    assert {r: a[0] for r, a in chained.items()} == {r: a[0] for r, a in single.items()}
    assert len({ramp for ramp, _ in single.values()}) >= 3, "the thresholds should spread exits over several ramps"
    for row, (ramp, logits) in single.items():
        np.testing.assert_allclose(chained[row][1], logits, atol=1e-4)
        # earliest-exit semantics: the answering ramp is the first whose confidence reaches its threshold
        earliest = next(
            (r for r in full_runtime.manifest.exit_ramps() if probs[r.name][row].max() >= thresholds[r.name]), None
        )
        assert ramp == (earliest.name if earliest else "head")


def test_runtime_matches_pytorch(minilm_bundle, heldout_ids, minilm_state, full_runtime):
    import torch

    from exitplan.prepare.from_hf import reference_model
    from exitplan.prepare.minilm import model_path

    _, texts = heldout_ids
    onnx = _final_logits(full_runtime.run_range(minilm_state, BUCKET), len(texts))
    with torch.inference_mode():
        tensors = {k: torch.from_numpy(v) for k, v in minilm_state.items()}
        reference = reference_model(model_path(), minilm_bundle)(tensors["input_ids"], tensors["attention_mask"])
    assert np.abs(onnx - reference.numpy()[: len(texts)]).max() <= 1e-4


def test_buckets_give_the_same_answers(minilm_bundle, heldout_ids):
    ids, _ = heldout_ids
    ids = [s for s in ids if len(s) <= 16][:8]
    assert ids, "the held-out texts should include short ones"
    runtime = BundleRuntime(minilm_bundle)
    assert runtime.buckets == default_buckets(128) == (16, 32, 64, 128)
    outputs = [runtime.run_all_ramps(pad_batch(ids, b), b)[0] for b in runtime.buckets]
    for other in outputs[1:]:
        for name, logits in outputs[0].items():
            np.testing.assert_allclose(other[name], logits, atol=1e-4)


def test_thresholds_above_one_or_missing_mean_no_exit(minilm_state, full_runtime):
    result = full_runtime.run_range(minilm_state, BUCKET, {"ramp0": 1.5, "ramp2": 2.0})
    assert {ex.ramp for ex in result.exits} == {"head"}
    result = full_runtime.run_range(minilm_state, BUCKET, {"ramp1": 0.0})
    assert {ex.ramp for ex in result.exits} == {"ramp1"}
    assert result.rows.size == 0 and result.state == {}


def test_a_middle_split_forwards_only_live_state(minilm_bundle, minilm_state):
    first = BundleRuntime(minilm_bundle, first_block=0, last_block=2, buckets=[BUCKET])
    result = first.run_range(minilm_state, BUCKET, {"ramp0": 0.0})
    assert result.rows.size == 0 and {ex.ramp for ex in result.exits} == {"ramp0"}
    result = first.run_range(minilm_state, None, None)
    hidden = first.manifest.blocks[2].outputs[0]
    assert sorted(result.state) == sorted(first.manifest.live_after(2)) == sorted(["attention_mask", hidden])
    assert result.state[hidden].shape == (minilm_state["input_ids"].shape[0], BUCKET, 384)
    assert result.exits == []


def test_digits_splits_chain_to_the_full_model(digits_bundle):
    with np.load(digits_bundle / "data" / "heldout.npz") as data:
        x, full_pred = data["x"][:50], data["full_pred"][:50]
    full = BundleRuntime(digits_bundle)
    assert full.buckets == (1,)
    reference = _final_logits(full.run_range({"x": x}), len(x), 10)
    assert (reference.argmax(1) == full_pred).all()
    for cut in _cuts(3):
        state, rows, answers = {"x": x}, np.arange(len(x)), {}
        for first, last in cut:
            result = BundleRuntime(digits_bundle, first_block=first, last_block=last).run_range(state)
            answers.update({int(rows[e.row]): e.logits for e in result.exits})
            rows, state = rows[result.rows], result.state
        chained = np.stack([answers[i] for i in range(len(x))])
        assert np.abs(chained - reference).max() <= 1e-4


# ------------------------------------------------------------------ bad calls


def test_bad_state_is_a_clear_state_error(full_runtime, minilm_state):
    with pytest.raises(StateError, match="input_ids.*int64"):
        full_runtime.run_block(0, {**minilm_state, "input_ids": minilm_state["input_ids"].astype(np.int32)}, BUCKET)
    with pytest.raises(StateError, match="attention_mask.*not in the state"):
        full_runtime.run_block(0, {"input_ids": minilm_state["input_ids"]}, BUCKET)
    with pytest.raises(StateError, match="bucket 32 is not one of"):
        full_runtime.run_block(0, dict(minilm_state), 32)
    short = {k: v[:, :20] for k, v in minilm_state.items()}
    with pytest.raises(StateError, match="fit none of the buckets"):
        full_runtime.run_block(0, short)
    with pytest.raises(StateError, match="unknown ramp 'ramp9'"):
        full_runtime.run_range(minilm_state, BUCKET, {"ramp9": 0.5})
    with pytest.raises(StateError, match="outside this runtime's range"):
        BundleRuntime(full_runtime.directory, first_block=2, last_block=3, buckets=[BUCKET]).run_block(
            0, dict(minilm_state)
        )


def test_bucket_helpers():
    assert bucket_for(16, (16, 32)) == 16 and bucket_for(17, (16, 32)) == 32
    with pytest.raises(StateError, match="longer than the largest bucket"):
        bucket_for(33, (16, 32))
    padded = pad_batch([[101, 7, 102], [101, 102]], 4)
    assert padded["input_ids"].tolist() == [[101, 7, 102, 0], [101, 102, 0, 0]]
    assert padded["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]
    assert default_buckets(100) == (16, 32, 64, 100)


def test_manifest_of_the_minilm_bundle(minilm_bundle):
    m = read_manifest(minilm_bundle)
    assert [b.name for b in m.blocks] == [f"block{i}" for i in range(6)]
    assert [(r.name, r.after, r.final) for r in m.ramps] == [(f"ramp{i}", i, False) for i in range(5)] + [
        ("head", 5, True)
    ]
    assert m.blocks[0].inputs == ["input_ids", "attention_mask"] and m.seq_axis == 1 and m.max_length == 128
