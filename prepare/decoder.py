"""A small decoder-only early-exit transformer trained on the tweets (EE-LLM), exported per layer with a KV cache.

Byte-level: ids 0-255 are UTF-8 bytes, then <bos>, <eos>, <pad>. Block i is decoder layer i (block 0
also holds the token and position embeddings). Every block takes the KV cache of its layer as inputs
`past_key_i`/`past_value_i` [batch, heads, past, head_dim] and returns the hidden states of the new
positions plus `present_key_i`/`present_value_i` (past followed by the new entries), so serving can run
any positions against any cache. An exit head (LayerNorm + linear to the vocabulary) follows every block
but the last; the final head follows the last. Training minimises EE-LLM's objective: the weighted sum
of every exit's next-token loss (weights grow with depth, the final head weighs most).

The build (`build_decoder_bundle`) caches like `exitplan prepare`: a finished bundle holds
`.complete.json` with a hash of its options, a rerun with the same options reuses it, and the build
happens in a sibling directory under a file lock.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

if TYPE_CHECKING:
    import torch

    from exitplan.api.bundle import BundleManifest
    from exitplan.prepare.decoder_model import EarlyExitDecoder

FORMAT_VERSION = 1
BOS, EOS, PAD = 256, 257, 258
VOCAB = 259


class DecoderBuildError(RuntimeError):
    """Decoder options that cannot be built; the message says what to change."""


@dataclass(frozen=True)
class DecoderOptions:
    """What the decoder bundle is built from (the cache key)."""

    layers: int = 4
    hidden: int = 128
    heads: int = 4
    context: int = 128
    steps: int = 1500
    batch: int = 16
    lr: float = 3e-3
    heldout: int = 500
    """Tweets kept out of training (the benchmark's held-out text)."""
    train_tweets: int | None = None
    """Training tweets (None: every tweet not held out)."""
    seed: int = 0
    exit_weights: tuple[float, ...] = field(default=())
    """Loss weight per head, exits then final (empty: EE-LLM-style i/L for head i of L)."""

    def check(self) -> DecoderOptions:
        if not 1 <= self.layers <= 24:
            raise DecoderBuildError(f"layers {self.layers}: use 1..24")
        if self.hidden % self.heads:
            raise DecoderBuildError(f"hidden size {self.hidden} must be a multiple of heads {self.heads}")
        if not 8 <= self.context <= 1024:
            raise DecoderBuildError(f"context {self.context}: use 8..1024 positions")
        if self.steps < 1 or self.batch < 1 or self.heldout < 1:
            raise DecoderBuildError("steps, batch and heldout must each be >= 1")
        if self.exit_weights and len(self.exit_weights) != self.layers:
            raise DecoderBuildError(
                f"exit_weights needs {self.layers} values (one per head), got {len(self.exit_weights)}"
            )
        return self

    def weights(self) -> list[float]:
        raw = list(self.exit_weights) or [(i + 1) / self.layers for i in range(self.layers)]
        total = sum(raw)
        return [w / total for w in raw]

    def digest(self) -> str:
        payload = json.dumps({"format": FORMAT_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------- the model


def make_model(options: DecoderOptions) -> EarlyExitDecoder:
    """The PyTorch early-exit decoder (exitplan.prepare.decoder_model, imported here: torch is a prepare-only import)."""
    from exitplan.prepare.decoder_model import EarlyExitDecoder

    return EarlyExitDecoder(
        vocab=VOCAB, d=options.hidden, n_heads=options.heads, context=options.context, layers=options.layers
    )


# ---------------------------------------------------------------------------------- data


def encode_bytes(text: str, context: int) -> list[int]:
    """<bos> + UTF-8 bytes + <eos>, cut to `context` positions."""
    return ([BOS] + list(text.encode("utf-8")) + [EOS])[:context]


def tweet_corpus(heldout: int, seed: int, train_tweets: int | None = None) -> tuple[list[str], list[str]]:
    """(training tweets, held-out tweets): a seeded shuffle of every tweet, deduplicated."""
    from exitplan.prepare.datasets import load_tweets

    texts, _ = load_tweets()
    unique = list(dict.fromkeys(texts))
    order = np.random.default_rng(seed).permutation(len(unique))
    if heldout >= len(unique):
        raise DecoderBuildError(f"held-out {heldout} leaves no training tweets (there are {len(unique)})")
    held = [unique[i] for i in order[:heldout]]
    train = [unique[i] for i in order[heldout:]]
    return (train if train_tweets is None else train[:train_tweets]), held


def _batches(
    encoded: np.ndarray, lengths: np.ndarray, batch: int, steps: int, rng: np.random.Generator
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for _ in range(steps):
        rows = rng.integers(0, len(encoded), batch)
        longest = int(lengths[rows].max())
        yield encoded[rows, :longest], lengths[rows]


# ---------------------------------------------------------------------------------- training + export


def train(options: DecoderOptions, texts: list[str], bar: Bar | None = None) -> tuple[EarlyExitDecoder, dict[str, Any]]:
    import torch
    from torch.nn import functional as F

    torch.manual_seed(options.seed)
    model = make_model(options)
    encoded = np.full((len(texts), options.context), PAD, dtype=np.int64)
    lengths = np.zeros(len(texts), dtype=np.int64)
    for row, text in enumerate(texts):
        ids = encode_bytes(text, options.context)
        encoded[row, : len(ids)] = ids
        lengths[row] = len(ids)
    weights = options.weights()
    optimiser = torch.optim.AdamW(model.parameters(), lr=options.lr, weight_decay=0.01)
    warmup = max(1, options.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimiser, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / options.steps)))
    )
    rng = np.random.default_rng(options.seed)
    progress = bar(options.steps, "training the early-exit decoder") if bar else None
    model.train()
    losses: list[list[float]] = []
    for batch_ids, _ in _batches(encoded, lengths, options.batch, options.steps, rng):
        batch = torch.from_numpy(batch_ids)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        per_head = [
            F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=PAD)
            for logits in model.train_logits(inputs)
        ]
        loss = sum(w * head_loss for w, head_loss in zip(weights, per_head))
        if not isinstance(loss, torch.Tensor):  # the sum of no heads is 0; check() keeps layers >= 1
            raise DecoderBuildError(f"no heads to train (layers {options.layers})")
        optimiser.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimiser.step()
        schedule.step()
        losses.append([float(head_loss.detach()) for head_loss in per_head])
        if progress:
            progress.update(1)
    if progress:
        progress.close()
    model.eval()
    tail = np.asarray(losses[-max(1, len(losses) // 10) :]).mean(axis=0)
    return model, {"final_train_loss_per_head": tail.tolist(), "loss_weights": weights}


def manifest(options: DecoderOptions, name: str = "tweet-decoder") -> BundleManifest:
    """bundle.yaml of a decoder with `options.layers` blocks, exits after all but the last."""
    from exitplan.api.bundle import BlockSpec, BundleManifest, DecoderSpec, KVCacheSpec, RampSpec, TensorSpec
    from exitplan.api.resources import Task

    n, head_dim = options.layers, options.hidden // options.heads
    inputs = [
        TensorSpec(name="input_ids", dtype="int64", shape=["batch", "seq"]),
        TensorSpec(name="position_ids", dtype="int64", shape=["batch", "seq"]),
    ]
    cache: list[KVCacheSpec] = []
    blocks: list[BlockSpec] = []
    ramps: list[RampSpec] = []
    for i in range(n):
        kv = KVCacheSpec(
            block=i,
            past_key=f"past_key_{i}",
            past_value=f"past_value_{i}",
            present_key=f"present_key_{i}",
            present_value=f"present_value_{i}",
        )
        cache.append(kv)
        inputs += [
            TensorSpec(name=t, dtype="float32", shape=["batch", options.heads, "past", head_dim])
            for t in (kv.past_key, kv.past_value)
        ]
        first = ["input_ids", "position_ids"] if i == 0 else [f"hidden{i - 1}"]
        blocks.append(
            BlockSpec(
                name=f"layer{i}",
                file=f"blocks/layer{i}.onnx",
                inputs=[*first, kv.past_key, kv.past_value],
                outputs=[f"hidden{i}", kv.present_key, kv.present_value],
            )
        )
        final = i == n - 1
        ramps.append(
            RampSpec(
                name="head" if final else f"exit{i}",
                after=i,
                file=f"ramps/{'head' if final else f'exit{i}'}.onnx",
                inputs=[f"hidden{i}"],
                output="logits",
                final=final,
            )
        )
    labels = [f"<0x{b:02X}>" for b in range(256)] + ["<bos>", "<eos>", "<pad>"]
    return BundleManifest(
        name=name,
        task=Task.text_generation,
        labels=labels,
        dtype="float32",
        inputs=inputs,
        blocks=blocks,
        ramps=ramps,
        seq_axis=1,
        max_length=options.context,
        pad_token_id=PAD,
        decoder=DecoderSpec(
            vocab_size=VOCAB,
            num_heads=options.heads,
            head_dim=head_dim,
            hidden_size=options.hidden,
            max_context=options.context,
            cache=cache,
            tokenizer="bytes",
            bos_token_id=BOS,
            eos_token_id=EOS,
        ),
    )


def export(model: EarlyExitDecoder, options: DecoderOptions, bundle: BundleManifest, directory: Path) -> None:
    """Every block and head to ONNX (free axes: batch, seq = new positions, past, total = past + seq)."""
    import torch
    from torch import nn

    from exitplan.prepare.decoder_model import FirstBlock, LayerBlock
    from exitplan.prepare.export import export_module

    if bundle.decoder is None:
        raise DecoderBuildError(f"bundle {bundle.name!r} has no decoder section (its KV cache tensors)")
    decoder = bundle.decoder

    b, q, past, hd = 1, 3, 5, options.hidden // options.heads
    cache_in = {0: "batch", 2: "past"}
    cache_out = {0: "batch", 2: "total"}
    rows = {0: "batch", 1: "seq"}
    example_cache = (torch.randn(b, options.heads, past, hd), torch.randn(b, options.heads, past, hd))
    for i, spec in enumerate(bundle.blocks):
        kv = decoder.cache[i]
        module: nn.Module
        example: tuple[torch.Tensor, ...]
        if i == 0:
            module = FirstBlock(model)
            example = (torch.randint(0, 256, (b, q)), torch.arange(past, past + q).unsqueeze(0), *example_cache)
        else:
            module = LayerBlock(model.blocks()[i][0])
            example = (torch.randn(b, q, options.hidden), *example_cache)
        axes = {name: rows for name in spec.inputs[:-2]}
        axes.update(
            {
                kv.past_key: cache_in,
                kv.past_value: cache_in,
                spec.outputs[0]: rows,
                kv.present_key: cache_out,
                kv.present_value: cache_out,
            }
        )
        export_module(
            module.eval(),
            example,
            directory / spec.file,
            input_names=spec.inputs,
            output_names=spec.outputs,
            free_axes=axes,
        )
    for i, ramp in enumerate(bundle.ramps):
        export_module(
            model.heads[i].eval(),
            (torch.randn(b, q, options.hidden),),
            directory / ramp.file,
            input_names=ramp.inputs,
            output_names=[ramp.output],
            free_axes={ramp.inputs[0]: rows, ramp.output: rows},
        )


def torch_reference_logits(model: EarlyExitDecoder, ids: list[int]) -> list[np.ndarray]:
    """Every head's logits [s, vocab] for one sequence, PyTorch, cache path with an empty past."""
    import torch

    with torch.no_grad():
        t = torch.tensor([ids])
        positions = torch.arange(len(ids)).unsqueeze(0)
        x = model.embed(t, positions)
        out = []
        for layer, head in model.blocks():
            x, _, _ = layer(x, *_empty_cache(model, x))
            out.append(head(x)[0].numpy())
    return out


def _empty_cache(model: EarlyExitDecoder, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    n_heads = model.n_heads
    hd = x.shape[-1] // n_heads
    return torch.zeros(1, n_heads, 0, hd), torch.zeros(1, n_heads, 0, hd)


# ---------------------------------------------------------------------------------- the cached build

Bar = Callable[[int, str], Any]


def tqdm_bar(enabled: bool = True) -> Bar:
    from tqdm.auto import tqdm

    return lambda total, desc: tqdm(total=total, desc=desc, disable=not enabled, leave=False)


@dataclass
class DecoderBuild:
    path: Path
    reused: bool
    report: dict[str, Any]


def build_decoder_bundle(
    options: DecoderOptions, out: Path, *, force: bool = False, bar: Bar | None = None, threads: int | None = None
) -> DecoderBuild:
    """Train, export and verify the decoder bundle at `out` (or reuse a finished one with the same options)."""
    options = options.check()
    out = Path(out)
    from exitplan.prepare.build import PrepareError, build_once

    try:
        path, reused, report = build_once(
            out, options, lambda work: _build(options, work, bar), force=force, threads=threads
        )
    except PrepareError as err:
        raise DecoderBuildError(str(err)) from err
    return DecoderBuild(path, reused, report)


def _build(options: DecoderOptions, directory: Path, bar: Bar | None) -> dict[str, Any]:
    started = time.perf_counter()
    train_texts, heldout = tweet_corpus(options.heldout, options.seed, options.train_tweets)
    model, report = train(options, train_texts, bar)
    report["train_seconds"] = time.perf_counter() - started
    report["train_tweets"] = len(train_texts)
    bundle = manifest(options)
    export(model, options, bundle, directory)
    (directory / "bundle.yaml").write_text(
        yaml.safe_dump(bundle.model_dump(mode="json", exclude_none=True), sort_keys=False)
    )
    (directory / "data" / "heldout.json").write_text(json.dumps(heldout))
    # Check the export: ONNX Runtime (no cache, whole sequence) against PyTorch on held-out tweets.
    from exitplan.worker_image.generate.decoder import DecoderModel

    runtime = DecoderModel(directory)
    diffs = []
    for text in heldout[:8]:
        ids = encode_bytes(text, options.context)
        reference = torch_reference_logits(model, ids)
        got = [runtime.full_forward(ids).logits[r.name] for r in bundle.ramps]
        diffs.append(max(float(np.abs(r - g).max()) for r, g in zip(reference, got)))
    report["onnx_vs_torch_max_abs_diff"] = max(diffs)
    report["options"] = asdict(options)
    report["total_seconds"] = time.perf_counter() - started
    return report
