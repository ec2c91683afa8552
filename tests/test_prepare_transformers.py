"""Cut points that survive real exporters (issue 27): ten architectures built from small configs with
random weights (tests/hf_exports.py), each exported by TorchScript (`torch.onnx.export(dynamo=False)`),
optimum-style (inputs named like forward's arguments, token types too), the dynamo exporter and the
graph `prepare --hf` exports. Shape reads of activations are rewritten to read the inputs' shapes
(exitplan.prepare.shape_paths), after which every encoder of L layers has at least L-1 cut vertices,
and the blocks split there, chained, reproduce the model on other batch sizes and lengths.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from hf_exports import ARCHITECTURES, IMAGE, LAYERS, TEXT, build, example, export, takes_token_types
from onnx import TensorProto, helper, numpy_helper

from exitplan.prepare.graph_cuts import find_cuts, load_model
from exitplan.prepare.graph_split import split, verify_chain
from exitplan.prepare.shape_paths import detach_shape_reads, fit_axis

EXPORTERS = ("torchscript", "optimum", "dynamo")
DYNAMO = ("bert", "albert", "deberta-v2", "vit")
"""The dynamo exporter takes 10-15 s a model here: these four stand for the others (absolute and relative
positions, factorised embeddings with shared layers, patches); bench/prepare_architectures.py runs all ten.
Optimum exports image models as the plain TorchScript export does (pixel_values only): text models only."""
CASES = [
    (arch, exporter)
    for exporter in EXPORTERS
    for arch in ARCHITECTURES
    if (exporter != "dynamo" or arch in DYNAMO) and (exporter != "optimum" or arch in TEXT)
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(path, example arrays) of an architecture's export, built once per module and exporter."""
    cache: dict[tuple[str, str], tuple] = {}
    models: dict[str, object] = {}

    def get(arch: str, exporter: str):
        if (arch, exporter) not in cache:
            model = models.setdefault(arch, build(arch))
            path = tmp_path_factory.mktemp(arch) / f"{exporter}.onnx"
            cache[(arch, exporter)] = (path, export(arch, model, path, exporter))
        return cache[(arch, exporter)]

    return get


def _other_inputs(arch: str, arrays: dict) -> dict:
    """Inputs the export never saw: 5 rows, 9 positions, other values."""
    return example(arch, rows=5, seq=9, seed=1, token_types="token_type_ids" in arrays)


def _cut_and_chain(model: onnx.ModelProto, arrays: dict, arch: str, tmp_path) -> tuple[int, float]:
    seq_axis = None if arch in IMAGE else 1
    detached, _ = detach_shape_reads(model, arrays, seq_axis)
    cuts = find_cuts(detached, arrays, seq_axis=seq_axis)
    blocks = split(detached, cuts, tmp_path, seq_axis=seq_axis, example_inputs=arrays)
    carried = {name for block in blocks[1:] for name in block.inputs} & {"input_ids", "pixel_values"}
    assert not carried, f"{arch}: later blocks read {carried} (only their values matter: block 0's)"
    return len(cuts), verify_chain(model, blocks, _other_inputs(arch, arrays))


@pytest.mark.parametrize(("arch", "exporter"), CASES)
def test_every_exporter_leaves_a_cut_between_layers(arch, exporter, exported, tmp_path):
    path, arrays = exported(arch, exporter)
    cuts, diff = _cut_and_chain(load_model(path), arrays, arch, tmp_path)
    assert cuts >= LAYERS - 1, f"{arch} ({exporter}): {cuts} cut vertices for {LAYERS} layers"
    assert diff <= 1e-4


@pytest.mark.parametrize("arch", TEXT)
def test_the_graph_prepare_hf_exports_has_a_cut_between_layers(arch, tmp_path):
    from exitplan.prepare.from_hf import text_classifier
    from exitplan.prepare.from_torch import export_onnx

    model = build(arch)
    arrays = example(arch, rows=4)
    wrapper = text_classifier(model, arrays["input_ids"], arrays["attention_mask"], classifier=True)
    export_onnx(wrapper, arrays, tmp_path / "model.onnx", f"--hf {arch}")
    cuts, diff = _cut_and_chain(load_model(tmp_path / "model.onnx"), arrays, arch, tmp_path)
    assert cuts >= LAYERS - 1 and diff <= 1e-4


def test_optimum_style_exports_take_token_types_where_the_model_does(exported):
    for arch in ("bert", "albert", "distilbert"):
        _, arrays = exported(arch, "optimum")
        assert ("token_type_ids" in arrays) == takes_token_types(build(arch))


# ------------------------------------------------------------------------------ the rewrite itself


def test_an_axis_is_fitted_as_a_constant_the_batch_the_length_or_their_product():
    batches, lengths = [2, 3, 4], [12, 11, 10]
    assert fit_axis([32, 32, 32], batches, lengths) == (32, 0, 0)
    assert fit_axis([2, 3, 4], batches, lengths) == (1, 1, 0)
    assert fit_axis([12, 11, 10], batches, lengths) == (1, 0, 1)
    assert fit_axis([48, 66, 80], batches, lengths) == (2, 1, 1)  # [batch * heads, ...] with 2 heads
    assert fit_axis([13, 12, 11], batches, lengths) is None  # length + 1 is not a product
    assert fit_axis([2, 3, 4], batches, None) == (1, 1, 0)


def _shape_side_path_model() -> onnx.ModelProto:
    """x [n, s] int64 -> embedding -> h1 = MatMul -> h2 = MatMul -> mean over s -> logits, where the bias
    added to h2 is ConstantOfShape(Shape(h0)) read from the first activation: no cut between h1 and h2."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(size=(20, 8)).astype(np.float32), "table"),
        numpy_helper.from_array(rng.normal(size=(8, 8)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(size=(8, 8)).astype(np.float32), "w2"),
        numpy_helper.from_array(rng.normal(size=(8, 3)).astype(np.float32), "w3"),
    ]
    value = helper.make_tensor("half", TensorProto.FLOAT, [1], [0.5])
    nodes = [
        helper.make_node("Gather", ["table", "x"], ["h0"]),
        helper.make_node("Shape", ["h0"], ["shape"]),
        helper.make_node("ConstantOfShape", ["shape"], ["bias"], value=value),
        helper.make_node("MatMul", ["h0", "w1"], ["m1"]),
        helper.make_node("Relu", ["m1"], ["h1"]),
        helper.make_node("MatMul", ["h1", "w2"], ["m2"]),
        helper.make_node("Add", ["m2", "bias"], ["h2"]),
        helper.make_node("ReduceMean", ["h2"], ["pooled"], axes=[1], keepdims=0),
        helper.make_node("MatMul", ["pooled", "w3"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "side",
        [helper.make_tensor_value_info("x", TensorProto.INT64, ["n", "s"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 3])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_shape_read_of_an_activation_is_recomputed_from_the_inputs(tmp_path):
    model = _shape_side_path_model()
    arrays = {"x": np.random.default_rng(1).integers(0, 20, (2, 6)).astype(np.int64)}
    before = [c.tensor for c in find_cuts(model, arrays, seq_axis=1, margin=0.0)]
    detached, rewritten = detach_shape_reads(model, arrays, seq_axis=1)
    after = [c.tensor for c in find_cuts(detached, arrays, seq_axis=1, margin=0.0)]
    assert "h1" not in before and "h1" in after and rewritten == 1
    assert all(n.input[0] == "x" for n in detached.graph.node if n.op_type == "Shape")
    blocks = split(detached, ["h1"], tmp_path, seq_axis=1, example_inputs=arrays)
    assert blocks[1].inputs == ["hidden0"]  # the sizes come from the state, not from x carried along
    other = {"x": np.random.default_rng(2).integers(0, 20, (7, 3)).astype(np.int64)}
    assert verify_chain(model, blocks, other) <= 1e-6


def test_a_model_without_shape_reads_is_returned_as_it_is():
    model = _shape_side_path_model()
    del model.graph.node[1:3]
    model.graph.node[4].input[1] = "m2"  # h2 = m2 + m2
    arrays = {"x": np.zeros((2, 4), dtype=np.int64)}
    assert detach_shape_reads(model, arrays, seq_axis=1) == (model, 0)


# ------------------------------------------------------------------------------ through prepare


class _LogitsAndPooled(torch.nn.Module):
    """ALBERT with two outputs, the class scores and the pooled features, as a user may export it."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        return out.logits, out.hidden_states[-1][:, 0]


def test_a_two_output_albert_export_is_prepared_and_checked(tmp_path):
    from typer.testing import CliRunner

    from exitplan.cli import app

    model = _LogitsAndPooled(build("albert")).eval()
    arrays = example("albert", rows=160, seq=16, seed=3)
    axes = {n: {0: "batch", 1: "seq"} for n in arrays} | {"logits": {0: "batch"}, "pooled": {0: "batch"}}
    with torch.no_grad():
        torch.onnx.export(model, tuple(torch.from_numpy(a[:2]) for a in arrays.values()), str(tmp_path / "albert.onnx"),
                          input_names=list(arrays), output_names=["logits", "pooled"], dynamic_axes=axes,
                          opset_version=17, dynamo=False)  # fmt: skip
    np.savez(tmp_path / "data.npz", **arrays)
    out, report = tmp_path / "bundle", tmp_path / "report.json"
    args = ["prepare", "--onnx", tmp_path / "albert.onnx", "--data", tmp_path / "data.npz", "--out", out]
    result = CliRunner().invoke(app, [str(a) for a in [*args, "--budget", "0.05", "--json", report]])
    assert result.exit_code == 0, result.output
    built = json.loads(report.read_text())
    assert built["outputs_not_served"] == ["pooled"] and len(built["candidates"]) >= LAYERS - 1
    assert built["kept"] and built["exits"]["compute_saved"] > 0
    assert built["exits"]["oracle_compute_saved"] <= 1 - built["exits"]["ramps"][0]["place"]  # none exits earlier
    check = CliRunner().invoke(app, ["check", str(out), "--source", str(tmp_path / "albert.onnx"), "--json",
                                     str(tmp_path / "check.json")])  # fmt: skip
    assert check.exit_code == 0, check.output
    assert json.loads((tmp_path / "check.json").read_text())["source"]["max_abs_diff"] <= 1e-4


def test_which_ramps_pay_does_not_depend_on_timings(tmp_path, exported, monkeypatch):
    """The placement reads FLOPs from the graph: block and ramp timings that swing 100x (a busy machine)
    change neither the ramps kept nor the compute figures (issue 30 item 6)."""
    from exitplan.prepare import window
    from exitplan.prepare.from_onnx import from_onnx

    path, _ = exported("bert", "torchscript")
    arrays = example("bert", rows=120, seq=12, seed=5)
    np.savez(tmp_path / "data.npz", **arrays)
    quiet = from_onnx(path, tmp_path / "data.npz", tmp_path / "quiet", budget=0.05).report
    rng = np.random.default_rng(0)
    real = window.time_chain

    def noisy(*args, **kwargs):
        timing = real(*args, **kwargs)
        timing.block_ms = [t * rng.uniform(1, 100) for t in timing.block_ms]
        timing.ramp_ms = {k: t * rng.uniform(1, 100) for k, t in timing.ramp_ms.items()}
        return timing

    monkeypatch.setattr(window, "time_chain", noisy)  # every latency prepare measures
    busy = from_onnx(path, tmp_path / "data.npz", tmp_path / "busy", budget=0.05).report
    assert quiet["kept"] and busy["kept"] == quiet["kept"]
    assert busy["exits"] == quiet["exits"] and busy["saving_ms"] != quiet["saving_ms"]  # the timings did swing
