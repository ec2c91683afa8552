"""Threshold tuner vs exhaustive grid search.

For every window: the grid optimum (every ramp at 0.00, 0.01, ..., 1.00 or disabled for 2-3 ramps;
step 0.05 for 4 ramps), then the tuner from all-disabled thresholds, side by side, each checked on
the window itself: the ratio of savings (tuner / grid) and whether the budget holds. Three tuner
variants: the default (``profile`` climb, budget-programme restart, refinement), the default
without its restart, and Apparate's plain step climb (``steps``: no restart, no refinement).

Windows:
- synthetic: ``exitplan.planner.tuning.synthetic_windows.synthetic_window`` (per-input difficulty, confidence
  rising with depth, agreement probability conf ** gamma), 1,024 inputs, 2/3/4 ramps, knobs drawn
  per window;
- MiniLM: the real ramp outputs of the bundle's held-out set (``--window``, default
  artifacts/bundles/minilm/data/window.npz): 1,024 inputs drawn per window (without replacement
  when the file holds enough, else a bootstrap resample), a random subset of 2-4 of its ramps.
Budgets are drawn from {0.5 %, 1 %, 2 %, 5 %}.

    python bench/tuner_vs_grid.py [--windows 150] [--window PATH] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from exitplan.planner.tuning.grid import grid_search
from exitplan.planner.tuning.synthetic_windows import synthetic_window
from exitplan.planner.tuning.thresholds import FeedbackWindow, allowed_disagreements, outcome, tune

REPO = Path(__file__).resolve().parents[1]
DEFAULT_WINDOW = REPO / "artifacts" / "bundles" / "minilm" / "data" / "window.npz"
BUDGETS = (0.005, 0.01, 0.02, 0.05)
METHODS = {
    "default (profile climb, DP restart, refine)": dict(),
    "profile climb + refine, no restart": dict(restart=False),
    "steps (Apparate, plain)": dict(method="steps", refine_pass=False, restart=False),
}
DEFAULT = next(iter(METHODS))
N_INPUTS = 1024


def synthetic_windows(count: int, rng: np.random.Generator):
    for i in range(count):
        r = 2 + i % 3
        yield "synthetic", synthetic_window(rng, n=N_INPUTS, r=r), float(rng.choice(BUDGETS))


def real_windows(source: FeedbackWindow, count: int, rng: np.random.Generator):
    for i in range(count):
        r = 2 + i % 3
        ramps = sorted(rng.choice(source.n_ramps, size=r, replace=False).tolist())
        replace = source.n_inputs < N_INPUTS
        rows = rng.choice(source.n_inputs, size=N_INPUTS, replace=replace)
        yield "minilm", source.subset(rows, ramps), float(rng.choice(BUDGETS))


def run(windows, total: int, console: Console) -> list[dict]:
    records = []
    for source, w, budget in tqdm(windows, total=total, desc="windows", file=sys.stderr):
        step = 0.01 if w.n_ramps <= 3 else 0.05
        began = time.perf_counter()
        grid = grid_search(w, budget, step)
        grid_s = time.perf_counter() - began
        allowed = allowed_disagreements(w.n_inputs, budget)
        rec = {
            "source": source,
            "ramps": w.n_ramps,
            "budget": budget,
            "grid_step": step,
            "grid_saving_ms": grid.saving_ms,
            "grid_agreement": grid.agreement,
            "grid_s": grid_s,
            "tuners": {},
        }
        for name, kwargs in METHODS.items():
            began = time.perf_counter()
            res = tune(w, budget, **kwargs)
            took = time.perf_counter() - began
            out = outcome(w, res.thresholds)  # judged on the window, not on what the tuner says
            rec["tuners"][name] = {
                "saving_ms": out.saving_ms,
                "agreement": out.agreement,
                "s": took,
                "budget_held": bool(w.n_inputs - out.agree_count <= allowed),
                "ratio": out.saving_ms / grid.saving_ms if grid.saving_ms > 1e-9 else None,
                "not_below_grid": bool(out.saving_ms >= grid.saving_ms - 1e-9),
            }
        records.append(rec)
    return records


def summarize(records: list[dict], console: Console) -> dict:
    summary = {}
    table = Table(title="tuner saving / grid-optimum saving (same window, budget checked on the window)")
    for col in (
        "source",
        "ramps",
        "tuner",
        "windows",
        "median",
        "p5",
        "worst",
        ">= 99.5 %",
        "budget held",
        "grid saves 0: tuner >= grid",
        "tune ms (median)",
        "grid ms (median)",
    ):
        table.add_column(col, justify="left" if col in ("source", "tuner") else "right")
    groups = sorted({(r["source"], r["ramps"]) for r in records}) + sorted({(r["source"], 0) for r in records})
    for source, ramps in groups:
        rows = [r for r in records if r["source"] == source and (ramps == 0 or r["ramps"] == ramps)]
        for name in METHODS:
            ratios = np.array([r["tuners"][name]["ratio"] for r in rows if r["tuners"][name]["ratio"] is not None])
            zero = [r for r in rows if r["tuners"][name]["ratio"] is None]
            held = sum(r["tuners"][name]["budget_held"] for r in rows)
            key = f"{source}/{'all' if ramps == 0 else ramps}/{name}"
            summary[key] = {
                "windows": len(rows),
                "median": float(np.median(ratios)) if ratios.size else None,
                "p5": float(np.percentile(ratios, 5)) if ratios.size else None,
                "worst": float(ratios.min()) if ratios.size else None,
                "share_ge_0995": float((ratios >= 0.995).mean()) if ratios.size else None,
                "budget_held": held,
                "grid_zero": len(zero),
                "grid_zero_not_below": sum(r["tuners"][name]["not_below_grid"] for r in zero),
            }
            s = summary[key]
            table.add_row(
                source,
                "all" if ramps == 0 else str(ramps),
                name,
                str(len(rows)),
                f"{s['median']:.4f}" if ratios.size else "-",
                f"{s['p5']:.4f}" if ratios.size else "-",
                f"{s['worst']:.4f}" if ratios.size else "-",
                f"{s['share_ge_0995']:.1%}" if ratios.size else "-",
                f"{held}/{len(rows)}",
                f"{s['grid_zero_not_below']}/{len(zero)}",
                f"{1e3 * np.median([r['tuners'][name]['s'] for r in rows]):.2f}",
                f"{1e3 * np.median([r['grid_s'] for r in rows]):.1f}",
            )
        if ramps == 0 or (source, ramps) != groups[-1]:
            table.add_section()
    console.print(table)
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=150, help="windows per source (>= 100 for the issue)")
    parser.add_argument("--window", type=Path, default=DEFAULT_WINDOW, help="MiniLM ramp outputs (.npz)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    console = Console(width=200)
    rng = np.random.default_rng(args.seed)
    records = run(synthetic_windows(args.windows, rng), args.windows, console)
    real_note = None
    if args.window.exists():
        source = FeedbackWindow.load(args.window)
        console.print(
            f"MiniLM window: {args.window} ({source.n_inputs} held-out inputs, {source.n_ramps} ramps: "
            f"{', '.join(source.ramps)}); {N_INPUTS} inputs per window drawn "
            f"{'with' if source.n_inputs < N_INPUTS else 'without'} replacement"
        )
        records += run(real_windows(source, args.windows, rng), args.windows, console)
    else:
        real_note = f"NO REAL WINDOWS: {args.window} does not exist (build the bundle with `exitplan prepare`); only synthetic windows were measured"
        console.print(f"[bold red]{real_note}[/bold red]")
    summary = summarize(records, console)
    verdicts = []
    for source in sorted({r["source"] for r in records}):
        s = summary[f"{source}/all/{DEFAULT}"]
        ok = (
            s["median"] is not None
            and s["median"] >= 0.995
            and s["worst"] >= 0.97
            and s["budget_held"] == s["windows"]
            and s["grid_zero_not_below"] == s["grid_zero"]
        )
        verdicts.append(ok)
        console.print(
            f"{source}: default tuner median {s['median']:.4f} (>= 0.995), worst {s['worst']:.4f} (>= 0.97), "
            f"budget held {s['budget_held']}/{s['windows']}: {'PASS' if ok else 'FAIL'}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"summary": summary, "real_windows_missing": real_note, "records": records}, indent=1)
        )
    return 0 if all(verdicts) and real_note is None else 1


if __name__ == "__main__":
    sys.exit(main())
