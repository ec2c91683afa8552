"""Running an ONNX graph for the splitter: sessions, the values of inner tensors on example inputs,
which axes of a tensor follow the batch and the sequence, and the example inputs themselves (checked,
remembered per model, or zero-filled). Only onnx, onnxruntime and numpy here."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from exitplan.prepare.onnx_graph import EXTERNAL_DATA_BYTES, Graph, GraphError

__all__ = [
    "SYNTH_BATCH",
    "SYNTH_FREE",
    "Dims",
    "Shapes",
    "check_feeds",
    "check_outputs",
    "free_dims",
    "grown_feeds",
    "probe",
    "remember_example",
    "remembered",
    "seq_len",
    "session",
    "synthetic_feeds",
]

SYNTH_BATCH, SYNTH_FREE = 2, 8  # sizes of the free axes of zero-filled inputs, when no example is given
Dims = tuple[int | str, ...]
"""A tensor's shape with its free axes named: "batch" (axis 0), "seq" (the sequence axis), else the size."""
Shapes = dict[str, tuple[tuple[int, ...], np.dtype[Any]]]
"""Input name -> (shape, dtype) of an example."""
_EXAMPLES: dict[int, tuple[tuple[int, str], Shapes, int | None]] = {}
"""Shapes of the example inputs and the seq_axis last given to find_cuts for a model (by id)."""


def session(model: onnx.ModelProto, optimize: bool = True) -> ort.InferenceSession:
    """A CPU session on `model` (saved with external data first when protobuf cannot hold it)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = min(4, os.cpu_count() or 1)
    options.graph_optimization_level = ort.GraphOptimizationLevel(99 if optimize else 0)  # ENABLE_ALL / DISABLE_ALL
    if model.ByteSize() < EXTERNAL_DATA_BYTES:
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    with tempfile.TemporaryDirectory() as tmp:
        onnx.save_model(model, f"{tmp}/model.onnx", save_as_external_data=True, location="model.data")
        return ort.InferenceSession(f"{tmp}/model.onnx", options, providers=["CPUExecutionProvider"])


def probe(g: Graph, feeds: Mapping[str, np.ndarray], names: Sequence[str], hint: str = "") -> dict[str, np.ndarray]:
    """Values of `names` (node outputs or graph outputs) on `feeds`, from one unoptimised run."""
    model = onnx.ModelProto()
    model.CopyFrom(g.model)
    model.graph.output.extend(onnx.ValueInfoProto(name=n) for n in dict.fromkeys(names) if n not in g.outputs)
    try:
        run = session(model, optimize=False)
        wanted = [o.name for o in run.get_outputs()]
        values = run.run(wanted, dict(feeds))
    except Exception as err:  # onnxruntime raises several unrelated types
        shapes = {k: list(v.shape) for k, v in feeds.items()}
        raise GraphError(f"{g.desc}: ONNX Runtime cannot run it on inputs of shapes {shapes}{hint}: {err}") from err
    return {n: v for n, v in zip(wanted, values) if isinstance(v, np.ndarray)}


def check_feeds(g: Graph, example: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The example arrays of the graph inputs, checked (cast within a kind: float64 -> float32, int32 -> int64)."""
    missing = [n for n in g.inputs if n not in example]
    if missing:
        raise GraphError(f"{g.desc}: no example array for input(s) {missing}; the model's inputs are {g.inputs}")
    feeds = {}
    for name in g.inputs:
        tensor = g.input_info[name].type.tensor_type
        want, array = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.elem_type)), np.asarray(example[name])
        if array.dtype.kind != want.kind and not (array.dtype.kind in "iu" and want.kind in "iu"):
            raise GraphError(f"{g.desc}: input {name!r} is {want.name}, but the example array is {array.dtype.name}")
        if array.ndim != len(tensor.shape.dim) or array.ndim == 0 or array.shape[0] < 1:
            raise GraphError(f"{g.desc}: input {name!r} has {len(tensor.shape.dim)} axes, not {list(array.shape)}")
        feeds[name] = array.astype(want, copy=False)
    if len({a.shape[0] for a in feeds.values()}) != 1:
        raise GraphError(f"{g.desc}: the example arrays disagree on the batch size (axis 0)")
    return feeds


def remember_example(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], seq_axis: int | None) -> None:
    """Keep the shapes of the example inputs and the seq_axis given for `model` (for synthetic_feeds)."""
    shapes = {k: (v.shape, v.dtype) for k, v in feeds.items()}
    _EXAMPLES[id(model)] = ((len(model.graph.node), model.graph.name), shapes, seq_axis)


def remembered(model: onnx.ModelProto) -> tuple[Shapes, int | None] | None:
    """(input shapes and dtypes, seq_axis) last given to remember_example for this model, if any."""
    entry = _EXAMPLES.get(id(model))
    return entry[1:] if entry and entry[0] == (len(model.graph.node), model.graph.name) else None


def synthetic_feeds(g: Graph, free: set[int | None] | None) -> dict[str, np.ndarray]:
    """Zero-filled inputs: the shapes of the last example remembered for this model, else the declared
    shapes with SYNTH_BATCH rows and SYNTH_FREE on the free axes in `free` (None: any)."""
    known = remembered(g.model)
    if known:
        return {k: np.zeros(shape, dtype) for k, (shape, dtype) in known[0].items()}
    feeds = {}
    for name in g.inputs:
        tensor, shape = g.input_info[name].type.tensor_type, []
        for axis, dim in enumerate(tensor.shape.dim):
            if axis == 0 or not dim.HasField("dim_value"):
                if axis != 0 and free is not None and axis not in free:
                    raise GraphError(f"{g.desc}: input {name!r} axis {axis} is free; pass example_inputs to size it")
                shape.append(SYNTH_BATCH if axis == 0 else SYNTH_FREE)
            else:
                shape.append(dim.dim_value)
        feeds[name] = np.zeros(shape, helper.tensor_dtype_to_np_dtype(tensor.elem_type))
    return feeds


def seq_len(feeds: Mapping[str, np.ndarray], seq_axis: int | None) -> int:
    """The length of the examples' sequence axis (0 without one)."""
    return next((a.shape[seq_axis] for a in feeds.values() if a.ndim > seq_axis), 0) if seq_axis is not None else 0


def grown_feeds(feeds: Mapping[str, np.ndarray], seq_axis: int | None, step: int = 1) -> dict[str, np.ndarray]:
    """The examples with `step` more rows (copies of the first) and `step` positions fewer on the sequence axis."""
    length = seq_len(feeds, seq_axis)
    out = {}
    for name, a in feeds.items():
        a = np.concatenate([a, *[a[:1]] * step], axis=0)
        if seq_axis is not None and a.ndim > seq_axis and a.shape[seq_axis] == length:
            a = np.take(a, np.arange(length - step), axis=seq_axis)
        out[name] = a
    return out


def free_dims(
    g: Graph,
    feeds: Mapping[str, np.ndarray],
    names: Sequence[str],
    seq_axis: int | None,
    first: Mapping[str, np.ndarray],
) -> dict[str, Dims | None]:
    """Every tensor of `names` with its free axes named, from a second run with one more row (a copy
    of the first) and one position fewer: axis 0 must follow the batch, any other axis that changes
    must follow the sequence length; None for a tensor that does not."""
    batch = next(iter(feeds.values())).shape[0]
    length = seq_len(feeds, seq_axis)
    if seq_axis is not None and length < 2:
        raise GraphError(f"{g.desc}: example inputs with {length} positions on axis {seq_axis}; give at least 2")
    hint = " (with one more row and one position fewer: export the model with free batch and sequence axes)"
    second = probe(g, grown_feeds(feeds, seq_axis), names, hint)
    dims: dict[str, Dims | None] = {}
    for name in names:
        both = name in first and name in second
        one: tuple[int, ...] = first[name].shape if both else ()
        two: tuple[int, ...] = second[name].shape if both else ()
        named: list[int | str] = [
            int(a) if a == b else "seq" if (a, b) == (length, length - 1) else "?" for a, b in zip(one, two)
        ]
        ok = len(one) == len(two) > 0 and (one[0], two[0]) == (batch, batch + 1) and "?" not in named[1:]
        dims[name] = ("batch", *named[1:]) if ok else None
    return dims


def check_outputs(g: Graph, dims: Mapping[str, Dims | None], values: Mapping[str, np.ndarray]) -> None:
    """A GraphError unless every graph output is class scores [batch, classes] (float, 2 or more classes)."""
    for name in g.outputs:
        value, named = values.get(name), dims.get(name)
        if value is None or value.dtype.kind != "f" or named is None or len(named) != 2 or value.shape[1] < 2:
            shape = f"shape {list(value.shape)} of {value.dtype.name}" if value is not None else "no tensor value"
            raise GraphError(
                f"{g.desc}: output {name!r} has {shape} (free axes: {named}); a classifier must output class scores "
                "[batch, classes] (float, 2 or more classes, axis 0 following the batch): export the model with its "
                "classification head (logits), not hidden states, pooled features or class indices"
            )
