"""An ONNX graph as the splitter sees it (exitplan.prepare.graph_cuts, graph_split, shape_paths): its
nodes in topological order, who writes and who reads every tensor, the class of every tensor and the
ancestor bitsets the cut test reads. Only onnx and numpy here.

Tensors are *static* (initializers, constants, what is computed from them alone), *input-derived*
(computed from graph inputs and constants without touching the data stream: an extended attention
mask, position ids, a padded input) or *activations*. The stream starts at *source* nodes (a
MatMul/Gemm/Conv/attention/RNN on input values, or an embedding lookup: a Gather of a constant
table by input values, not by shape-derived indices) and whatever reads an activation is one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx

__all__ = [
    "ACTIVE",
    "ATTENTION_OPS",
    "CONTROL_FLOW",
    "DERIVED",
    "EXTERNAL_DATA_BYTES",
    "GATHER_OPS",
    "HEAVY_OPS",
    "STATIC",
    "Graph",
    "GraphError",
    "describe",
    "label",
    "subgraph_reads",
]

STATIC, DERIVED, ACTIVE = 0, 1, 2
CONTROL_FLOW = {"If", "Loop", "Scan", "SequenceMap"}
ATTENTION_OPS = {"Attention", "MultiHeadAttention", "GroupQueryAttention"}
HEAVY_OPS = {"MatMul", "Gemm", "FusedMatMul", "MatMulInteger", "QLinearMatMul", "Einsum", "LSTM", "GRU", "RNN"}
HEAVY_OPS |= {"Conv", "ConvTranspose", "FusedConv", "ConvInteger", "QLinearConv", "EmbedLayerNormalization"}
HEAVY_OPS |= ATTENTION_OPS
GATHER_OPS = {"Gather", "GatherElements", "GatherND"}
EXTERNAL_DATA_BYTES = 1_800_000_000
"""Models at least this large are saved with their weights in a separate file (protobuf's 2 GB limit)."""


class GraphError(ValueError):
    """A model the splitter cannot handle; the message names the file and what is wrong."""


def label(node: onnx.NodeProto, index: int) -> str:
    """A node as messages name it: its name, else its position, with its operator."""
    return f"{node.name!r} ({node.op_type})" if node.name else f"#{index} ({node.op_type})"


def describe(model: onnx.ModelProto) -> str:
    """What messages call the model: the file it was read from (load_model records it), else its graph's name."""
    found = [p.value for p in model.metadata_props if p.key == "exitplan.source"]
    return found[0] if found else f"ONNX model {model.graph.name!r}"


def subgraph_reads(node: onnx.NodeProto) -> set[str]:
    """Outer-scope names that the subgraphs of a control-flow node read."""
    found: set[str] = set()
    for attr in node.attribute:
        for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
            defined = {v.name for v in sub.input} | {t.name for t in sub.initializer}
            used: set[str] = {o.name for o in sub.output}
            for inner in sub.node:
                defined.update(inner.output)
                used.update(x for x in inner.input if x)
                used |= subgraph_reads(inner)
            found |= used - defined
    return found


class Graph:
    """The nodes (ONNX keeps them in topological order), the class of every tensor, ancestor bitsets."""

    def __init__(self, model: onnx.ModelProto) -> None:
        g = model.graph
        self.model, self.desc = model, describe(model)
        if g.sparse_initializer:
            raise GraphError(f"{self.desc}: sparse initializers are not supported; store them dense")
        self.init_protos = {t.name: t for t in g.initializer}
        self.inputs = [v.name for v in g.input if v.name not in self.init_protos]
        self.input_info = {v.name: v for v in g.input}
        self.outputs = [v.name for v in g.output]
        self.nodes = list(g.node)
        self.reads = [[x for x in n.input if x] + sorted(subgraph_reads(n)) for n in self.nodes]
        self.producer: dict[str, int] = {}
        self.consumers: dict[str, list[int]] = {}
        known = set(self.input_info) | set(self.init_protos)
        for i, node in enumerate(self.nodes):
            for name in dict.fromkeys(self.reads[i]):
                if name not in known:
                    raise GraphError(f"{self.desc}: node {label(node, i)} reads {name!r} before anything writes it")
                self.consumers.setdefault(name, []).append(i)
            for out in (o for o in node.output if o):
                if out in known:
                    raise GraphError(f"{self.desc}: tensor {out!r} is written twice (node {label(node, i)})")
                known.add(out)
                self.producer[out] = i
        self.kind: dict[str, int] = {}
        """The class of every tensor: STATIC, DERIVED or ACTIVE."""
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
                    f"{self.desc}: node {label(node, i)} is control flow on the main path (it computes on the "
                    "model's activations), which the splitter cannot cut; export the model without data-dependent "
                    "control flow (tracing exporters such as torch.onnx.export(dynamo=False) unroll it)"
                )
            self.node_kind.append(k)
            for out in (o for o in node.output if o):
                kind[out], by_value[out] = k, value
        self.kind = kind

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
        """(node index, tensor) of every cut vertex, in topological order: an activation whose ancestors
        hold every source and leave no other activation to a node outside them (nor as a graph output)."""
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
