"""The full MiniLM classifier as ONE ONNX file, and the model code every peer server runs.

`compose(bundle, out)` (needs the `onnx` package: run it from exitplan's .venv) chains the bundle's
blocks and its final head into one graph: block i's tensors are prefixed `b{i}/` except the ones the
bundle passes between blocks (`input_ids`, `attention_mask`, `hidden{i}`, `logits`), so the chain's
tensors connect by name, as `BundleRuntime` connects them. Next to the file it writes `<out>.json`
with what the servers need (labels, pad token, longest input, the tokenizer's path).

`FullModel` (onnxruntime, numpy, tokenizers only: it runs inside the peers' own virtual
environments) tokenizes texts as exitplan's router does (the bundle's tokenizer.json, no padding,
no truncation), pads a batch to its longest input, runs the one session (CPU provider, `threads`
intra-op threads, no spinning, as exitplan's workers) and answers per text its label, its softmax
scores and the ramp that answered ("head": always the final head).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

FINAL_RAMP = "head"


def compose(bundle: str | Path, out: str | Path) -> Path:
    """Write the bundle's blocks + final head as one ONNX model at `out` (and `<out>.json`); returns `out`."""
    import onnx
    import yaml

    bundle = Path(bundle)
    manifest = yaml.safe_load((bundle / "bundle.yaml").read_text())
    final = [r for r in manifest["ramps"] if r.get("final")]
    if len(final) != 1:
        raise ValueError(f"{bundle}/bundle.yaml: expected one final ramp, found {len(final)}")
    parts = [(b["name"], b["file"], list(b["outputs"])) for b in manifest["blocks"]]
    parts.append((final[0]["name"], final[0]["file"], [final[0]["output"]]))
    shared = {i["name"] for i in manifest["inputs"]}
    for _, _, outputs in parts:
        shared.update(outputs)
    graph_inputs = [i["name"] for i in manifest["inputs"]]
    nodes, initializers, value_infos, inputs_by_name, opsets = [], [], [], {}, {}
    output = None
    ir_version = 0
    for index, (_name, rel, outputs) in enumerate(parts):
        model = onnx.load(str(bundle / rel))
        ir_version = max(ir_version, model.ir_version)
        for opset in model.opset_import:
            opsets[opset.domain] = max(opsets.get(opset.domain, 0), opset.version)
        if model.functions:
            raise ValueError(f"{bundle / rel}: local functions are not supported by this composition")
        prefix = f"b{index}/"
        graph = _prefixed(model.graph, prefix, shared)
        nodes.extend(graph.node)
        initializers.extend(graph.initializer)
        value_infos.extend(v for v in graph.value_info if v.name not in shared)
        for vi in graph.input:
            if vi.name in graph_inputs:
                inputs_by_name.setdefault(vi.name, vi)
        output = next(o for o in graph.output if o.name == outputs[0])
    merged = onnx.helper.make_graph(
        nodes,
        f"{manifest['name']}-full",
        [inputs_by_name[n] for n in graph_inputs],
        [output],
        initializer=initializers,
        value_info=value_infos,
    )
    model = onnx.helper.make_model(
        merged, opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()], ir_version=ir_version
    )
    onnx.checker.check_model(model)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out))
    meta = {
        "model": str(out.resolve()),
        "name": manifest["name"],
        "labels": list(manifest["labels"]),
        "pad_token_id": int(manifest.get("pad_token_id") or 0),
        "max_length": int(manifest["max_length"]),
        "tokenizer": str((bundle / manifest["tokenizer"]).resolve()),
        "inputs": graph_inputs,
        "output": output.name,
    }
    meta_path(out).write_text(json.dumps(meta, indent=2))
    return out


def meta_path(model: str | Path) -> Path:
    return Path(f"{model}.json")


def _prefixed(graph, prefix: str, shared: set[str]):
    """A copy of `graph` whose node, initializer and tensor names are prefixed, except `shared` tensors."""
    from onnx import GraphProto

    g = GraphProto()
    g.CopyFrom(graph)

    def name(n: str) -> str:
        return n if not n or n in shared else prefix + n

    for node in g.node:
        if any(a.HasField("g") or len(a.graphs) for a in node.attribute):
            raise ValueError(f"node {node.name!r} ({node.op_type}) holds a subgraph: not supported by this composition")
        node.name = prefix + node.name if node.name else node.name
        node.input[:] = [name(n) for n in node.input]
        node.output[:] = [name(n) for n in node.output]
    for init in g.initializer:
        init.name = name(init.name)
    for vi in (*g.value_info, *g.input, *g.output):
        vi.name = name(vi.name)
    return g


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


class FullModel:
    """The one ONNX session and the bundle's tokenizer; `predict(texts)` -> (labels, scores, ramps)."""

    def __init__(self, model: str | Path, threads: int = 1) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        self.meta = json.loads(meta_path(model).read_text())
        self.labels = list(self.meta["labels"])
        self.pad = int(self.meta["pad_token_id"])
        self.max_length = int(self.meta["max_length"])
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as exitplan's router
        self.tokenizer = Tokenizer.from_file(self.meta["tokenizer"])
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        if threads > 1:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])

    def tokenize(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """input_ids and attention_mask [n, longest], padded with the bundle's pad token."""
        ids = [e.ids for e in self.tokenizer.encode_batch([str(t) for t in texts])]
        longest = max(len(t) for t in ids)
        if longest > self.max_length:
            raise ValueError(f"an input has {longest} tokens, over the model's {self.max_length}")
        input_ids = np.full((len(ids), longest), self.pad, dtype=np.int64)
        mask = np.zeros((len(ids), longest), dtype=np.int64)
        for row, tokens in enumerate(ids):
            input_ids[row, : len(tokens)] = tokens
            mask[row, : len(tokens)] = 1
        return input_ids, mask

    def logits(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        return self.session.run(None, {"input_ids": input_ids, "attention_mask": attention_mask})[0]

    def predict(self, texts: list[str]) -> tuple[list[str], np.ndarray, list[str]]:
        if not texts:
            raise ValueError("no text to classify")
        scores = softmax(self.logits(*self.tokenize(texts)).astype(np.float32))
        labels = [self.labels[int(i)] for i in scores.argmax(axis=1)]
        return labels, scores.astype(np.float32), [FINAL_RAMP] * len(texts)


def v2_outputs(labels: list[str], scores: np.ndarray, ramps: list[str]) -> list[dict]:
    """The Open Inference Protocol outputs exitplan's router answers with (label, scores, exit_ramp)."""
    n = len(labels)
    return [
        {"name": "label", "datatype": "BYTES", "shape": [n], "data": labels},
        {"name": "scores", "datatype": "FP32", "shape": [n, scores.shape[1]], "data": scores.ravel().tolist()},
        {"name": "exit_ramp", "datatype": "BYTES", "shape": [n], "data": ramps},
    ]


def v2_texts(body: dict) -> list[str]:
    """The texts of an Open Inference Protocol request with one BYTES input named `text` (JSON form)."""
    inputs = {i.get("name"): i for i in body.get("inputs") or []}
    if "text" not in inputs:
        raise ValueError(f"send an input named 'text' (BYTES); got {sorted(inputs)}")
    data = inputs["text"].get("data")
    if not isinstance(data, list) or not data:
        raise ValueError("input 'text' must hold a non-empty list of strings")
    return [d.decode() if isinstance(d, bytes) else str(d) for d in data]
