"""Exit ramps for any model, built from the activation they read (Apparate's ramp shape).

A ramp pools the activation at its cut to a feature vector and maps it to class scores:

- ``sequence`` [batch, seq, hidden]: the mean over the sequence positions the attention mask keeps
  (over every position when the model has no mask input);
- ``spatial`` [batch, channels, d1, d2, ...]: the mean over every axis after the channels (global
  average pooling);
- ``vector`` [batch, features]: the activation itself.

Then a linear layer (``hidden=0``) or a small MLP (one ReLU layer of ``hidden`` units). The numpy
pooling here (:func:`pool`) is exactly what the exported ONNX graph computes, so ramps are trained
on features computed once, without running the ramp graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8
"""ONNX IR version of the ramp files (what ONNX Runtime reads; opset 17 needs IR >= 8)."""
KINDS = ("sequence", "spatial", "vector")


@dataclass(frozen=True)
class RampWeights:
    """The layers after pooling: [(weight [out, in], bias [out]), ...], ReLU between them."""

    layers: tuple[tuple[np.ndarray, np.ndarray], ...]

    def logits(self, features: np.ndarray) -> np.ndarray:
        h = features
        for i, (weight, bias) in enumerate(self.layers):
            h = h @ weight.T + bias
            if i < len(self.layers) - 1:
                h = np.maximum(h, 0.0)
        return h


def pool(kind: str, activation: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """[batch, features] float32 features of `activation`, as the ramp graph computes them."""
    x = activation.astype(np.float32, copy=False)
    if kind == "vector":
        return x.reshape(x.shape[0], -1)
    pooled: np.ndarray
    if kind == "spatial":
        pooled = x.mean(axis=tuple(range(2, x.ndim)))
        return pooled
    if kind != "sequence":
        raise ValueError(f"unknown ramp kind {kind!r}; expected one of {KINDS}")
    if mask is None:
        pooled = x.mean(axis=1)
        return pooled
    m = (mask != 0).astype(np.float32)[:, :, None]
    pooled = (x * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
    return pooled


def ramp_flops(kind: str, shape: tuple[int, ...], weights: RampWeights) -> float:
    """Estimated FLOPs of one sample through the ramp: pooling the activation of `shape` (one sample's,
    without the batch axis) and its layers (2 per multiply-accumulate), as graph_cuts counts a model's."""
    elements = float(np.prod(shape)) if shape else 1.0
    pooling = 0.0 if kind == "vector" else 2.0 * elements if kind == "sequence" else elements
    return pooling + sum(2.0 * weight.size + bias.size for weight, bias in weights.layers)


def _pooling_nodes(kind: str, source: str, mask: str | None, rank: int) -> tuple[list[onnx.NodeProto], str]:
    """Nodes computing the pooled features of `source`, and the name of their output."""
    if kind == "vector":
        if rank == 2:
            return [], source
        return [helper.make_node("Flatten", [source], ["pooled"], axis=1)], "pooled"
    if kind == "spatial":
        axes = list(range(2, rank))
        return [helper.make_node("ReduceMean", [source], ["pooled"], axes=axes, keepdims=0)], "pooled"
    if mask is None:
        return [helper.make_node("ReduceMean", [source], ["pooled"], axes=[1], keepdims=0)], "pooled"
    nodes = [
        helper.make_node("Cast", [mask], ["mask_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["mask_f", "axis2"], ["mask_3d"]),
        helper.make_node("Mul", [source, "mask_3d"], ["masked"]),
        helper.make_node("ReduceSum", ["masked", "axis1"], ["summed"], keepdims=0),
        helper.make_node("ReduceSum", ["mask_3d", "axis1"], ["count"], keepdims=0),
        helper.make_node("Max", ["count", "tiny"], ["count_safe"]),
        helper.make_node("Div", ["summed", "count_safe"], ["pooled"]),
    ]
    return nodes, "pooled"


def ramp_model(
    kind: str,
    source: str,
    shape: list[int | str],
    source_type: int,
    weights: RampWeights,
    *,
    mask: tuple[str, list[int | str], int] | None = None,
    output: str = "logits",
) -> onnx.ModelProto:
    """The ramp as an ONNX model: `source` (with `shape`, axis names for free axes, and ONNX element
    type `source_type`) and, for a sequence ramp, `mask` (name, shape, element type) -> `output`
    [batch, classes] float32."""
    nodes: list[onnx.NodeProto] = []
    current = source
    if source_type != TensorProto.FLOAT:
        nodes.append(helper.make_node("Cast", [source], ["source_f"], to=TensorProto.FLOAT))
        current = "source_f"
    pooling, pooled = _pooling_nodes(kind, current, mask[0] if mask else None, len(shape))
    nodes += pooling
    inits = [
        numpy_helper.from_array(np.array([2], dtype=np.int64), "axis2"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "axis1"),
        numpy_helper.from_array(np.array(1e-9, dtype=np.float32), "tiny"),
    ]
    h = pooled
    for i, (weight, bias) in enumerate(weights.layers):
        inits.append(numpy_helper.from_array(weight.astype(np.float32), f"w{i}"))
        inits.append(numpy_helper.from_array(bias.astype(np.float32), f"b{i}"))
        out = output if i == len(weights.layers) - 1 else f"h{i}"
        nodes.append(helper.make_node("Gemm", [h, f"w{i}", f"b{i}"], [out], transB=1))
        if i < len(weights.layers) - 1:
            nodes.append(helper.make_node("Relu", [out], [f"r{i}"]))
            out = f"r{i}"
        h = out
    inputs = [helper.make_tensor_value_info(source, source_type, shape)]
    if mask is not None:
        inputs.append(helper.make_tensor_value_info(mask[0], mask[2], mask[1]))
    classes = int(weights.layers[-1][0].shape[0])
    outputs = [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["batch", classes])]
    used = {name for node in nodes for name in node.input}
    graph = helper.make_graph(nodes, "ramp", inputs, outputs, [i for i in inits if i.name in used])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)
    onnx.checker.check_model(model)
    return model


def head_model(source: str, shape: list[int | str], source_type: int, output: str = "logits") -> onnx.ModelProto:
    """The model's own head as the bundle's final ramp: its output, cast to float32, renamed."""
    op = (
        helper.make_node("Identity", [source], [output])
        if source_type == TensorProto.FLOAT
        else helper.make_node("Cast", [source], [output], to=TensorProto.FLOAT)
    )
    graph = helper.make_graph(
        [op],
        "head",
        [helper.make_tensor_value_info(source, source_type, shape)],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, shape)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)
    onnx.checker.check_model(model)
    return model


def train_ramp(
    features: np.ndarray, targets: np.ndarray, n_classes: int, *, hidden: int = 0, seed: int = 0
) -> tuple[RampWeights, float]:
    """(weights, training accuracy) of a ramp trained on the model's own answers `targets`."""
    if hidden <= 0:
        from exitplan.prepare.heads import train_linear

        fit = train_linear(features, targets, n_classes, seed=seed)
        return RampWeights(((fit.weight, fit.bias),)), fit.train_accuracy
    return _train_mlp(features, targets, n_classes, hidden, seed)


def _train_mlp(
    features: np.ndarray, targets: np.ndarray, n_classes: int, hidden: int, seed: int
) -> tuple[RampWeights, float]:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    x = torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32))
    y = torch.from_numpy(targets.astype(np.int64))
    mean, std = x.mean(0), x.std(0).clamp(min=1e-6)
    first, last = nn.Linear(x.shape[1], hidden), nn.Linear(hidden, n_classes)
    net = nn.Sequential(first, nn.ReLU(), last)
    optimiser = torch.optim.Adam(net.parameters(), lr=3e-3, weight_decay=1e-4)
    z = (x - mean) / std
    for _ in range(300):
        optimiser.zero_grad()
        loss = nn.functional.cross_entropy(net(z), y)
        loss.backward()
        optimiser.step()
    with torch.no_grad():
        accuracy = float((net(z).argmax(1) == y).float().mean())
        w0 = first.weight / std  # fold the standardization into the first layer
        b0 = first.bias - w0 @ mean
    layers = (
        (w0.numpy().astype(np.float32), b0.numpy().astype(np.float32)),
        (last.weight.detach().numpy().astype(np.float32), last.bias.detach().numpy().astype(np.float32)),
    )
    return RampWeights(layers), accuracy
