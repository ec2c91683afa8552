"""`exitplan simulate SERVICE.yaml --trace T`: replay a trace through each configuration's plan in the
discrete-event simulator and compare (rich table, --json, --png latency CDFs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from exitplan.cli_common import fail
from exitplan.cli_common import length_mode as length_mode_choice
from exitplan.cli_common import table as make_table

if TYPE_CHECKING:
    from rich.console import Console

    from exitplan.api.resources import EarlyExitServiceSpec, GPUPoolSpec, ModelProfileSpec
    from exitplan.planner.service import PlanResult
    from exitplan.planner.sim_result import SimResult
    from exitplan.planner.traces import LengthMode, Trace


def cdf_png(results: list[SimResult], slo_ms: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for res in results:
        lat = np.sort(res.latencies_ms)
        if len(lat):
            ax.plot(lat, np.arange(1, len(lat) + 1) / res.offered, label=f"{res.name} ({res.goodput:.0f} req/s good)")
    ax.axvline(slo_ms, color="black", linestyle="--", linewidth=1, label="SLO")
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("fraction of offered requests answered")
    ax.set_ylim(0, 1.01)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def command(
    service_file: Path = typer.Argument(
        ..., help="EarlyExitService YAML (may also hold GPUPool and ModelProfile documents)."
    ),
    trace: Path | None = typer.Option(
        None, "--trace", help="Trace (Azure CSV or JSON lines); default: the shared Azure trace."
    ),
    with_files: list[Path] = typer.Option([], "--with", "-w", help="More YAML files with GPUPools / ModelProfiles."),
    configs: str = typer.Option(
        "vanilla,naive-ee,naive-ee+buckets,e3,e3+buckets,arlo,exitplan,oracle",
        help="Comma-separated configurations to compare.",
    ),
    rate: float | None = typer.Option(None, help="Mean request rate (req/s) to simulate; default: the trace's own."),
    duration: float = typer.Option(
        60.0, help="Seconds to simulate at that rate, whatever the trace's own length (its pattern loops)."
    ),
    arrivals: str = typer.Option(
        "trace", help="trace: the trace's arrival pattern looped and scaled to the rate; poisson: Poisson arrivals."
    ),
    length_mode: str = typer.Option("scale", help="Fit trace lengths to the model: scale or clip."),
    seed: int = typer.Option(0, help="Seed of the exit-depth draws."),
    json_out: Path | None = typer.Option(None, "--json", help="Write per-configuration results as JSON here."),
    png: Path | None = typer.Option(None, "--png", help="Draw latency CDFs per configuration into this PNG."),
) -> None:
    """Compare vanilla, naive early exit, E3, Arlo, exitplan and the oracle bound on one trace, at equal cost."""
    from rich.console import Console

    from exitplan.cmd_plan import load_inputs

    console = Console()
    name, spec, pools, profiles = load_inputs(service_file, with_files)
    wanted = _wanted(configs)
    mode = length_mode_choice(length_mode)
    path, full, tr = _load_traces(console, trace, spec, profiles, mode, rate, duration, arrivals, seed)
    results, rows = _compare(wanted, name, spec, pools, profiles, full, tr, seed)
    _print_table(console, name, spec, tr, rows)
    if json_out:
        _write_json(json_out, name, path, tr, rows)
        console.print(f"wrote {json_out}")
    if png and results:
        cdf_png(results, spec.slo.latency_ms, png)
        console.print(f"wrote {png}")


def _wanted(configs: str) -> list[str]:
    """The configurations named in --configs, each one known."""
    from exitplan.planner.compare import CONFIGS

    wanted = [c.strip() for c in configs.split(",") if c.strip()]
    unknown = [c for c in wanted if c not in CONFIGS]
    if unknown:
        raise typer.BadParameter(
            f"unknown configurations {unknown}; choose from {list(CONFIGS)}", param_hint="--configs"
        )
    return wanted


def _load_traces(
    console: Console,
    trace: Path | None,
    spec: EarlyExitServiceSpec,
    profiles: dict[str, ModelProfileSpec],
    length_mode: LengthMode,
    rate: float | None,
    duration: float,
    arrivals: str,
    seed: int,
) -> tuple[Path, Trace, Trace]:
    """(path, full trace, what to replay): lengths fitted to the model's longest; `duration` seconds at `rate`
    (default: the trace's own mean rate), the trace's pattern looped and scaled or Poisson arrivals with
    lengths drawn from the trace."""
    import numpy as np

    from exitplan.planner.arrivals import looped_trace, poisson_for
    from exitplan.planner.traces import Trace, TraceError, default_trace_path, load_trace

    if arrivals not in ("trace", "poisson"):
        raise typer.BadParameter(f"choose trace or poisson, not {arrivals!r}", param_hint="--arrivals")
    if duration <= 0 or (rate is not None and rate <= 0):
        raise typer.BadParameter("--rate and --duration must be > 0", param_hint="--rate/--duration")
    try:
        path = trace or default_trace_path()
        top = (
            max(spec.workload.length_buckets)
            if spec.workload.length_buckets
            else max(max(p.seq_lens) for p in profiles.values())
        )
        full = load_trace(path, max_length=int(top), length_mode=length_mode)
    except TraceError as err:
        fail(f"trace: {err}")
    mean = rate or full.mean_rate
    if arrivals == "poisson":
        rng = np.random.default_rng(seed)
        times = poisson_for(rng, mean, duration)
        lengths = rng.choice(full.lengths, size=len(times))
    else:
        times, lengths = looped_trace(full.timestamps, full.lengths, mean, duration)
    tr = Trace(times, lengths, str(path))
    console.print(
        f"trace {path}: {len(tr)} requests over {duration:g} s ({len(tr) / duration:.1f} req/s, "
        f"{'Poisson' if arrivals == 'poisson' else 'its pattern looped'}), lengths fitted to {top} ({length_mode})"
    )
    return path, full, tr


def _compare(
    wanted: list[str],
    name: str,
    spec: EarlyExitServiceSpec,
    pools: dict[str, GPUPoolSpec],
    profiles: dict[str, ModelProfileSpec],
    full: Trace,
    tr: Trace,
    seed: int,
) -> tuple[list[SimResult], list[dict[str, Any]]]:
    """(simulation results, one row per configuration): plan each, replay `tr` through it; the oracle's bound last."""
    from rich.progress import track

    from exitplan.planner.compare import oracle_for, plan_config, simulate_plan
    from exitplan.planner.errors import PlannerError

    results: list[SimResult] = []
    rows: list[dict[str, Any]] = []
    plans: dict[str, PlanResult] = {}
    for cfg in track([c for c in wanted if c != "oracle"], description="planning and simulating"):
        try:
            res_plan = plan_config(cfg, name, spec, pools, profiles, lengths=full.lengths.tolist())
        except PlannerError as err:
            rows.append({"config": cfg, "error": str(err)})
            continue
        plans[cfg] = res_plan
        res = simulate_plan(res_plan, tr.timestamps, tr.lengths, spec.slo.latency_ms, seed=seed, name=cfg)
        results.append(res)
        rows.append(
            {
                **res.summary(),
                "planned_goodput_rps": res_plan.plan.prediction.goodput_rps,
                "splits": len(res_plan.plan.splits),
                "buckets": res_plan.plan.buckets,
            }
        )
    if "oracle" in wanted and plans:
        any_plan = plans.get("exitplan") or next(iter(plans.values()))
        bound = oracle_for(any_plan, tr.lengths, tr.mean_rate, seed=seed)
        rows.append(
            {
                "config": "oracle",
                "goodput_rps": bound,
                "note": "fluid bound: min(offered rate, capacity with perfect batching, exits and ramps as drawn, no padding, within the caps and cost cap)",
            }
        )
    return results, rows


def _print_table(
    console: Console, name: str, spec: EarlyExitServiceSpec, tr: Trace, rows: list[dict[str, Any]]
) -> None:
    """One row per configuration (planning errors printed below their row's mark)."""
    from rich.markup import escape

    table = make_table(  # two-line headers: ten columns fit 80 characters
        "config",
        "splits",
        "buckets",
        "goodput\nreq/s",
        "within\nSLO",
        "p50\nms",
        "p99\nms",
        "over\nSLO",
        "drops",
        "cost\n/h",
        title=f"{name}: {len(tr)} requests, SLO {spec.slo.latency_ms:g} ms",
    )
    for r in rows:
        if "error" in r:
            table.add_row(r["config"], "-", "-", "[red]no plan[/red]", "-", "-", "-", "-", "-", "-")
            console.print(f"[red]{r['config']}[/red]: {escape(r['error'])}")
        elif r["config"] == "oracle":
            table.add_row("oracle", "-", "-", f"{r['goodput_rps']:.1f}", "-", "-", "-", "-", "-", "(bound)")
        else:
            table.add_row(
                r["config"],
                str(r["splits"]),
                ",".join(map(str, r["buckets"])),
                f"{r['goodput_rps']:.1f}",
                f"{r['attainment']:.1%}",
                f"{r['p50_ms']:.1f}",
                f"{r['p99_ms']:.1f}",
                str(r["violations"]),
                str(r["dropped"]),
                f"{r['cost_per_hour']:.2f}",
            )
    console.print(table)


def _write_json(out: Path, name: str, path: Path, tr: Trace, rows: list[dict[str, Any]]) -> None:
    import numpy as np

    out.write_text(
        json.dumps(
            {"service": name, "trace": str(path), "requests": len(tr), "rows": rows},
            indent=2,
            default=lambda x: x.tolist() if isinstance(x, np.ndarray) else float(x),
        )
    )
