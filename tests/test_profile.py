"""`exitplan profile`: a whole ModelProfile document measured on this machine from a real bundle."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from exitplan.api.resources import ModelProfile
from exitplan.cli import app
from exitplan.planner.tuning.initial import survival_curve
from exitplan.prepare.profile import (
    THRESHOLDS_ANNOTATION,
    ProfileError,
    read_thresholds,
    repeats_for,
    resolve_thresholds,
)

pytestmark = pytest.mark.slow


def _text(result) -> str:
    """The command's output with rich's line wrapping undone."""
    return " ".join(result.output.split())


def _profile(runner, args):
    result = runner.invoke(app, ["profile", *args])
    assert result.exit_code == 0, result.output
    return result


def test_digits_profile_document(digits_bundle, tmp_path):
    out = tmp_path / "digits.yaml"
    result = _profile(
        CliRunner(), [str(digits_bundle), "--pool", "cpu-pool", "--out", str(out), "--json", str(tmp_path / "p.json")]
    )
    assert "profile written to" in _text(result) and "block0" in _text(result)
    doc = yaml.safe_load(out.read_text())
    assert doc["kind"] == "ModelProfile" and doc["apiVersion"] == "exitplan.io/v1alpha1"
    assert doc["metadata"]["name"] == "digits-cnn-cpu-pool"
    assert json.loads((tmp_path / "p.json").read_text()) == doc
    spec = ModelProfile.model_validate(doc).spec
    assert spec.model == "digits-cnn" and spec.pool == "cpu-pool"
    assert spec.batch_sizes == [1, 2, 4, 8, 16, 32, 64] and spec.seq_lens == [1]
    assert [b.name for b in spec.blocks] == ["block0", "block1", "block2"]
    assert [(r.name, r.after_block) for r in spec.ramps] == [("ramp0", 0), ("ramp1", 1), ("head", 2)]
    for entry in [*spec.blocks, *spec.ramps]:
        assert np.asarray(entry.latency_ms).shape == (1, 7) and min(min(r) for r in entry.latency_ms) > 0
    # weights and activations follow from the architecture: conv 1->16->32->64 (3x3), 8x8 -> 8x8 -> 4x4, then the
    # last block pools to 2x2 and ends in the linear layer over 10 classes
    last = (32 * 64 * 9 + 64) * 4 + (64 * 4 * 10 + 10) * 4
    assert [b.weight_bytes for b in spec.blocks] == [(16 * 9 + 16) * 4, (16 * 32 * 9 + 32) * 4, last]
    assert [b.output_bytes for b in spec.blocks] == [[16 * 8 * 8 * 4], [32 * 4 * 4 * 4], [10 * 4]]
    assert spec.input_bytes == [8 * 8 * 4]
    # the survival curve is the held-out window's at 0.9 everywhere; the head repeats the last exit's
    with np.load(digits_bundle / "data" / "window.npz") as w:
        conf = w["conf"]
    expected = survival_curve(conf, [0.9, 0.9])
    assert spec.survival == pytest.approx([*expected, expected[-1]])
    assert expected[0] == pytest.approx(float((conf[:, 0] < 0.9).mean()))
    assert expected[1] == pytest.approx(float(((conf[:, 0] < 0.9) & (conf[:, 1] < 0.9)).mean()))
    assert json.loads(doc["metadata"]["annotations"][THRESHOLDS_ANNOTATION]) == {"ramp0": 0.9, "ramp1": 0.9}
    # the serving path, measured with a real router and worker: CPU per request and per batch beyond the model
    serving = spec.serving
    assert serving is not None and serving.requests >= 100 and serving.threads == 1 and serving.cores >= 1
    assert serving.router_ms > 0.05 and serving.hop_ms >= 0.0
    assert serving.colocated_ms is not None and serving.colocated_ms > 0.0  # the router running the model itself
    # the workers' mean compute over the tables' fastest figure, per length: never far below it
    assert len(serving.compute_scale) == len(spec.seq_lens) and all(s > 0.5 for s in serving.compute_scale)
    assert "serving path: router" in _text(result) and "serving.computeScale" in _text(result)


def test_minilm_profile_with_buckets_and_thresholds(minilm_bundle, tmp_path):
    thresholds = tmp_path / "t.json"
    thresholds.write_text(json.dumps({"thresholds": {"ramp0": 0.95, "ramp2": 0.8, "ramp4": 1.5}}))
    out = tmp_path / "minilm.yaml"
    args = [
        str(minilm_bundle),
        "--pool",
        "cpu",
        "--out",
        str(out),
        "--batch-sizes",
        "1,4",
        "--seq-lens",
        "32,16",
        "--repeats",
        "1",
        "--thresholds",
        str(thresholds),
        "--model-name",
        "tweets",
    ]
    _profile(CliRunner(), args)
    spec = ModelProfile.model_validate(yaml.safe_load(out.read_text())).spec
    assert spec.model == "tweets" and spec.batch_sizes == [1, 4] and spec.seq_lens == [16, 32]
    assert len(spec.blocks) == 6 and [r.name for r in spec.ramps] == [
        "ramp0",
        "ramp1",
        "ramp2",
        "ramp3",
        "ramp4",
        "head",
    ]
    for entry in [*spec.blocks, *spec.ramps]:
        assert np.asarray(entry.latency_ms).shape == (2, 2)
    hidden = 384
    for block in spec.blocks[:-1]:  # hidden state (float32) + attention mask (int64) per sample
        assert block.output_bytes == [L * hidden * 4 + L * 8 for L in (16, 32)]
    assert spec.blocks[-1].output_bytes == [3 * 4, 3 * 4]  # the last block ends in the class scores
    assert spec.input_bytes == [L * 8 * 2 for L in (16, 32)]
    from exitplan.prepare.minilm import load_encoder

    encoder = load_encoder()
    layer_bytes = [sum(p.numel() for p in encoder.encoder.layer[i].parameters()) * 4 for i in range(6)]
    embedding_bytes = sum(p.numel() for p in encoder.embeddings.parameters()) * 4
    assert spec.blocks[0].weight_bytes == pytest.approx(embedding_bytes + layer_bytes[0], rel=0.01)
    head_bytes = (hidden * 3 + 3) * 4  # the linear head, in the last block
    assert [b.weight_bytes for b in spec.blocks[1:]] == pytest.approx(
        [*layer_bytes[1:5], layer_bytes[5] + head_bytes], rel=0.01
    )
    with np.load(minilm_bundle / "data" / "window.npz") as w:
        expected = survival_curve(w["conf"], [0.95, 2.0, 0.8, 2.0, 1.5])
    assert spec.survival == pytest.approx([*expected, expected[-1]])
    assert expected[0] > expected[2] and expected[1] == expected[0] and expected[3] == expected[2] == expected[4]


def test_bad_profile_options_are_explained(minilm_bundle, digits_bundle, tmp_path):
    runner = CliRunner()
    out = str(tmp_path / "p.yaml")
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"head": 0.5}))
    result = runner.invoke(app, ["profile", str(digits_bundle), "--pool", "p", "--out", out, "--thresholds", str(bad)])
    assert result.exit_code == 2 and "not exit ramps" in _text(result) and "'head'" in _text(result)
    result = runner.invoke(app, ["profile", str(minilm_bundle), "--pool", "p", "--out", out, "--seq-lens", "256"])
    assert result.exit_code == 2 and "--seq-lens [256]" in _text(result) and "outside 1..128" in _text(result)
    result = runner.invoke(app, ["profile", str(digits_bundle), "--pool", "p", "--out", out, "--batch-sizes", "1,x"])
    assert result.exit_code != 0 and "comma-separated integers" in _text(result)
    result = runner.invoke(app, ["profile", str(tmp_path), "--pool", "p", "--out", out])
    assert result.exit_code == 2 and "no bundle.yaml here" in _text(result)
    result = runner.invoke(
        app, ["profile", str(digits_bundle), "--pool", "p", "--out", out, "--providers", "NoSuchProvider"]
    )
    assert result.exit_code == 2 and "NoSuchProvider" in _text(result) and "CPUExecutionProvider" in _text(result)
    copy = tmp_path / "copy"
    shutil.copytree(digits_bundle, copy)
    (copy / "data" / "window.npz").unlink()
    result = runner.invoke(app, ["profile", str(copy), "--pool", "p", "--out", out])
    assert result.exit_code == 2 and "no calibration window" in _text(result)
    assert not (tmp_path / "p.yaml").exists()


def test_threshold_files_and_repeats():
    assert repeats_for(1, 16, 5) == 5 and repeats_for(64, 16, 5) == 5
    assert repeats_for(64, 32, 5) == 3 and repeats_for(64, 128, 5) == 2 and repeats_for(64, 128, 1) == 1
    assert survival_curve(np.array([[0.95, 0.5], [0.5, 0.95], [0.5, 0.5]]), [0.9, 0.9]) == pytest.approx([2 / 3, 1 / 3])
    assert survival_curve(np.array([[0.95, 0.5], [0.5, 0.95]]), [1.5, 0.9]) == pytest.approx([1.0, 0.5])


def test_threshold_file_forms(tmp_path, digits_bundle):
    from exitplan.api.bundle import read_manifest

    path = tmp_path / "t.json"
    path.write_text(json.dumps({"ramp0": 0.7}))
    assert read_thresholds(path) == {"ramp0": 0.7}
    path.write_text("[1, 2]")
    with pytest.raises(ProfileError, match="expected a JSON object"):
        read_thresholds(path)
    manifest = read_manifest(digits_bundle)
    assert resolve_thresholds(manifest, None) == {"ramp0": 0.9, "ramp1": 0.9}
    assert resolve_thresholds(manifest, {"ramp1": 0.5}) == {"ramp0": 2.0, "ramp1": 0.5}
    with pytest.raises(ProfileError, match="must be a number >= 0"):
        resolve_thresholds(manifest, {"ramp1": float("nan")})
