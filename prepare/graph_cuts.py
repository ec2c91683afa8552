"""Cut vertices of an ONNX classifier (Apparate); exitplan.prepare.graph_split splits the graph there.

A *cut* is an activation T whose ancestors hold every source and leave no other activation to a node
outside them (nor as a graph output): after them the rest of the graph reads only T, graph inputs,
constants and input-derived tensors, which the next block recomputes from the graph inputs (the
classes of tensors: exitplan.prepare.onnx_graph). Ancestor bitsets make the test independent of the
node order: the inside of a residual or attention block is never a cut, the sum after it is. This
module owns the search: reading and checking the model, the compute estimate that places each cut,
merging equivalent cuts, spreading a few over the compute, and saying why there is none. Only onnx,
onnxruntime and numpy here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import onnx

from exitplan.prepare.onnx_graph import (
    ACTIVE,
    ATTENTION_OPS,
    EXTERNAL_DATA_BYTES,
    STATIC,
    Graph,
    GraphError,
    label,
)
from exitplan.prepare.onnx_probe import (
    check_feeds,
    check_outputs,
    free_dims,
    probe,
    remember_example,
    remembered,
    synthetic_feeds,
)
from exitplan.prepare.onnx_probe import (
    seq_len as example_seq_len,
)

__all__ = [
    "Cut",
    "GraphError",
    "check_classifier",
    "find_cuts",
    "load_model",
    "no_cut_message",
    "node_cost",
    "read_model",
    "spread",
]

# estimated FLOPs per output element of ops that are not multiply-accumulates (others: 1)
ELEMENT_COST = {"Softmax": 5.0, "LayerNormalization": 8.0, "Erf": 5.0, "Exp": 3.0, "Tanh": 3.0, "Sigmoid": 3.0}
Kind = Literal["sequence", "spatial", "vector"]


@dataclass(frozen=True)
class Cut:
    """A tensor at which the graph can be cut: the only activation crossing the boundary. `index`: position
    of its node in the graph's (topological) order; `shape`: on the example inputs (batch as given); `dims`:
    the shape with free axes named ("batch" = axis 0, "seq"), every other axis concrete; `dtype`: numpy name;
    `compute_before`: fraction of the model's estimated compute done before the cut, in [0, 1]; `kind`:
    "sequence" [batch, seq, ...], "spatial" [batch, C, ...] (pool over axes 2..), "vector" [batch, features];
    `model_flops`: the estimate of the whole model's compute per sample of the example (FLOPs)."""

    tensor: str
    index: int
    shape: tuple[int, ...]
    dims: tuple[int | str, ...]
    dtype: str
    compute_before: float
    kind: Kind
    node: str
    op: str
    model_flops: float = 0.0


# ------------------------------------------------------------------------------ compute estimate


def node_cost(node: onnx.NodeProto, shapes: Mapping[str, tuple[int, ...]]) -> float:
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


# ------------------------------------------------------------------------------ finding the cuts


def read_model(path: str | Path) -> onnx.ModelProto:
    """Read an ONNX model and check it is one ONNX accepts; its path is recorded for messages."""
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
    return model


def check_classifier(model: onnx.ModelProto, example_inputs: Mapping[str, np.ndarray] | None = None) -> None:
    """No control flow on the main path and every output class scores [batch, classes] (run on
    `example_inputs`; without them, on zero-filled inputs of the declared shapes with SYNTH_FREE for
    free axes, when the model runs on those: find_cuts checks on the data otherwise)."""
    g = Graph(model)
    feeds = check_feeds(g, example_inputs) if example_inputs is not None else synthetic_feeds(g, None)
    try:
        values = probe(g, feeds, g.outputs)
        dims = free_dims(g, feeds, g.outputs, None, values)
    except GraphError:
        if example_inputs is not None:
            raise
        return
    check_outputs(g, dims, values)


def load_model(path: str | Path, example_inputs: Mapping[str, np.ndarray] | None = None) -> onnx.ModelProto:
    """Read an ONNX classifier and check it (read_model, then check_classifier)."""
    model = read_model(path)
    check_classifier(model, example_inputs)
    return model


def _all_cuts(
    model: onnx.ModelProto, example: Mapping[str, np.ndarray], seq_axis: int | None
) -> tuple[Graph, list[Cut]]:
    """Every cut vertex with a usable layout, chains of equivalent cuts merged (not filtered)."""
    g = Graph(model)
    feeds = check_feeds(g, example)
    remember_example(model, feeds, seq_axis)
    values = probe(g, feeds, [o for nd in g.nodes for o in nd.output if o])
    shapes = {n: tuple(v.shape) for n, v in (values | feeds).items()} | {
        n: tuple(t.dims) for n, t in g.init_protos.items()
    }
    candidates = g.cut_candidates()
    dims = free_dims(g, feeds, [t for _, t in candidates] + g.outputs, seq_axis, values)
    check_outputs(g, dims, values)
    costs = np.array([0.0 if k == STATIC else node_cost(nd, shapes) for nd, k in zip(g.nodes, g.node_kind)])
    total = float(costs.sum()) or 1.0
    cuts = []
    for i, tensor in candidates:
        named, node = dims[tensor], g.nodes[i]
        seq = [a for a, d in enumerate(named or ()) if d == "seq"]
        if named is None or len(named) < 2 or seq not in ([], [1]) or (seq and len(named) < 3):
            continue  # axis 0 is not the batch, or a layout no ramp pools ([batch], [batch, seq], seq elsewhere)
        kind: Kind = "sequence" if seq else "vector" if len(named) == 2 else "spatial"
        before = g.before(i, costs) / total
        dtype, per_sample = values[tensor].dtype.name, total / max(1, next(iter(feeds.values())).shape[0])
        cuts.append(Cut(tensor, i, shapes[tensor], named, dtype, before, kind, node.name, node.op_type, per_sample))
    return g, _merge(g, cuts)


def _merge(g: Graph, cuts: list[Cut]) -> list[Cut]:
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
    if seq_axis is not None and seq_len is not None and seq_len != example_seq_len(example_inputs, seq_axis):
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
    g = Graph(model)
    known = remembered(model)
    seq_axis = known[1] if seq_axis is None and known else seq_axis
    head = f"{g.desc}: no place to split the model into blocks for early exits"
    candidates = g.cut_candidates()
    if candidates:
        try:
            _, cuts = _all_cuts(model, example_inputs or synthetic_feeds(g, None), seq_axis)
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
    starts = ", ".join(label(g.nodes[s], s) for s in later[:4])
    return (
        f"{head}: at its narrowest, after node {label(g.nodes[i], i)}, {len(names)} computed tensor(s) cross "
        f"({', '.join(map(repr, names[:6]))})"
        + (f" and {len(later)} branch(es) start from the inputs later ({starts})" if later else "")
        + ": no single tensor carries the whole computation (parallel branches from the inputs joined only at the "
        "end, or a connection that skips from near the input to near the output)"
    )
