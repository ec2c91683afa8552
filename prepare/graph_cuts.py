"""Cut vertices of an ONNX classifier (Apparate); exitplan.prepare.graph_split splits the graph there.

Tensors are *static* (initializers, constants, what is computed from them alone), *input-derived*
(computed from graph inputs and constants without touching the data stream: an extended attention
mask, position ids, a padded input) or *activations*. The stream starts at *source* nodes (a
MatMul/Gemm/Conv/attention/RNN on input values, or an embedding lookup: a Gather of a constant
table by input values, not by shape-derived indices) and whatever reads an activation is one. A
*cut* is an activation T whose ancestors hold every source and leave no other activation to a node
outside them (nor as a graph output): after them the rest of the graph reads only T, graph inputs,
constants and input-derived tensors, which the next block recomputes from the graph inputs. Ancestor
bitsets make the test independent of the node order: the inside of a residual or attention block is
never a cut, the sum after it is. Only onnx, onnxruntime and numpy here.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

STATIC, DERIVED, ACTIVE = 0, 1, 2
CONTROL_FLOW = {"If", "Loop", "Scan", "SequenceMap"}
ATTENTION_OPS = {"Attention", "MultiHeadAttention", "GroupQueryAttention"}
HEAVY_OPS = {"MatMul", "Gemm", "FusedMatMul", "MatMulInteger", "QLinearMatMul", "Einsum", "LSTM", "GRU", "RNN"}
HEAVY_OPS |= {"Conv", "ConvTranspose", "FusedConv", "ConvInteger", "QLinearConv", "EmbedLayerNormalization"}
HEAVY_OPS |= ATTENTION_OPS
GATHER_OPS = {"Gather", "GatherElements", "GatherND"}
# estimated FLOPs per output element of ops that are not multiply-accumulates (others: 1)
ELEMENT_COST = {"Softmax": 5.0, "LayerNormalization": 8.0, "Erf": 5.0, "Exp": 3.0, "Tanh": 3.0, "Sigmoid": 3.0}
SYNTH_BATCH, SYNTH_FREE = 2, 8  # sizes of the free axes of zero-filled inputs, when no example is given
EXTERNAL_DATA_BYTES = 1_800_000_000
Kind = Literal["sequence", "spatial", "vector"]


class GraphError(ValueError):
    """A model the splitter cannot handle; the message names the file and what is wrong."""


@dataclass(frozen=True)
class Cut:
    """A tensor at which the graph can be cut: the only activation crossing the boundary. `index`: position
    of its node in the graph's (topological) order; `shape`: on the example inputs (batch as given); `dims`:
    the shape with free axes named ("batch" = axis 0, "seq"), every other axis concrete; `dtype`: numpy name;
    `compute_before`: fraction of the model's estimated compute done before the cut, in [0, 1]; `kind`:
    "sequence" [batch, seq, ...], "spatial" [batch, C, ...] (pool over axes 2..), "vector" [batch, features]."""

    tensor: str
    index: int
    shape: tuple[int, ...]
    dims: tuple[int | str, ...]
    dtype: str
    compute_before: float
    kind: Kind
    node: str
    op: str


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


# ------------------------------------------------------------------------------ the graph


def _label(node: onnx.NodeProto, index: int) -> str:
    return f"{node.name!r} ({node.op_type})" if node.name else f"#{index} ({node.op_type})"


def _describe(model: onnx.ModelProto) -> str:
    found = [p.value for p in model.metadata_props if p.key == "exitplan.source"]
    return found[0] if found else f"ONNX model {model.graph.name!r}"


def _subgraph_reads(node: onnx.NodeProto) -> set[str]:
    """Outer-scope names that the subgraphs of a control-flow node read."""
    found: set[str] = set()
    for attr in node.attribute:
        for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
            defined = {v.name for v in sub.input} | {t.name for t in sub.initializer}
            used: set[str] = {o.name for o in sub.output}
            for inner in sub.node:
                defined.update(inner.output)
                used.update(x for x in inner.input if x)
                used |= _subgraph_reads(inner)
            found |= used - defined
    return found


class _Graph:
    """The nodes (ONNX keeps them in topological order), the class of every tensor, ancestor bitsets."""

    def __init__(self, model: onnx.ModelProto) -> None:
        g = model.graph
        self.model, self.desc = model, _describe(model)
        if g.sparse_initializer:
            raise GraphError(f"{self.desc}: sparse initializers are not supported; store them dense")
        self.init_protos = {t.name: t for t in g.initializer}
        self.inputs = [v.name for v in g.input if v.name not in self.init_protos]
        self.input_info = {v.name: v for v in g.input}
        self.outputs = [v.name for v in g.output]
        self.nodes = list(g.node)
        self.reads = [[x for x in n.input if x] + sorted(_subgraph_reads(n)) for n in self.nodes]
        self.producer: dict[str, int] = {}
        self.consumers: dict[str, list[int]] = {}
        known = set(self.input_info) | set(self.init_protos)
        for i, node in enumerate(self.nodes):
            for name in dict.fromkeys(self.reads[i]):
                if name not in known:
                    raise GraphError(f"{self.desc}: node {_label(node, i)} reads {name!r} before anything writes it")
                self.consumers.setdefault(name, []).append(i)
            for out in (o for o in node.output if o):
                if out in known:
                    raise GraphError(f"{self.desc}: tensor {out!r} is written twice (node {_label(node, i)})")
                known.add(out)
                self.producer[out] = i
        self._classify()
        self._bitsets()

    def _classify(self) -> None:
        kind = {name: STATIC for name in self.init_protos} | {name: DERIVED for name in self.inputs}
        by_value = {name: k == DERIVED for name, k in kind.items()}  # depends on the values of graph inputs
        self.node_kind: list[int] = []
        self.sources: list[int] = []
        for i, node in enumerate(self.nodes):
            ins, op = self.reads[i], node.op_type
            value = op not in ("Shape", "Size") and any(by_value[x] for x in ins)
            if all(kind[x] == STATIC for x in ins):
                k = STATIC
            elif any(kind[x] == ACTIVE for x in ins):
                k = ACTIVE
            elif (op in HEAVY_OPS and value) or (
                op in GATHER_OPS and len(ins) > 1 and kind[ins[0]] == STATIC and by_value[ins[1]]
            ):
                k = ACTIVE
                self.sources.append(i)
            else:
                k = DERIVED
            if k == ACTIVE and op in CONTROL_FLOW:
                raise GraphError(
                    f"{self.desc}: node {_label(node, i)} is control flow on the main path (it computes on the "
                    "model's activations), which the splitter cannot cut; export the model without data-dependent "
                    "control flow (tracing exporters such as torch.onnx.export(dynamo=False) unroll it)"
                )
            self.node_kind.append(k)
            for out in (o for o in node.output if o):
                kind[out], by_value[out] = k, value

    def _bitsets(self) -> None:
        n, outputs = len(self.nodes), set(self.outputs)
        consumers = [0] * n  # who reads a node's activations (bit n: a graph output)
        for i, node in enumerate(self.nodes):
            if self.node_kind[i] == ACTIVE:
                for out in (o for o in node.output if o):
                    consumers[i] |= sum(1 << j for j in self.consumers.get(out, [])) | ((out in outputs) << n)
        self.anc, self.escape = [0] * n, [0] * n  # escape: readers of the activations among strict ancestors
        for i in range(n):
            a, e = 1 << i, 0
            for r in {self.producer[x] for x in self.reads[i] if x in self.producer}:
                a, e = a | self.anc[r], e | self.escape[r] | consumers[r]
            self.anc[i], self.escape[i] = a, e
        self.source_bits = sum(1 << i for i in self.sources)
        self.heavy_bits = sum(1 << i for i, nd in enumerate(self.nodes) if nd.op_type in HEAVY_OPS)

    def cut_candidates(self) -> list[tuple[int, str]]:
        """(node index, tensor) of every cut vertex, in topological order."""
        found = []
        for i, node in enumerate(self.nodes):
            live = [o for o in node.output if o and (o in self.consumers or o in self.outputs)]
            if self.node_kind[i] != ACTIVE or len(live) != 1 or live[0] in self.outputs:
                continue
            if not (self.escape[i] | self.source_bits) & ~self.anc[i]:
                found.append((i, live[0]))
        return found

    def closure(self, targets: Sequence[str], stop: str | None) -> tuple[list[int], set[str], set[str]]:
        """Nodes computing `targets` from `stop`, graph inputs and constants; the graph inputs and
        the initializers they read."""
        nodes, inputs, inits, seen, stack = set(), set(), set(), {stop}, list(targets)
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            if name in self.init_protos:
                inits.add(name)
            elif name in self.input_info:
                inputs.add(name)
            elif self.producer[name] not in nodes:
                nodes.add(self.producer[name])
                stack.extend(self.reads[self.producer[name]])
        return sorted(nodes), inputs, inits

    def before(self, i: int, costs: np.ndarray) -> float:
        """The sum of `costs` over node i and its ancestors."""
        raw = np.frombuffer(self.anc[i].to_bytes(len(self.nodes) // 8 + 1, "little"), dtype=np.uint8)
        return float(costs[np.unpackbits(raw, bitorder="little")[: len(self.nodes)].astype(bool)].sum())


# ------------------------------------------------------------------------------ compute estimate


def _node_cost(node: onnx.NodeProto, shapes: Mapping[str, tuple[int, ...]]) -> float:
    """Estimated FLOPs: multiply-accumulates for MatMul/Gemm/Conv/attention, per element otherwise."""

    def shape(k: int) -> tuple[int, ...]:
        return shapes.get(node.input[k], ()) if len(node.input) > k else ()

    op, n_out = node.op_type, math.prod(shapes.get(node.output[0], ()) if node.output else ())
    attrs = {a.name: a for a in node.attribute}
    try:
        if op in ("MatMul", "FusedMatMul", "MatMulInteger", "QLinearMatMul"):
            return 2.0 * n_out * shape(0)[-1]
        if op == "Gemm":
            return 2.0 * n_out * shape(0)[0 if "transA" in attrs and attrs["transA"].i else 1]
        if op in ("Conv", "FusedConv", "ConvInteger", "QLinearConv"):
            return 2.0 * n_out * math.prod(shape(3 if op == "QLinearConv" else 1)[1:])
        if op == "ConvTranspose":
            return 2.0 * math.prod(shape(0)) * math.prod(shape(1)[1:])
        if op == "Einsum":
            terms = attrs["equation"].s.decode().replace(" ", "").split("->")[0].split(",")
            sizes = {c: d for term, k in zip(terms, range(len(node.input))) for c, d in zip(term, shape(k))}
            return 2.0 * math.prod(sizes.values()) if "..." not in terms[0] else 2.0 * n_out
        if op in ATTENTION_OPS:
            q, w = shape(0), shape(1)
            if op == "Attention" and len(w) == 2:  # com.microsoft: input [b, s, hidden], packed QKV weights
                return 2.0 * math.prod(q) * w[1] + 4.0 * math.prod(q) * q[-2]
            return 4.0 * math.prod(q) * w[-2]
    except (IndexError, KeyError, TypeError):
        pass
    reads_all = op.startswith("Reduce") or "Pool" in op  # reductions read more than they write
    return (max(n_out, math.prod(shape(0))) if reads_all else n_out) * ELEMENT_COST.get(op, 1.0)


# ------------------------------------------------------------------------------ running the model


def _session(model: onnx.ModelProto, optimize: bool = True) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = min(4, os.cpu_count() or 1)
    options.graph_optimization_level = ort.GraphOptimizationLevel(99 if optimize else 0)  # ENABLE_ALL / DISABLE_ALL
    if model.ByteSize() < EXTERNAL_DATA_BYTES:
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    with tempfile.TemporaryDirectory() as tmp:
        onnx.save_model(model, f"{tmp}/model.onnx", save_as_external_data=True, location="model.data")
        return ort.InferenceSession(f"{tmp}/model.onnx", options, providers=["CPUExecutionProvider"])


def _probe(g: _Graph, feeds: Mapping[str, np.ndarray], names: Sequence[str], hint: str = "") -> dict:
    """Values of `names` (node outputs or graph outputs) on `feeds`, from one unoptimised run."""
    probe = onnx.ModelProto()
    probe.CopyFrom(g.model)
    probe.graph.output.extend(onnx.ValueInfoProto(name=n) for n in dict.fromkeys(names) if n not in g.outputs)
    try:
        session = _session(probe, optimize=False)
        wanted = [o.name for o in session.get_outputs()]
        values = session.run(wanted, dict(feeds))
    except Exception as err:  # onnxruntime raises several unrelated types
        shapes = {k: list(v.shape) for k, v in feeds.items()}
        raise GraphError(f"{g.desc}: ONNX Runtime cannot run it on inputs of shapes {shapes}{hint}: {err}") from err
    return {n: v for n, v in zip(wanted, values) if isinstance(v, np.ndarray)}


def _feeds(g: _Graph, example: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
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


_EXAMPLES: dict[int, tuple[tuple, dict[str, tuple[tuple[int, ...], np.dtype]], int | None]] = {}
"""Shapes of the example inputs and the seq_axis last given to find_cuts for a model (by id)."""


def _remembered(model: onnx.ModelProto) -> tuple | None:
    """(input shapes and dtypes, seq_axis) last given to find_cuts for this model, if any."""
    entry = _EXAMPLES.get(id(model))
    return entry[1:] if entry and entry[0] == (len(model.graph.node), model.graph.name) else None


def _synthetic_feeds(g: _Graph, free: set[int | None] | None) -> dict[str, np.ndarray]:
    """Zero-filled inputs: the shapes of the last example given to find_cuts for this model, else the
    declared shapes with SYNTH_BATCH rows and SYNTH_FREE on the free axes in `free` (None: any)."""
    remembered = _remembered(g.model)
    if remembered:
        return {k: np.zeros(shape, dtype) for k, (shape, dtype) in remembered[0].items()}
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


def _free_dims(g: _Graph, feeds: Mapping, names: Sequence[str], seq_axis: int | None, first: Mapping) -> dict:
    """Every tensor of `names` with its free axes named, from a second run with one more row (a copy
    of the first) and one position fewer: axis 0 must follow the batch, any other axis that changes
    must follow the sequence length; None for a tensor that does not."""
    batch = next(iter(feeds.values())).shape[0]
    seq_len = _seq_len(feeds, seq_axis)
    if seq_axis is not None and seq_len < 2:
        raise GraphError(f"{g.desc}: example inputs with {seq_len} positions on axis {seq_axis}; give at least 2")
    second_feeds = {}
    for name, a in feeds.items():
        a = np.concatenate([a, a[:1]], axis=0)
        if seq_axis is not None and a.ndim > seq_axis and a.shape[seq_axis] == seq_len:
            a = np.take(a, np.arange(seq_len - 1), axis=seq_axis)
        second_feeds[name] = a
    hint = " (with one more row and one position fewer: export the model with free batch and sequence axes)"
    second = _probe(g, second_feeds, names, hint)
    dims: dict[str, tuple | None] = {}
    for name in names:
        one, two = (first[name].shape, second[name].shape) if name in first and name in second else ((), ())
        named = [int(a) if a == b else "seq" if (a, b) == (seq_len, seq_len - 1) else "?" for a, b in zip(one, two)]
        ok = len(one) == len(two) > 0 and (one[0], two[0]) == (batch, batch + 1) and "?" not in named[1:]
        dims[name] = ("batch", *named[1:]) if ok else None
    return dims


def _seq_len(feeds: Mapping[str, np.ndarray], seq_axis: int | None) -> int:
    return next((a.shape[seq_axis] for a in feeds.values() if a.ndim > seq_axis), 0) if seq_axis is not None else 0


def _check_outputs(g: _Graph, dims: Mapping[str, tuple | None], values: Mapping[str, np.ndarray]) -> None:
    for name in g.outputs:
        value, named = values.get(name), dims.get(name)
        if value is None or value.dtype.kind != "f" or named is None or len(named) != 2 or value.shape[1] < 2:
            shape = f"shape {list(value.shape)} of {value.dtype.name}" if value is not None else "no tensor value"
            raise GraphError(
                f"{g.desc}: output {name!r} has {shape} (free axes: {named}); a classifier must output class scores "
                "[batch, classes] (float, 2 or more classes, axis 0 following the batch): export the model with its "
                "classification head (logits), not hidden states, pooled features or class indices"
            )


# ------------------------------------------------------------------------------ finding the cuts


def load_model(path: str | Path, example_inputs: Mapping[str, np.ndarray] | None = None) -> onnx.ModelProto:
    """Read an ONNX classifier and check it: a readable model, no control flow on the main path, every
    output class scores [batch, classes] (run on `example_inputs`; without them, on zero-filled inputs
    of the declared shapes with SYNTH_FREE for free axes, when the model runs on those)."""
    where = Path(path)
    if not where.is_file():
        raise GraphError(f"{where}: no such file")
    try:
        model = onnx.load(str(where))
    except Exception as err:  # protobuf's DecodeError, a missing external data file, ...
        raise GraphError(f"{where}: not an ONNX file ({type(err).__name__}: {err})") from err
    if not model.graph.node or not model.graph.output or not model.opset_import:
        raise GraphError(f"{where}: not an ONNX model (no graph with nodes and outputs)")
    try:
        onnx.checker.check_model(model if model.ByteSize() < EXTERNAL_DATA_BYTES else str(where))
    except (onnx.checker.ValidationError, ValueError) as err:
        raise GraphError(f"{where}: invalid ONNX model: {err}") from err
    model.metadata_props.add(key="exitplan.source", value=str(where))
    g = _Graph(model)
    feeds = _feeds(g, example_inputs) if example_inputs is not None else _synthetic_feeds(g, None)
    try:
        values = _probe(g, feeds, g.outputs)
        dims = _free_dims(g, feeds, g.outputs, None, values)
    except GraphError:
        if example_inputs is not None:
            raise
        return model  # zero-filled inputs did not fit (e.g. free image sizes): find_cuts checks on the data
    _check_outputs(g, dims, values)
    return model


def _all_cuts(model: onnx.ModelProto, example: Mapping, seq_axis: int | None) -> tuple[_Graph, list[Cut]]:
    """Every cut vertex with a usable layout, chains of equivalent cuts merged (not filtered)."""
    g = _Graph(model)
    feeds = _feeds(g, example)
    shapes = {k: (v.shape, v.dtype) for k, v in feeds.items()}
    _EXAMPLES[id(model)] = ((len(model.graph.node), model.graph.name), shapes, seq_axis)
    values = _probe(g, feeds, [o for nd in g.nodes for o in nd.output if o])
    shapes = {n: tuple(v.shape) for n, v in (values | feeds).items()} | {
        n: tuple(t.dims) for n, t in g.init_protos.items()
    }
    candidates = g.cut_candidates()
    dims = _free_dims(g, feeds, [t for _, t in candidates] + g.outputs, seq_axis, values)
    _check_outputs(g, dims, values)
    costs = np.array([0.0 if k == STATIC else _node_cost(nd, shapes) for nd, k in zip(g.nodes, g.node_kind)])
    total = float(costs.sum()) or 1.0
    cuts = []
    for i, tensor in candidates:
        named, node = dims[tensor], g.nodes[i]
        seq = [a for a, d in enumerate(named or ()) if d == "seq"]
        if named is None or len(named) < 2 or seq not in ([], [1]) or (seq and len(named) < 3):
            continue  # axis 0 is not the batch, or a layout no ramp pools ([batch], [batch, seq], seq elsewhere)
        kind: Kind = "sequence" if seq else "vector" if len(named) == 2 else "spatial"
        before = g.before(i, costs) / total
        cuts.append(
            Cut(tensor, i, shapes[tensor], named, values[tensor].dtype.name, before, kind, node.name, node.op_type)
        )
    return g, _merge(g, cuts)


def _merge(g: _Graph, cuts: list[Cut]) -> list[Cut]:
    """Of each chain of cuts with no MatMul/Conv/... between consecutive ones (Add -> LayerNorm,
    Conv -> ReLU -> Pad, Reshape/Identity renames), keep the smallest tensor (the latest on ties)."""
    groups: list[list[Cut]] = []
    for cut in cuts:
        if groups and not (g.anc[cut.index] & ~g.anc[groups[-1][-1].index]) & g.heavy_bits:
            groups[-1].append(cut)
        else:
            groups.append([cut])
    return [min(reversed(group), key=lambda c: math.prod(c.shape)) for group in groups]


def find_cuts(
    model: onnx.ModelProto,
    example_inputs: Mapping[str, np.ndarray],
    *,
    seq_axis: int | None = None,
    seq_len: int | None = None,
    margin: float = 0.02,
) -> list[Cut]:
    """The cut vertices of `model` in topological order, shapes from a run on `example_inputs` (a few
    rows; axis 0 stays free), except those with compute_before < margin or > 1 - margin. With
    `seq_axis` (the inputs' sequence axis; `seq_len`, when given, must be the example's length), an
    activation axis that follows the sequence length is named "seq"."""
    if seq_axis is not None and seq_len is not None and seq_len != _seq_len(example_inputs, seq_axis):
        raise GraphError(f"seq_len {seq_len} is not the length of the example inputs on axis {seq_axis}")
    _, cuts = _all_cuts(model, example_inputs, seq_axis)
    return [c for c in cuts if margin <= c.compute_before <= 1.0 - margin]


def spread(cuts: Sequence[Cut], k: int) -> list[Cut]:
    """Up to `k` cuts spread evenly by compute_before: the nearest unused cut to each of the targets
    1/(k+1), ..., k/(k+1); in topological order."""
    if k >= len(cuts):
        return sorted(cuts, key=lambda c: c.index)
    chosen: list[Cut] = []
    for target in np.arange(1, max(k, 0) + 1) / (k + 1):
        rest = [c for c in cuts if c not in chosen]
        chosen.append(min(rest, key=lambda c: (abs(c.compute_before - target), c.index)))
    return sorted(chosen, key=lambda c: c.index)


def no_cut_message(
    model: onnx.ModelProto, example_inputs: Mapping[str, np.ndarray] | None = None, *, seq_axis: int | None = None
) -> str:
    """Why `find_cuts` found nothing, for the user: the cut vertices too close to the ends, or else where
    the graph is narrowest and what crosses there. Defaults: the example and seq_axis last given to find_cuts."""
    g = _Graph(model)
    remembered = _remembered(model)
    seq_axis = remembered[1] if seq_axis is None and remembered else seq_axis
    head = f"{g.desc}: no place to split the model into blocks for early exits"
    candidates = g.cut_candidates()
    if candidates:
        try:
            _, cuts = _all_cuts(model, example_inputs or _synthetic_feeds(g, None), seq_axis)
            listed = ", ".join(f"{c.tensor!r} at {c.compute_before:.1%} of the compute" for c in cuts[:8])
        except GraphError:
            listed = ", ".join(repr(t) for _, t in candidates[:8])
        return (
            f"{head}: its cut vertices ({listed or 'none with a [batch, ...] layout'}) lie within 2% of the "
            "compute of the input or the output, or their activations are not [batch, ...] tensors"
        )
    if not g.sources:
        return f"{head}: no node computes on the data (no MatMul, Gemm, Conv, attention or embedding lookup)"
    last = {o: max(g.consumers.get(o, [-1]) + [len(g.nodes)] * (o in g.outputs)) for o in g.producer}
    live: set[str] = set()
    best: tuple[int, int, list[str], list[int]] | None = None
    for i, node in enumerate(g.nodes):
        if g.node_kind[i] == ACTIVE:
            live = {t for t in live | {o for o in node.output if o} if last[t] > i}
            later = [s for s in g.sources if s > i]
            if live and not live & set(g.outputs) and (best is None or len(live) + len(later) < best[0]):
                best = (len(live) + len(later), i, sorted(live), later)
    if best is None:
        return f"{head}: every activation feeds the output directly"
    _, i, names, later = best
    starts = ", ".join(_label(g.nodes[s], s) for s in later[:4])
    return (
        f"{head}: at its narrowest, after node {_label(g.nodes[i], i)}, {len(names)} computed tensor(s) cross "
        f"({', '.join(map(repr, names[:6]))})"
        + (f" and {len(later)} branch(es) start from the inputs later ({starts})" if later else "")
        + ": no single tensor carries the whole computation (parallel branches from the inputs joined only at the "
        "end, or a connection that skips from near the input to near the output)"
    )
