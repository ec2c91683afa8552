"""The token vocabulary a text bundle accepts: how many token ids its model can run.

The manifest does not say it; two parts of the bundle do. The tokenizer file knows its vocabulary
(added tokens included), and the first block's ONNX graph looks token ids up in an embedding table:
a `Gather` whose data is an initializer (the table, [vocab, hidden]) and whose indices are the token
input (directly, or through Cast / Identity / Reshape-like nodes that keep the values). An id past
the table's rows makes ONNX Runtime's CPU Gather fail (CUDA's reads zeros), so the router refuses
ids outside the smaller of the two before they join a batch.

The ONNX file is read with a minimal protocol-buffer reader (the data plane does not depend on the
`onnx` package): only the graph's nodes and the names and dims of its initializers are decoded;
weights (`raw_data`) are skipped without being read, and the file is memory-mapped.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from exitplan.api.bundle import BundleManifest

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TOKEN_INPUT = "input_ids"
_VALUE_KEEPING = frozenset({"Cast", "Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten"})
"""Ops whose output holds the same token ids as their first input."""

# Field numbers of onnx.proto (ModelProto.graph, GraphProto.node / initializer, NodeProto.input /
# output / op_type / attribute, AttributeProto.name / t, TensorProto.dims / name).
_MODEL_GRAPH = 7
_GRAPH_NODE, _GRAPH_INITIALIZER = 1, 5
_NODE_INPUT, _NODE_OUTPUT, _NODE_OP_TYPE, _NODE_ATTRIBUTE = 1, 2, 4, 5
_ATTR_NAME, _ATTR_TENSOR = 1, 5
_TENSOR_DIMS, _TENSOR_NAME = 1, 8


class OnnxReadError(ValueError):
    """Bytes that are not a well-formed ONNX protocol buffer."""


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf):
            raise OnnxReadError("a varint runs past the end of the message")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise OnnxReadError("a varint is longer than 10 bytes")


def _fields(buf: memoryview) -> Iterator[tuple[int, int, int | memoryview]]:
    """(field number, wire type, value) of each field of one message: an int for varints and fixed
    widths, a view of the bytes for length-delimited fields."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
            yield number, wire, value
        elif wire == 2:
            length, pos = _varint(buf, pos)
            if pos + length > len(buf):
                raise OnnxReadError(f"field {number} of {length} bytes runs past the end of the message")
            yield number, wire, buf[pos : pos + length]
            pos += length
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            yield number, wire, int.from_bytes(buf[pos : pos + width], "little")
            pos += width
        else:
            raise OnnxReadError(f"field {number} has wire type {wire}, which ONNX files do not use")


def _text(value: int | memoryview) -> str:
    return bytes(value).decode("utf-8", "replace") if isinstance(value, memoryview) else ""


def _tensor_head(buf: memoryview) -> tuple[str, list[int]]:
    """A TensorProto's (name, dims)."""
    name, dims = "", []
    for number, wire, value in _fields(buf):
        if number == _TENSOR_NAME:
            name = _text(value)
        elif number == _TENSOR_DIMS:
            if wire == 2:  # packed
                assert isinstance(value, memoryview)
                pos = 0
                while pos < len(value):
                    dim, pos = _varint(value, pos)
                    dims.append(dim)
            else:
                assert isinstance(value, int)
                dims.append(value)
    return name, dims


def _node(buf: memoryview) -> tuple[str, list[str], list[str], list[int] | None]:
    """A NodeProto's (op_type, inputs, outputs, dims of its `value` tensor for a Constant)."""
    op, inputs, outputs, const = "", [], [], None
    for number, _, value in _fields(buf):
        if number == _NODE_OP_TYPE:
            op = _text(value)
        elif number == _NODE_INPUT:
            inputs.append(_text(value))
        elif number == _NODE_OUTPUT:
            outputs.append(_text(value))
        elif number == _NODE_ATTRIBUTE and isinstance(value, memoryview):
            attr = {n: v for n, _, v in _fields(value) if n in (_ATTR_NAME, _ATTR_TENSOR)}
            if _text(attr.get(_ATTR_NAME, 0)) == "value" and isinstance(attr.get(_ATTR_TENSOR), memoryview):
                const = _tensor_head(attr[_ATTR_TENSOR])[1]  # type: ignore[arg-type]
    return op, inputs, outputs, const


def embedding_rows(onnx_path: str | Path, token_input: str = TOKEN_INPUT) -> int | None:
    """Rows of the table the graph gathers `token_input`'s ids from (the smallest, if several); None
    when the graph has no such lookup. Raises OnnxReadError for a file that is not ONNX."""
    with open(onnx_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        with memoryview(mapped) as model:
            try:
                return _embedding_rows(model, token_input)
            finally:
                del model  # no view may outlive the map


def _embedding_rows(model: memoryview, token_input: str) -> int | None:
    graph = next((v for n, w, v in _fields(model) if n == _MODEL_GRAPH and w == 2), None)
    if not isinstance(graph, memoryview):
        raise OnnxReadError("the file holds no graph")
    tables: dict[str, list[int]] = {}
    nodes = []
    for number, wire, value in _fields(graph):
        if wire != 2 or not isinstance(value, memoryview):
            continue
        if number == _GRAPH_INITIALIZER:
            name, dims = _tensor_head(value)
            tables[name] = dims
        elif number == _GRAPH_NODE:
            nodes.append(_node(value))
    for op, _, outputs, const in nodes:
        if op == "Constant" and const is not None and outputs:
            tables[outputs[0]] = const
    ids = {token_input}
    for op, inputs, outputs, _ in nodes:  # ONNX graphs are topologically sorted
        if op in _VALUE_KEEPING and inputs and inputs[0] in ids:
            ids.update(outputs)
    rows = [
        tables[inputs[0]][0]
        for op, inputs, _, _ in nodes
        if op == "Gather" and len(inputs) >= 2 and inputs[1] in ids and len(tables.get(inputs[0], ())) >= 1
    ]
    return min(rows) if rows else None


def vocabulary_size(directory: str | Path, manifest: BundleManifest, tokenizer: Tokenizer | None = None) -> int | None:
    """How many token ids (0 .. n-1) the bundle's model runs: the smaller of its tokenizer's vocabulary
    and its first block's embedding table; None for bundles without token ids or where neither says."""
    if manifest.seq_axis is None:
        return None
    sizes = []
    if tokenizer is not None:
        sizes.append(int(tokenizer.get_vocab_size(with_added_tokens=True)))
    first = manifest.blocks[0]
    if TOKEN_INPUT in first.inputs:
        rows = embedding_rows(Path(directory) / first.file)
        if rows is not None:
            sizes.append(rows)
    return min(sizes) if sizes else None
