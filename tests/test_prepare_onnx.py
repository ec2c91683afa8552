"""`exitplan prepare --onnx`: a user's own model, never seen by the team, to a served early-exit service.

A residual CNN trained here on the digits and MiniLM with a tweet classifier head, each exported as one
ONNX file, go through the commands a user runs (prepare -> check -> profile -> plan) and are served by
local router and worker processes under load; bad models and bad data get errors that name the problem
and leave no bundle behind.
"""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import pytest
import yaml
from byom_models import digits_cnn, minilm_classifier
from dataplane_helpers import deployment, service_spec
from onnx import TensorProto, helper
from typer.testing import CliRunner

from exitplan.api.bundle import read_manifest
from exitplan.cli import app
from exitplan.client.bench import run_bench
from exitplan.localrun.service_setup import ServiceSetup, load_setup, planned, tuned_thresholds
from exitplan.planner.tuning.feedback import FeedbackWindow
from exitplan.planner.tuning.placement import best_placement, place_ramps
from exitplan.prepare.check import check_bundle
from exitplan.prepare.from_onnx import from_onnx

pytestmark = pytest.mark.slow
BUDGET = 0.02


def _run(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    return digits_cnn(tmp_path_factory.mktemp("cnn"))


@pytest.fixture(scope="module")
def transformer(tmp_path_factory, minilm_bundle):
    return minilm_classifier(tmp_path_factory.mktemp("minilm"), minilm_bundle)


def _service_file(path, bundle, name: str) -> None:
    docs = [
        {"apiVersion": "exitplan.io/v1alpha1", "kind": "GPUPool", "metadata": {"name": "cpu"},
         "spec": {"capacity": 2, "costPerHour": 1.0, "memoryBytes": 4 << 30, "linkBandwidthGbps": 20, "gpuResource": ""}},
        {"apiVersion": "exitplan.io/v1alpha1", "kind": "EarlyExitService", "metadata": {"name": name},
         "spec": {"model": {"name": name, "bundle": str(bundle)}, "slo": {"latencyMs": 500},
                  "accuracy": {"maxDrop": BUDGET}, "pools": [{"name": "cpu"}], "planner": {"maxSplits": 2}}},
    ]  # fmt: skip
    path.write_text(yaml.safe_dump_all(docs))


def _prepare_check_profile_plan(tmp_path, model, data, name: str, extra: tuple[str, ...] = ()):
    """The user's commands; returns (bundle, service file, plan)."""
    bundle = tmp_path / f"{name}-bundle"
    out = _run("prepare", "--onnx", str(model), "--data", str(data), "--out", str(bundle), "--budget", str(BUDGET),
               "--json", str(tmp_path / "report.json"), *extra)  # fmt: skip
    assert "chained blocks vs the source model" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["chain_max_abs_diff"] <= 1e-4
    check = check_bundle(bundle, source=model)
    assert check.ok and check.source is not None and check.source.max_abs_diff <= 1e-4, check.failures
    profile = bundle / "profiles" / "cpu.yaml"
    _run("profile", str(bundle), "--pool", "cpu", "--out", str(profile), "--batch-sizes", "1,2,4,8", "--repeats", "2")
    service = tmp_path / "service.yaml"
    _service_file(service, bundle, name)
    setup = load_setup(service, [profile])
    thresholds = tuned_thresholds(setup.bundle, BUDGET, setup.spec.workload.length_buckets)
    plan = planned(setup, thresholds)
    assert plan.thresholds.keys() == {r.name for r in setup.manifest.exit_ramps()}
    return bundle, setup, plan, report


def _serve_and_bench(tmp_path, setup: ServiceSetup, plan, trace, limit: int = 240):
    spec = service_spec(setup.bundle, slo_ms=500).model_copy(update={"model": setup.spec.model})
    with deployment(setup.bundle, plan, spec, tmp_path / "run") as dep:
        return run_bench(
            dep.url, setup.spec.model.name, setup.bundle, trace, rps=30.0, limit=limit, slo_ms=2000, seed=1
        )


def _assert_served(report, budget: float) -> None:
    assert report.results > 0 and report.accounted == report.requests and report.lost == 0, report.error_samples
    assert report.errors["transport"] == 0 and report.errors["invalid"] == 0, report.error_samples
    # agreement with the full model within the budget, up to the sampling error of this many requests
    slack = 3 * math.sqrt(budget * (1 - budget) / report.results)
    assert report.agreement >= 1 - budget - slack, report.agreement


def test_cnn_from_onnx_end_to_end(cnn, tmp_path, shared_trace):
    model, data = cnn
    bundle, setup, plan, report = _prepare_check_profile_plan(tmp_path, model, data, "digits-resnet")
    manifest = read_manifest(bundle)
    assert manifest.inputs[0].name == "pixels" and manifest.inputs[0].shape == ["batch", 1, 32, 32]
    assert 1 <= len(manifest.exit_ramps()) <= 3 and report["kept"]
    assert all(c["kind"] == "spatial" for c in report["candidates"])
    _assert_served(_serve_and_bench(tmp_path, setup, plan, shared_trace), BUDGET)


def test_transformer_from_onnx_end_to_end(transformer, tmp_path, shared_trace):
    model, data = transformer
    bundle, setup, plan, report = _prepare_check_profile_plan(tmp_path, model, data, "minilm-tweets")
    manifest = read_manifest(bundle)
    assert [t.name for t in manifest.inputs] == ["input_ids", "attention_mask"] and manifest.seq_axis == 1
    assert all(c["kind"] == "sequence" for c in report["candidates"]) and report["kept"]
    for ramp in manifest.exit_ramps():  # masked mean pooling reads the mask
        assert ramp.inputs[1] == "attention_mask"
    _assert_served(_serve_and_bench(tmp_path, setup, plan, shared_trace, limit=160), BUDGET)


@pytest.mark.parametrize("which", ["cnn", "transformer"])
def test_automatic_placement_is_within_ten_percent_of_exhaustive_search(which, request, tmp_path):
    model, data = request.getfixturevalue(which)
    bundle = from_onnx(model, data, tmp_path / "b", max_ramps=3, budget=BUDGET).path
    # the candidates' window as the placement saw it, rebuilt from a bundle that keeps them all
    candidates = json.loads((bundle / "data" / "report.json").read_text())["candidates"]
    every = from_onnx(model, data, tmp_path / "all", cuts=tuple(c["tensor"] for c in candidates), budget=BUDGET).path
    with np.load(every / "data" / "window.npz") as w:
        window = FeedbackWindow(conf=w["conf"], pred=w["pred"], final=w["final"], saving_ms=w["saving_ms"],
                                cost_ms=w["cost_ms"])  # fmt: skip
    greedy, best = place_ramps(window, BUDGET, 3), best_placement(window, BUDGET, 3)
    assert best.saving_ms > 0
    assert greedy.saving_ms >= 0.9 * best.saving_ms, (greedy, best)


# ------------------------------------------------------------------------------ bad models, bad data


def _model(tmp_path, nodes, inputs, outputs, inits=(), name="m.onnx"):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    path = tmp_path / name
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return path


def _dense(name: str, n_in: int, n_out: int, seed: int) -> onnx.TensorProto:
    rng = np.random.default_rng(seed)
    return onnx.numpy_helper.from_array(rng.normal(size=(n_in, n_out)).astype(np.float32), name)


def _prepare_fails(tmp_path, model, data, *words: str) -> str:
    out = tmp_path / "bundle"
    result = CliRunner().invoke(app, ["prepare", "--onnx", str(model), "--data", str(data), "--out", str(out)])
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "error:" in text and "Traceback" not in text, text
    assert all(w in text for w in words), text
    assert not (out / "bundle.yaml").exists() and not (out / ".complete.json").exists()
    return text


def test_a_graph_without_a_cut_vertex(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])
    nodes = [helper.make_node("MatMul", ["x", "wa"], ["a"]), helper.make_node("MatMul", ["x", "wb"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["y"])]  # fmt: skip
    model = _model(tmp_path, nodes, [x], [y], [_dense("wa", 8, 4, 0), _dense("wb", 8, 4, 1)])
    np.savez(tmp_path / "d.npz", x=np.ones((20, 8), np.float32))
    _prepare_fails(tmp_path, model, tmp_path / "d.npz", "cut")


def _chain(tmp_path, classes: int = 4):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", classes])
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["h0"]), helper.make_node("Relu", ["h0"], ["r0"]),
             helper.make_node("MatMul", ["r0", "w1"], ["h1"]), helper.make_node("Relu", ["h1"], ["r1"]),
             helper.make_node("MatMul", ["r1", "w2"], ["y"])]  # fmt: skip
    inits = [_dense("w0", 8, 64, 0), _dense("w1", 64, 64, 1), _dense("w2", 64, classes, 2)]
    return _model(tmp_path, nodes, [x], [y], inits)


def test_data_missing_an_input_or_with_the_wrong_dtype(tmp_path):
    model = _chain(tmp_path)
    np.savez(tmp_path / "d.npz", pixels=np.ones((20, 8), np.float32))
    _prepare_fails(tmp_path, model, tmp_path / "d.npz", "'x'", "no array")
    np.savez(tmp_path / "e.npz", x=np.ones((20, 8), np.float64))
    _prepare_fails(tmp_path, model, tmp_path / "e.npz", "float64", "float32")
    np.savez(tmp_path / "f.npz", x=np.ones((20, 9), np.float32))
    _prepare_fails(tmp_path, model, tmp_path / "f.npz", "axis 1", "needs 8")


def test_fewer_samples_than_classes(tmp_path):
    model = _chain(tmp_path, classes=6)
    np.savez(tmp_path / "d.npz", x=np.ones((5, 8), np.float32))
    _prepare_fails(tmp_path, model, tmp_path / "d.npz", "5 samples", "6 classes")


def test_an_output_that_is_not_a_class_score_vector(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2, 4])
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["h0"]), helper.make_node("Reshape", ["h0", "shape"], ["y"])]
    shape = onnx.numpy_helper.from_array(np.array([-1, 2, 4], dtype=np.int64), "shape")
    model = _model(tmp_path, nodes, [x], [y], [_dense("w0", 8, 8, 0), shape])
    np.savez(tmp_path / "d.npz", x=np.ones((20, 8), np.float32))
    _prepare_fails(tmp_path, model, tmp_path / "d.npz", "class")


def test_cuts_by_hand_must_be_cut_vertices(tmp_path):
    model = _chain(tmp_path)
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(0).normal(size=(40, 8)).astype(np.float32))
    out = tmp_path / "bundle"
    result = CliRunner().invoke(app, ["prepare", "--onnx", str(model), "--data", str(tmp_path / "d.npz"),
                                      "--out", str(out), "--cuts", "h0"])  # fmt: skip
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "'h0'" in text and "r0" in text, text  # inside a block; the cut is r0
    _run("prepare", "--onnx", str(model), "--data", str(tmp_path / "d.npz"), "--out", str(out), "--cuts", "r0,r1",
         "--name", "Dense Chain")  # fmt: skip
    manifest = read_manifest(out)
    assert [r.after for r in manifest.exit_ramps()] == [0, 1] and manifest.name == "dense-chain"
