"""Bundles served in fp16 (prepare/precision.py): converted blocks keep fp16 between them and fp32 at the
model's inputs and the ramps' logits, agree with the fp32 chain on the held-out data (recorded in
bundle.yaml and re-checked), carry a calibration window of their own, and a precision that cannot be
served is refused with the reason."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from exitplan.api.bundle import read_manifest
from exitplan.prepare.precision import MIN_AGREEMENT, PrecisionError, convert_bundle, recheck
from exitplan.worker_image.bundle_runtime import BundleRuntime

FP16, FP32, INT64 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT, onnx.TensorProto.INT64


def _io_types(path: Path) -> tuple[dict[str, int], dict[str, int]]:
    model = onnx.load(str(path), load_external_data=False)
    kinds = lambda values: {v.name: v.type.tensor_type.elem_type for v in values}  # noqa: E731
    return kinds(model.graph.input), kinds(model.graph.output)


@pytest.fixture(scope="module")
def digits_fp16(digits_bundle, tmp_path_factory) -> Path:
    return convert_bundle(digits_bundle, tmp_path_factory.mktemp("fp16") / "digits", "fp16").directory


def test_a_cnn_in_fp16_agrees_with_fp32_and_says_so(digits_bundle, digits_fp16):
    manifest = read_manifest(digits_fp16)
    record = manifest.precision
    assert manifest.dtype == "float16" and record is not None and record.name == "fp16"
    assert record.final_agreement >= MIN_AGREEMENT and record.heldout_rows > 100
    assert set(record.ramp_agreement) == {r.name for r in manifest.exit_ramps()}
    assert manifest.digests and "data/window.npz" in manifest.digests
    source_window = np.load(digits_bundle / "data" / "window.npz")
    window = np.load(digits_fp16 / "data" / "window.npz")
    assert window["conf"].shape == source_window["conf"].shape  # tuned on the precision that is served
    assert recheck(digits_fp16) == record


def test_activations_are_fp16_between_blocks_and_the_ends_stay_as_they_were(digits_bundle, digits_fp16):
    manifest = read_manifest(digits_fp16)
    model_inputs = {t.name: t.dtype for t in manifest.inputs}
    for block in manifest.blocks:
        inputs, outputs = _io_types(digits_fp16 / block.file)
        for name, kind in inputs.items():
            assert kind == (FP32 if model_inputs.get(name) == "float32" else INT64 if name in model_inputs else FP16)
        assert set(outputs.values()) == {FP16}
    for ramp in manifest.ramps:
        _, outputs = _io_types(digits_fp16 / ramp.file)
        assert outputs == {ramp.output: FP32}
    runtime = BundleRuntime(digits_fp16)
    source = BundleRuntime(digits_bundle)
    x = np.random.default_rng(0).standard_normal((3, *[int(d) for d in manifest.inputs[0].shape[1:]]), np.float32)
    got = runtime.run_range({manifest.inputs[0].name: x}, thresholds={})
    want = source.run_range({manifest.inputs[0].name: x}, thresholds={})
    assert got.exits[0].logits.dtype == np.float32
    assert np.allclose([e.logits for e in got.exits], [e.logits for e in want.exits], atol=0.05)


def test_minilm_in_fp16_agrees_with_fp32(minilm_bundle, tmp_path):
    report = convert_bundle(minilm_bundle, tmp_path / "minilm", "fp16")
    assert report.record.final_agreement >= MIN_AGREEMENT
    inputs, _ = _io_types(tmp_path / "minilm" / read_manifest(minilm_bundle).blocks[0].file)
    assert inputs == {"input_ids": INT64, "attention_mask": INT64}  # token ids are not converted


def test_bf16_and_unknown_precisions_are_refused_with_the_reason(digits_bundle, tmp_path):
    with pytest.raises(PrecisionError, match="bf16 is not served.*use --precision fp16"):
        convert_bundle(digits_bundle, tmp_path / "x", "bf16")
    with pytest.raises(PrecisionError, match="not one of"):
        convert_bundle(digits_bundle, tmp_path / "x", "int4")
    assert not (tmp_path / "x").exists()


def test_converting_an_fp16_bundle_again_is_refused(digits_fp16, tmp_path):
    with pytest.raises(PrecisionError, match="already float16; convert its fp32 source"):
        convert_bundle(digits_fp16, tmp_path / "again", "fp16")


def test_a_conversion_that_changes_the_answers_is_refused_and_leaves_nothing(digits_bundle, tmp_path, monkeypatch):
    import exitplan.prepare.precision as precision

    monkeypatch.setattr(precision, "MIN_AGREEMENT", 1.01)  # no conversion can agree on more than all inputs
    with pytest.raises(PrecisionError, match="serve this model in fp32"):
        convert_bundle(digits_bundle, tmp_path / "refused", "fp16")
    assert not (tmp_path / "refused").exists()


def test_recheck_notices_a_changed_file(digits_bundle, digits_fp16, tmp_path):
    import shutil

    from exitplan.api.bundle import BundleError

    copy = tmp_path / "tampered"
    shutil.copytree(digits_fp16, copy)
    last = read_manifest(copy).blocks[-1]
    model = onnx.load(str(copy / last.file))
    for init in model.graph.initializer:  # the last block's weights scrambled: the answers change
        arr = onnx.numpy_helper.to_array(init)
        if arr.ndim >= 2:
            init.CopyFrom(onnx.numpy_helper.from_array(np.random.default_rng(1).permutation(arr), init.name))
    onnx.save(model, str(copy / last.file))
    with pytest.raises(BundleError, match="convert the bundle again"):
        recheck(copy)


def test_exitplan_check_rechecks_the_recorded_agreement(digits_fp16, tmp_path):
    """`exitplan check` of a converted bundle compares its chain with the fp32 source's answers (full_pred) against
    what bundle.yaml records, not against an exact match; a file changed since the conversion fails it."""
    import shutil

    from typer.testing import CliRunner

    from exitplan.cli import app

    record = read_manifest(digits_fp16).precision
    assert record is not None
    good = CliRunner().invoke(app, ["check", str(digits_fp16), "--json", str(tmp_path / "c.json")])
    assert good.exit_code == 0, good.output
    assert f"fp16: bundle.yaml records {record.final_agreement:.3f}" in " ".join(good.output.split())
    report = __import__("json").loads((tmp_path / "c.json").read_text())
    assert report["precision"]["final_agreement"] == record.final_agreement
    copy = tmp_path / "tampered"
    shutil.copytree(digits_fp16, copy)
    last = read_manifest(copy).blocks[-1]
    model = onnx.load(str(copy / last.file))
    for init in model.graph.initializer:
        arr = onnx.numpy_helper.to_array(init)
        if arr.ndim >= 2:
            init.CopyFrom(onnx.numpy_helper.from_array(np.random.default_rng(1).permutation(arr), init.name))
    onnx.save(model, str(copy / last.file))
    bad = CliRunner().invoke(app, ["check", str(copy)])
    assert bad.exit_code != 0 and "check passed" not in bad.output, bad.output
