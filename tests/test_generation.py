"""Early-exit generation with a KV cache: KV recomputation and the pipeline-based mode.

A tiny decoder bundle (3 blocks, exits after blocks 0 and 1) is trained for a few seconds on the
tweets and exported per block with explicit KV inputs/outputs; the engines run it through ONNX
Runtime. The reference is plain greedy decoding with a full cache and a full forward of the whole
sequence (what every block's cache must hold).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from generation_helpers import PROMPTS, tiny_decoder_bundle

from exitplan.api.bundle import BundleError
from exitplan.worker_image.generate.decoder import (
    DecoderModel,
    GenerationError,
    RecomputeEngine,
    full_greedy,
)
from exitplan.worker_image.generate.local_pipeline import PipelineEngine, even_stages

TOL = 1e-5


@pytest.fixture(scope="module")
def bundle() -> Path:
    return tiny_decoder_bundle()


@pytest.fixture(scope="module")
def model(bundle: Path) -> DecoderModel:
    return DecoderModel(bundle)


@pytest.fixture(scope="module")
def pipeline(bundle: Path):
    engine = PipelineEngine(bundle, splits=2)
    yield engine
    engine.close()


def assert_cache_exact(model: DecoderModel, keys, values, ids, *, complete: bool) -> None:
    """Every block's cache holds exactly what a full forward of `ids` writes, in position order."""
    reference = model.full_forward(ids)
    lengths = [k.shape[2] for k in keys]
    assert lengths[0] == len(ids)
    assert all(a >= b for a, b in zip(lengths, lengths[1:])), f"cache lengths must not grow with depth: {lengths}"
    if complete:
        assert lengths == [len(ids)] * len(lengths)
    for block, (k, v) in enumerate(zip(keys, values)):
        n = k.shape[2]
        np.testing.assert_allclose(
            k, reference.keys[block][:, :, :n], atol=TOL, rtol=0, err_msg=f"keys of block {block}"
        )
        np.testing.assert_allclose(
            v, reference.values[block][:, :, :n], atol=TOL, rtol=0, err_msg=f"values of block {block}"
        )


@pytest.mark.parametrize("mode", ["recompute", "pipeline"])
def test_threshold_one_is_plain_greedy_with_exact_caches_at_every_step(mode, model, pipeline, bundle):
    engine = RecomputeEngine(model) if mode == "recompute" else pipeline
    for prompt in PROMPTS:
        expected, ref_keys, _ = full_greedy(model, model.codec.encode(prompt), 12, ignore_eos=True)
        handle = engine.open(prompt, 12, 1.0, ignore_eos=True)
        got = []
        try:
            while not handle.finished:
                event = engine.step(handle)
                got.append(event.token_id)
                assert event.exit == "head" and event.block == model.n_blocks - 1
                keys, values = engine.snapshot(handle)
                assert_cache_exact(model, keys, values, handle.ids[:-1], complete=True)
        finally:
            engine.release(handle)
        assert got == expected
        assert engine.active_caches == 0
        # the final cache also matches the reference decoder's own cache
        np.testing.assert_allclose(keys[-1], ref_keys[-1][:, :, : keys[-1].shape[2]], atol=TOL, rtol=0)


@pytest.mark.parametrize("threshold", [0.0, 0.05, 0.1])
def test_recompute_fills_missing_entries_exactly(model, threshold):
    engine = RecomputeEngine(model, max_pending=3)
    handle = engine.open(PROMPTS[0], 24, threshold, ignore_eos=True)
    events = []
    try:
        while not handle.finished:
            pending_before = engine.pending(handle) if events else 0
            event = engine.step(handle)
            events.append(event)
            keys, values = engine.snapshot(handle)
            ids = handle.ids[:-1]
            assert_cache_exact(model, keys, values, ids, complete=event.full_pass)
            assert engine.pending(handle) <= engine.max_pending
            if pending_before >= engine.max_pending:
                assert event.full_pass and event.exit == "head"
            # the head that chose the token saw exactly the hidden state a full forward computes
            logits = model.full_forward(ids).logits[event.exit][-1]
            assert int(logits.argmax()) == event.token_id
    finally:
        engine.release(handle)
    assert engine.active_caches == 0
    exited = [e for e in events if e.exit != "head"]
    if threshold == 0.0:
        assert len(exited) >= len(events) // 2, "threshold 0 must exit at the first head whenever allowed"
        assert any(e.recomputed > 0 for e in events), "exited tokens' entries must be recomputed in later passes"
        assert any(e.full_pass for e in events[1:]), "the pending bound must force full passes"


@pytest.mark.parametrize("threshold", [0.0, 0.1])
def test_pipeline_exits_keep_every_cache_complete(pipeline, model, threshold):
    handle = pipeline.open(PROMPTS[1], 16, threshold, ignore_eos=True)
    events = []
    try:
        while not handle.finished:
            event = pipeline.step(handle)
            events.append(event)
            keys, values = pipeline.snapshot(handle)
            assert_cache_exact(model, keys, values, handle.ids[:-1], complete=True)
            logits = model.full_forward(handle.ids[:-1]).logits[event.exit][-1]
            assert int(logits.argmax()) == event.token_id
    finally:
        pipeline.release(handle)
    assert pipeline.active_caches == 0
    if threshold == 0.0:
        assert all(e.exit == "exit0" for e in events[1:])


def test_both_modes_agree_token_for_token_at_any_threshold(model, pipeline):
    """Both modes compute exact hidden states, so they make the same exit decisions (no forced full pass here)."""
    for threshold in (0.0, 0.08, 1.0):
        a = [
            (e.token_id, e.exit)
            for e in RecomputeEngine(model, max_pending=64).generate(PROMPTS[2], 16, threshold, ignore_eos=True)
        ]
        b = [(e.token_id, e.exit) for e in pipeline.generate(PROMPTS[2], 16, threshold, ignore_eos=True)]
        assert a == b


def test_bad_requests_get_clear_errors_and_hold_no_cache(model, pipeline):
    context = model.spec.max_context
    for engine in (RecomputeEngine(model), pipeline):
        cases = [
            (("", 4, 0.5), "prompt is empty"),
            (("   ", 4, 0.5), "prompt is empty"),
            (("x" * context, 4, 0.5), "shorten it"),
            (("hello", 0, 0.5), "max_tokens must be an integer in 1.."),
            (("hello", context, 0.5), "max_tokens must be an integer in 1.."),
            (("hello", "5", 0.5), "max_tokens must be an integer"),
            (("hello", 4, 1.5), "threshold must be a number in 0..1"),
            (("hello", 4, float("nan")), "threshold must be a number in 0..1"),
        ]
        for args, message in cases:
            with pytest.raises(GenerationError, match=message):
                list(engine.generate(*args))
        assert engine.active_caches == 0


def test_closing_a_generation_midway_releases_its_cache(model, pipeline):
    for engine in (RecomputeEngine(model), pipeline):
        stream = engine.generate(PROMPTS[0], 20, 0.0, ignore_eos=True)
        next(stream)
        next(stream)
        assert engine.active_caches == 1
        stream.close()
        assert engine.active_caches == 0


def test_any_decoder_with_the_layout_loads_fewer_exits_and_other_splits(bundle, tmp_path):
    """A bundle.yaml that keeps only some exits still serves; pipelines take any contiguous split."""
    copy = tmp_path / "one-exit"
    shutil.copytree(bundle, copy)
    manifest = yaml.safe_load((copy / "bundle.yaml").read_text())
    manifest["ramps"] = [r for r in manifest["ramps"] if r["name"] != "exit0"]
    (copy / "bundle.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    model = DecoderModel(copy)
    assert [h.name for h in model.heads] == ["exit1", "head"]
    events = list(RecomputeEngine(model).generate(PROMPTS[0], 8, 0.0, ignore_eos=True))
    assert {e.exit for e in events[1:]} <= {"exit1", "head"} and "exit1" in {e.exit for e in events}
    engine = PipelineEngine(copy, splits=[(0, 0), (1, 1), (2, 2)])
    try:
        assert [(e.token_id, e.exit) for e in engine.generate(PROMPTS[0], 8, 0.0, ignore_eos=True)] == [
            (e.token_id, e.exit) for e in events
        ]
    finally:
        engine.close()


def test_bundles_that_break_the_layout_are_rejected(bundle, tmp_path):
    copy = tmp_path / "broken"
    shutil.copytree(bundle, copy)
    manifest = yaml.safe_load((copy / "bundle.yaml").read_text())
    manifest["decoder"]["cache"] = manifest["decoder"]["cache"][:-1]
    (copy / "bundle.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    with pytest.raises(BundleError, match="one entry per block"):
        DecoderModel(copy)
    del manifest["decoder"]
    (copy / "bundle.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    with pytest.raises(BundleError, match="not a generative bundle"):
        DecoderModel(copy)
    with pytest.raises(GenerationError, match="cover blocks"):
        PipelineEngine(bundle, splits=[(0, 0), (2, 2)])
    with pytest.raises(GenerationError, match="stages must be within"):
        even_stages(3, 4)


def test_a_bundle_with_a_tokenizers_file_serves_the_same_tokens(bundle, model, tmp_path):
    """Real models bring a tokenizers JSON: here a character-level one with the same ids as the bytes codec."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {chr(i): i for i in range(32, 127)} | {"[UNK]": 0}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    copy = tmp_path / "with-tokenizer"
    shutil.copytree(bundle, copy)
    tokenizer.save(str(copy / "tokenizer.json"))
    manifest = yaml.safe_load((copy / "bundle.yaml").read_text())
    manifest["tokenizer"] = "tokenizer.json"
    manifest["decoder"]["tokenizer"] = "tokenizers"
    (copy / "bundle.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    other = DecoderModel(copy)
    assert other.codec.encode(PROMPTS[0]) == model.codec.encode(PROMPTS[0])
    ours = list(RecomputeEngine(model).generate(PROMPTS[0], 12, 0.05, ignore_eos=True))
    theirs = list(RecomputeEngine(other).generate(PROMPTS[0], 12, 0.05, ignore_eos=True))
    assert [e.token_id for e in theirs] == [e.token_id for e in ours]
    if all(32 <= e.token_id < 127 for e in ours):
        assert "".join(e.text for e in theirs) == "".join(e.text for e in ours)
    manifest["tokenizer"] = None
    del manifest["tokenizer"]
    (copy / "bundle.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    with pytest.raises(BundleError, match="no tokenizer file is named"):
        DecoderModel(copy)
