"""Cut vertices of ONNX classifiers and splitting them into blocks (exitplan.prepare.graph_cuts).

Models are built here: a small CNN with residual blocks and TF-style asymmetric padding (torch,
exported with torch.onnx.export), the MiniLM encoder + a linear head exported whole (slow: loads
the checkpoint), and small graphs written with onnx.helper for the error cases.
"""

from __future__ import annotations

import time

import numpy as np
import onnx
import pytest
from byom_models import MiniLMClassifier, export, nn, torch
from onnx import TensorProto, helper

from exitplan.prepare.graph_cuts import (
    Cut,
    GraphError,
    find_cuts,
    load_model,
    no_cut_message,
    spread,
)
from exitplan.prepare.graph_split import BlockFile, split, verify_chain

OPSET = 17


def _producer(model: onnx.ModelProto, tensor: str) -> str:
    return next(n.name for n in model.graph.node if tensor in n.output)


def _scope(model: onnx.ModelProto, tensor: str) -> str:
    """Top-level module of the node producing `tensor` ("/res1/out_relu/Relu" -> "res1")."""
    return _producer(model, tensor).split("/")[1]


def _free_axes(path) -> list[tuple[str, int, str]]:
    model = onnx.load(str(path))
    found = []
    for value in list(model.graph.input) + list(model.graph.output):
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.HasField("dim_param") or not dim.HasField("dim_value"):
                found.append((value.name, axis, dim.dim_param))
    return found


# ------------------------------------------------------------------------------ a residual CNN


class ResBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.out_relu = nn.ReLU()

    def forward(self, x):
        return self.out_relu(x + self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))))


def _down(c_in: int, c_out: int) -> nn.Module:
    """TF-style 'same' padding for a stride-2 conv: pad right/bottom only, then an unpadded conv."""
    return nn.Sequential(
        nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(c_in, c_out, 3, stride=2), nn.BatchNorm2d(c_out), nn.ReLU()
    )


class ResNetLike(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.down1 = _down(16, 32)
        self.res1 = ResBlock(32)
        self.res2 = ResBlock(32)
        self.down2 = _down(32, 64)
        self.res3 = ResBlock(64)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, classes)

    def forward(self, x):
        for stage in (self.stem, self.down1, self.res1, self.res2, self.down2, self.res3):
            x = stage(x)
        return self.fc(torch.flatten(self.pool(x), 1))


@pytest.fixture(scope="module")
def cnn_path(tmp_path_factory):
    torch.manual_seed(0)
    net = ResNetLike()
    for module in net.modules():  # non-trivial batch-norm statistics, folded into the convs on export
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-0.2, 0.2)
            module.running_var.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("cnn") / "resnet.onnx"
    export(net, (torch.randn(2, 3, 32, 32),), path, ["x"], {"x": {0: "batch"}, "logits": {0: "batch"}})
    return path


def _images(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((n, 3, 32, 32)).astype(np.float32)}


def test_cnn_cuts_are_the_block_boundaries(cnn_path):
    model = load_model(cnn_path)
    cuts = find_cuts(model, _images(2))
    assert [_scope(model, c.tensor) for c in cuts] == ["stem", "down1", "res1", "res2", "down2"]
    # a residual block's output is the ReLU after the sum; nothing inside a residual block is a cut
    for c in cuts:
        if _scope(model, c.tensor).startswith("res"):
            assert _producer(model, c.tensor).endswith("/out_relu/Relu")
    assert all(c.kind == "spatial" and c.dims[0] == "batch" and c.dtype == "float32" for c in cuts)
    assert cuts[2].shape == (2, 32, 16, 16) and cuts[2].dims == ("batch", 32, 16, 16)
    fractions = [c.compute_before for c in cuts]
    assert fractions == sorted(fractions) and len(set(fractions)) == len(fractions)
    assert 0.02 <= fractions[0] and fractions[-1] <= 0.98
    assert [c.index for c in cuts] == sorted(c.index for c in cuts)


def test_cnn_split_reproduces_the_model(cnn_path, tmp_path):
    model = load_model(cnn_path)
    chosen = spread(find_cuts(model, _images(2)), 3)
    assert len(chosen) == 3
    blocks = split(model, [c.tensor for c in chosen], tmp_path)
    assert [b.file for b in blocks] == [f"blocks/block{i}.onnx" for i in range(4)]
    assert blocks[0].inputs == ["x"] and blocks[-1].outputs == ["logits"]
    for before, after in zip(blocks, blocks[1:]):
        assert after.inputs == before.outputs  # a CNN block needs nothing but the previous activation
    assert blocks[-1].output_shape == ["batch", 10]
    for block in blocks:
        # every spatial axis pinned: only axis 0 is free, and it is called batch
        assert all(axis == 0 and name == "batch" for _, axis, name in _free_axes(block.path))
    for n in (1, 2, 5):
        assert verify_chain(model, blocks, _images(n, seed=n)) <= 1e-4


def test_spread_picks_distinct_cuts_near_even_targets():
    cuts = [
        Cut(f"t{i}", i, (1, 4), ("batch", 4), "float32", f, "vector", f"n{i}", "Relu")
        for i, f in enumerate([0.05, 0.1, 0.12, 0.3, 0.5, 0.52, 0.7, 0.9])
    ]
    assert [c.tensor for c in spread(cuts, 3)] == ["t3", "t4", "t6"]
    assert len(spread(cuts, 7)) == 7 and len({c.tensor for c in spread(cuts, 7)}) == 7
    assert spread(cuts, 20) == cuts and spread(cuts, 0) == []


# ------------------------------------------------------------------------------ small graphs


def _save(tmp_path, nodes, inputs, outputs, inits=(), name="m.onnx"):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8)
    path = tmp_path / name
    onnx.save(model, str(path))
    return path


def _weight(name: str, shape: tuple[int, ...], seed: int) -> onnx.TensorProto:
    array = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return onnx.numpy_helper.from_array(array, name)


def _vec(name: str, *dims) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(dims))


def test_parallel_branches_have_no_cut(tmp_path):
    nodes, inits = [], []
    for b in ("a", "b"):
        nodes += [
            helper.make_node("MatMul", ["x", f"{b}_w1"], [f"{b}1"], name=f"{b}_dense1"),
            helper.make_node("Relu", [f"{b}1"], [f"{b}2"]),
            helper.make_node("MatMul", [f"{b}2", f"{b}_w2"], [f"{b}3"], name=f"{b}_dense2"),
        ]
        inits += [_weight(f"{b}_w1", (8, 16), 1), _weight(f"{b}_w2", (16, 3), 2)]
    nodes.append(helper.make_node("Add", ["a3", "b3"], ["logits"], name="join"))
    path = _save(tmp_path, nodes, [_vec("x", "batch", 8)], [_vec("logits", "batch", 3)], inits)
    model = load_model(path)
    example = {"x": np.ones((2, 8), np.float32)}
    assert find_cuts(model, example) == []
    message = no_cut_message(model)
    assert str(path) in message and "branch" in message and "b_dense1" in message
    with pytest.raises(GraphError, match=r"\['a2'\] are not \(distinct\) cut vertices"):
        split(model, ["a2"], tmp_path / "out", example_inputs=example)


def test_a_chain_of_dense_layers_cuts_after_each(tmp_path):
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["r1"]),
        helper.make_node("MatMul", ["r1", "w2"], ["h2"]),
        helper.make_node("Relu", ["h2"], ["r2"]),
        helper.make_node("Identity", ["r2"], ["r2_view"]),
        helper.make_node("MatMul", ["r2_view", "w3"], ["logits"]),
    ]
    inits = [_weight("w1", (8, 32), 1), _weight("w2", (32, 32), 2), _weight("w3", (32, 4), 3)]
    path = _save(tmp_path, nodes, [_vec("x", "batch", 8)], [_vec("logits", "batch", 4)], inits)
    model = load_model(path)
    cuts = find_cuts(model, {"x": np.ones((3, 8), np.float32)})
    # MatMul -> Relu -> Identity is one chain of equivalent cuts: the latest is kept
    assert [c.tensor for c in cuts] == ["r1", "r2_view"]
    assert [c.kind for c in cuts] == ["vector", "vector"] and cuts[0].dims == ("batch", 32)
    blocks = split(model, cuts[::-1], tmp_path / "out")  # Cut objects, in any order
    # the cut tensors carry plain names between blocks; the graph's outputs keep theirs
    assert [b.outputs for b in blocks] == [["hidden0"], ["hidden1"], ["logits"]]
    assert blocks[1].inputs == ["hidden0"] and blocks[1].output_shape == ["batch", 32]
    x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    assert verify_chain(model, blocks, {"x": x}) <= 1e-5


def test_a_state_name_the_graph_already_uses_is_not_reused(tmp_path):
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["hidden0"]),  # a tensor inside block 0 named like a state
        helper.make_node("Relu", ["hidden0"], ["r1"]),
        helper.make_node("MatMul", ["r1", "w2"], ["logits"]),
    ]
    inits = [_weight("w1", (8, 16), 1), _weight("w2", (16, 4), 2)]
    model = load_model(_save(tmp_path, nodes, [_vec("x", "batch", 8)], [_vec("logits", "batch", 4)], inits))
    blocks = split(model, ["r1"], tmp_path / "out")
    assert blocks[0].outputs == ["hidden0_"] and blocks[1].inputs == ["hidden0_"]
    x = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    assert verify_chain(model, blocks, {"x": x}) <= 1e-5


def test_if_on_the_main_path_is_named(tmp_path):
    then = helper.make_graph(
        [helper.make_node("Identity", ["h"], ["y_then"])], "then", [], [_vec("y_then", "batch", 4)]
    )
    other = helper.make_graph([helper.make_node("Neg", ["h"], ["y_else"])], "else", [], [_vec("y_else", "batch", 4)])
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("ReduceSum", ["h"], ["total"], keepdims=0),
        helper.make_node("Greater", ["total", "zero"], ["positive"]),
        helper.make_node("If", ["positive"], ["logits"], name="sign_switch", then_branch=then, else_branch=other),
    ]
    inits = [_weight("w", (8, 4), 1), onnx.numpy_helper.from_array(np.array(0.0, np.float32), "zero")]
    path = _save(tmp_path, nodes, [_vec("x", "batch", 8)], [_vec("logits", "batch", 4)], inits)
    with pytest.raises(GraphError, match="sign_switch") as err:
        load_model(path)
    assert str(path) in str(err.value) and "control flow" in str(err.value)


def test_control_flow_on_input_shapes_is_recomputed_by_the_next_block(tmp_path):
    """An If on the batch size (input-derived, reading an outer initializer) is not on the main path:
    the block after the cut recomputes it, the batch size read from the state it receives."""
    scalar = helper.make_tensor_value_info("s", TensorProto.FLOAT, [])
    then = helper.make_graph([helper.make_node("Identity", ["one"], ["s"])], "then", [], [scalar])
    other = helper.make_graph([helper.make_node("Add", ["one", "one"], ["s"])], "else", [], [scalar])
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["rows"], axis=0),
        helper.make_node("Greater", ["rows", "two"], ["many"]),
        helper.make_node("If", ["many"], ["scale"], name="batch_switch", then_branch=then, else_branch=other),
        helper.make_node("MatMul", ["x", "w1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["r1"]),
        helper.make_node("MatMul", ["r1", "w2"], ["h2"]),
        helper.make_node("Mul", ["h2", "scale"], ["r2"]),
        helper.make_node("MatMul", ["r2", "w3"], ["logits"]),
    ]
    consts = {"one": np.array(1.0, np.float32), "zero": np.array(0, np.int64), "two": np.array(2, np.int64)}
    inits = [_weight("w1", (8, 32), 1), _weight("w2", (32, 32), 2), _weight("w3", (32, 4), 3)]
    inits += [onnx.numpy_helper.from_array(v, k) for k, v in consts.items()]
    path = _save(tmp_path, nodes, [_vec("x", "batch", 8)], [_vec("logits", "batch", 4)], inits)
    model = load_model(path)
    cuts = find_cuts(model, {"x": np.ones((2, 8), np.float32)})
    assert [c.tensor for c in cuts] == ["r1", "r2"]
    blocks = split(model, ["r1"], tmp_path / "out")
    assert blocks[1].inputs == ["hidden0"]  # x's batch size, which the If reads, is hidden0's: x stays behind
    for n in (1, 3, 4):  # both branches of the If
        x = np.random.default_rng(n).standard_normal((n, 8)).astype(np.float32)
        assert verify_chain(model, blocks, {"x": x}) <= 1e-5


def test_cuts_too_close_to_the_ends_are_left_out_and_explained(tmp_path):
    """A tiny first layer, then a residual block from it to the output: the only cut is near the input."""
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["r1"]),
        helper.make_node("MatMul", ["r1", "w2"], ["h2"]),
        helper.make_node("Relu", ["h2"], ["r2"]),
        helper.make_node("MatMul", ["r2", "w3"], ["h3"]),
        helper.make_node("Add", ["h3", "r1"], ["logits"]),
    ]
    inits = [_weight("w1", (8, 2), 1), _weight("w2", (2, 4096), 2), _weight("w3", (4096, 2), 3)]
    path = _save(tmp_path, nodes, [_vec("x", "batch", 8)], [_vec("logits", "batch", 2)], inits)
    model = load_model(path)
    example = {"x": np.ones((2, 8), np.float32)}
    assert find_cuts(model, example) == []
    assert [c.tensor for c in find_cuts(model, example, margin=0.0)] == ["r1"]
    message = no_cut_message(model)
    assert "'r1' at 0.1% of the compute" in message and "within 2%" in message


def test_example_inputs_are_checked(tmp_path):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["logits"])]
    path = _save(tmp_path, nodes, [_vec("x", "batch", 8)], [_vec("logits", "batch", 3)], [_weight("w", (8, 3), 1)])
    model = load_model(path)
    with pytest.raises(GraphError, match=r"no example array for input\(s\) \['x'\]"):
        find_cuts(model, {"pixels": np.ones((2, 8), np.float32)})
    with pytest.raises(GraphError, match="'x' is float32, but the example array is int64"):
        find_cuts(model, {"x": np.ones((2, 8), np.int64)})
    with pytest.raises(GraphError, match="cannot run"):
        find_cuts(model, {"x": np.ones((2, 5), np.float32)})


def test_output_that_is_not_class_scores(tmp_path):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["hidden"])]
    path = _save(
        tmp_path, nodes, [_vec("x", "batch", 5, 8)], [_vec("hidden", "batch", 5, 3)], [_weight("w", (8, 3), 1)]
    )
    for example in (None, {"x": np.ones((2, 5, 8), np.float32)}):
        with pytest.raises(GraphError, match=r"\[batch, classes\]") as err:
            load_model(path, example)
        assert "'hidden'" in str(err.value) and str(path) in str(err.value)


def test_not_an_onnx_file(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_text("this is not a protobuf\n" * 10)
    with pytest.raises(GraphError, match="not an ONNX"):
        load_model(path)
    with pytest.raises(GraphError, match="no such file"):
        load_model(tmp_path / "missing.onnx")


# ------------------------------------------------------------------------------ MiniLM + a linear head


@pytest.fixture(scope="module")
def minilm_path(tmp_path_factory):
    from exitplan.prepare.minilm import ModelNotInstalled, load_encoder

    try:
        encoder = load_encoder()
    except ModelNotInstalled as err:
        pytest.skip(str(err))
    torch.manual_seed(0)
    net = MiniLMClassifier(encoder, nn.Linear(encoder.config.hidden_size, 3))
    path = tmp_path_factory.mktemp("minilm") / "minilm.onnx"
    ids, mask = _tokens(2, 12, seed=0).values()
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}, "logits": {0: "batch"}}
    export(net, (torch.from_numpy(ids), torch.from_numpy(mask)), path, ["input_ids", "attention_mask"], axes)
    return path


def _tokens(n: int, length: int, seed: int) -> dict[str, np.ndarray]:
    """Random token ids with [CLS] ... [SEP] and right padding (every other row shorter)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, 30000, size=(n, length), dtype=np.int64)
    mask = np.ones((n, length), dtype=np.int64)
    ids[:, 0] = 101
    for row in range(n):
        used = length if row % 2 == 0 else max(2, length // 2)
        ids[row, used - 1] = 102
        ids[row, used:] = 0
        mask[row, used:] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.slow
def test_minilm_cuts_are_the_layer_boundaries(minilm_path):
    model = load_model(minilm_path)
    cuts = find_cuts(model, _tokens(2, 12, seed=1), seq_axis=1)
    producers = [_producer(model, c.tensor) for c in cuts]
    # after each attention block (its residual sum + LayerNorm) and each layer; the last layer's
    # output is within 2% of the output (only pooling and the head follow)
    expected = []
    for layer in range(6):
        expected.append(f"/layers.{layer}/attention/output/LayerNorm/LayerNormalization")
        if layer < 5:
            expected.append(f"/layers.{layer}/output/LayerNorm/LayerNormalization")
    assert producers == expected
    assert all(c.kind == "sequence" and c.dims == ("batch", "seq", 384) and c.shape == (2, 12, 384) for c in cuts)
    fractions = [c.compute_before for c in cuts]
    assert fractions == sorted(fractions) and len(set(fractions)) == len(fractions)
    assert fractions[-1] < 0.98 and fractions[0] > 0.02


@pytest.mark.slow
def test_minilm_split_reproduces_the_model(minilm_path, tmp_path):
    model = load_model(minilm_path)
    started = time.perf_counter()
    chosen = spread(find_cuts(model, _tokens(2, 12, seed=1), seq_axis=1), 3)
    blocks = split(model, [c.tensor for c in chosen], tmp_path, seq_axis=1)
    elapsed = time.perf_counter() - started
    assert elapsed < 60, f"find_cuts + split took {elapsed:.1f} s"
    assert len(blocks) == 4 and isinstance(blocks[0], BlockFile)
    assert blocks[0].inputs == ["input_ids", "attention_mask"]
    for before, after in zip(blocks, blocks[1:]):
        # the previous layer's output, and the mask the extended attention mask is recomputed from
        assert after.inputs == [before.outputs[0], "attention_mask"]
    assert [b.output_shape for b in blocks] == [["batch", "seq", 384]] * 3 + [["batch", 3]]
    for block in blocks:
        assert {(axis, name) for _, axis, name in _free_axes(block.path)} <= {(0, "batch"), (1, "seq")}
    for n, length in ((1, 8), (3, 8), (4, 20)):
        assert verify_chain(model, blocks, _tokens(n, length, seed=n + length)) <= 1e-4
