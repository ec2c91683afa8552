"""`exitplan prepare`: build an early-exit model bundle (ramps injected, trained, exported to ONNX)."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def command(
    model: str = typer.Option(
        "minilm", "--model", help="Model to prepare: minilm (text, 6 blocks) or digits-cnn (images, 3 blocks)."
    ),
    out: Path | None = typer.Option(
        None, "--out", help="Bundle directory (default: artifacts/bundles/<model> under the current directory)."
    ),
    train_size: int | None = typer.Option(
        None, "--train-size", help="Training inputs (default: 8000 for minilm, 1437 for digits-cnn)."
    ),
    heldout_size: int | None = typer.Option(
        None,
        "--heldout-size",
        help="Held-out inputs kept in the bundle (default: 2000 for minilm, 360 for digits-cnn).",
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the data splits and the training."),
    max_length: int = typer.Option(128, "--max-length", help="Longest token sequence the MiniLM bundle accepts."),
    force: bool = typer.Option(
        False, "--force", help="Rebuild even if a finished bundle with the same options exists."
    ),
    threads: int | None = typer.Option(
        None,
        "--threads",
        min=1,
        help="PyTorch threads for training (default: every core when the machine is idle, 1 when it is busy).",
    ),
    json_path: Path | None = typer.Option(
        None, "--json", help="Also write the build report (accuracy, agreement, timings) as JSON."
    ),
    onnx_model: Path | None = typer.Option(
        None, "--onnx", help="Your own ONNX classifier: ramps are placed at its cut vertices automatically."
    ),
    data: Path | None = typer.Option(
        None, "--data", help="With --onnx: DATA.npz, one array per model input keyed by its name, optional `label`."
    ),
    labels: Path | None = typer.Option(None, "--labels", help="With --onnx: class names, one a line (default 0..C-1)."),
    max_ramps: int = typer.Option(3, "--max-ramps", min=0, help="With --onnx: most exit ramps kept."),
    cuts: str | None = typer.Option(
        None, "--cuts", help="With --onnx: place ramps at these tensors (comma-separated cut vertices) instead."
    ),
    seq_axis: int | None = typer.Option(
        None, "--seq-axis", help="With --onnx: the inputs' sequence axis (default: 1 for integer [N, L] inputs)."
    ),
    ramp_hidden: int = typer.Option(
        0, "--ramp-hidden", min=0, help="With --onnx: MLP ramps of this width (0: linear)."
    ),
    budget: float = typer.Option(0.01, "--budget", help="With --onnx: accuracy budget the ramp placement tunes to."),
) -> None:
    """Build an early-exit bundle: train the head and the ramps (backbone frozen), export each block and ramp to
    ONNX, and write bundle.yaml, the tokenizer, the held-out data and a calibration window. A rerun with the same
    options reuses the finished bundle."""
    from rich.console import Console

    from exitplan.api.bundle import BundleError
    from exitplan.prepare.build import BuildOptions, PrepareError, prepare_bundle
    from exitplan.prepare.datasets import DatasetError
    from exitplan.prepare.minilm import ModelNotInstalled

    console = Console()
    if onnx_model is not None:
        onnx_options = dict(
            labels=labels, max_ramps=max_ramps, cuts=cuts, seq_axis=seq_axis, ramp_hidden=ramp_hidden, budget=budget
        )
        _prepare_onnx(console, onnx_model, data, out, onnx_options, force, threads, json_path)
        return
    options = BuildOptions(
        model=model, train_size=train_size, heldout_size=heldout_size, seed=seed, max_length=max_length
    )
    target = out if out is not None else Path("artifacts") / "bundles" / model
    try:
        result = prepare_bundle(options, target, force=force, threads=threads)
    except (PrepareError, DatasetError, ModelNotInstalled, BundleError) as err:
        console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(2) from err

    _print_report(console, result)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"path": str(result.path), "reused": result.reused, **result.report}, indent=2))


def _prepare_onnx(console, model: Path, data: Path | None, out: Path | None, options: dict, force, threads, json_path):
    """`--onnx`: the user's model through the automatic pipeline (exitplan.prepare.from_onnx)."""
    from exitplan.prepare.build import PrepareError
    from exitplan.prepare.from_onnx import from_onnx
    from exitplan.prepare.graph_cuts import GraphError
    from exitplan.prepare.user_data import DataError

    if data is None:
        console.print("[red]error:[/red] --onnx needs --data DATA.npz (one array per model input, keyed by its name)")
        raise typer.Exit(2)
    cuts = tuple(c.strip() for c in (options.pop("cuts") or "").split(",") if c.strip())
    labels = options.pop("labels")
    seq_axis = options.pop("seq_axis")
    target = out if out is not None else Path("artifacts") / "bundles" / model.stem.lower()
    try:
        result = from_onnx(
            model,
            data,
            target,
            force=force,
            threads=threads,
            cuts=cuts,
            labels=None if labels is None else str(labels),
            seq_axis=-1 if seq_axis is None else seq_axis,
            **options,
        )
    except (PrepareError, GraphError, DataError) as err:
        console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(2) from err
    report = result.report
    state = "reused (same options; --force rebuilds)" if result.reused else f"built in {report['total_seconds']:.1f} s"
    console.print(f"bundle [bold]{result.path}[/bold]: {state}")
    console.print(
        f"{len(report['candidates'])} candidate cuts, kept {report['kept'] or 'none (no ramp pays on this model)'}; "
        f"chained blocks vs the source model: max |diff| {report['chain_max_abs_diff']:.2e}"
    )
    for name, agreement in report["ramp_agreement"].items():
        console.print(
            f"  {name}: agreement {agreement:.3f}, saving {report['saving_ms'][name]:.3f} ms, "
            f"cost {report['cost_ms'][name]:.4f} ms"
        )
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"path": str(result.path), "reused": result.reused, **report}, indent=2))


def _print_report(console, result) -> None:
    """Whether the bundle was built or reused, then each ramp's held-out agreement, accuracy, saving and cost."""
    from rich.table import Table

    report = result.report
    state = (
        "reused (same options; --force rebuilds)"
        if result.reused
        else f"built in {report.get('total_seconds', 0):.1f} s"
    )
    console.print(f"bundle [bold]{result.path}[/bold]: {state}")
    table = Table(title=f"{report['model']}: held-out ({report['heldout_size']} inputs)")
    table.add_column("ramp")
    table.add_column("agreement with head", justify="right")
    table.add_column("accuracy", justify="right")
    table.add_column("saving ms", justify="right")
    table.add_column("cost ms", justify="right")
    for name, agreement in report["ramp_agreement"].items():
        table.add_row(
            name,
            f"{agreement:.3f}",
            f"{report['ramp_heldout_accuracy'][name]:.3f}",
            f"{report['saving_ms'][name]:.3f}",
            f"{report['cost_ms'][name]:.4f}",
        )
    table.add_row("head (final)", "1.000", f"{report['head_heldout_accuracy']:.3f}", "-", "-")
    console.print(table)
    console.print(
        f"ONNX vs PyTorch max |logit diff| on held-out: {report['onnx_vs_torch_max_abs_diff']:.2e}; "
        f"latencies at bucket {report['window_bucket']}, batch 1..8 (ONNX Runtime, 1 thread)"
    )
