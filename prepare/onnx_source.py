"""The user's model and data made ready for `exitplan prepare --onnx` (and --torch, --hf): the model read
and checked (a free batch axis), the output it serves chosen and the others pruned, its shape reads of
activations detached (exitplan.prepare.shape_paths), the data checked against it, and the model's own
answers on every sample, which the ramps learn and are judged by. Every problem is one line that
names the file, the input or output and the row, and says what to do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from exitplan.prepare.build import PrepareError
from exitplan.prepare.graph_cuts import check_classifier, read_model
from exitplan.prepare.onnx_options import OnnxOptions
from exitplan.prepare.shape_paths import detach_shape_reads
from exitplan.prepare.user_data import DataError, InputInfo, UserData, load_data, model_inputs
from exitplan.worker_image.bundle_runtime import input_role

__all__ = [
    "Source",
    "check_batch_axes",
    "heldout_texts",
    "keep_output",
    "load_source",
    "served_output",
    "tokenizer_pad_id",
]

SOURCE_BATCH = 64
"""Samples per ONNX Runtime call when the model answers the data."""


@dataclass
class Source:
    """The model (its served output only, shape reads detached), its inputs, the data and its answers."""

    model: Any
    inputs: list[InputInfo]
    data: UserData
    logits: np.ndarray
    labels: list[str]
    seq_axis: int | None
    mask: str | None
    """The input that masks sequence positions (pooled over), if any."""
    output: str = "logits"
    """The model output the bundle serves."""
    not_served: list[str] = field(default_factory=list)
    """The model's other outputs, pruned."""
    shape_reads: int = 0
    """Shape reads of activations rewritten to read the inputs' shapes."""

    @property
    def answers(self) -> np.ndarray:
        found: np.ndarray = self.logits.argmax(axis=1)
        return found


# ------------------------------------------------------------------------------ the model


def _rank(value: onnx.ValueInfoProto) -> int | None:
    tensor = value.type.tensor_type
    return len(tensor.shape.dim) if tensor.HasField("shape") else None


def served_output(model: onnx.ModelProto, wanted: str | None, where: str) -> tuple[str, list[str]]:
    """(the output to serve, the others): `wanted`, else the one named like logits, else the only one of
    rank 2, else the only one; a PrepareError listing them otherwise."""
    outputs = list(model.graph.output)
    names = [o.name for o in outputs]
    listed = ", ".join(f"{o.name!r} (rank {_rank(o) if _rank(o) is not None else '?'})" for o in outputs)
    if wanted is not None:
        if wanted not in names:
            raise PrepareError(f"--output {wanted!r}: {where} has no such output; its outputs are {listed}")
        chosen = wanted
    elif len(names) == 1:
        chosen = names[0]
    else:
        logits = [n for n in names if n == "logits"] or [n for n in names if "logits" in n.lower()]
        ranked = [o.name for o in outputs if _rank(o) == 2]
        found = logits if len(logits) == 1 else ranked if not logits and len(ranked) == 1 else []
        if not found:
            raise PrepareError(
                f"{where} has {len(names)} outputs, {listed}, and none is named like logits or is the only one of "
                "rank 2; choose the class scores to serve with --output NAME"
            )
        chosen = found[0]
    return chosen, [n for n in names if n != chosen]


def keep_output(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """A copy of `model` with `name` as its only output, and only the nodes and initializers it needs."""
    if [o.name for o in model.graph.output] == [name]:
        return model
    producer = {out: i for i, node in enumerate(model.graph.node) for out in node.output if out}
    needed, stack, seen = set(), [name], set()
    while stack:
        tensor = stack.pop()
        if tensor in seen or tensor not in producer:
            seen.add(tensor)
            continue
        seen.add(tensor)
        index = producer[tensor]
        if index not in needed:
            needed.add(index)
            node = model.graph.node[index]
            stack.extend(x for x in node.input if x)
            for attr in node.attribute:  # subgraphs read outer names too
                for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                    stack.extend(x for inner in sub.node for x in inner.input if x)
    pruned = onnx.ModelProto()
    pruned.CopyFrom(model)
    kept = [o for o in model.graph.output if o.name == name]
    del pruned.graph.output[:]
    pruned.graph.output.extend(kept)
    del pruned.graph.node[:]
    pruned.graph.node.extend(node for i, node in enumerate(model.graph.node) if i in needed)
    inits = [t for t in model.graph.initializer if t.name in seen]
    del pruned.graph.initializer[:]
    pruned.graph.initializer.extend(inits)
    return pruned


def check_batch_axes(inputs: list[InputInfo], where: str) -> None:
    """A PrepareError naming the first input whose batch axis (0) has a fixed size."""
    for info in inputs:
        size = info.shape[0] if info.shape else None
        if isinstance(size, int) and size > 0:
            raise PrepareError(
                f"{where}: input {info.name!r} has a fixed batch axis (axis 0 is always {size}), so the model cannot "
                f"run batches of other sizes; export it again with a free batch axis, e.g. torch.onnx.export(..., "
                f"dynamic_axes={{{info.name!r}: {{0: 'batch'}}, 'logits': {{0: 'batch'}}}}), or with dynamo=True and "
                f"dynamic_shapes"
            )


# ------------------------------------------------------------------------------ the data and the answers


def _detect_seq_axis(option: int | None, inputs: list[InputInfo]) -> int | None:
    if option is None or option >= 0:
        return option
    tokens = all(i.dtype.kind in "iu" and len(i.shape) == 2 for i in inputs)
    return 1 if tokens else None


def _widths(data: UserData, inputs: list[InputInfo], seq_axis: int | None, mask: str | None) -> np.ndarray | None:
    """Per sample, the sequence width that holds its tokens (the mask's last 1), when the model's sequence
    axis is free on every sequence input (padding beyond it changes no answer): batches are then run
    trimmed, several times faster on short texts padded to a long width. None: run as given."""
    if seq_axis != 1 or mask is None:
        return None
    if any(len(i.shape) > 1 and isinstance(i.shape[1], int) for i in inputs if data.inputs[i.name].ndim > 1):
        return None
    held = data.inputs[mask] != 0
    last = held.shape[1] - np.argmax(held[:, ::-1], axis=1)
    return np.where(held.any(axis=1), last, 1)


def _run_source(model: Any, output: str, data: UserData, widths: np.ndarray | None, where: tuple[str, str]) -> Any:
    """The model's `output` for every sample; with `widths`, samples sorted by width and each batch
    trimmed to its widest. A DataError naming the rows ONNX Runtime cannot run."""
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    order = np.arange(len(data)) if widths is None else np.argsort(widths, kind="stable")
    outputs: list[np.ndarray] = []
    for start in range(0, len(data), SOURCE_BATCH):
        rows = order[start : start + SOURCE_BATCH]
        feeds = {k: v[rows] for k, v in data.inputs.items()}
        if widths is not None:
            width = int(widths[rows].max())
            feeds = {k: v[:, :width] if v.ndim > 1 else v for k, v in feeds.items()}
        try:
            outputs.append(session.run([output], feeds)[0])
        except Exception as err:  # onnxruntime raises several unrelated types
            first = " ".join(str(err).split())[:300]
            shown = ", ".join(str(r) for r in np.sort(rows)[:5])
            raise DataError(
                f"{where[1]}: the model {where[0]} fails on rows {shown}{' ...' if len(rows) > 5 else ''} of the data "
                f"({first}); check those rows' values against what the model takes (token ids within the "
                f"vocabulary, the shapes it was exported for)"
            ) from err
    logits = np.concatenate(outputs).astype(np.float32)
    answer = np.empty_like(logits)
    answer[order] = logits
    return answer


def _check_answers(logits: np.ndarray, opts: OnnxOptions, output: str) -> None:
    if logits.ndim != 2 or logits.shape[1] < 2:
        raise PrepareError(
            f"{opts.model}: output {output!r} has shape {list(logits.shape)}; a classifier must output class "
            "scores [batch, classes] with at least 2 classes (choose another with --output NAME)"
        )
    bad = np.flatnonzero(~np.isfinite(logits).all(axis=1))
    if bad.size:
        what = "NaN" if np.isnan(logits[bad[0]]).any() else "infinite values"
        raise DataError(
            f"{opts.data}: the model's output {output!r} holds {what} on {bad.size} row(s) of the data, the first "
            f"row {int(bad[0])}; remove those rows or fix what the model computes on them"
        )
    n, classes = logits.shape
    if n < classes:
        raise DataError(f"{opts.data}: {n} samples for {classes} classes; give at least one sample per class")


def _labels(path: str | None, classes: int) -> list[str]:
    if path is None:
        return [str(i) for i in range(classes)]
    names = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    if len(names) != classes:
        raise PrepareError(f"--labels {path}: {len(names)} class names, but the model scores {classes} classes")
    return names


def _check_tokenizer_inputs(opts: OnnxOptions, inputs: list[InputInfo], seq_axis: int | None) -> None:
    names = [i.name for i in inputs]
    if opts.tokenizer and (seq_axis != 1 or "input_ids" not in names or any(input_role(n) == "data" for n in names)):
        raise PrepareError(
            f"{opts.model}: a bundle with a tokenizer takes token sequences as the router feeds them, inputs "
            f"`input_ids` [batch, seq] and optionally an attention mask, token types and positions; this model "
            f"takes {', '.join(i.describe() for i in inputs)}"
        )


def load_source(opts: OnnxOptions) -> Source:
    """The model, its data and its answers, checked: a free batch axis, a class score vector per sample,
    finite, at least as many samples as classes."""
    original = read_model(Path(opts.model))
    inputs = model_inputs(original)
    check_batch_axes(inputs, opts.model)
    output, others = served_output(original, opts.output, opts.model)
    model = keep_output(original, output)
    check_classifier(model)
    data = load_data(Path(opts.data), inputs)
    seq_axis = _detect_seq_axis(opts.seq_axis, inputs)
    mask = next((i.name for i in inputs if input_role(i.name) == "mask"), None) if seq_axis is not None else None
    _check_tokenizer_inputs(opts, inputs, seq_axis)
    logits = _run_source(original, output, data, _widths(data, inputs, seq_axis, mask), (opts.model, opts.data))
    _check_answers(logits, opts, output)
    example = {k: v[:2] for k, v in data.inputs.items()}
    model, rewritten = detach_shape_reads(model, example, seq_axis)
    labels = _labels(opts.labels, logits.shape[1])
    return Source(model, inputs, data, logits, labels, seq_axis, mask, output, others, rewritten)


# ------------------------------------------------------------------------------ texts


def tokenizer_pad_id(tokenizer: Any) -> int:
    """The id a `tokenizers` tokenizer pads with: its padding's, else [PAD], <pad> or <|pad|>, else 0."""
    padding = tokenizer.padding
    if padding and padding.get("pad_id") is not None:
        return int(padding["pad_id"])
    found = (tokenizer.token_to_id(t) for t in ("[PAD]", "<pad>", "<|pad|>"))
    return next((int(i) for i in found if i is not None), 0)


def heldout_texts(opts: OnnxOptions, src: Source, rows: np.ndarray) -> dict[str, np.ndarray]:
    """`text` and `length` (tokens, no truncation) of the held-out `rows` when the data comes with its
    texts (`opts.texts`); each text must tokenize, truncated at the sequence width, to its row's ids."""
    if not opts.texts or not opts.tokenizer:
        return {}
    from tokenizers import Tokenizer

    texts = json.loads(Path(opts.texts).read_text())
    if not isinstance(texts, list) or len(texts) != len(src.data):
        raise PrepareError(f"{opts.texts}: expected a JSON list of {len(src.data)} texts, one per data row")
    held = [str(texts[r]) for r in rows]
    tokenizer = Tokenizer.from_file(opts.tokenizer)
    tokenizer.no_padding()
    tokenizer.no_truncation()
    lengths = np.array([len(e.ids) for e in tokenizer.encode_batch(held)], dtype=np.int64)
    ids = src.data.inputs["input_ids"]
    tokenizer.enable_truncation(max_length=int(ids.shape[1]))
    mask = src.data.inputs.get(src.mask) if src.mask else None
    for row, encoded in zip(rows, tokenizer.encode_batch(held), strict=True):
        used = int((mask[row] != 0).sum()) if mask is not None else len(encoded.ids)
        if list(ids[row, :used]) != encoded.ids:
            raise PrepareError(
                f"{opts.texts}: text {int(row)} ({str(texts[row])[:40]!r}) tokenizes to {encoded.ids[:12]}... but its "
                f"input_ids are {ids[row, :used][:12].tolist()}...; the texts and the ids must agree"
            )
    return {"text": np.asarray(held), "length": lengths}
