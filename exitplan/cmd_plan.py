"""`exitplan plan SERVICE.yaml`: run the planner offline and print the plan (rich tables, --json, --png)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from exitplan.cli_common import fail, table
from exitplan.cli_common import length_mode as length_mode_choice

if TYPE_CHECKING:
    from rich.console import Console

    from exitplan.api.plan import Plan
    from exitplan.api.resources import EarlyExitServiceSpec, GPUPoolSpec, ModelProfileSpec
    from exitplan.planner.service import PlanResult
    from exitplan.planner.traces import LengthMode, Trace


def load_inputs(
    service_file: Path, extra: list[Path]
) -> tuple[str, EarlyExitServiceSpec, dict[str, GPUPoolSpec], dict[str, ModelProfileSpec]]:
    """(name, spec, pools, profiles) from the service file and extra YAML files (GPUPools, ModelProfiles).

    Profiles not given are looked up in the bundle's profiles/<pool>.yaml (where `exitplan up` caches them).
    """
    from exitplan.api import SpecError, load_resources
    from exitplan.api.resources import EarlyExitService, GPUPool, ModelProfile

    docs = []
    for path in [service_file, *extra]:
        docs.extend(load_resources(path))  # a missing file or bad YAML: SpecError naming the file
    services = [d for d in docs if isinstance(d, EarlyExitService)]
    if len(services) != 1:
        raise SpecError(f"{service_file}: expected exactly one EarlyExitService, found {len(services)}")
    svc = services[0]
    pools = {d.metadata.get("name", ""): d.spec for d in docs if isinstance(d, GPUPool)}
    profiles = {
        d.spec.pool: d.spec for d in docs if isinstance(d, ModelProfile) and d.spec.model == svc.spec.model.name
    }
    bundle = Path(svc.spec.model.bundle.removeprefix("file://"))
    for ref in svc.spec.pools:
        cached = bundle / "profiles" / f"{ref.name}.yaml"
        if ref.name not in profiles and cached.is_file():
            profiles[ref.name] = ModelProfile.model_validate(__import__("yaml").safe_load(cached.read_text())).spec
    return svc.metadata.get("name") or "exitplan", svc.spec, pools, profiles


def trace_lengths(
    trace: Path | None,
    spec: EarlyExitServiceSpec,
    profiles: dict[str, ModelProfileSpec],
    length_mode: LengthMode,
    limit: int | None = None,
) -> Trace | None:
    """Input lengths of a trace fitted to the model's longest length (None without a trace)."""
    if trace is None:
        return None
    from exitplan.planner.traces import load_trace

    top = (
        max(spec.workload.length_buckets)
        if spec.workload.length_buckets
        else max(max(p.seq_lens) for p in profiles.values())
    )
    return load_trace(trace, max_length=int(top), length_mode=length_mode, limit=limit)


def plan_png(result: PlanResult, path: Path) -> None:
    """The plan's pipeline: one row per bucket, one box per split (blocks, pool, replicas x batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plan = result.plan
    n_blocks = result.inputs.n_blocks
    fig, ax = plt.subplots(figsize=(max(6, n_blocks * 0.7), 1.2 + 0.9 * len(plan.buckets)))
    palette = matplotlib.colormaps["tab10"]
    colors = {p: palette(i % 10) for i, p in enumerate(result.inputs.pool_names)}
    for row, bucket in enumerate(plan.buckets):
        for split in plan.splits:
            cells = [c for c in plan.cells if c.split == split.index and c.bucket == bucket]
            label = " + ".join(f"{c.replicas}x{c.pool} b{c.batch_size}" for c in cells)
            pool = cells[0].pool if cells else ""
            ax.barh(
                row,
                split.last_block - split.first_block + 1,
                left=split.first_block,
                height=0.6,
                color=colors.get(pool, "lightgray"),
                edgecolor="black",
                alpha=0.8,
            )
            ax.text((split.first_block + split.last_block + 1) / 2, row, label, ha="center", va="center", fontsize=8)
    ax.set_yticks(
        range(len(plan.buckets)),
        [f"len<={b} ({s:.0%})" for b, s in zip(plan.buckets, plan.length_histogram or [0] * len(plan.buckets))],
    )
    ax.set_xlim(0, n_blocks)
    ax.set_xlabel("block")
    p = plan.prediction
    ax.set_title(
        f"{plan.service}: {len(plan.splits)} split(s), goodput {p.goodput_rps:.0f} req/s, p99 <= {p.p99_ms:.0f} ms, cost {p.cost_per_hour:.2f}/h",
        fontsize=9,
    )
    for name, color in colors.items():
        ax.barh([], [], color=color, label=name)
    ax.legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def command(
    service_file: Path = typer.Argument(
        ..., help="EarlyExitService YAML (may also hold GPUPool and ModelProfile documents)."
    ),
    with_files: list[Path] = typer.Option([], "--with", "-w", help="More YAML files with GPUPools / ModelProfiles."),
    trace: Path | None = typer.Option(None, "--trace", help="Size the length buckets from this trace's input lengths."),
    length_mode: str = typer.Option("scale", help="Fit trace lengths to the model: scale or clip."),
    thresholds_file: Path | None = typer.Option(
        None,
        "--thresholds",
        help="JSON {ramp: threshold}: the plan names them and is sized with them (default: none, so no ramp exits).",
    ),
    previous: Path | None = typer.Option(
        None, "--previous", help="A previous plan.json: keep its layout when close (fewest changes)."
    ),
    json_out: Path | None = typer.Option(None, "--json", help="Write the plan and solver details as JSON here."),
    png: Path | None = typer.Option(None, "--png", help="Draw the plan's pipeline into this PNG."),
    served: bool = typer.Option(
        True,
        "--served/--fluid-only",
        help="Also simulate the plan as served (routers' CPU, shared cores, bursts, admission) and print the "
        "highest rate that keeps >= 99 % within the SLO (the trace's own arrivals with --trace, else Poisson).",
    ),
) -> None:
    """Plan a service offline: splits x replicas x pools (E3), length buckets (Arlo), batch sizes; print the plan."""
    from rich.console import Console
    from rich.markup import escape

    from exitplan.api.plan import Plan
    from exitplan.planner import plan_change

    console = Console()
    name, spec, pools, profiles = load_inputs(service_file, with_files)
    lengths = trace_lengths(trace, spec, profiles, length_mode_choice(length_mode))
    thresholds = _read_json(thresholds_file) if thresholds_file else None
    prev = Plan.from_file(previous) if previous else None
    result = _solve(console, name, spec, pools, profiles, thresholds, prev, lengths)
    as_served = _as_served(result, spec, lengths) if served else None
    _print_plan(console, name, spec, result, as_served)
    if prev is not None:
        change = plan_change(prev, result.plan)
        console.print(
            f"change from the previous plan: {change.added} instance(s) started, {change.removed} stopped, {change.kept} kept"
        )
    for note in result.notes:
        console.print(f"[dim]note: {escape(note)}[/dim]")
    if json_out:
        _write_json(result, json_out, as_served)
        console.print(f"wrote {json_out}")
    if png:
        plan_png(result, png)
        console.print(f"wrote {png}")


def _read_json(path: Path) -> dict[str, float]:
    from exitplan.api import SpecError

    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise SpecError(f"{path}: not valid JSON: {err}") from err
    if not isinstance(doc, dict) or not all(isinstance(v, (int, float)) for v in doc.values()):
        raise SpecError(f"{path}: expected a JSON object of ramp name -> threshold (numbers)")
    return {str(k): float(v) for k, v in doc.items()}


def _solve(
    console: Console,
    name: str,
    spec: EarlyExitServiceSpec,
    pools: dict[str, GPUPoolSpec],
    profiles: dict[str, ModelProfileSpec],
    thresholds: dict[str, float] | None,
    prev: Plan | None,
    lengths: Trace | None,
) -> PlanResult:
    """The verified planner result, or exit 2 with the planner's error printed."""

    from exitplan.planner import PlannerError, plan_service

    try:
        result = plan_service(
            name,
            spec,
            pools,
            profiles,
            thresholds=thresholds,
            previous=prev,
            lengths=None if lengths is None else lengths.lengths.tolist(),
            reason="cli",
        )
        result.verify()
    except PlannerError as err:
        fail(f"cannot plan {name} ({type(err).__name__}, field {err.field or '-'}): {err}")
    return result


def _as_served(result: PlanResult, spec: EarlyExitServiceSpec, lengths: Trace | None) -> float:
    """The plan's capacity as served (planner/predict.py): the trace's own arrivals looped and scaled when
    one is given, else Poisson with the plan's lengths."""
    import numpy as np
    import numpy.typing as npt

    from exitplan.planner.arrivals import looped_trace
    from exitplan.planner.predict import serving_capacity, serving_path, simulated_seconds

    seconds = simulated_seconds(result)
    arrivals = None
    if lengths is not None:
        trace = lengths

        def arrivals(rate: float) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
            return looped_trace(trace.timestamps, trace.lengths, rate, seconds)

    path = serving_path(result, routers=spec.router.replicas)
    return serving_capacity(result, spec.slo.latency_ms, path=path, arrivals=arrivals, seconds=seconds).rate_rps


def _print_plan(
    console: Console, name: str, spec: EarlyExitServiceSpec, result: PlanResult, as_served: float | None = None
) -> None:
    """The plan's summary table, then one row per cell (worker Deployment)."""

    plan, pred = result.plan, result.plan.prediction
    columns = (
        "splits",
        "buckets",
        "goodput req/s",
        "as served req/s",
        "p99 bound ms",
        "cost /h",
        "cycle ms",
        "solve s",
    )
    head = table(*columns, title=f"plan for {name} ({spec.model.name})")
    head.add_row(
        " | ".join(f"{s.first_block}-{s.last_block}" for s in plan.splits),
        ",".join(map(str, plan.buckets)),
        f"{pred.goodput_rps:.1f}",
        "-" if as_served is None else f"{as_served:.1f}",
        f"{pred.p99_ms:.1f}",
        f"{pred.cost_per_hour:.2f}",
        f"{result.cycle_ms:.1f}",
        f"{result.timings['total']:.3f}",
    )
    console.print(head)
    cell_columns = ("split", "blocks", "rebatch", "bucket", "share", "pool", "replicas", "batch", "batch ms")
    cells = table(*cell_columns, title="cells (one worker Deployment each)")
    shares = dict(zip(plan.buckets, plan.length_histogram))
    for c in plan.cells:
        s = plan.splits[c.split]
        cells.add_row(
            str(c.split),
            f"{s.first_block}-{s.last_block}",
            "yes" if s.rebatch else "no",
            str(c.bucket),
            f"{shares.get(c.bucket, 0):.1%}",
            c.pool,
            str(c.replicas),
            str(c.batch_size),
            f"{result.stage_ms[(c.split, c.bucket)]:.2f}",
        )
    console.print(cells)


def _write_json(result: PlanResult, path: Path, as_served: float | None = None) -> None:
    """The plan and the solver's details (timings, cycle, notes, alternatives) as JSON."""
    body = {
        "plan": result.plan.dump(),
        "served_rps": as_served,
        "timings": result.timings,
        "cycle_ms": result.cycle_ms,
        "notes": result.notes,
        "alternatives": result.alternatives,
        "kept_previous": result.kept_previous,
    }
    path.write_text(json.dumps(body, indent=2, default=float))
