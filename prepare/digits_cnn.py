"""A small early-exit CNN on scikit-learn's bundled 8x8 digits: proves the bundle format beyond BERT.

Three blocks (conv 1->16; conv 16->32 + max-pool; conv 32->64 + max-pool), each ramp and the head
= adaptive average pooling to 2x2 + a linear layer. Training: head first (the CNN and its head
trained together on the labels), then the backbone is frozen and ramps after blocks 0 and 1 are
trained on the model's own predictions (the head's argmax), from features computed once.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn

from exitplan.api.bundle import BlockSpec, BundleManifest, RampSpec, TensorSpec
from exitplan.api.resources import Task
from exitplan.prepare.datasets import digits_splits
from exitplan.prepare.export import export_module
from exitplan.prepare.heads import LinearFit, train_linear

NAME = "digits-cnn"
CHANNELS = (16, 32, 64)
EPOCHS = 40


def hidden(index: int) -> str:
    return f"hidden{index}"


def make_blocks() -> nn.ModuleList:
    return nn.ModuleList(
        [
            nn.Sequential(nn.Conv2d(1, CHANNELS[0], 3, padding=1), nn.ReLU()),
            nn.Sequential(nn.Conv2d(CHANNELS[0], CHANNELS[1], 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
            nn.Sequential(nn.Conv2d(CHANNELS[1], CHANNELS[2], 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        ]
    )


class PooledLinear(nn.Module):
    """A ramp or the head: average-pool to 2x2, flatten, linear."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.linear = linear

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.flatten(self.pool(hidden), 1))


def _features(blocks: nn.ModuleList, x: torch.Tensor) -> list[np.ndarray]:
    pool = nn.AdaptiveAvgPool2d(2)
    out = []
    with torch.no_grad():
        h = x
        for block in blocks:
            h = block(h)
            out.append(torch.flatten(pool(h), 1).numpy())
    return out


def manifest(labels: list[str]) -> BundleManifest:
    blocks = [
        BlockSpec(
            name=f"conv{i}", file=f"blocks/conv{i}.onnx", inputs=["x" if i == 0 else hidden(i - 1)], outputs=[hidden(i)]
        )
        for i in range(len(CHANNELS))
    ]
    ramps = [
        RampSpec(name=f"ramp{i}", after=i, file=f"ramps/ramp{i}.onnx", inputs=[hidden(i)])
        for i in range(len(CHANNELS) - 1)
    ]
    last = len(CHANNELS) - 1
    ramps.append(RampSpec(name="head", after=last, file="ramps/head.onnx", inputs=[hidden(last)], final=True))
    return BundleManifest(
        name=NAME,
        task=Task.image_classification,
        labels=labels,
        inputs=[TensorSpec(name="x", dtype="float32", shape=["batch", 1, 8, 8])],
        blocks=blocks,
        ramps=ramps,
    )


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, seed: int, bar) -> None:
    """Train the CNN and its head end to end (Adam, EPOCHS epochs of shuffled batches of 64)."""
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3, weight_decay=1e-4)
    generator = torch.Generator().manual_seed(seed)
    progress = bar(EPOCHS, "training digits CNN + head")
    model.train()
    for _ in range(EPOCHS):
        for rows in torch.randperm(len(y), generator=generator).split(64):
            optimiser.zero_grad()
            nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
            optimiser.step()
        progress.update(1)
    progress.close()
    model.eval()


def _export(
    directory, bundle: BundleManifest, blocks: nn.ModuleList, head: nn.Module, fits: list[LinearFit], x, bar
) -> None:
    """Export every block and ramp of `bundle` to its ONNX file in `directory`; `fits` are the ramps'
    linear fits in manifest order (the final one, the head, is exported as the trained module)."""
    examples = [x[:2]]
    with torch.no_grad():
        for block in blocks:
            examples.append(block(examples[-1]))
    batch_axis = {0: "batch"}
    progress = bar(len(bundle.blocks) + len(bundle.ramps), "exporting to ONNX")
    for i, spec in enumerate(bundle.blocks):
        axes = {spec.inputs[0]: batch_axis, spec.outputs[0]: batch_axis}
        export_module(
            blocks[i],
            [examples[i]],
            directory / spec.file,
            input_names=spec.inputs,
            output_names=spec.outputs,
            free_axes=axes,
        )
        progress.update(1)
    for spec, fit in zip(bundle.ramps, fits):
        module = PooledLinear(fit.to_linear()) if not spec.final else head
        axes = {spec.inputs[0]: batch_axis, spec.output: batch_axis}
        export_module(
            module,
            [examples[spec.after + 1]],
            directory / spec.file,
            input_names=spec.inputs,
            output_names=[spec.output],
            free_axes=axes,
        )
        progress.update(1)
    progress.close()


def build(directory, *, train_size: int, heldout_size: int, seed: int, bar) -> dict:
    report: dict = {"model": NAME}
    splits = digits_splits(train_size, heldout_size, seed)
    torch.manual_seed(seed)
    blocks = make_blocks()
    head = PooledLinear(nn.Linear(CHANNELS[-1] * 4, len(splits.labels)))
    model = nn.Sequential(*blocks, head)
    x = torch.from_numpy(splits.train_x)
    y = torch.from_numpy(splits.train_label)

    started = time.perf_counter()
    _train(model, x, y, seed=seed, bar=bar)

    feats = _features(blocks, x)
    head_fit = LinearFit(
        weight=head.linear.weight.detach().numpy().copy(),
        bias=head.linear.bias.detach().numpy().copy(),
        train_accuracy=0.0,
    )
    own = head_fit.logits(feats[-1]).argmax(1)
    head_fit.train_accuracy = float((own == splits.train_label).mean())
    progress = bar(len(CHANNELS) - 1, "training ramps on the model's own answers")
    ramps = []
    for i in range(len(CHANNELS) - 1):
        ramps.append(train_linear(feats[i], own, len(splits.labels), seed=seed))
        progress.update(1)
    progress.close()
    report["train_seconds"] = time.perf_counter() - started
    report["head_train_accuracy"] = head_fit.train_accuracy
    report["ramp_train_agreement"] = [r.train_accuracy for r in ramps]
    heldout_x = torch.from_numpy(splits.heldout_x)
    with torch.no_grad():
        report["torch_reference"] = (np.arange(len(heldout_x)), model(heldout_x).numpy())

    exported = time.perf_counter()
    bundle = manifest(splits.labels)
    _export(directory, bundle, blocks, head, ramps + [head_fit], x, bar)
    report["export_seconds"] = time.perf_counter() - exported
    report["manifest"] = bundle
    report["heldout"] = {"x": splits.heldout_x, "label": splits.heldout_label}
    return report
