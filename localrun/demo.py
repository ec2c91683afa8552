"""The demo: one run that prepares, profiles, plans and serves three configurations side by side.

vanilla     the whole model in one split, every input in the longest bucket (a CPU worker pads each batch
            only to its longest row, trim.py), no exits
naive-ee    the same with exits at the tuned thresholds (early exit without splitting or buckets)
exitplan    the planner's plan: splits, length buckets (Arlo), replicas, tuned thresholds

The baselines are sized by the same planner held to one split and one bucket (`whole_model`): their batch
size and whether the router runs the model are chosen as the plan's are, so the ratios measure what the
exits, splits and buckets add, not a batch size or a hop the baselines were denied.

All three get the same number of worker processes (the pool's capacity) and the same trace, and each
one's capacity within the SLO is measured by the same search (`exitplan.client.capacity`): the highest
offered rate at which at least 99 % of the requests finish within the SLO, over a short step and over
its last third (refused, failed and lost requests are misses), bracketed by doubling and then bisected;
a few seconds at a rate that passed, not counted, come before the first step and after each miss.
The comparison is the ratio of those measured capacities, with each configuration's latency and
agreement with the full model at its capacity. Beside each, the planner's prediction of that capacity
(localrun/prediction.py: the plan as served, on the same steps of the same trace, with the load
generator's CPU per request read over the search).

Trace lengths are scaled onto the model's range with the trace's 99th percentile mapped to the
longest bucket (longer inputs clipped to it), so short and long inputs both occur; the planner sizes
its buckets from those same lengths.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from exitplan.api.plan import Plan
from exitplan.api.resources import ModelProfileSpec
from exitplan.localrun.deployment import LocalDeployment
from exitplan.localrun.prediction import background_cores, measured_search, served_capacity
from exitplan.localrun.service_setup import (
    ServiceSetup,
    ensure_profiles,
    load_setup,
    planned_result,
    trace_lengths,
    tuned_thresholds,
)

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from exitplan.client.bench import BenchSetup
    from exitplan.client.capacity import CapacityResult, CapacityStep
    from exitplan.planner.service import PlanResult

CONFIGS = ("vanilla", "naive-ee", "exitplan")
ALL_CONFIGS = ("vanilla", "naive-ee", "naive-ee-buckets", "exitplan")
"""`CONFIGS` and naive early exit with the planner's length buckets (one split): what buckets alone add."""


@dataclass
class DemoOptions:
    service_file: Path = Path("examples/minilm-local.yaml")
    trace: Path | None = None
    step_duration: float = 10.0
    """Seconds of trace replayed per step of a capacity search."""
    settle_s: float = 4.0
    """Seconds of trace replayed, not counted, before the first step and after each miss (at a rate that
    passed): a fresh deployment warms up, and one that missed recovers before the next rate is judged."""
    start_rps: float = 8.0
    """The first configuration's first step (vanilla's); the others start at its capacity."""
    max_rps: float = 400.0
    resolution: float = 0.05
    """Bisect until the rate that passed and the rate that missed are within this fraction."""
    max_steps: int = 10
    port: int = 8080
    base_port: int = 9100
    workdir: Path = Path("artifacts/demo")
    seed: int = 0
    configs: tuple[str, ...] = CONFIGS
    """Which configurations to measure, in order (of `ALL_CONFIGS`); the first one's capacity is where
    the others' searches start."""
    routers: int = 1
    """Router processes of every configuration (more than one: behind the local front, as `exitplan up
    --routers N`)."""


@dataclass
class DemoResult:
    thresholds: dict[str, float]
    slo_ms: float = 0.0
    plans: dict[str, dict[str, Any]] = field(default_factory=dict)
    capacities: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per configuration: its measured capacity and the figures at it (`capacity_row`)."""

    def capacity(self, config: str) -> float:
        return float(self.capacities[config]["capacity_rps"]) if config in self.capacities else 0.0

    def ratio(self, config: str, baseline: str) -> float | None:
        """capacity(config) / capacity(baseline); None when the baseline passed at no rate."""
        base = self.capacity(baseline)
        return self.capacity(config) / base if base > 0 else None

    def ratio_bounds(self, config: str, baseline: str) -> tuple[float, float] | None:
        """The range the ratio can take given both searches' brackets (each capacity lies between the
        rate that passed and the rate that missed above it); None unless both were bracketed."""
        a, b = self.capacities.get(config), self.capacities.get(baseline)
        if not a or not b or a["failed_rps"] is None or b["failed_rps"] is None or b["capacity_rps"] <= 0:
            return None
        return a["capacity_rps"] / b["failed_rps"], a["failed_rps"] / b["capacity_rps"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "thresholds": self.thresholds,
            "slo_ms": self.slo_ms,
            "plans": self.plans,
            "capacities": self.capacities,
            "capacity_rps": {c: self.capacity(c) for c in self.capacities},
            "ratios": {f"exitplan/{c}": self.ratio("exitplan", c) for c in ALL_CONFIGS[:-1] if c in self.capacities},
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
    """vanilla and naive early exit as the planner sizes them when it may not split the model nor bucket
    its inputs (one split, the longest length, batch and co-location its own), and the planner's plan."""
    return {name: r.plan for name, r in build_results(setup, thresholds, lengths).items()}


def build_results(
    setup: ServiceSetup,
    thresholds: dict[str, float],
    lengths: np.ndarray | None = None,
    configs: tuple[str, ...] = CONFIGS,
    routers: int = 1,
) -> dict[str, PlanResult]:
    """`build_plans` with the planner's whole results (what the predictions are made from), for `configs`
    (of `ALL_CONFIGS`) on `routers` routers."""
    unknown = [c for c in configs if c not in ALL_CONFIGS]
    if unknown:
        raise ValueError(f"unknown configurations {unknown}; known: {list(ALL_CONFIGS)}")
    off = {name: 2.0 for name in thresholds}
    setups = {
        "vanilla": (whole_model(setup), off, "baseline-vanilla"),
        "naive-ee": (whole_model(setup), thresholds, "baseline-naive"),
        "naive-ee-buckets": (whole_model(setup, buckets=True), thresholds, "baseline-naive-buckets"),
        "exitplan": (setup, thresholds, "initial"),
    }
    return {
        c: planned_result(setups[c][0], setups[c][1], reason=setups[c][2], lengths=lengths, routers=routers)
        for c in configs
    }


def whole_model(setup: ServiceSetup, *, buckets: bool = False) -> ServiceSetup:
    """The setup with the planner held to the whole model in one split and, for a sequence model, one
    bucket at the longest length (unless `buckets`: then the planner sizes length buckets as for the plan):
    the baselines, served by the same data plane as the plan."""
    spec = setup.spec
    planner = spec.planner.model_copy(update={"max_splits": 1, "rebatch": False})
    update: dict[str, Any] = {"planner": planner}
    if setup.manifest.seq_axis is not None and not buckets:
        longest = int(setup.manifest.max_length or max(setup.profiles[spec.pools[0].name].seq_lens))
        update["workload"] = spec.workload.model_copy(update={"length_buckets": [longest]})
    return replace(setup, spec=spec.model_copy(update=update))


def run_demo(opts: DemoOptions, console: Console, keep: bool = False) -> DemoResult:
    setup = load_setup(opts.service_file)
    ensure_profiles(setup, console.print)
    thresholds, lengths, reference = demo_inputs(setup, opts, console)
    results = build_results(setup, thresholds, lengths, opts.configs, opts.routers)
    result, kept = measure_configs(setup, results, thresholds, reference, opts, console, keep=keep)
    console.print(summary_table(result))
    if kept is not None:
        _serve_until_interrupted(kept, setup.spec.model.name, console)
    return result


def demo_inputs(setup: ServiceSetup, opts: DemoOptions, console: Console) -> tuple[dict[str, float], np.ndarray, int]:
    """(the thresholds tuned on the bundle's window, the trace's lengths scaled to the model, the raw length
    scaled to its longest input): what every configuration is planned and measured with."""
    thresholds = tuned_thresholds(setup.bundle, setup.spec.accuracy.max_drop, setup.spec.workload.length_buckets)
    console.print(f"thresholds tuned on the held-out window (budget {setup.spec.accuracy.max_drop:.1%}): {thresholds}")
    lengths, reference = trace_lengths(opts.trace, int(setup.manifest.max_length or 1))
    console.print(
        f"trace lengths scaled so that {reference} tokens (the trace's p99) = {setup.manifest.max_length}; "
        f"p50 {np.percentile(lengths, 50):.0f}, p90 {np.percentile(lengths, 90):.0f}"
    )
    return thresholds, lengths, reference


def measure_configs(
    setup: ServiceSetup,
    results: dict[str, PlanResult],
    thresholds: dict[str, float],
    reference: int,
    opts: DemoOptions,
    console: Console,
    *,
    keep: bool = False,
) -> tuple[DemoResult, LocalDeployment | None]:
    """Start each configuration's plan in turn, search its capacity within the SLO, predict it; with `keep`
    the last one is left running (returned)."""
    from exitplan.client.bench import BenchSetup

    plans = {name: r.plan for name, r in results.items()}
    model = setup.spec.model.name
    slo = setup.spec.slo.latency_ms
    result = DemoResult(thresholds, slo, plans={k: json.loads(p.to_json()) for k, p in plans.items()})
    bench_setup: BenchSetup | None = None
    kept: LocalDeployment | None = None
    configs = list(results)
    for config in configs:
        plan = plans[config]
        dep = LocalDeployment(
            setup.bundle,
            plan,
            setup.spec,
            opts.workdir / config,
            port=opts.port,
            base_port=opts.base_port,
            routers=opts.routers,
            pools=setup.pools,
        )
        console.rule(f"{config}: {describe_plan(plan)}")
        background = background_cores()  # other load on these cores, for the prediction
        with console.status(f"starting {config}..."):
            dep.start()
        try:
            connected = bench_setup = bench_setup or BenchSetup.connect(dep.url, model, setup.bundle)
            start = result.capacity(configs[0]) or opts.start_rps
            cap, client_ms = measured_search(
                dep,
                lambda: _search(opts, dep.url, model, setup.bundle, connected, start, slo, reference, console, config),
            )
            served = served_capacity(
                results[config],
                plan,
                slo,
                trace=opts.trace,
                reference=reference,
                step_s=opts.step_duration,
                sender_ms=client_ms,
                background=background,
                routers=len(dep.router_procs()),
            )
            result.capacities[config] = capacity_row(
                config, describe_plan(plan), cap, served.rate_rps, client_ms, background
            )
            console.print(
                f"{config}: capacity {cap.capacity_rps:.1f} rps within the SLO ({cap.reason}); the planner "
                f"predicted {served.rate_rps:.1f} as served (load generator {client_ms:.2f} ms CPU per request, "
                f"other load {background:.2f} cores)"
            )
        finally:
            if keep and config == configs[-1]:
                kept = dep
            else:
                with console.status(f"stopping {config}..."):
                    dep.stop()
    return result, kept


def describe_plan(plan: Plan) -> str:
    batches = sorted({c.batch_size for c in plan.cells})
    return (
        f"{len(plan.splits)} split(s), buckets {plan.buckets}, {sum(c.replicas for c in plan.cells)} workers, "
        f"batch {'/'.join(str(b) for b in batches)}" + (", split 0 in the router" if plan.colocate else "")
    )


def _search(
    opts: DemoOptions,
    url: str,
    model: str,
    bundle: Path,
    bench_setup: BenchSetup,
    start: float,
    slo: float,
    reference: int,
    console: Console,
    config: str,
) -> CapacityResult:
    """One configuration's capacity search, a line per step."""
    from exitplan.client.bench import find_capacity

    def show(step: CapacityStep) -> None:
        r = step.report
        last = "-" if r.last_third_within_slo_share is None else f"{r.last_third_within_slo_share:.1%}"
        console.print(
            f"  {config:9s} {r.offered_rps:6.1f} rps offered: {r.within_slo_share:6.1%} within the SLO "
            f"(last third {last}), p50 {_ms(r.latency_ms['p50'])} p99 {_ms(r.latency_ms['p99'])} ms, "
            f"errors {r.error_total}, lost {r.lost} -> {'pass' if step.passed else 'miss'}"
        )

    return find_capacity(
        url,
        model,
        bundle,
        opts.trace,
        setup=bench_setup,
        start_rps=start,
        max_rps=opts.max_rps,
        resolution=opts.resolution,
        step_duration=opts.step_duration,
        max_steps=opts.max_steps,
        settle_s=opts.settle_s,
        slo_ms=slo,
        seed=opts.seed,
        reference_max=reference,
        on_step=show,
    )


def capacity_row(
    config: str,
    plan: str,
    cap: CapacityResult,
    predicted_rps: float | None = None,
    client_ms: float | None = None,
    background: float | None = None,
) -> dict[str, Any]:
    """One configuration's measured capacity and the figures of the step at it (`DemoResult.capacities`),
    with the planner's predicted capacity as served and what it took that is not the service's: the load
    generator's CPU per request and the other load on the cores (cores' worth)."""
    at = cap.at_capacity
    latency = at.latency_ms if at else {}
    return {
        "config": config,
        "plan": plan,
        "capacity_rps": cap.capacity_rps,
        "predicted_rps": predicted_rps,
        "client_ms": client_ms,
        "background_cores": background,
        "failed_rps": cap.failed_rps,
        "ended": cap.ended,
        "reason": cap.reason,
        "p50_ms": latency.get("p50"),
        "p95_ms": latency.get("p95"),
        "p99_ms": latency.get("p99"),
        "within_slo_share": at.within_slo_share if at else None,
        "last_third_within_slo_share": at.last_third_within_slo_share if at else None,
        "agreement": at.agreement if at else None,
        "exit_share": at.exit_share if at else {},
        "errors": at.error_total if at else None,
        "lost": at.lost if at else None,
        "steps": [
            {
                "offered_rps": s.report.offered_rps,
                "passed": s.passed,
                "within_slo_share": s.report.within_slo_share,
                "last_third_within_slo_share": s.report.last_third_within_slo_share,
                "p50_ms": s.report.latency_ms["p50"],
                "p99_ms": s.report.latency_ms["p99"],
                "errors": s.report.error_total,
                "lost": s.report.lost,
            }
            for s in cap.steps
        ],
    }


def _serve_until_interrupted(kept: LocalDeployment, model: str, console: Console) -> None:
    """Keep the last configuration serving until one of its processes ends or Ctrl-C; then stop it."""
    console.print(f"[green]exitplan keeps serving[/green] at {kept.url}/v2/models/{model}/infer — Ctrl-C stops it")
    stop = {"now": False}

    def _stop(*_: object) -> None:
        stop["now"] = True

    # as `exitplan up`: SIGINT handled explicitly (a background start inherits it ignored), SIGTERM too
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        while not stop["now"] and all(p.popen and p.popen.poll() is None for p in kept.procs):
            time.sleep(0.5)
    finally:
        kept.stop()


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def summary_table(result: DemoResult) -> Table:
    from rich.table import Table

    table = Table(
        title=f"measured capacity within the {result.slo_ms:.0f} ms SLO: the highest offered rate at which "
        f">= 99 % of requests finished within it, over the step and its last third (refused, failed and lost "
        f"requests count as misses); same trace for each configuration"
    )
    columns = ("config", "what runs", "capacity rps", "predicted rps", "missed at rps", "p50 ms", "p99 ms")
    for col in (*columns, "within SLO (last third)"):
        table.add_column(col, justify="left" if col in ("config", "what runs") else "right")
    table.add_column("agreement with full model", justify="right")
    table.add_column("steps", justify="right")
    for config in ALL_CONFIGS:
        row = result.capacities.get(config)
        if row is None:
            continue
        missed = "-" if row["failed_rps"] is None else f"{row['failed_rps']:.1f}"
        table.add_row(
            config,
            row["plan"],
            f"{row['capacity_rps']:.1f}",
            "-" if row.get("predicted_rps") is None else f"{row['predicted_rps']:.1f}",
            missed,
            _ms(row["p50_ms"]),
            _ms(row["p99_ms"]),
            f"{_pct(row['within_slo_share'])} ({_pct(row['last_third_within_slo_share'])})",
            _pct(row["agreement"]),
            str(len(row["steps"])),
        )
    table.caption = summary_caption(result)
    return table


def summary_caption(result: DemoResult) -> str:
    """The ratios of the measured capacities, their range from the searches' brackets, and a plain
    note for every capacity that is not a bracketed measurement."""
    parts = []
    for baseline in [c for c in ALL_CONFIGS[:-1] if c in result.capacities]:
        ratio = result.ratio("exitplan", baseline)
        if ratio is None:
            parts.append(f"no ratio to {baseline} (it met the target at no rate tried)")
            continue
        bounds = result.ratio_bounds("exitplan", baseline)
        span = f" (between {bounds[0]:.2f}x and {bounds[1]:.2f}x given the search steps)" if bounds else ""
        parts.append(f"{ratio:.2f}x {baseline}{span}")
    lines = ["measured capacities: exitplan = " + ", ".join(parts)]
    predicted = [
        f"{c} {row['predicted_rps'] / row['capacity_rps']:.2f}x"
        for c, row in result.capacities.items()
        if row.get("predicted_rps") is not None and row["capacity_rps"] > 0
    ]
    if predicted:
        lines.append(
            "predicted / measured (the planner's simulation of each plan as served on these cores, with the load "
            "generator and the other load measured before each search): " + ", ".join(predicted)
        )
    for config, row in result.capacities.items():
        if row["ended"] == "ceiling":
            lines.append(f"{config} passed at the highest rate tried: its capacity is a lower bound")
        elif row["ended"] == "floor":
            lines.append(f"{config} missed the target even at the lowest rate tried")
        elif row["ended"] == "steps":
            lines.append(f"{config}'s search ran out of steps ({row['reason']})")
    return "\n".join(lines)
