"""`exitplan prepare`: build an early-exit model bundle (ramps injected, trained, exported to ONNX)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

# The options of a user's own model (--onnx, --torch, --hf), declared here to keep `command` short.
ONNX = typer.Option(
    None, "--onnx", help="Your own ONNX classifier: ramps are placed at its cut vertices automatically."
)
TORCH = typer.Option(
    None,
    "--torch",
    help="Your own PyTorch classifier, PKG.MODULE:FACTORY (imported with the current directory on the path); "
    "FACTORY() returns the nn.Module, exported to ONNX, then as --onnx. DATA.npz's arrays other than `label`, "
    "in the file's order, are passed to forward positionally and name the bundle's inputs.",
)
HF = typer.Option(
    None,
    "--hf",
    help="A local Hugging Face checkpoint directory (nothing is downloaded): a sequence classifier as it is, or "
    "an encoder with a linear head trained here on the labels; --data is then a .csv or .jsonl of labelled texts.",
)
TEXT_COLUMN = typer.Option("text", "--text-column", help="With --hf: the data's column of texts.")
LABEL_COLUMN = typer.Option(
    "label", "--label-column", help="With --hf: the data's column of labels (class names: its distinct values, sorted)."
)
DATA = typer.Option(
    None,
    "--data",
    help="With --onnx/--torch: DATA.npz, one array per model input keyed by its name, optional `label`; "
    "with --hf: FILE.csv or FILE.jsonl.",
)
LABELS = typer.Option(None, "--labels", help="With --onnx/--torch: class names, one a line (default 0..C-1).")
MAX_RAMPS = typer.Option(3, "--max-ramps", min=0, help="With --onnx/--torch/--hf: most exit ramps kept.")
CUTS = typer.Option(
    None,
    "--cuts",
    help="With --onnx/--torch/--hf: place ramps at these tensors (comma-separated cut vertices) instead.",
)
SEQ_AXIS = typer.Option(
    None, "--seq-axis", help="With --onnx/--torch: the inputs' sequence axis (default: 1 for integer [N, L] inputs)."
)
RAMP_HIDDEN = typer.Option(
    0, "--ramp-hidden", min=0, help="With --onnx/--torch/--hf: MLP ramps of this width (0: linear)."
)
NAME = typer.Option(
    None, "--name", help="With --onnx/--torch/--hf: the model's name (default: the file's, module's or folder's name)."
)
BUDGET = typer.Option(0.01, "--budget", help="With --onnx/--torch/--hf: accuracy budget the ramp placement tunes to.")


def command(
    model: str | None = typer.Option(
        None,
        "--model",
        help="Built-in model, a preset of --hf or --torch: minilm (all-MiniLM-L6-v2 on tweets, --hf, a ramp after "
        "every encoder layer; the default) or digits-cnn (a CNN trained on scikit-learn's digits, --torch).",
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
    max_length: int = typer.Option(
        128, "--max-length", help="Longest token sequence the bundle accepts (minilm, --hf: capped by the model)."
    ),
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
    onnx_model: Path | None = ONNX,
    torch_factory: str | None = TORCH,
    hf: Path | None = HF,
    text_column: str = TEXT_COLUMN,
    label_column: str = LABEL_COLUMN,
    data: Path | None = DATA,
    labels: Path | None = LABELS,
    max_ramps: int = MAX_RAMPS,
    cuts: str | None = CUTS,
    seq_axis: int | None = SEQ_AXIS,
    ramp_hidden: int = RAMP_HIDDEN,
    budget: float = BUDGET,
    name: str | None = NAME,
) -> None:
    """Build an early-exit bundle: train the head and the ramps (backbone frozen), export each block and ramp to
    ONNX, and write bundle.yaml, the tokenizer, the held-out data and a calibration window. A rerun with the same
    options reuses the finished bundle. The model is one of --onnx, --torch or --hf (your own: ramps placed at the
    graph's cut vertices automatically) or --model (a built-in preset of --hf or --torch)."""
    from rich.console import Console

    console = Console()
    flag, source = _chosen(console, model, onnx_model, torch_factory, hf)
    if flag == "--model":
        builtin = dict(train_size=train_size, heldout_size=heldout_size, seed=seed, max_length=max_length)
        _prepare_builtin(console, source, builtin, out, force, threads, json_path)
        return
    options = dict(max_ramps=max_ramps, cuts=cuts, ramp_hidden=ramp_hidden, budget=budget, seed=seed)
    if name is not None:
        options["name"] = name
    text = dict(text_column=text_column, label_column=label_column, max_length=max_length)
    _prepare_user_model(console, flag, source, data, out, options, labels, seq_axis, text, force, threads, json_path)


def _prepare_builtin(console, model: str, options: dict, out: Path | None, force, threads, json_path) -> None:
    """--model minilm | digits-cnn: the built-in bundles."""
    from exitplan.api.bundle import BundleError
    from exitplan.prepare.build import BuildOptions, PrepareError, prepare_bundle
    from exitplan.prepare.datasets import DatasetError
    from exitplan.prepare.graph_cuts import GraphError
    from exitplan.prepare.minilm import ModelNotInstalled
    from exitplan.prepare.user_data import DataError

    target = out if out is not None else Path("artifacts") / "bundles" / model
    try:
        result = prepare_bundle(BuildOptions(model=model, **options), target, force=force, threads=threads)
    except (PrepareError, DatasetError, ModelNotInstalled, BundleError, GraphError, DataError) as err:
        from exitplan.cli import fail

        fail(err)

    _print_report(console, result, json_path)


def _chosen(console, model, onnx_model, torch_factory, hf) -> tuple[str, object]:
    """The one source chosen among --model, --onnx, --torch and --hf (none: --model minilm)."""
    given = [(f, v) for f, v in (("--model", model), ("--onnx", onnx_model), ("--torch", torch_factory), ("--hf", hf))]
    given = [(f, v) for f, v in given if v is not None]
    if len(given) > 1:
        from exitplan.cli import fail

        fail(f"choose one model source of --model, --onnx, --torch and --hf; got {' and '.join(f for f, _ in given)}")
    return given[0] if given else ("--model", "minilm")


DATA_HELP = {
    "--onnx": "DATA.npz (one array per model input, keyed by its name)",
    "--torch": "DATA.npz (one array per forward argument, in order, keyed by the input's name)",
    "--hf": "FILE.csv or FILE.jsonl (labelled texts, see --text-column and --label-column)",
}


def _default_name(flag: str, source) -> str:
    if flag == "--torch":
        return str(source).partition(":")[0].rsplit(".", 1)[-1].lower() or "model"
    return Path(source).stem.lower() if flag == "--onnx" else Path(source).resolve().name.lower()


def _prepare_user_model(console, flag, source, data, out, options, labels, seq_axis, text, force, threads, json_path):
    """--onnx, --torch, --hf: the user's model through the automatic pipeline (exitplan.prepare.from_onnx)."""
    from exitplan.cli import fail
    from exitplan.prepare.build import PrepareError
    from exitplan.prepare.graph_cuts import GraphError
    from exitplan.prepare.user_data import DataError

    if data is None:
        fail(f"{flag} needs --data {DATA_HELP[flag]}")
    if flag == "--hf" and (labels is not None or seq_axis is not None):
        fail("--labels and --seq-axis do not apply to --hf (class names: the label column)")
    options["cuts"] = tuple(c.strip() for c in (options.pop("cuts") or "").split(",") if c.strip())
    target = (
        out if out is not None else Path("artifacts") / "bundles" / (options.get("name") or _default_name(flag, source))
    )
    common = dict(force=force, threads=threads, **options)
    if flag != "--hf":
        common.update(labels=None if labels is None else str(labels), seq_axis=-1 if seq_axis is None else seq_axis)
    try:
        if flag == "--onnx":
            from exitplan.prepare.from_onnx import from_onnx

            result = from_onnx(source, data, target, **common)
        elif flag == "--torch":
            from exitplan.prepare.from_torch import from_torch

            result = from_torch(source, data, target, **common)
        else:
            from exitplan.prepare.from_hf import from_hf

            result = from_hf(source, data, target, **text, **common)
    except (PrepareError, GraphError, DataError) as err:
        from exitplan.cli import fail

        fail(err)
    _print_report(console, result, json_path)


def _print_report(console, result, json_path: Path | None) -> None:
    report = result.report
    state = "reused (same options; --force rebuilds)" if result.reused else f"built in {report['total_seconds']:.1f} s"
    console.print(f"bundle [bold]{result.path}[/bold]: {state}")
    console.print(
        f"{len(report['candidates'])} candidate cuts, kept {report['kept'] or 'none (no ramp pays on this model)'}; "
        f"chained blocks vs the source model: max |diff| {report['chain_max_abs_diff']:.2e}"
    )
    accuracy = report.get("ramp_heldout_accuracy", {})
    for name, agreement in report["ramp_agreement"].items():
        shown = f", accuracy {accuracy[name]:.3f}" if name in accuracy else ""
        console.print(
            f"  {name}: agreement {agreement:.3f}{shown}, saving {report['saving_ms'][name]:.3f} ms, "
            f"cost {report['cost_ms'][name]:.4f} ms"
        )
    if report.get("head_heldout_accuracy") is not None:
        console.print(f"  head: accuracy {report['head_heldout_accuracy']:.3f} on {report['heldout_size']} held-out")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"path": str(result.path), "reused": result.reused, **report}, indent=2))
