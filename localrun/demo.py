"""The demo: one run that prepares, profiles, plans and serves three configurations side by side.

vanilla     the whole model in one split, every input padded to the longest bucket, no exits
naive-ee    the same with exits at the tuned thresholds (early exit without splitting or buckets)
exitplan    the planner's plan: splits, length buckets (Arlo), replicas, tuned thresholds

All three get the same number of worker processes (the pool's capacity), the same trace window and
the same offered loads: multiples of vanilla's capacity measured at the start of the run.

Trace lengths are scaled onto the model's range with the trace's 99th percentile mapped to the
longest bucket (longer inputs clipped to it), so short and long inputs both occur; the planner sizes
its buckets from those same lengths.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from exitplan.api.plan import Plan
from exitplan.api.resources import ModelProfileSpec
from exitplan.localrun.deployment import LocalDeployment
from exitplan.localrun.service_setup import (
    ServiceSetup,
    ensure_profiles,
    load_setup,
    planned,
    single_split_plan,
    trace_lengths,
    tuned_thresholds,
)

if TYPE_CHECKING:
    from exitplan.client.report import BenchReport

CONFIGS = ("vanilla", "naive-ee", "exitplan")


@dataclass
class DemoOptions:
    service_file: Path = Path("examples/minilm-local.yaml")
    trace: Path | None = None
    loads: tuple[float, ...] = (0.5, 1.0, 1.2, 1.6)
    duration: float = 15.0
    trace_start: float = 0.0
    port: int = 8080
    base_port: int = 9100
    workdir: Path = Path("artifacts/demo")
    seed: int = 0


@dataclass
class DemoResult:
    thresholds: dict[str, float]
    capacity_rps: float
    plans: dict[str, dict] = field(default_factory=dict)
    runs: list[dict] = field(default_factory=list)

    def best_goodput(self, config: str) -> float:
        return max((r["goodput_rps"] for r in self.runs if r["config"] == config), default=0.0)

    def to_dict(self) -> dict:
        return {
            "thresholds": self.thresholds,
            "vanilla_capacity_rps": self.capacity_rps,
            "plans": self.plans,
            "runs": self.runs,
            "best_goodput_rps": {c: self.best_goodput(c) for c in CONFIGS},
        }


def whole_model_ms(profile: ModelProfileSpec, seq_len: int, batch: int) -> float:
    """Latency of every block plus the final head at (seq_len, batch), from the profile (nearest measured)."""
    i = int(np.argmin([abs(s - seq_len) for s in profile.seq_lens]))
    j = int(np.argmin([abs(b - batch) for b in profile.batch_sizes]))
    head = [r for r in profile.ramps if r.after_block == len(profile.blocks) - 1]
    return sum(b.latency_ms[i][j] for b in profile.blocks) + sum(r.latency_ms[i][j] for r in head[-1:])


def baseline_batch(setup: ServiceSetup) -> int:
    """The largest profiled batch whose whole-model latency at the longest bucket fits half the SLO budget."""
    profile = setup.profiles[setup.spec.pools[0].name]
    budget = (setup.spec.slo.latency_ms - setup.spec.slo.slack_ms) / 2
    longest = max(profile.seq_lens)
    fitting = [b for b in profile.batch_sizes if whole_model_ms(profile, longest, b) <= budget]
    return max(fitting, default=min(profile.batch_sizes))


def build_plans(
    setup: ServiceSetup, thresholds: dict[str, float], lengths: np.ndarray | None = None
) -> dict[str, Plan]:
    capacity = setup.spec.pools[0].max_gpus or setup.pools[setup.spec.pools[0].name].capacity
    batch = baseline_batch(setup)
    off = {name: 2.0 for name in thresholds}
    return {
        "vanilla": single_split_plan(
            setup, thresholds=off, replicas=capacity, batch_size=batch, reason="baseline-vanilla"
        ),
        "naive-ee": single_split_plan(
            setup, thresholds=thresholds, replicas=capacity, batch_size=batch, reason="baseline-naive"
        ),
        "exitplan": planned(setup, thresholds, lengths=lengths),
    }


def run_demo(opts: DemoOptions, console, keep: bool = False) -> DemoResult:
    from exitplan.client.bench import BenchSetup, find_capacity, run_bench

    setup = load_setup(opts.service_file)
    ensure_profiles(setup, console.print)
    thresholds = tuned_thresholds(setup.bundle, setup.spec.accuracy.max_drop, setup.spec.workload.length_buckets)
    console.print(f"thresholds tuned on the held-out window (budget {setup.spec.accuracy.max_drop:.1%}): {thresholds}")
    lengths, reference = trace_lengths(opts.trace, int(setup.manifest.max_length or 1))
    console.print(
        f"trace lengths scaled so that {reference} tokens (the trace's p99) = {setup.manifest.max_length}; "
        f"p50 {np.percentile(lengths, 50):.0f}, p90 {np.percentile(lengths, 90):.0f}"
    )
    plans = build_plans(setup, thresholds, lengths)
    model = setup.spec.model.name
    slo = setup.spec.slo.latency_ms
    result = DemoResult(thresholds, 0.0, plans={k: json.loads(p.to_json()) for k, p in plans.items()})
    bench_setup: BenchSetup | None = None
    kept: LocalDeployment | None = None
    for config in CONFIGS:
        dep = LocalDeployment(
            setup.bundle, plans[config], setup.spec, opts.workdir / config, port=opts.port, base_port=opts.base_port
        )
        console.rule(
            f"{config}: {len(plans[config].splits)} split(s), buckets {plans[config].buckets}, "
            f"{sum(c.replicas for c in plans[config].cells)} workers"
        )
        with console.status(f"starting {config}..."):
            dep.start()
        try:
            bench_setup = bench_setup or BenchSetup.connect(dep.url, model, setup.bundle)
            if config == "vanilla":
                cap = find_capacity(
                    dep.url,
                    model,
                    setup.bundle,
                    opts.trace,
                    setup=bench_setup,
                    start_rps=2.0,
                    step_duration=min(opts.duration, 8.0),
                    slo_ms=slo,
                    seed=opts.seed,
                    reference_max=reference,
                )
                result.capacity_rps = cap.capacity_rps
                console.print(f"vanilla capacity: {cap.capacity_rps:.1f} rps within the SLO ({cap.reason})")
            for load in opts.loads:
                rps = max(load * result.capacity_rps, 0.5)
                report = run_bench(
                    dep.url,
                    model,
                    setup.bundle,
                    opts.trace,
                    rps=rps,
                    start=opts.trace_start,
                    duration=opts.duration,
                    slo_ms=slo,
                    seed=opts.seed,
                    setup=bench_setup,
                    reference_max=reference,
                )
                row = _run_row(config, load, report)
                result.runs.append(row)
                console.print(_row_text(row))
        finally:
            if keep and config == CONFIGS[-1]:
                kept = dep
            else:
                with console.status(f"stopping {config}..."):
                    dep.stop()
    console.print(summary_table(result, slo))
    if kept is not None:
        _serve_until_interrupted(kept, model, console)
    return result


def _run_row(config: str, load: float, report: BenchReport) -> dict:
    """One bench run of the demo, as a row of its summary (`DemoResult.runs`)."""
    return {
        "config": config,
        "load": load,
        "offered_rps": report.offered_rps,
        "goodput_rps": report.goodput_rps,
        "p50_ms": report.latency.get("p50"),
        "p95_ms": report.latency.get("p95"),
        "p99_ms": report.latency.get("p99"),
        "agreement_drop": report.agreement_drop,
        "requests": report.requests,
        "results": report.results,
        "overload": report.errors.get("overload", 0),
        "errors": report.error_total,
        "lost": report.lost,
        "exit_share": report.exit_share,
    }


def _serve_until_interrupted(kept: LocalDeployment, model: str, console) -> None:
    """Keep the last configuration serving until one of its processes ends or Ctrl-C; then stop it."""
    console.print(f"[green]exitplan keeps serving[/green] at {kept.url}/v2/models/{model}/infer — Ctrl-C stops it")
    try:
        while all(p.popen and p.popen.poll() is None for p in kept.procs):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        kept.stop()


def _row_text(row: dict) -> str:
    drop = "-" if row["agreement_drop"] is None else f"{row['agreement_drop']:.2%}"
    return (
        f"  {row['config']:9s} x{row['load']:.1f}: offered {row['offered_rps']:.1f} rps, goodput {row['goodput_rps']:.1f} rps, "
        f"p50 {_ms(row['p50_ms'])} p99 {_ms(row['p99_ms'])} ms, drop {drop}, overload {row['overload']}, lost {row['lost']}"
    )


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def summary_table(result: DemoResult, slo_ms: float):
    from rich.table import Table

    table = Table(
        title=f"goodput within the {slo_ms:.0f} ms SLO, same trace, same loads (x vanilla capacity {result.capacity_rps:.1f} rps)"
    )
    for col in (
        "config",
        "load",
        "offered rps",
        "goodput rps",
        "p50 ms",
        "p95 ms",
        "p99 ms",
        "accuracy drop",
        "overload",
        "errors",
        "lost",
    ):
        table.add_column(col, justify="right" if col != "config" else "left")
    for r in result.runs:
        drop = "-" if r["agreement_drop"] is None else f"{r['agreement_drop']:.2%}"
        table.add_row(
            r["config"],
            f"{r['load']:.1f}",
            f"{r['offered_rps']:.1f}",
            f"{r['goodput_rps']:.1f}",
            _ms(r["p50_ms"]),
            _ms(r["p95_ms"]),
            _ms(r["p99_ms"]),
            drop,
            str(r["overload"]),
            str(r["errors"]),
            str(r["lost"]),
        )
    best = {c: result.best_goodput(c) for c in CONFIGS}
    table.caption = (
        f"best goodput: vanilla {best['vanilla']:.1f}, naive-ee {best['naive-ee']:.1f}, exitplan {best['exitplan']:.1f} rps; "
        f"exitplan = {best['exitplan'] / max(best['vanilla'], 1e-9):.2f}x vanilla, {best['exitplan'] / max(best['naive-ee'], 1e-9):.2f}x naive-ee"
    )
    if not any(saturated(result, c) for c in CONFIGS):
        top = max(r["load"] for r in result.runs)
        table.caption += (
            f"\nevery configuration kept up with the highest load (x{top:g}): the ratios are lower bounds; "
            f"add higher loads (--loads ...,{2 * top:g}) to see where each one falls behind"
        )
    return table


def saturated(result: DemoResult, config: str) -> bool:
    """Whether `config` fell behind at its highest load: goodput under 95 % of the offered rate, or errors."""
    runs = [r for r in result.runs if r["config"] == config]
    if not runs:
        return False
    top = max(runs, key=lambda r: r["load"])
    return top["goodput_rps"] < 0.95 * top["offered_rps"] or top["errors"] > 0
