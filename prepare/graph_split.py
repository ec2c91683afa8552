"""Splitting an ONNX classifier into blocks at cut vertices (found by exitplan.prepare.graph_cuts), and
checking that the chained blocks reproduce it. Only onnx, onnxruntime and numpy here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from exitplan.prepare.graph_cuts import Cut
from exitplan.prepare.onnx_graph import EXTERNAL_DATA_BYTES, Graph, GraphError, subgraph_reads
from exitplan.prepare.onnx_probe import (
    Dims,
    check_feeds,
    check_outputs,
    free_dims,
    probe,
    seq_len,
    session,
    synthetic_feeds,
)
from exitplan.prepare.shape_paths import dims_from_state

__all__ = ["BlockFile", "split", "verify_chain"]


@dataclass(frozen=True)
class BlockFile:
    """One block written by `split`: `file` relative to the output directory (the bundle's BlockSpec.file),
    `output_shape` and `output_type` (onnx.TensorProto.FLOAT, ...) those of outputs[0], free axes named."""

    file: str
    path: Path
    inputs: list[str]
    outputs: list[str]
    output_shape: list[int | str]
    output_type: int


def _block_model(
    g: Graph, index: int, outputs: list[str], previous: str | None, dims: Mapping[str, Dims], types: Mapping[str, int]
) -> onnx.ModelProto:
    node_ids, _, _ = g.closure(outputs, previous)
    nodes = [g.nodes[i] for i in node_ids]
    if previous is not None:  # the inputs' sizes read from the state: no input travels only for its shape
        nodes = dims_from_state(nodes, previous, dims[previous], {n: dims[n] for n in g.inputs})
    read = {x for node in nodes for x in (*node.input, *subgraph_reads(node)) if x}
    sources = ([previous] if previous else []) + [n for n in g.inputs if n in read]
    graph = helper.make_graph(
        nodes,
        f"block{index}",
        [helper.make_tensor_value_info(n, types[n], list(dims[n])) for n in sources],
        [helper.make_tensor_value_info(n, types[n], list(dims[n])) for n in outputs],
        initializer=[g.init_protos[n] for n in sorted(read & set(g.init_protos))],
    )
    block = helper.make_model(graph, opset_imports=list(g.model.opset_import), ir_version=g.model.ir_version)
    block.functions.extend(g.model.functions)
    return block


def _state_names(g: Graph, cuts: Sequence[str]) -> dict[str, str]:
    """The name each cut tensor carries between blocks: `hidden{i}` (with `_` appended while the source
    graph uses the name), so bundle.yaml and the state on the wire read plainly whatever the exporter called it."""
    used = {name for node in g.nodes for name in (*node.input, *node.output)} | set(g.inputs) | set(g.outputs)
    names: dict[str, str] = {}
    for i, tensor in enumerate(cuts):
        name = f"hidden{i}"
        while name in used:
            name += "_"
        names[tensor] = name
    return names


def _rename(graph: onnx.GraphProto, old: str, new: str) -> None:
    """Rename tensor `old` to `new` in `graph`, its inputs and outputs and the subgraphs of its nodes."""
    for node in graph.node:
        node.input[:] = [new if n == old else n for n in node.input]
        node.output[:] = [new if n == old else n for n in node.output]
        for attr in node.attribute:
            for sub in (*([attr.g] if attr.HasField("g") else []), *attr.graphs):
                _rename(sub, old, new)
    for value in (*graph.input, *graph.output, *graph.value_info):
        if value.name == old:
            value.name = new


def split(
    model: onnx.ModelProto,
    cut_tensors: Sequence[str | Cut],
    out_dir: str | Path,
    *,
    seq_axis: int | None = None,
    example_inputs: Mapping[str, np.ndarray] | None = None,
) -> list[BlockFile]:
    """Write `out_dir/blocks/block{i}.onnx`, one per block between the cuts (given in any order):
    block 0 reads the graph inputs, block i > 0 the previous cut tensor and the graph inputs its
    input-derived tensors are recomputed from; each block writes its cut tensor, the last one the
    graph's outputs. Axis 0 of every block input and output is named "batch", the sequence axis
    "seq"; every other axis is pinned to its size on `example_inputs` (default: zero-filled arrays of
    the shapes last given to find_cuts for this model, else of the declared input shapes)."""
    g = Graph(model)
    valid = {t: i for i, t in g.cut_candidates()}
    cuts = [c.tensor if isinstance(c, Cut) else str(c) for c in cut_tensors]
    if [t for t in cuts if t not in valid] or len(set(cuts)) != len(cuts):
        bad, shown = [t for t in cuts if t not in valid] or cuts, ", ".join(list(valid)[:20]) or "none"
        raise GraphError(f"{g.desc}: {bad} are not (distinct) cut vertices of the graph (its cut vertices: {shown})")
    cuts.sort(key=lambda t: valid[t])
    feeds = check_feeds(g, example_inputs) if example_inputs is not None else synthetic_feeds(g, {seq_axis})
    values = probe(g, feeds, cuts + g.outputs)
    dims = free_dims(g, feeds, cuts + g.outputs, seq_axis, values)
    check_outputs(g, dims, values)
    if [t for t in cuts if dims[t] is None]:
        shapes = {t: list(values[t].shape) for t in cuts if dims[t] is None}
        raise GraphError(
            f"{g.desc}: cuts {shapes} have free axes other than batch (0) and sequence, or none following the batch"
        )
    length = seq_len(feeds, seq_axis)
    for name, a in feeds.items():
        dims[name] = tuple(
            "batch" if k == 0 else "seq" if (k, d) == (seq_axis, length) else d for k, d in enumerate(a.shape)
        )
    named = {n: d for n, d in dims.items() if d is not None}  # every cut, output and input (checked above)
    types = {n: helper.np_dtype_to_tensor_dtype(values[n].dtype) for n in cuts + g.outputs}
    types |= {n: g.input_info[n].type.tensor_type.elem_type for n in g.inputs}
    (Path(out_dir) / "blocks").mkdir(parents=True, exist_ok=True)
    blocks: list[BlockFile] = []
    names = _state_names(g, cuts)
    for index, outputs in enumerate([[t] for t in cuts] + [list(g.outputs)]):
        block = _block_model(g, index, outputs, cuts[index - 1] if index else None, named, types)
        for old_name, new_name in names.items():
            _rename(block.graph, old_name, new_name)
        outputs = [names.get(t, t) for t in outputs]
        rel, big = f"blocks/block{index}.onnx", block.ByteSize() >= EXTERNAL_DATA_BYTES
        onnx.save_model(block, str(Path(out_dir) / rel), save_as_external_data=big, location=f"block{index}.onnx.data")
        read = [v.name for v in block.graph.input]
        assert not set(read) & set(outputs), "a node output is never a graph input (SSA)"
        source = {v: k for k, v in names.items()}.get(outputs[0], outputs[0])
        blocks.append(BlockFile(rel, Path(out_dir) / rel, read, outputs, list(named[source]), types[source]))
    return blocks


def verify_chain(model: onnx.ModelProto, blocks: Sequence[BlockFile], inputs: Mapping[str, np.ndarray]) -> float:
    """Max absolute difference between the source model's outputs and the chained blocks' on `inputs`."""
    g = Graph(model)
    feeds = check_feeds(g, inputs)
    reference = dict(zip(g.outputs, session(model).run(g.outputs, feeds)))
    state: dict[str, np.ndarray] = dict(feeds)
    for block in blocks:
        outputs = session(onnx.load(str(block.path))).run(block.outputs, {n: state[n] for n in block.inputs})
        state.update(zip(block.outputs, outputs))
    return max(float(np.max(np.abs(state[n].astype(np.float64) - reference[n]), initial=0.0)) for n in g.outputs)
