"""`exitplan prepare`: what a built bundle holds, how good its head and ramps are, reuse and rebuilds."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from exitplan.api.bundle import read_manifest
from exitplan.cli import app
from exitplan.prepare.build import MARKER, BuildOptions, PrepareError, tqdm_bar
from exitplan.prepare.datasets import DatasetError, load_tweets
from exitplan.prepare.presets import prepare_bundle
from exitplan.worker_image.bundle_runtime import BundleRuntime, pad_batch, softmax

pytestmark = pytest.mark.slow


def _text(result) -> str:
    """The command's output with rich's line wrapping undone."""
    return " ".join(result.output.split())


def _report(bundle):
    return json.loads((bundle / "data" / "report.json").read_text())


def test_onnx_files_name_their_free_axes_batch_and_seq(minilm_bundle):
    import onnx

    manifest = read_manifest(minilm_bundle)
    for spec in [*manifest.blocks, *manifest.exit_ramps()]:
        graph = onnx.load(str(minilm_bundle / spec.file), load_external_data=False).graph
        for value in graph.input:
            dims = [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
            assert dims[:2] == ["batch", "seq"], (spec.file, value.name, dims)
        for value in graph.output:
            dims = [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
            # hidden states between blocks; the last block ends in the class scores (the head passes them on)
            hidden = spec in manifest.blocks[:-1]
            assert dims == (["batch", "seq", 384] if hidden else ["batch", 3]), (spec.file, dims)


def test_tokenizer_file_matches_the_models_tokenizer(minilm_bundle):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from exitplan.prepare.minilm import model_path

    with np.load(minilm_bundle / "data" / "heldout.npz") as data:
        texts = [str(t) for t in data["text"][:50]]
        lengths = data["length"][:50]
    ours = Tokenizer.from_file(str(minilm_bundle / "tokenizer.json"))
    theirs = AutoTokenizer.from_pretrained(str(model_path()))
    for text, length in zip(texts, lengths):
        ids = ours.encode(text).ids
        assert ids == theirs(text)["input_ids"]
        assert len(ids) == length
    long = ours.encode("word " * 300).ids  # no truncation and no padding in the shipped file: the router decides
    assert len(long) == 302


def test_heldout_data_and_full_pred_come_from_the_exported_model(minilm_bundle):
    manifest = read_manifest(minilm_bundle)
    with np.load(minilm_bundle / "data" / "heldout.npz") as data:
        assert {"text", "label", "full_pred", "length"} <= set(data.files)
        texts, labels, full_pred = list(data["text"]), data["label"], data["full_pred"]
    assert len(texts) == labels.size == full_pred.size == _report(minilm_bundle)["heldout_size"]
    assert set(np.unique(labels)) == {0, 1, 2} and manifest.labels == ["negative", "neutral", "positive"]
    # stratified: the class mix of the held-out split is the corpus's
    _, corpus = load_tweets()
    assert (
        np.abs(np.bincount(labels, minlength=3) / labels.size - np.bincount(corpus, minlength=3) / corpus.size).max()
        < 0.01
    )
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(minilm_bundle / "tokenizer.json"))
    ids = [e.ids for e in tokenizer.encode_batch([str(t) for t in texts[:64]])]
    runtime = BundleRuntime(minilm_bundle, buckets=[128])
    result = runtime.run_range(pad_batch(ids, 128), 128)
    answers = np.zeros(64, dtype=np.int64)
    for ex in result.exits:
        answers[ex.row] = ex.logits.argmax()
    assert (answers == full_pred[:64]).all()


def test_head_is_accurate_and_ramps_agree_more_with_depth(minilm_bundle):
    report = _report(minilm_bundle)
    with np.load(minilm_bundle / "data" / "heldout.npz") as data:
        labels, full_pred = data["label"], data["full_pred"]
    accuracy = float((full_pred == labels).mean())
    majority = np.bincount(labels).max() / labels.size
    print(
        f"\nMiniLM test bundle: head held-out accuracy {accuracy:.3f} (majority class {majority:.3f}); "
        f"ramp agreement {report['ramp_agreement']}"
    )
    assert accuracy == pytest.approx(report["head_heldout_accuracy"])
    assert accuracy > majority + 0.15
    with np.load(minilm_bundle / "data" / "window.npz") as window:
        agreement = (window["pred"] == window["final"][:, None]).mean(axis=0)
    assert list(agreement) == pytest.approx(list(report["ramp_agreement"].values()))
    assert agreement[-1] > agreement[0] + 0.05
    assert all(b >= a - 0.03 for a, b in zip(agreement, agreement[1:])), agreement
    assert agreement.min() > majority


def test_calibration_window_format_and_values(minilm_bundle):
    manifest = read_manifest(minilm_bundle)
    exits = [r.name for r in manifest.exit_ramps()]
    with np.load(minilm_bundle / "data" / "window.npz") as w:
        conf, pred, final, saving, cost = w["conf"], w["pred"], w["final"], w["saving_ms"], w["cost_ms"]
        assert list(w["ramps"]) == exits
        bucket = int(w["bucket"])
    with np.load(minilm_bundle / "data" / "heldout.npz") as data:
        full_pred, texts = data["full_pred"], [str(t) for t in data["text"][:32]]
    n, r = conf.shape
    assert pred.shape == (n, r) and final.shape == (n,) and saving.shape == cost.shape == (r,) and r == len(exits)
    assert (final == full_pred).all()
    assert conf.min() >= 1 / 3 - 1e-6 and conf.max() <= 1 + 1e-6 and set(np.unique(pred)) <= {0, 1, 2}
    assert (saving > 0).all() and (np.diff(saving) < 0).all(), "exiting earlier saves more"
    assert (cost > 0).all() and (cost < saving[-1]).all()
    assert bucket in (16, 32, 64)
    # the window's confidences are what the runtime computes for those inputs
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(minilm_bundle / "tokenizer.json"))
    ids = [e.ids for e in tokenizer.encode_batch(texts)]
    logits, _ = BundleRuntime(minilm_bundle, buckets=[128]).run_all_ramps(pad_batch(ids, 128), 128)
    for i, name in enumerate(exits):
        np.testing.assert_allclose(softmax(logits[name]).max(1), conf[:32, i], atol=1e-5)


def test_digits_bundle_is_accurate_and_its_ramps_agree_more_with_depth(digits_bundle):
    from exitplan.prepare.presets import DIGITS_CUTS

    manifest = read_manifest(digits_bundle)
    assert len(manifest.blocks) == 3 and manifest.inputs[0].name == "x"
    assert [(r.name, r.after) for r in manifest.exit_ramps()] == [("ramp0", 0), ("ramp1", 1)]
    report = _report(digits_bundle)
    print(
        f"\ndigits test bundle: head held-out accuracy {report['head_heldout_accuracy']:.3f}; ramp agreement {report['ramp_agreement']}"
    )
    # a preset of --torch: the ramps sit at the cuts it names, the chain reproduces the exported model
    assert report["source"] == "built-in digits-cnn" and report["kept"] == list(DIGITS_CUTS)
    assert report["head_heldout_accuracy"] > 0.9
    assert report["chain_max_abs_diff"] < 1e-4
    with np.load(digits_bundle / "data" / "window.npz") as w:
        agreement = (w["pred"] == w["final"][:, None]).mean(axis=0)
    assert agreement[1] > agreement[0] > 0.5


def test_minilm_bundle_is_a_preset_of_the_hf_path_and_matches_pytorch(minilm_bundle):
    """The chain equals the exported model, and the ONNX bundle equals the PyTorch model it came from (the
    checkpoint with the head the build trained, kept in data/head.npz)."""
    import torch
    from tokenizers import Tokenizer

    from exitplan.prepare.from_hf import reference_model
    from exitplan.prepare.minilm import model_path
    from exitplan.prepare.presets import minilm_cuts

    report = _report(minilm_bundle)
    assert report["source"] == "built-in minilm" and report["kept"] == list(minilm_cuts())
    assert report["chain_max_abs_diff"] <= 1e-4
    with np.load(minilm_bundle / "data" / "heldout.npz") as data:
        texts = [str(t) for t in data["text"][:48]]
    tokenizer = Tokenizer.from_file(str(minilm_bundle / "tokenizer.json"))
    ids = [e.ids for e in tokenizer.encode_batch(texts)]
    logits, _ = BundleRuntime(minilm_bundle, buckets=[128]).run_all_ramps(pad_batch(ids, 128), 128)
    state = pad_batch(ids, 128)
    with torch.inference_mode():
        reference = reference_model(model_path(), minilm_bundle)(
            torch.from_numpy(state["input_ids"]), torch.from_numpy(state["attention_mask"])
        ).numpy()
    assert np.abs(logits["head"][: len(texts)] - reference[: len(texts)]).max() <= 1e-4


# ------------------------------------------------------------------ reuse, rebuilds, the CLI


def test_cli_builds_then_reuses_and_force_rebuilds(tmp_path):
    out = tmp_path / "digits"
    runner = CliRunner()
    args = ["prepare", "--model", "digits-cnn", "--out", str(out), "--train-size", "200", "--heldout-size", "100"]
    first = runner.invoke(app, [*args, "--json", str(tmp_path / "r.json")])
    assert first.exit_code == 0, first.output
    assert "built in" in _text(first) and "ramp0" in _text(first)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["reused"] is False and report["heldout_size"] == 100 and report["options"]["train_size"] == 200
    marker = json.loads((out / MARKER).read_text())
    built_at = (out / "bundle.yaml").stat().st_mtime_ns

    again = runner.invoke(app, args)
    assert again.exit_code == 0 and "reused" in _text(again)
    assert (out / "bundle.yaml").stat().st_mtime_ns == built_at

    options = BuildOptions(model="digits-cnn", train_size=200, heldout_size=100)
    assert prepare_bundle(options, out, bar=tqdm_bar(False)).reused
    changed = prepare_bundle(
        BuildOptions(model="digits-cnn", train_size=200, heldout_size=100, seed=1), out, bar=tqdm_bar(False)
    )
    assert not changed.reused
    assert json.loads((out / MARKER).read_text())["options_hash"] != marker["options_hash"]
    forced = runner.invoke(app, [*args, "--seed", "1", "--force"])
    assert forced.exit_code == 0 and "built in" in _text(forced)
    assert not list(tmp_path.glob(".digits.building*")), "no half-built directory is left behind"


def test_bad_prepare_options_are_explained(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["prepare", "--model", "resnet", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "unknown model 'resnet'" in _text(result)
    result = runner.invoke(
        app, ["prepare", "--model", "digits-cnn", "--out", str(tmp_path / "x"), "--train-size", "1700"]
    )
    assert result.exit_code == 2 and "exceed the 1797 labelled inputs" in _text(result)
    with pytest.raises(PrepareError, match="at least 10"):
        BuildOptions(model="digits-cnn", heldout_size=3).resolved()
    with pytest.raises(DatasetError, match="exceed"):
        from exitplan.prepare.datasets import tweet_splits

        tweet_splits(40000, 1000)
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    with pytest.raises(PrepareError, match="is not a bundle"):
        prepare_bundle(BuildOptions(model="digits-cnn", train_size=100, heldout_size=50), occupied, bar=tqdm_bar(False))
    assert (occupied / "notes.txt").read_text() == "mine"
