"""`exitplan check BUNDLE`: load, warm up and verify a bundle; exit 0 ok, 1 a check failed, 2 cannot load.

Most cases run on tiny hand-made bundles (MatMul blocks written with onnx.helper, plus a source
model equal to their chain); one runs on the digits test bundle.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from exitplan.api.bundle import read_manifest
from exitplan.cli import app
from exitplan.prepare.check import check_bundle, dummy_state

LABELS = ["a", "b", "c"]
HIDDEN = 4


def _save(path: Path, nodes, inputs, outputs, weights: dict[str, np.ndarray]) -> None:
    graph = helper.make_graph(
        nodes, path.stem, inputs, outputs, initializer=[numpy_helper.from_array(v, k) for k, v in weights.items()]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def _float(name: str, *shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def _matmul(path: Path, src: str, dst: str, weight: np.ndarray) -> None:
    """A block or ramp: dst = src @ weight."""
    node = helper.make_node("MatMul", [src, f"{path.stem}_w"], [dst])
    _save(
        path,
        [node],
        [_float(src, "batch", weight.shape[0])],
        [_float(dst, "batch", weight.shape[1])],
        {f"{path.stem}_w": weight},
    )


def _weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "w0": rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32),
        "w1": rng.standard_normal((HIDDEN, len(LABELS))).astype(np.float32),
        "r0": rng.standard_normal((HIDDEN, len(LABELS))).astype(np.float32),
    }


def _source(path: Path, w0: np.ndarray, w1: np.ndarray, input_name: str) -> Path:
    """The unsplit model: logits = input @ w0 @ w1."""
    nodes = [helper.make_node("MatMul", [input_name, "w0"], ["h"]), helper.make_node("MatMul", ["h", "w1"], ["logits"])]
    _save(
        path,
        nodes,
        [_float(input_name, "batch", HIDDEN)],
        [_float("logits", "batch", len(LABELS))],
        {"w0": w0, "w1": w1},
    )
    return path


def make_tiny_bundle(root: Path, input_name: str = "x", n: int = 40) -> Path:
    """Two MatMul blocks, an exit ramp after block 0 and an Identity head after block 1, with held-out data."""
    w = _weights()
    _matmul(root / "blocks" / "b0.onnx", input_name, "h0", w["w0"])
    _matmul(root / "blocks" / "b1.onnx", "h0", "h1", w["w1"])
    _matmul(root / "ramps" / "r0.onnx", "h0", "logits", w["r0"])
    identity = helper.make_node("Identity", ["h1"], ["logits"])
    _save(root / "ramps" / "head.onnx", [identity], [_float("h1", "batch", 3)], [_float("logits", "batch", 3)], {})
    manifest = {
        "name": "tiny",
        "task": "image-classification",
        "labels": LABELS,
        "inputs": [{"name": input_name, "dtype": "float32", "shape": ["batch", HIDDEN]}],
        "blocks": [
            {"name": "b0", "file": "blocks/b0.onnx", "inputs": [input_name], "outputs": ["h0"]},
            {"name": "b1", "file": "blocks/b1.onnx", "inputs": ["h0"], "outputs": ["h1"]},
        ],
        "ramps": [
            {"name": "r0", "after": 0, "file": "ramps/r0.onnx", "inputs": ["h0"]},
            {"name": "head", "after": 1, "file": "ramps/head.onnx", "inputs": ["h1"], "final": True},
        ],
    }
    (root / "bundle.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    x = np.random.default_rng(1).standard_normal((n, HIDDEN)).astype(np.float32)
    full = (x.astype(np.float64) @ w["w0"] @ w["w1"]).argmax(axis=1)
    (root / "data").mkdir(exist_ok=True)
    np.savez(root / "data" / "heldout.npz", **{input_name: x}, label=full.copy(), full_pred=full)
    return root


@pytest.fixture
def tiny(tmp_path) -> Path:
    return make_tiny_bundle(tmp_path / "tiny")


def _run(*args: str):
    return CliRunner().invoke(app, ["check", *map(str, args)])


def _edit(bundle: Path, change) -> None:
    path = bundle / "bundle.yaml"
    doc = yaml.safe_load(path.read_text())
    change(doc)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def _error_line(result) -> str:
    """The single `error: ...` line of a failed load (no traceback)."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


# ------------------------------------------------------------------ the source model


def test_source_equal_to_the_chain_passes(tiny, tmp_path):
    w = _weights()
    source = _source(tmp_path / "source.onnx", w["w0"], w["w1"], "x")
    out = tmp_path / "report.json"
    result = _run(tiny, "--source", source, "--json", out)
    assert result.exit_code == 0, result.output
    assert "check passed" in result.output
    report = json.loads(out.read_text())
    assert report["ok"] and report["exit_code"] == 0
    assert report["source"]["passed"] and report["source"]["max_abs_diff"] <= 1e-4
    assert report["source"]["inputs"] == report["heldout_inputs"] == 40
    assert report["full_pred_agreement"] == 1.0
    assert [r["name"] for r in report["ramps"]] == ["r0"]
    assert report["savings_from"].startswith("measured")  # no data/window.npz in this bundle
    assert report["ramps"][0]["saving_ms"] > 0


def test_source_that_differs_fails_with_exit_1_naming_the_difference(tiny, tmp_path):
    w = _weights()
    w1 = w["w1"].copy()
    w1[0, 0] += 0.5
    source = _source(tmp_path / "other.onnx", w["w0"], w1, "x")
    out = tmp_path / "report.json"
    result = _run(tiny, "--source", source, "--json", out)
    assert result.exit_code == 1, result.output
    assert "differs from the source model" in result.output and "other.onnx" in result.output
    report = json.loads(out.read_text())
    assert not report["ok"] and report["exit_code"] == 1
    diff = report["source"]["max_abs_diff"]
    assert diff > 1e-4 and f"{diff:.3g}" in " ".join(report["failures"])
    # a tolerance above the difference lets it pass
    assert _run(tiny, "--source", source, "--tolerance", "10").exit_code == 0


def test_source_model_with_an_input_the_bundle_lacks_cannot_load(tiny, tmp_path):
    w = _weights()
    source = _source(tmp_path / "source.onnx", w["w0"], w["w1"], "pixels")
    line = _error_line(_run(tiny, "--source", source))
    assert "source.onnx" in line and "'pixels'" in line


# ------------------------------------------------------------------ full_pred


def test_without_source_the_chain_is_compared_with_full_pred(tiny):
    report = check_bundle(tiny)
    assert report.ok and report.exit_code == 0
    assert report.full_pred_agreement == 1.0 and report.source is None
    assert report.heldout_format == "inputs" and report.heldout_inputs == 40
    assert [(w.bucket, w.batch) for w in report.warmup] == [(1, 32)]


def test_disagreement_with_full_pred_fails_with_exit_1(tiny):
    path = tiny / "data" / "heldout.npz"
    data = dict(np.load(path))
    data["full_pred"][:3] = (data["full_pred"][:3] + 1) % len(LABELS)
    np.savez(path, **data)
    result = _run(tiny)
    assert result.exit_code == 1, result.output
    assert "disagrees with full_pred" in result.output and "3 of 40" in result.output


def test_held_out_arrays_keyed_by_input_name(tmp_path):
    bundle = make_tiny_bundle(tmp_path / "named", input_name="features")
    report = check_bundle(bundle)
    assert report.ok, report.failures
    assert report.heldout_format == "inputs" and report.full_pred_agreement == 1.0
    assert report.ramps[0].saving_ms is not None and report.ramps[0].saving_ms > 0


# ------------------------------------------------------------------ bundles that cannot load


def test_deleted_block_file_exits_2_naming_the_file(tiny):
    (tiny / "blocks" / "b1.onnx").unlink()
    line = _error_line(_run(tiny))
    assert "blocks/b1.onnx" in line and "missing" in line


def test_tensor_the_onnx_file_lacks_exits_2_naming_file_and_tensor(tiny, tmp_path):
    def rename(doc):
        doc["blocks"][0]["outputs"] = ["hidden0"]
        doc["blocks"][1]["inputs"] = ["hidden0"]
        doc["ramps"][0]["inputs"] = ["hidden0"]

    _edit(tiny, rename)
    out = tmp_path / "error.json"
    line = _error_line(_run(tiny, "--json", out))
    assert "blocks/b0.onnx" in line and "'hidden0'" in line
    assert json.loads(out.read_text())["exit_code"] == 2


def test_onnx_tensor_bundle_yaml_does_not_name_exits_2(tiny):
    _edit(tiny, lambda doc: doc["inputs"].append({"name": "mask", "dtype": "float32", "shape": ["batch", 4]}))
    _edit(tiny, lambda doc: doc["blocks"][0]["inputs"].append("mask"))
    line = _error_line(_run(tiny))
    assert "blocks/b0.onnx" in line and "'mask'" in line


def test_ramp_output_not_matching_the_labels_exits_2(tiny):
    _edit(tiny, lambda doc: doc["labels"].append("d"))
    line = _error_line(_run(tiny))
    assert "ramps/r0.onnx" in line and "'logits'" in line and "4 labels" in line


# ------------------------------------------------------------------ sequence models


def _sum_block(path: Path, weight: np.ndarray, name: str = "input_ids", dims=("batch", "seq")) -> None:
    """logits-ish [batch, labels] = sum over the sequence of float(input_ids), times weight [1, labels]."""
    nodes = [
        helper.make_node("Cast", [name], ["as_float"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["as_float", "axes"], ["total"], keepdims=1),
        helper.make_node("MatMul", ["total", "w"], ["h0" if path.parent.name == "blocks" else "logits"]),
    ]
    ids = helper.make_tensor_value_info(name, TensorProto.INT64, list(dims))
    out = _float("h0" if path.parent.name == "blocks" else "logits", "batch", len(LABELS))
    _save(path, nodes, [ids], [out], {"axes": np.array([1], dtype=np.int64), "w": weight})


def test_sequence_bundle_warms_every_bucket_and_groups_held_out_rows(tmp_path):
    root = tmp_path / "seq"
    weight = np.array([[1.0, -1.0, 0.5]], dtype=np.float32)
    _sum_block(root / "blocks" / "b0.onnx", weight)
    identity = helper.make_node("Identity", ["h0"], ["logits"])
    _save(root / "ramps" / "head.onnx", [identity], [_float("h0", "batch", 3)], [_float("logits", "batch", 3)], {})
    manifest = {
        "name": "seq",
        "task": "text-classification",
        "labels": LABELS,
        "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"]}],
        "blocks": [{"name": "b0", "file": "blocks/b0.onnx", "inputs": ["input_ids"], "outputs": ["h0"]}],
        "ramps": [{"name": "head", "after": 0, "file": "ramps/head.onnx", "inputs": ["h0"], "final": True}],
        "seq_axis": 1,
        "max_length": 40,
    }
    (root / "bundle.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    (root / "data").mkdir()
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 40, size=30)
    ids = np.zeros((30, 40), dtype=np.int64)
    for row, k in enumerate(lengths):
        ids[row, :k] = rng.integers(-5, 6, size=k)
    full = (ids.sum(axis=1, keepdims=True).astype(np.float64) * weight).argmax(axis=1)
    np.savez(root / "data" / "heldout.npz", input_ids=ids, length=lengths, label=full, full_pred=full)
    _sum_block(tmp_path / "src" / "source.onnx", weight)
    report = check_bundle(root, source=tmp_path / "src" / "source.onnx", batch=8)
    assert [w.bucket for w in report.warmup] == [16, 32, 40]
    assert report.ok, report.failures
    assert report.full_pred_agreement == 1.0 and report.source is not None and report.source.max_abs_diff == 0.0
    state = dummy_state(read_manifest(root), batch=2, bucket=16)
    assert state["input_ids"].shape == (2, 16)
    assert [w.bucket for w in check_bundle(root, buckets=[16]).warmup] == [16]


# ------------------------------------------------------------------ the digits test bundle


@pytest.mark.slow
def test_digits_bundle_passes_with_ramp_agreements(digits_bundle, tmp_path):
    out = tmp_path / "digits.json"
    result = _run(digits_bundle, "--json", out)
    assert result.exit_code == 0, result.output
    assert "check passed" in result.output and "ramp0" in result.output
    report = json.loads(out.read_text())
    assert report["heldout_format"] == "inputs" and report["heldout_inputs"] > 0
    assert report["full_pred_agreement"] == 1.0
    assert [r["name"] for r in report["ramps"]] == ["ramp0", "ramp1"]
    for ramp in report["ramps"]:
        assert 0.5 < ramp["agreement"] <= 1.0 and ramp["saving_ms"] > 0 and ramp["cost_ms"] > 0
    assert report["savings_from"].startswith("data/window.npz")
    assert [(w["bucket"], w["first_ms"] > 0) for w in report["warmup"]] == [(1, True)]
