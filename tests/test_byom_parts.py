"""Pieces of `exitplan prepare --onnx`: ramps built from an activation's shape, the user's data
checked against the model's inputs, and ramp placement against exhaustive search."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from exitplan.planner.tuning.placement import best_placement, place_ramps
from exitplan.planner.tuning.synthetic_windows import synthetic_window
from exitplan.prepare.exit_ramps import RampWeights, head_model, pool, ramp_model, train_ramp
from exitplan.prepare.user_data import DataError, load_data, model_inputs


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


@pytest.fixture
def weights() -> RampWeights:
    rng = np.random.default_rng(0)
    return RampWeights(((rng.normal(size=(5, 8)).astype(np.float32), rng.normal(size=5).astype(np.float32)),))


def test_each_ramp_graph_computes_what_its_features_were_trained_on(weights):
    rng = np.random.default_rng(1)
    spatial = rng.normal(size=(3, 8, 4, 5)).astype(np.float32)
    model = ramp_model("spatial", "h", ["batch", 8, 4, 5], TensorProto.FLOAT, weights)
    assert np.abs(_run(model, {"h": spatial}) - weights.logits(pool("spatial", spatial))).max() < 1e-5
    seq = rng.normal(size=(3, 6, 8)).astype(np.float32)
    mask = np.array([[1] * 6, [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]], dtype=np.int64)
    model = ramp_model(
        "sequence", "h", ["batch", "seq", 8], TensorProto.FLOAT, weights,
        mask=("attention_mask", ["batch", "seq"], TensorProto.INT64),
    )  # fmt: skip
    got = _run(model, {"h": seq, "attention_mask": mask})
    assert np.abs(got - weights.logits(pool("sequence", seq, mask))).max() < 1e-5
    # padding positions do not count: changing them changes nothing
    seq2 = seq.copy()
    seq2[1, 3:] = 100.0
    assert np.abs(_run(model, {"h": seq2, "attention_mask": mask}) - got).max() < 1e-5
    vector = rng.normal(size=(3, 8)).astype(np.float32)
    model = ramp_model("vector", "h", ["batch", 8], TensorProto.FLOAT, weights)
    assert np.abs(_run(model, {"h": vector}) - weights.logits(vector)).max() < 1e-5


def test_mlp_ramps_and_the_head():
    rng = np.random.default_rng(2)
    features = rng.normal(size=(300, 8)).astype(np.float32)
    targets = (features[:, 0] * features[:, 1] > 0).astype(np.int64)  # not linearly separable
    linear, linear_acc = train_ramp(features, targets, 2)
    mlp, mlp_acc = train_ramp(features, targets, 2, hidden=32)
    assert mlp_acc > linear_acc + 0.2
    model = ramp_model("vector", "h", ["batch", 8], TensorProto.FLOAT, mlp)
    assert np.abs(_run(model, {"h": features}) - mlp.logits(features)).max() < 1e-4
    assert (mlp.logits(features).argmax(1) == targets).mean() == pytest.approx(mlp_acc)
    head = head_model("y", ["batch", 3], TensorProto.DOUBLE)
    assert _run(head, {"y": np.ones((2, 3))}).dtype == np.float32


def _model_with_inputs() -> onnx.ModelProto:
    pixels = helper.make_tensor_value_info("pixels", TensorProto.FLOAT, ["n", 1, 4, 4])
    extra = helper.make_tensor_value_info("scale", TensorProto.FLOAT, ["n", 1])
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1])
    node = helper.make_node("ReduceMean", ["pixels"], ["m"], axes=[1, 2, 3], keepdims=0)
    reshape = helper.make_node("Unsqueeze", ["m", "one"], ["m2"])
    mul = helper.make_node("Mul", ["m2", "scale"], ["y"])
    one = onnx.numpy_helper.from_array(np.array([1], dtype=np.int64), "one")
    graph = helper.make_graph([node, reshape, mul], "g", [pixels, extra], [out], [one])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(
    "arrays, words",
    [
        ({"pixels": np.zeros((4, 1, 4, 4), np.float32)}, ["'scale'", "no array"]),
        ({"pixels": np.zeros((4, 1, 4, 4), np.float64), "scale": np.zeros((4, 1), np.float32)}, ["float64", "float32"]),
        ({"pixels": np.zeros((4, 1, 5, 4), np.float32), "scale": np.zeros((4, 1), np.float32)}, ["axis 2", "needs 4"]),
        ({"pixels": np.zeros((4, 16), np.float32), "scale": np.zeros((4, 1), np.float32)}, ["2 dimensions"]),
        ({"pixels": np.zeros((4, 1, 4, 4), np.float32), "scale": np.zeros((3, 1), np.float32)}, ["different numbers"]),
        (
            {"pixels": np.zeros((4, 1, 4, 4), np.float32), "scale": np.zeros((4, 1), np.float32), "x": np.zeros(4)},
            ["'x'", "not inputs"],
        ),
        (
            {"pixels": np.zeros((4, 1, 4, 4), np.float32), "scale": np.zeros((4, 1), np.float32), "label": np.zeros(3)},
            ["label", "integer"],
        ),
    ],
)
def test_data_that_does_not_fit_the_model_is_named(tmp_path, arrays, words):
    path = tmp_path / "data.npz"
    np.savez(path, **arrays)
    with pytest.raises(DataError) as err:
        load_data(path, model_inputs(_model_with_inputs()))
    assert all(w in str(err.value) for w in words), str(err.value)


def test_data_keyed_by_input_name_loads(tmp_path):
    path = tmp_path / "data.npz"
    np.savez(path, pixels=np.ones((6, 1, 4, 4), np.float32), scale=np.ones((6, 1), np.float32), label=np.arange(6))
    data = load_data(path, model_inputs(_model_with_inputs()))
    assert len(data) == 6 and set(data.inputs) == {"pixels", "scale"} and data.label.tolist() == list(range(6))
    with pytest.raises(DataError, match="not a readable .npz"):
        (tmp_path / "bad.npz").write_text("hello")
        load_data(tmp_path / "bad.npz", model_inputs(_model_with_inputs()))


def test_greedy_placement_is_within_ten_percent_of_exhaustive_search():
    rng = np.random.default_rng(3)
    for _ in range(12):
        window = synthetic_window(rng, 1000, 6)
        greedy = place_ramps(window, 0.02, 3)
        best = best_placement(window, 0.02, 3)
        assert len(greedy.ramps) <= 3 and greedy.agreement >= 0.98 - 1e-12
        assert greedy.saving_ms >= 0.9 * best.saving_ms - 1e-9
        assert greedy.evaluated < best.evaluated


def test_placement_respects_the_overhead_budget_and_max_ramps():
    window = synthetic_window(np.random.default_rng(4), 800, 5)
    free = place_ramps(window, 0.05, 5)
    assert free.ramps, "some ramp pays on this window"
    tight = place_ramps(window, 0.05, 5, overhead_ms=float(window.cost_ms.min()) * 1.5)
    assert len(tight.ramps) <= 1
    assert place_ramps(window, 0.05, 0).ramps == ()
