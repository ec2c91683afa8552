"""Transformers as users export them, built here from small configs with random weights (no download):
ten architectures (eight text encoders, ViT, ConvNeXt) and three ways to an ONNX file:

- `torchscript`: `torch.onnx.export(dynamo=False)` of forward(input_ids, attention_mask) -> logits, the
  model called with its own 0/1 mask (as a user writes it);
- `optimum`: the model exported the way Hugging Face optimum does it: inputs named like the model's
  forward arguments (token_type_ids too, where it takes them), axes named batch_size/sequence_length,
  opset 14;
- `dynamo`: `torch.onnx.export(dynamo=True)` of the same wrapper as `torchscript`.

Each comes with example arrays (`example`) for its inputs.
"""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import numpy as np
import torch

TEXT = ("bert", "roberta", "distilbert", "albert", "deberta-v2", "mpnet", "xlm-roberta", "electra")
IMAGE = ("vit", "convnext")
ARCHITECTURES = TEXT + IMAGE
LAYERS = 3
VOCAB = 120
SEQ = 12
_TEXT_SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=2)
CONFIGS = {
    "bert": ("BertConfig", _TEXT_SIZES),
    "roberta": ("RobertaConfig", {**_TEXT_SIZES, "pad_token_id": 1}),
    "xlm-roberta": ("XLMRobertaConfig", {**_TEXT_SIZES, "pad_token_id": 1}),
    "distilbert": ("DistilBertConfig", dict(dim=32, hidden_dim=64, n_layers=LAYERS, n_heads=2)),
    "albert": ("AlbertConfig", {**_TEXT_SIZES, "embedding_size": 16}),
    "deberta-v2": (
        "DebertaV2Config",
        {**_TEXT_SIZES, "relative_attention": True, "pos_att_type": ["p2c", "c2p"], "position_buckets": 16},
    ),
    "mpnet": ("MPNetConfig", _TEXT_SIZES),
    "electra": ("ElectraConfig", {**_TEXT_SIZES, "embedding_size": 16}),
    "vit": ("ViTConfig", {**_TEXT_SIZES, "image_size": 32, "patch_size": 8}),
    "convnext": ("ConvNextConfig", dict(image_size=32, hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1])),
}
"""The encoder has LAYERS layers (ConvNeXt: 4 stages of one block)."""


def build(arch: str, classes: int = 3, seed: int = 0, **overrides) -> torch.nn.Module:
    """The architecture's classifier from its small config, random weights, eval mode, eager attention."""
    import transformers

    name, sizes = CONFIGS[arch]
    extra = {} if arch in IMAGE else {"vocab_size": VOCAB, "max_position_embeddings": 64}
    config = getattr(transformers, name)(**{**extra, **sizes, **overrides}, num_labels=classes)
    torch.manual_seed(seed)
    auto = (
        transformers.AutoModelForImageClassification
        if arch in IMAGE
        else transformers.AutoModelForSequenceClassification
    )
    return auto.from_config(config, attn_implementation="eager").eval()


def example(arch: str, rows: int = 2, seq: int = SEQ, seed: int = 0, token_types: bool = False) -> dict:
    """Example arrays: pixels [rows, 3, 32, 32], or token ids and a mask [rows, seq] (row 1 padded by 3)."""
    rng = np.random.default_rng(seed)
    if arch in IMAGE:
        return {"pixel_values": rng.standard_normal((rows, 3, 32, 32)).astype(np.float32)}
    ids = rng.integers(3, VOCAB, (rows, seq)).astype(np.int64)
    mask = np.ones((rows, seq), dtype=np.int64)
    if rows > 1:
        mask[1, seq - 3 :] = 0
        ids[1, seq - 3 :] = 0
    arrays = {"input_ids": ids, "attention_mask": mask}
    if token_types:
        arrays["token_type_ids"] = np.zeros_like(ids)
    return arrays


class _Logits(torch.nn.Module):
    """forward(*inputs by name) -> logits: the model called with keyword arguments."""

    def __init__(self, model: torch.nn.Module, names: list[str]) -> None:
        super().__init__()
        self.model, self.names = model, names


class _One(_Logits):
    def forward(self, a):
        return self.model(**dict(zip(self.names, [a]))).logits


class _Two(_Logits):
    def forward(self, a, b):
        return self.model(**dict(zip(self.names, [a, b]))).logits


class _Three(_Logits):
    def forward(self, a, b, c):
        return self.model(**dict(zip(self.names, [a, b, c]))).logits


def wrapper(model: torch.nn.Module, names: list[str]) -> torch.nn.Module:
    return {1: _One, 2: _Two, 3: _Three}[len(names)](model, names).eval()


def takes_token_types(model: torch.nn.Module) -> bool:
    return "token_type_ids" in inspect.signature(model.forward).parameters


def export(arch: str, model: torch.nn.Module, path: Path, exporter: str) -> dict[str, np.ndarray]:
    """Export `model` to `path` the `exporter` way; the example arrays of its inputs."""
    optimum = exporter == "optimum"
    arrays = example(arch, token_types=optimum and arch in TEXT and takes_token_types(model))
    names = list(arrays)
    batch, seq = ("batch_size", "sequence_length") if optimum else ("batch", "seq")
    axes = {n: ({0: batch} if n == "pixel_values" else {0: batch, 1: seq}) for n in names}
    axes["logits"] = {0: batch}
    tensors = tuple(torch.from_numpy(a) for a in arrays.values())
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            wrapper(model, names),
            tensors,
            str(path),
            input_names=names,
            output_names=["logits"],
            dynamic_axes=axes,
            opset_version=18 if exporter == "dynamo" else 14 if optimum else 17,
            dynamo=exporter == "dynamo",
            **({"verbose": False} if exporter == "dynamo" else {"do_constant_folding": True}),
        )
    return arrays
