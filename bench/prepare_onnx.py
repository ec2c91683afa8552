"""`exitplan prepare --onnx` on models the team did not write: how long it takes, and how good its
automatic ramp placement is against exhaustive search, side by side in one run.

Models (built here from what packages ship; tests/byom_models.py):
- ``cnn5m``: a residual CNN of ~5 M parameters on scikit-learn's digits scaled to 3x32x32, trained
  for ``--epochs`` (default 1) so its answers are a trained model's; ``--samples`` (default 2,000;
  the 1,797 digits, then shifted copies) in DATA.npz;
- ``cnn``: the small residual CNN of the tests (digits at 1x32x32);
- ``minilm``: MiniLM with the MiniLM test bundle's tweet head, exported whole (needs the test bundle:
  artifacts/test-bundles/minilm, built by `make test` or `exitplan prepare --out ...`).

For each: the wall time of `from_onnx` (the whole pipeline: the model on every sample, cut vertices,
candidate split, ramp training, measurement, placement, final split, verification), the ratio to the
5-minute target, then the saving per input of the automatic (greedy) placement and of the best
placement found by exhaustive search over the same candidates (up to --max-ramps ramps) on the
candidates' window, and their ratio.

    python -P bench/prepare_onnx.py [--models cnn5m,cnn,minilm] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from byom_models import ResBlock, digits_cnn, export, minilm_classifier, nn, torch  # noqa: E402

from exitplan.planner.tuning.feedback import FeedbackWindow  # noqa: E402
from exitplan.planner.tuning.placement import best_placement, place_ramps  # noqa: E402
from exitplan.prepare.from_onnx import from_onnx  # noqa: E402

TARGET_S = 300.0


class WideResNet(nn.Module):
    """~4.9 M parameters: stem 3->64, residual blocks 1 x 64, 3 x 128, 3 x 256, TF-style stride-2 downsampling."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU())
        stages: list[nn.Module] = [ResBlock(64)]
        for c_in, c_out in ((64, 128), (128, 256)):
            stages += [nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(c_in, c_out, 3, stride=2), nn.ReLU()]
            stages += [ResBlock(c_out) for _ in range(3)]
        self.body = nn.Sequential(*stages)
        self.fc = nn.Linear(256, classes)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(self.stem(image)).mean(dim=(2, 3)))


def cnn5m(directory: Path, samples: int, epochs: int) -> tuple[Path, Path, int]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = np.kron(digits.images.astype(np.float32) / 16.0, np.ones((4, 4), dtype=np.float32))[:, None]
    x = np.repeat(x, 3, axis=1)
    y = digits.target.astype(np.int64)
    extra = samples - len(y)
    if extra > 0:  # shifted copies of the first digits
        x = np.concatenate([x, np.roll(x[:extra], 2, axis=3)])
        y = np.concatenate([y, y[:extra]])
    x, y = x[:samples], y[:samples]
    torch.manual_seed(0)
    net = WideResNet()
    optimiser = torch.optim.Adam(net.parameters(), lr=1e-3)
    net.train()
    for _ in range(epochs):
        for start in range(0, len(y), 64):
            optimiser.zero_grad()
            loss = nn.functional.cross_entropy(
                net(torch.from_numpy(x[start : start + 64])), torch.from_numpy(y[start : start + 64])
            )
            loss.backward()
            optimiser.step()
    directory.mkdir(parents=True, exist_ok=True)
    model, data = directory / "cnn5m.onnx", directory / "cnn5m.npz"
    export(net, (torch.from_numpy(x[:2]),), model, ["image"], {"image": {0: "n"}, "logits": {0: "n"}})
    np.savez(data, image=x, label=y)
    return model, data, sum(p.numel() for p in net.parameters())


def placement_quality(model: Path, data: Path, report: dict, work: Path, max_ramps: int, budget: float) -> dict:
    """Greedy vs exhaustive on the candidates' window (a bundle that keeps every candidate)."""
    cuts = tuple(c["tensor"] for c in report["candidates"])
    every = from_onnx(model, data, work / "every", cuts=cuts, budget=budget).path
    with np.load(every / "data" / "window.npz") as w:
        window = FeedbackWindow(
            conf=w["conf"], pred=w["pred"], final=w["final"], saving_ms=w["saving_ms"], cost_ms=w["cost_ms"]
        )
    greedy, best = place_ramps(window, budget, max_ramps), best_placement(window, budget, max_ramps)
    return {
        "candidates": len(cuts),
        "greedy_ramps": list(greedy.ramps),
        "greedy_saving_ms": greedy.saving_ms,
        "greedy_subsets_tuned": greedy.evaluated,
        "best_ramps": list(best.ramps),
        "best_saving_ms": best.saving_ms,
        "best_subsets_tuned": best.evaluated,
        "greedy_over_best": greedy.saving_ms / best.saving_ms if best.saving_ms > 0 else 1.0,
    }


def run_one(name: str, work: Path, args: argparse.Namespace) -> dict:
    params = None
    if name == "cnn5m":
        model, data, params = cnn5m(work / "src", args.samples, args.epochs)
    elif name == "cnn":
        model, data = digits_cnn(work / "src")
    else:
        model, data = minilm_classifier(work / "src", REPO / "artifacts" / "test-bundles" / "minilm")
    started = time.perf_counter()
    result = from_onnx(model, data, work / "bundle", max_ramps=args.max_ramps, budget=args.budget, force=True)
    seconds = time.perf_counter() - started
    report = result.report
    row = {
        "model": name,
        "parameters": params,
        "samples": report["samples"],
        "prepare_s": seconds,
        "prepare_over_target": seconds / TARGET_S,
        "kept": report["kept"],
        "chain_max_abs_diff": report["chain_max_abs_diff"],
        "whole_model_ms": report["whole_model_ms"],
        "placement_saving_ms": report.get("placement_saving_ms"),
    }
    row.update(placement_quality(model, data, report, work, args.max_ramps, args.budget))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="cnn5m,cnn,minilm")
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max-ramps", type=int, default=3)
    parser.add_argument("--budget", type=float, default=0.01)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            rows.append(run_one(name.strip(), Path(tmp) / name.strip(), args))
    table = Table(title=f"exitplan prepare --onnx (budget {args.budget}, at most {args.max_ramps} ramps)")
    for col in ("model", "params", "samples", "prepare s", "/ 5 min", "kept", "chain diff", "greedy ms", "best ms",
                "greedy / best", "subsets"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["model"], f"{r['parameters']:,}" if r["parameters"] else "-", str(r["samples"]), f"{r['prepare_s']:.1f}",
            f"{r['prepare_over_target']:.3f}", str(len(r["kept"])), f"{r['chain_max_abs_diff']:.1e}",
            f"{r['greedy_saving_ms']:.3f}", f"{r['best_saving_ms']:.3f}", f"{r['greedy_over_best']:.3f}",
            f"{r['greedy_subsets_tuned']} vs {r['best_subsets_tuned']}",
        )  # fmt: skip
    Console(width=160).print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
