"""`exitplan prepare --hf DIR --data FILE.csv|FILE.jsonl --text-column C --label-column L`: a local Hugging
Face checkpoint and labelled texts to an early-exit bundle that takes texts.

Nothing is downloaded (`local_files_only`, HF_HUB_OFFLINE=1). A checkpoint whose config names a
`*ForSequenceClassification` architecture is used as it is; any other is an encoder (AutoModel), and a
linear head over its mean-pooled (masked), frozen last hidden state is trained here on the labels
(features computed once, :func:`exitplan.prepare.heads.train_linear`) on the rows the ONNX pipeline
trains on (its held-out rows stay unseen). The model is exported whole, forward(input_ids,
attention_mask) -> logits, calling the checkpoint with the additive float mask computed once, token
types (zeros) and positions passed explicitly where it takes them, so the graph has cut vertices
between layers; then :func:`exitplan.prepare.from_onnx.from_onnx` places the ramps. Texts are tokenized
with the checkpoint's tokenizer (`tokenizer.json`, or AutoTokenizer's fast tokenizer), truncated and
padded to `max_length` (capped by the position embeddings); class names are the label column's
distinct values, sorted (or the classifier's own, when the values are its labels). The bundle keeps
the tokenizer (no padding, no truncation) and the held-out texts, so the router and `exitplan bench`
take texts.
"""

from __future__ import annotations

import csv
import inspect
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from exitplan.prepare.build import BuildResult, PrepareError
from exitplan.prepare.minilm import additive_mask, mean_pool
from exitplan.prepare.user_data import DataError

MAX_LENGTH = 128
FEATURE_BATCH = 64
SUFFIXES = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl"}
HEAD_FILE = "head.npz"
"""The linear head trained here (`weight` [classes, hidden], `bias`), copied into the bundle's data/."""


def _offline() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def load_config(directory: Path) -> Any:
    """The checkpoint's config; a PrepareError when `directory` is not a checkpoint."""
    what = f"--hf {directory}"
    if not directory.is_dir():
        raise PrepareError(
            f"{what}: no such directory; pass a local Hugging Face checkpoint (what save_pretrained wrote)"
        )
    if not (directory / "config.json").is_file():
        held = sorted(p.name for p in directory.iterdir())[:12]
        raise PrepareError(
            f"{what}: not a Hugging Face checkpoint directory (no config.json; it holds {held}); pass the folder "
            f"save_pretrained wrote: config.json, the weights and the tokenizer"
        )
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except Exception as err:
        raise PrepareError(f"{what}: config.json cannot be read ({type(err).__name__}: {err})") from err


def is_sequence_classifier(config: Any) -> bool:
    return any(str(a).endswith("ForSequenceClassification") for a in (getattr(config, "architectures", None) or []))


# ------------------------------------------------------------------------------ the labelled texts


@dataclass
class LabelledTexts:
    texts: list[str]
    labels: np.ndarray
    """[N] class indices into `names`."""
    names: list[str]


def _rows(path: Path) -> tuple[list[str], list[dict[str, Any]]]:
    """(columns, rows) of a CSV (UTF-8, else Latin-1) or JSON Lines file."""
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise DataError(f"{path}: --hf takes a .csv or a .jsonl file (one JSON object a line), not {path.suffix!r}")
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    if kind == "csv":
        for encoding in ("utf-8-sig", "latin-1"):
            try:
                with path.open(encoding=encoding, newline="") as handle:
                    reader = csv.DictReader(handle)
                    rows = list(reader)
                    return list(reader.fieldnames or []), rows
            except UnicodeDecodeError:
                continue
            except csv.Error as err:
                raise DataError(f"{path}: not a readable CSV file ({err})") from err
        raise DataError(f"{path}: neither UTF-8 nor Latin-1 text")  # not reached: Latin-1 decodes any byte
    rows, columns = [], {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            raise DataError(f"{path}: line {number} is not JSON ({err})") from err
        if not isinstance(row, dict):
            raise DataError(f"{path}: line {number} is a JSON {type(row).__name__}, not an object of columns")
        columns.update(dict.fromkeys(row))
        rows.append(row)
    return list(columns), rows


def _sorted_values(values: list[Any]) -> list[Any]:
    numbers = all(isinstance(v, int) and not isinstance(v, bool) for v in values)
    return sorted(set(values)) if numbers else sorted({str(v) for v in values})


def _classes(values: list[Any], config: Any, classifier: bool, where: str) -> tuple[np.ndarray, list[str]]:
    """Class indices and names: the distinct values sorted, or a sequence classifier's own labels."""
    distinct = _sorted_values(values)
    if len(distinct) < 2:
        raise DataError(f"{where} holds one value, {distinct[0]!r}; a classifier needs at least 2 classes")
    names = [str(v) for v in distinct]
    if classifier:
        own = [str(config.id2label[i]) for i in range(config.num_labels)]
        if set(names) <= set(own) and own != [f"LABEL_{i}" for i in range(len(own))]:
            names = own  # the checkpoint's own class names, in its order
        elif len(names) != len(own):
            raise DataError(
                f"{where} holds {len(names)} values {names[:10]} but the checkpoint classifies {len(own)} classes "
                f"{own[:10]}; use the checkpoint's labels, or an encoder checkpoint (a head is trained here)"
            )
    index = {name: i for i, name in enumerate(names)}
    return np.array([index[str(v)] for v in values], dtype=np.int64), names


def read_texts(path: Path, text_column: str, label_column: str, config: Any, classifier: bool) -> LabelledTexts:
    """The texts and their classes; a DataError naming the file, the column and what to change."""
    columns, rows = _rows(path)
    for option, column in (("--text-column", text_column), ("--label-column", label_column)):
        if column not in columns:
            raise DataError(f"{path}: no column {column!r} ({option}); the file has columns {columns}")
    texts, values = [], []
    for number, row in enumerate(rows, 1):
        text, value = row.get(text_column), row.get(label_column)
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{path}: row {number} has no text in column {text_column!r}; remove it or fill it in")
        if isinstance(value, str):
            value = value.strip()
        if value is None or value == "" or isinstance(value, (dict, list)) or "\n" in str(value):
            raise DataError(f"{path}: row {number} has no usable label in column {label_column!r} (got {value!r})")
        texts.append(text)
        values.append(value)
    if not texts:
        raise DataError(f"{path}: no rows")
    labels, names = _classes(values, config, classifier, f"{path}: the label column {label_column!r}")
    if len(texts) < len(names):
        raise DataError(f"{path}: {len(texts)} samples for {len(names)} classes; give at least one sample per class")
    return LabelledTexts(texts, labels, names)


# ------------------------------------------------------------------------------ tokenizer and model


def load_tokenizer(directory: Path) -> Any:
    """The checkpoint's `tokenizers` tokenizer: tokenizer.json, or AutoTokenizer's fast tokenizer's backend."""
    from tokenizers import Tokenizer

    if (directory / "tokenizer.json").is_file():
        return Tokenizer.from_file(str(directory / "tokenizer.json"))
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True, use_fast=True)
    except Exception as err:
        raise PrepareError(
            f"--hf {directory}: no tokenizer.json and no tokenizer AutoTokenizer can load ({err})"
        ) from err
    if not getattr(tokenizer, "is_fast", False):
        raise PrepareError(
            f"--hf {directory}: its tokenizer ({type(tokenizer).__name__}) has no fast (`tokenizers`) version the "
            f"router can run; save one as tokenizer.json in the checkpoint"
        )
    return tokenizer.backend_tokenizer


def pad_token_id(config: Any, tokenizer: Any) -> int:
    from exitplan.prepare.onnx_source import tokenizer_pad_id

    if getattr(config, "pad_token_id", None) is not None:
        return int(config.pad_token_id)
    return tokenizer_pad_id(tokenizer)


def load_model(directory: Path, classifier: bool) -> Any:
    from transformers import AutoModel, AutoModelForSequenceClassification

    auto = AutoModelForSequenceClassification if classifier else AutoModel
    try:
        try:  # eager attention: the implementation that exports
            model = auto.from_pretrained(str(directory), local_files_only=True, attn_implementation="eager")
        except (TypeError, ValueError):
            model = auto.from_pretrained(str(directory), local_files_only=True)
    except Exception as err:
        raise PrepareError(f"--hf {directory}: cannot load the model ({type(err).__name__}: {err})") from err
    return model.eval()


class TextClassifier(nn.Module):
    """forward(input_ids, attention_mask) -> logits: the checkpoint's own (a sequence classifier), or masked
    mean pooling of its last hidden state and `head`. The checkpoint is called with the additive float
    mask [b, 1, 1, s] (`additive`; else the 0/1 mask), token types (zeros) and positions 0..s-1 where it
    takes them (not where positions start after a padding index: those models compute their own)."""

    def __init__(self, model: nn.Module, additive: bool) -> None:
        super().__init__()
        self.model = model
        self.head: nn.Module | None = None
        self.additive = additive
        params = inspect.signature(model.forward).parameters
        base = getattr(model, getattr(model, "base_model_prefix", ""), model)
        embeddings = getattr(base, "embeddings", None)
        self.token_types = "token_type_ids" in params
        self.positions = "position_ids" in params and embeddings is not None and not hasattr(embeddings, "padding_idx")

    def call(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        kwargs = {"input_ids": input_ids}
        kwargs["attention_mask"] = additive_mask(attention_mask) if self.additive else attention_mask
        if self.token_types:
            kwargs["token_type_ids"] = torch.zeros_like(input_ids)
        if self.positions:
            positions = torch.arange(input_ids.shape[1], dtype=torch.long, device=input_ids.device)
            kwargs["position_ids"] = positions.unsqueeze(0).expand_as(input_ids)
        return self.model(**kwargs)

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden: torch.Tensor = self.call(input_ids, attention_mask).last_hidden_state
        return hidden

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor
        if self.head is None:
            logits = self.call(input_ids, attention_mask).logits
        else:
            logits = self.head(mean_pool(self.hidden(input_ids, attention_mask), attention_mask))
        return logits


def text_classifier(model: nn.Module, ids: np.ndarray, mask: np.ndarray, classifier: bool) -> TextClassifier:
    """The wrapper, with the additive float mask where the checkpoint gives the same answers with it
    (checked on a few rows; it keeps the layers apart in the exported graph) and the 0/1 mask otherwise."""
    rows = slice(0, min(4, len(ids)))
    example = (torch.from_numpy(ids[rows]), torch.from_numpy(mask[rows]))
    plain = TextClassifier(model, additive=False).eval()
    with torch.inference_mode():
        want = plain.call(*example)
        want = want.logits if classifier else want.last_hidden_state
        try:
            wrapped = TextClassifier(model, additive=True).eval()
            got = wrapped.call(*example)
            got = got.logits if classifier else got.last_hidden_state
        except Exception:
            return plain
    keep = example[1].bool() if not classifier else slice(None)
    same = got.shape == want.shape and float((got[keep] - want[keep]).abs().max()) <= 1e-4
    return wrapped if same else plain


# ------------------------------------------------------------------------------ features and the head


def tokenize(tokenizer: Any, texts: list[str], max_length: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and attention mask [N, max_length] (int64), truncated and right-padded."""
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=max_length)
    encoded = tokenizer.encode_batch(texts)
    ids = np.full((len(texts), max_length), pad, dtype=np.int64)
    mask = np.zeros((len(texts), max_length), dtype=np.int64)
    for row, enc in enumerate(encoded):
        ids[row, : len(enc.ids)] = enc.ids
        mask[row, : len(enc.ids)] = 1
    return ids, mask


def pooled_features(
    wrapper: TextClassifier, ids: np.ndarray, mask: np.ndarray, rows: np.ndarray, bar: Any
) -> np.ndarray:
    """Mean-pooled last hidden state of `rows` [len(rows), hidden], batched by length (frozen encoder)."""
    lengths = mask[rows].sum(axis=1)
    order = np.argsort(lengths, kind="stable")
    out: np.ndarray | None = None
    progress = bar(len(rows), "encoder features (frozen)")
    with torch.inference_mode():
        for start in range(0, len(order), FEATURE_BATCH):
            batch = order[start : start + FEATURE_BATCH]
            width = max(1, int(lengths[batch].max()))
            sel_ids = torch.from_numpy(ids[rows[batch], :width])
            sel_mask = torch.from_numpy(mask[rows[batch], :width])
            pooled = mean_pool(wrapper.hidden(sel_ids, sel_mask), sel_mask).float().numpy()
            if out is None:
                out = np.zeros((len(rows), pooled.shape[1]), dtype=np.float32)
            out[batch] = pooled
            progress.update(len(batch))
    progress.close()
    assert out is not None
    return out


def _max_length(model: Any, config: Any, requested: int) -> int:
    cap = getattr(config, "max_position_embeddings", None)
    base = getattr(model, getattr(model, "base_model_prefix", ""), model)
    offset = getattr(getattr(base, "embeddings", None), "padding_idx", None)
    if cap is not None and offset is not None:
        cap -= int(offset) + 1  # positions start after the padding index
    length = min(requested, int(cap)) if cap else requested
    if length < 4:
        raise PrepareError(f"--max-length {requested}: at least 4 tokens (the model takes up to {cap})")
    return length


def _train_head(
    wrapper: TextClassifier, ids: np.ndarray, mask: np.ndarray, data: LabelledTexts, options: dict[str, Any]
) -> float:
    """Train the linear head on the rows the pipeline trains its ramps on; its training accuracy."""
    from exitplan.prepare.build import auto_threads, tqdm_bar
    from exitplan.prepare.from_onnx import split_rows
    from exitplan.prepare.heads import train_linear
    from exitplan.prepare.onnx_options import OnnxOptions

    fraction = float(options.get("heldout_fraction", OnnxOptions.heldout_fraction))
    seed = int(options.get("seed", OnnxOptions.seed))
    _, train = split_rows(len(data.texts), fraction, seed, int(options.get("heldout_last", 0)))
    previous = torch.get_num_threads()
    torch.set_num_threads(options.get("threads") or auto_threads())
    try:
        features = pooled_features(wrapper, ids, mask, train, options.get("bar") or tqdm_bar())
        fit = train_linear(features, data.labels[train], len(data.names), seed=seed)
    finally:
        torch.set_num_threads(previous)
    wrapper.head = fit.to_linear()
    return fit.train_accuracy


def from_hf(
    directory: str | Path,
    data: str | Path,
    out: str | Path,
    *,
    text_column: str,
    label_column: str,
    max_length: int = MAX_LENGTH,
    **options: Any,
) -> BuildResult:
    """Build (or reuse) an early-exit bundle that takes texts at `out` from the Hugging Face checkpoint in
    `directory` and the labelled texts in `data` (.csv or .jsonl; columns `text_column`, `label_column`);
    `options` are those of :func:`exitplan.prepare.from_onnx.from_onnx` (force, bar, threads, and
    OnnxOptions' fields but labels, tokenizer, texts, seq_axis). Raises PrepareError, DataError or
    GraphError; nothing is left at `out` unless the bundle is complete."""
    from exitplan.prepare.from_torch import export_onnx, run_onnx_pipeline, verify_export

    _offline()
    directory, data = Path(directory), Path(data)
    config = load_config(directory)
    classifier = is_sequence_classifier(config)
    texts = read_texts(data, text_column, label_column, config, classifier)
    tokenizer = load_tokenizer(directory)
    model = load_model(directory, classifier)
    pad = pad_token_id(config, tokenizer)
    ids, mask = tokenize(tokenizer, texts.texts, _max_length(model, config, max_length), pad)
    wrapper = text_classifier(model, ids, mask, classifier)
    head_accuracy = None if classifier else _train_head(wrapper, ids, mask, texts, options)
    what = f"--hf {directory}"
    options.setdefault("name", directory.resolve().name)
    options.setdefault("source", what)
    with tempfile.TemporaryDirectory(prefix="exitplan-hf-") as tmp:
        work = Path(tmp)
        arrays = {"input_ids": ids, "attention_mask": mask}
        traced = export_onnx(wrapper, arrays, work / "model.onnx", what)
        verify_export(wrapper, arrays, work / "model.onnx", what, float(options.get("tolerance", 1e-4)), traced)
        # allow_pickle: numpy's default, named so that the stubs match the arrays' names to **kwds alone
        np.savez(work / "data.npz", allow_pickle=True, **arrays, label=texts.labels)
        (work / "labels.txt").write_text("".join(f"{name}\n" for name in texts.names))
        (work / "texts.json").write_text(json.dumps(texts.texts))
        tokenizer.no_padding()
        tokenizer.no_truncation()
        tokenizer.save(str(work / "tokenizer.json"))
        extra = dict(labels=str(work / "labels.txt"), tokenizer=str(work / "tokenizer.json"), pad_token_id=pad)
        extra.update(texts=str(work / "texts.json"), seq_axis=1)
        if isinstance(wrapper.head, nn.Linear):  # kept in the bundle (data/head.npz): a reference beside ONNX
            weights = {k: v.detach().numpy() for k, v in wrapper.head.state_dict().items()}
            np.savez(work / HEAD_FILE, **weights)
            extra["extras"] = (*options.get("extras", ()), str(work / HEAD_FILE))
        result = run_onnx_pipeline(work / "model.onnx", work / "data.npz", out, what, {**options, **extra})
    result.report.setdefault("head", "the checkpoint's own" if classifier else "linear, trained here")
    if head_accuracy is not None:
        result.report.setdefault("head_train_accuracy", head_accuracy)
    return result


def reference_model(directory: str | Path, bundle: str | Path) -> TextClassifier:
    """The PyTorch model a bundle was built from by :func:`from_hf`: the checkpoint in `directory`, with the
    head the build trained (the bundle's data/head.npz) when the checkpoint is an encoder."""
    _offline()
    directory = Path(directory)
    classifier = is_sequence_classifier(load_config(directory))
    model = load_model(directory, classifier)
    ids, mask = np.ones((2, 8), dtype=np.int64), np.ones((2, 8), dtype=np.int64)
    wrapper = text_classifier(model, ids, mask, classifier)
    if not classifier:
        with np.load(Path(bundle) / "data" / HEAD_FILE) as head:
            linear = nn.Linear(head["weight"].shape[1], head["weight"].shape[0])
            linear.load_state_dict({k: torch.from_numpy(head[k]) for k in ("weight", "bias")})
        wrapper.head = linear
    return wrapper.eval()
