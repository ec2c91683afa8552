"""`exitplan check BUNDLE`: load, warm up and verify a bundle (held-out chain, source model, exit ramps)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from exitplan.cli_common import positive_ints

if TYPE_CHECKING:
    from rich.console import Console

    from exitplan.prepare.check import CheckReport


def command(
    bundle: Path = typer.Argument(..., help="Bundle directory (holding bundle.yaml), e.g. artifacts/bundles/minilm."),
    source: Path | None = typer.Option(
        None,
        "--source",
        help="The unsplit model as one ONNX file (inputs named like the bundle's): its output on the held-out inputs "
        "must match the chained final ramp's logits within --tolerance. Without it, the chained answer is compared "
        "with full_pred in the held-out data.",
    ),
    output: str | None = typer.Option(
        None,
        "--output",
        help="With --source: the source model's output to compare (default: the one the bundle serves, as "
        "prepare --output chose it).",
    ),
    tolerance: float = typer.Option(
        1e-4, "--tolerance", min=0.0, help="Largest max |logit difference| allowed against --source."
    ),
    buckets: str | None = typer.Option(
        None,
        "--buckets",
        help="Comma-separated length buckets to warm up (default: the bundle's own list, else 16,32,...,max_length). "
        "Fixed-size bundles have one.",
    ),
    batch: int = typer.Option(32, "--batch", min=1, help="Inputs per batch (warm-up and held-out chain)."),
    measure: bool = typer.Option(
        False, "--measure", help="Time each ramp's saving and cost again instead of reading data/window.npz."
    ),
    providers: str = typer.Option(
        "CPUExecutionProvider",
        "--providers",
        help="Comma-separated ONNX Runtime execution providers in order of preference ('auto': CUDA when present).",
    ),
    threads: int = typer.Option(1, "--threads", min=1, help="ONNX Runtime intra-op threads."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the report as JSON (an error too)."),
) -> None:
    """Check a bundle before serving it: every block and ramp ONNX file against bundle.yaml, a warm-up at every
    length bucket, the chained blocks on the held-out data (against full_pred, or --source), and each exit ramp's
    agreement and saving. Exit code 0: ok; 1: a check failed; 2: the bundle cannot be loaded or run."""
    from rich.console import Console

    from exitplan.api.bundle import BundleError
    from exitplan.prepare.check import check_bundle, one_line
    from exitplan.worker_image.bundle_runtime import choose_providers

    console = Console(soft_wrap=True)  # lines whole: a failure names a path, which a wrap at 80 columns would break
    chosen = positive_ints(buckets, "--buckets")
    try:
        with console.status("checking the bundle") as status:
            report = check_bundle(
                bundle,
                source=source,
                output=output,
                tolerance=tolerance,
                buckets=chosen,
                batch=batch,
                measure=measure,
                providers=choose_providers(providers),
                threads=threads,
                log=lambda msg: status.update(msg),
            )
    except (BundleError, ValueError) as err:
        message = one_line(err)
        typer.echo(f"error: {message}", err=True)
        _write_json(json_path, {"bundle": str(bundle), "ok": False, "exit_code": 2, "error": message})
        raise typer.Exit(2) from None
    _print_report(console, report)
    _write_json(json_path, report.to_dict())
    if not report.ok:
        raise typer.Exit(report.exit_code)


def _write_json(path: Path | None, document: dict[str, Any]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=2))


def _print_report(console: Console, report: CheckReport) -> None:
    """Files loaded, warm-up per bucket, the held-out chain, the exit ramps, then the verdict."""
    from rich.table import Table

    console.print(
        f"bundle [bold]{report.bundle}[/bold] ({report.name}, {report.task}): {len(report.files)} ONNX files "
        f"match bundle.yaml ({sum(f.kind == 'block' for f in report.files)} blocks, "
        f"{sum(f.kind == 'ramp' for f in report.files)} ramps) on {', '.join(report.providers)}"
    )
    warm = Table(title="warm-up: every block and ramp, one batch")
    for column in ("bucket", "batch", "first run ms", "warm ms"):
        warm.add_column(column, justify="right")
    for w in report.warmup:
        warm.add_row(str(w.bucket), str(w.batch), f"{w.first_ms:.2f}", f"{w.warm_ms:.2f}")
    console.print(warm)
    if report.heldout_format is not None:
        line = f"held-out: {report.heldout_inputs} inputs chained; final accuracy {report.final_accuracy:.3f}"
        if report.full_pred_agreement is not None:
            line += f"; agreement with full_pred {report.full_pred_agreement:.3f}"
        if report.precision is not None:  # a converted bundle: full_pred is its fp32 source's answer
            line += (
                f" ({report.precision['name']}: bundle.yaml records {report.precision['final_agreement']:.3f} "
                f"with the fp32 source)"
            )
        console.print(line)
    if report.source is not None:
        s = report.source
        verdict = "[green]ok[/green]" if s.passed else "[red]over tolerance[/red]"
        console.print(
            f"source {s.path} (output {s.output!r}): max |diff| {s.max_abs_diff:.3g} vs the final ramp, "
            f"tolerance {s.tolerance:.3g}: {verdict}"
        )
    if report.ramps:
        _print_ramps(console, report)
    for note in report.notes:
        console.print(f"[dim]note: {note}[/dim]")
    for failure in report.failures:
        console.print(f"[red]failed:[/red] {failure}")
    console.print("[green]check passed[/green]" if report.ok else f"[red]check failed[/red] ({len(report.failures)})")


def _print_ramps(console: Console, report: CheckReport) -> None:
    from rich.table import Table

    table = Table(title="exit ramps on the held-out data", caption=f"saving, cost: {report.savings_from or 'n/a'}")
    table.add_column("ramp")
    table.add_column("after block", justify="right")
    table.add_column("agreement with final", justify="right")
    table.add_column("accuracy", justify="right")
    table.add_column("saving ms", justify="right")
    table.add_column("cost ms", justify="right")
    for r in report.ramps:
        table.add_row(
            r.name,
            str(r.after),
            f"{r.agreement:.3f}",
            f"{r.accuracy:.3f}",
            "-" if r.saving_ms is None else f"{r.saving_ms:.3f}",
            "-" if r.cost_ms is None else f"{r.cost_ms:.4f}",
        )
    console.print(table)
