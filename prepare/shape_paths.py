"""Side paths that read an activation only for its shape, rewritten to read the graph inputs' shapes.

Exporters read the hidden state for its size: a TorchScript export of BERT builds the attention mask
from `Shape(embeddings)`, DeBERTa-v2 takes `Shape(hidden)` once at the encoder and uses it in every
layer, and `zeros_like(x)` becomes `ConstantOfShape(Shape(x))`. Such a `Shape` reads an activation, so
everything after it would count as the main path and no tensor between layers would be a cut vertex.
But each axis of that activation is a constant, the batch, the sequence length or a product of them,
so the value can be computed from the graph inputs instead: this module owns that rewrite. Every
`Shape` and `Size` of an activation whose axes all fit `c * batch^p * seq^q` (p, q in {0, 1}, c a
whole number; fitted on the example inputs grown by one and by two rows and shrunk by one and two
positions) becomes a `Concat` of such terms computed from the inputs' `Shape`s, and `CastLike(x, A)`
of an activation `A` becomes `Cast(x, to=A's type)`. The side path is then input-derived, and each
block recomputes it from the graph inputs, as it does the attention mask. The rewritten model must
give the same outputs on the examples, or the original is kept. When a block is split off, the graph
inputs' sizes it needs are read from the state it receives (`dims_from_state`), so no input travels
between blocks only for its shape. Only onnx, onnxruntime and numpy here.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from exitplan.prepare.onnx_graph import ACTIVE, Graph, GraphError
from exitplan.prepare.onnx_probe import check_feeds, grown_feeds, probe, seq_len

__all__ = ["SHAPE_READERS", "Term", "detach_shape_reads", "dims_from_state", "fit_axis"]

SHAPE_READERS = {"Shape": 0, "Size": 0, "CastLike": 1}
"""Operators that read one input only for its shape or type: op -> the position of that input."""
PREFIX = "exitplan_shape"

Term = tuple[int, int, int]
"""An axis size as (c, p, q): c * batch**p * seq**q."""


def fit_axis(sizes: list[int], batches: list[int], lengths: list[int] | None) -> Term | None:
    """The simplest (c, p, q) that gives `sizes` on runs with `batches` rows and `lengths` positions
    (None: no sequence axis), or None."""
    for p, q in ((0, 0), (1, 0), (0, 1), (1, 1)):
        if q and lengths is None:
            continue
        bases = [b**p * (lengths[k] if q else 1) for k, b in enumerate(batches)] if lengths else [b**p for b in batches]
        if bases[0] == 0 or sizes[0] % bases[0]:
            continue
        c = sizes[0] // bases[0]
        if all(size == c * base for size, base in zip(sizes, bases, strict=True)):
            return c, p, q
    return None


def _readers(g: Graph) -> list[int]:
    """Nodes that read an activation only for its shape or type (and nothing else that is one)."""
    found = []
    for i, node in enumerate(g.nodes):
        at = SHAPE_READERS.get(node.op_type)
        if at is None or len(node.input) <= at or g.kind.get(node.input[at]) != ACTIVE:
            continue
        if not any(g.kind.get(x) == ACTIVE for k, x in enumerate(node.input) if k != at):
            found.append(i)
    return found


Run = tuple[int, int | None, dict[str, np.ndarray]]
"""(batch, sequence length (None: no sequence axis), values of the probed tensors) of one run."""


def _runs(g: Graph, feeds: dict[str, np.ndarray], seq_axis: int | None, names: list[str]) -> list[Run]:
    """(batch, sequence length, values of `names`) on the examples as given and grown by 1 and 2."""
    length = seq_len(feeds, seq_axis) if seq_axis is not None else 0
    runs: list[Run] = []
    for step in (0, 1, 2):
        if seq_axis is not None and length - step < 1:
            break
        grown = grown_feeds(feeds, seq_axis, step) if step else feeds
        batch = next(iter(grown.values())).shape[0]
        try:
            values = probe(g, grown, names)
        except GraphError:
            if step == 0:
                raise
            break
        runs.append((batch, length - step if seq_axis is not None else None, values))
    return runs


class _Builder:
    """New nodes and initializers computing axis sizes from the graph inputs' shapes, one of each term."""

    def __init__(self, g: Graph, feeds: Mapping[str, np.ndarray], seq_axis: int | None) -> None:
        used = {n for node in g.nodes for n in (*node.input, *node.output)} | set(g.init_protos) | set(g.input_info)
        self.used, self.count = used, itertools.count()
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.terms: dict[Term, str] = {}
        self.dims: dict[str, str] = {}
        length = seq_len(feeds, seq_axis)
        batch_input = g.inputs[0]
        seq_input = next(
            (n for n, a in feeds.items() if seq_axis is not None and a.ndim > seq_axis and a.shape[seq_axis] == length),
            None,
        )
        self.axes: dict[str, tuple[str | None, int | None]] = {"b": (batch_input, 0), "s": (seq_input, seq_axis)}

    def name(self, what: str) -> str:
        while True:
            candidate = f"{PREFIX}/{what}_{next(self.count)}"
            if candidate not in self.used:
                self.used.add(candidate)
                return candidate

    def const(self, values: list[int]) -> str:
        name = self.name("const")
        self.inits.append(numpy_helper.from_array(np.asarray(values, dtype=np.int64), name))
        return name

    def _dim(self, key: str) -> str:
        """[1] int64: the batch ("b") or the sequence length ("s") of the graph inputs."""
        if key not in self.dims:
            source, axis = self.axes[key]
            if source is None or axis is None:  # a term in the sequence length needs an input with that axis
                raise GraphError(f"no graph input has the sequence axis ({axis}) the shape reads follow")
            shape, out = self.name("shape"), self.name(key)
            self.nodes.append(helper.make_node("Shape", [source], [shape], name=shape))
            self.nodes.append(helper.make_node("Gather", [shape, self.const([axis])], [out], name=out, axis=0))
            self.dims[key] = out
        return self.dims[key]

    def term(self, term: Term) -> str:
        """[1] int64: c * batch**p * seq**q."""
        if term in self.terms:
            return self.terms[term]
        c, p, q = term
        if not p and not q:
            self.terms[term] = self.const([c])
            return self.terms[term]
        factors = [self._dim(k) for k, used in (("b", p), ("s", q)) if used]
        if c != 1:
            factors.append(self.const([c]))
        out = factors[0]
        for factor in factors[1:]:
            product = self.name("mul")
            self.nodes.append(helper.make_node("Mul", [out, factor], [product], name=product))
            out = product
        self.terms[term] = out
        return out


def _replacement(
    node: onnx.NodeProto, terms: list[Term] | None, dtype: np.dtype[Any], b: _Builder
) -> list[onnx.NodeProto]:
    """The nodes that compute `node`'s output from the terms of its activation's axes (None: keep it)."""
    if node.op_type == "CastLike":
        to = helper.np_dtype_to_tensor_dtype(dtype)
        return [helper.make_node("Cast", [node.input[0]], list(node.output), name=node.name, to=to)]
    if terms is None:
        return [node]
    attrs = {a.name: a.i for a in node.attribute}
    axes = list(range(len(terms)))
    if node.op_type == "Shape":
        axes = axes[attrs.get("start", 0) : attrs["end"] if "end" in attrs else None]
    pieces = [b.term(terms[a]) for a in axes]
    if not pieces:
        pieces = [b.const([])]
    out = node.output[0]
    if node.op_type == "Size":
        joined = b.name("dims")
        return [
            helper.make_node("Concat", pieces, [joined], name=f"{node.name}/dims", axis=0),
            helper.make_node("ReduceProd", [joined], [out], name=node.name, keepdims=0),
        ]
    return [helper.make_node("Concat", pieces, [out], name=node.name, axis=0)]


def _same_outputs(
    original: Graph, rewritten: onnx.ModelProto, feeds: dict[str, np.ndarray], seq_axis: int | None
) -> bool:
    graph = Graph(rewritten)
    for example in (feeds, grown_feeds(feeds, seq_axis)):
        try:
            want, got = probe(original, example, original.outputs), probe(graph, example, graph.outputs)
        except GraphError:
            return False
        for name in original.outputs:
            if want[name].shape != got[name].shape or not np.allclose(want[name], got[name], rtol=1e-5, atol=1e-6):
                return False
    return True


def detach_shape_reads(
    model: onnx.ModelProto, example_inputs: Mapping[str, np.ndarray], seq_axis: int | None
) -> tuple[onnx.ModelProto, int]:
    """`model` with its shape reads of activations rewritten (see the module docstring), and how many
    nodes were rewritten (0: `model` itself is returned). `example_inputs`: a few rows, as for find_cuts."""
    g = Graph(model)
    readers = _readers(g)
    if not readers:
        return model, 0
    feeds = check_feeds(g, example_inputs)
    targets = sorted({g.nodes[i].input[SHAPE_READERS[g.nodes[i].op_type]] for i in readers})
    runs = _runs(g, feeds, seq_axis, targets)
    if len(runs) < 2:
        return model, 0
    batches = [r[0] for r in runs]
    # with a sequence axis every run has a length
    lengths = [r[1] for r in runs if r[1] is not None] if seq_axis is not None else None
    builder = _Builder(g, feeds, seq_axis)
    replaced: dict[int, list[onnx.NodeProto]] = {}
    for i in readers:
        node = g.nodes[i]
        target = node.input[SHAPE_READERS[node.op_type]]
        shapes = [r[2][target].shape for r in runs]
        if len({len(s) for s in shapes}) != 1:
            continue
        terms = [fit_axis([s[a] for s in shapes], batches, lengths) for a in range(len(shapes[0]))]
        fitted = [t for t in terms if t is not None]
        new = _replacement(node, fitted if len(fitted) == len(terms) else None, runs[0][2][target].dtype, builder)
        if new != [node]:
            replaced[i] = new
    if not replaced:
        return model, 0
    nodes = list(builder.nodes)
    for i, node in enumerate(g.nodes):
        nodes.extend(replaced.get(i, [node]))
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    del rewritten.graph.node[:]
    rewritten.graph.node.extend(nodes)
    rewritten.graph.initializer.extend(builder.inits)
    if not _same_outputs(g, rewritten, feeds, seq_axis):
        return model, 0
    return rewritten, len(replaced)


def _state_shape(
    node: onnx.NodeProto, axes: Sequence[int | str], state: str, named: Sequence[int | str]
) -> list[onnx.NodeProto] | None:
    """Nodes computing `node`'s output (a Shape of a graph input whose axes are `axes`: "batch", "seq" or
    sizes) from the shape of `state` (axes `named`); None when the state lacks one of the free axes."""
    attrs = {a.name: a.i for a in node.attribute}
    chosen = list(axes)[attrs.get("start", 0) : attrs["end"] if "end" in attrs else None]
    if any(isinstance(a, str) and a not in named for a in chosen):
        return None
    out, shape = node.output[0], f"{node.output[0]}/of_state"
    index = [list(named).index(a) if isinstance(a, str) else -1 for a in chosen]
    nodes = [helper.make_node("Shape", [state], [shape], name=shape)]
    # gather the state's axes (a fixed size is gathered from axis 0 and overwritten by Where below)
    picks = helper.make_tensor(f"{out}/picks", onnx.TensorProto.INT64, [len(index)], [max(i, 0) for i in index])
    fixed = helper.make_tensor(
        f"{out}/fixed", onnx.TensorProto.INT64, [len(index)], [0 if isinstance(a, str) else a for a in chosen]
    )
    take = helper.make_tensor(f"{out}/take", onnx.TensorProto.BOOL, [len(index)], [i >= 0 for i in index])
    for t in (picks, fixed, take):
        nodes.append(helper.make_node("Constant", [], [t.name], name=t.name, value=t))
    nodes.append(helper.make_node("Gather", [shape, picks.name], [f"{out}/gathered"], name=f"{out}/gathered", axis=0))
    nodes.append(helper.make_node("Where", [take.name, f"{out}/gathered", fixed.name], [out], name=f"{out}/from_state"))
    return nodes


def dims_from_state(
    nodes: list[onnx.NodeProto], state: str, named: Sequence[int | str], inputs: Mapping[str, Sequence[int | str]]
) -> list[onnx.NodeProto]:
    """A block's `nodes` (computing its outputs from the tensor `state`, whose axes are `named`: "batch",
    "seq" or sizes) where every `Shape` of a graph input (`inputs`: their axes, named the same way) reads
    the shape of `state` instead, when the state has the input's free axes: a later block then reads a
    graph input only where it needs its values (a mask), never only for its size (the rewrite above reads
    the inputs' shapes, and so do dynamo exports), and nothing more travels between blocks."""
    kept: list[onnx.NodeProto] = []
    for node in nodes:
        source = node.input[0] if node.op_type == "Shape" and node.input else None
        replaced = _state_shape(node, inputs[source], state, named) if source is not None and source in inputs else None
        kept.extend(replaced or [node])
    return kept
