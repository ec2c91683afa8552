"""`exitplan prepare`: build an early-exit model bundle (ramps injected, trained, exported to ONNX)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer

from exitplan.cli_common import fail

if TYPE_CHECKING:
    from rich.console import Console

    from exitplan.prepare.build import BuildResult

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
OUTPUT = typer.Option(
    None,
    "--output",
    help="With --onnx: the model output to serve (default: the one named like logits, else the only one of rank 2); "
    "the others are not served.",
)
TOKENIZER = typer.Option(
    None,
    "--tokenizer",
    help="With --onnx/--torch: a Hugging Face `tokenizers` file (tokenizer.json, or the directory holding it) for a "
    "text model, so the router takes `text` (without it, only `input_ids`).",
)
PRECISION = typer.Option(
    "fp32",
    "--precision",
    help="Served precision: fp32, or fp16 (the fp32 bundle is built in OUT-fp32 and converted into OUT, its "
    "agreement with fp32 on the held-out data recorded in bundle.yaml and re-checked by exitplan check).",
)


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
    output: str | None = OUTPUT,
    tokenizer: Path | None = TOKENIZER,
    precision: str = PRECISION,
) -> None:
    """Build an early-exit bundle: train the head and the ramps (backbone frozen), export each block and ramp to
    ONNX, and write bundle.yaml, the tokenizer, the held-out data and a calibration window. A rerun with the same
    options reuses the finished bundle. The model is one of --onnx, --torch or --hf (your own: ramps placed at the
    graph's cut vertices automatically) or --model (a built-in preset of --hf or --torch)."""
    from rich.console import Console

    console = Console()
    flag, source = _chosen(console, model, onnx_model, torch_factory, hf)
    served = _served_precision(precision)  # refused before anything is built
    if flag == "--model":
        builtin: dict[str, Any] = dict(
            train_size=train_size, heldout_size=heldout_size, seed=seed, max_length=max_length
        )
        target = out if out is not None else Path("artifacts") / "bundles" / str(source)
        result = _prepare_builtin(str(source), builtin, served.source(target), force, threads)
    else:
        options = _user_options(flag, name, output, tokenizer)
        options.update(max_ramps=max_ramps, cuts=cuts, ramp_hidden=ramp_hidden, budget=budget, seed=seed)
        text: dict[str, Any] = dict(text_column=text_column, label_column=label_column, max_length=max_length)
        target = out or Path("artifacts") / "bundles" / (options.get("name") or _default_name(flag, source))
        result = _prepare_user_model(
            flag, source, data, served.source(target), options, labels, seq_axis, text, force, threads
        )
    _print_report(console, result, json_path, served.convert(console, result.path, target, force))


def _user_options(flag: str, name: str | None, output: str | None, tokenizer: Path | None) -> dict[str, Any]:
    """--name, --output and --tokenizer of a user's model (the last two not with --hf)."""
    options: dict[str, Any] = {} if name is None else {"name": name}
    if output is not None or tokenizer is not None:
        if flag == "--hf":
            _fail("--output and --tokenizer do not apply to --hf (the checkpoint's logits, its own tokenizer)")
        options.update(output=output, tokenizer=None if tokenizer is None else str(tokenizer))
    return options


class _Served:
    """The precision `--precision` asked for: where its fp32 source is built, and its conversion."""

    def __init__(self, precision: str) -> None:
        self.precision = precision

    def source(self, target: Path) -> Path:
        from exitplan.prepare.precision import source_dir

        return source_dir(target, self.precision)

    def convert(self, console: Console, built: Path, target: Path, force: bool) -> dict[str, Any] | None:
        """fp16: `built` converted into `target`, checked on the held-out data: what the report adds."""
        if self.precision == "fp32":
            return None
        from exitplan.prepare.precision import PrecisionError, convert_prepared

        try:
            with console.status(f"converting to {self.precision} and checking it on the held-out data"):
                record = convert_prepared(built, target, self.precision, force=force).record
        except PrecisionError as err:
            fail(err)
        return {"precision": record.model_dump(mode="json"), "fp32_path": str(built), "path": str(target)}


def _served_precision(precision: str) -> _Served:
    from exitplan.prepare.precision import PrecisionError, check_precision

    try:
        return _Served(check_precision(precision))
    except PrecisionError as err:
        fail(err)


def _prepare_builtin(
    model: str, options: dict[str, Any], target: Path, force: bool, threads: int | None
) -> BuildResult:
    """--model minilm | digits-cnn: the built-in bundles."""
    from exitplan.api.bundle import BundleError
    from exitplan.prepare.build import BuildOptions, PrepareError
    from exitplan.prepare.datasets import DatasetError
    from exitplan.prepare.minilm import ModelNotInstalled
    from exitplan.prepare.onnx_graph import GraphError
    from exitplan.prepare.presets import prepare_bundle
    from exitplan.prepare.user_data import DataError

    try:
        return prepare_bundle(BuildOptions(model=model, **options), target, force=force, threads=threads)
    except (PrepareError, DatasetError, ModelNotInstalled, BundleError, GraphError, DataError) as err:
        fail(err)


def _fail(message: object) -> NoReturn:
    from exitplan.cli_common import fail

    fail(message)


def _chosen(
    console: Console, model: str | None, onnx_model: Path | None, torch_factory: str | None, hf: Path | None
) -> tuple[str, str | Path]:
    """The one source chosen among --model, --onnx, --torch and --hf (none: --model minilm)."""
    sources: tuple[tuple[str, str | Path | None], ...] = (
        ("--model", model),
        ("--onnx", onnx_model),
        ("--torch", torch_factory),
        ("--hf", hf),
    )
    given = [(f, v) for f, v in sources if v is not None]
    if len(given) > 1:
        fail(f"choose one model source of --model, --onnx, --torch and --hf; got {' and '.join(f for f, _ in given)}")
    return given[0] if given else ("--model", "minilm")


DATA_HELP = {
    "--onnx": "DATA.npz (one array per model input, keyed by its name)",
    "--torch": "DATA.npz (one array per forward argument, in order, keyed by the input's name)",
    "--hf": "FILE.csv or FILE.jsonl (labelled texts, see --text-column and --label-column)",
}


def _default_name(flag: str, source: str | Path) -> str:
    if flag == "--torch":
        return str(source).partition(":")[0].rsplit(".", 1)[-1].lower() or "model"
    return Path(source).stem.lower() if flag == "--onnx" else Path(source).resolve().name.lower()


def _prepare_user_model(
    flag: str,
    source: str | Path,
    data: Path | None,
    target: Path,
    options: dict[str, Any],
    labels: Path | None,
    seq_axis: int | None,
    text: dict[str, Any],
    force: bool,
    threads: int | None,
) -> BuildResult:
    """--onnx, --torch, --hf: the user's model through the automatic pipeline (exitplan.prepare.from_onnx)."""
    from exitplan.prepare.build import PrepareError
    from exitplan.prepare.onnx_graph import GraphError
    from exitplan.prepare.user_data import DataError

    if data is None:
        fail(f"{flag} needs --data {DATA_HELP[flag]}")
    if flag == "--hf" and (labels is not None or seq_axis is not None):
        fail("--labels and --seq-axis do not apply to --hf (class names: the label column)")
    options["cuts"] = tuple(c.strip() for c in (options.pop("cuts") or "").split(",") if c.strip())
    common: dict[str, Any] = dict(force=force, threads=threads, **options)
    if flag != "--hf":
        common.update(labels=None if labels is None else str(labels), seq_axis=-1 if seq_axis is None else seq_axis)
    try:
        if flag == "--onnx":
            from exitplan.prepare.from_onnx import from_onnx

            return from_onnx(source, data, target, **common)
        elif flag == "--torch":
            from exitplan.prepare.from_torch import from_torch

            return from_torch(str(source), data, target, **common)
        else:
            from exitplan.prepare.from_hf import from_hf

            return from_hf(source, data, target, **text, **common)
    except (PrepareError, GraphError, DataError) as err:
        fail(err)


def _print_report(
    console: Console, result: BuildResult, json_path: Path | None, converted: dict[str, Any] | None = None
) -> None:
    """The build's report, and with --precision the converted bundle's (`converted`: its fields in the JSON)."""
    report = result.report
    state = "reused (same options; --force rebuilds)" if result.reused else f"built in {report['total_seconds']:.1f} s"
    console.print(f"bundle [bold]{result.path}[/bold]: {state}")
    console.print(
        f"{len(report['candidates'])} candidate cuts, kept {report['kept'] or 'none (no ramp pays on this model)'}; "
        f"chained blocks vs the source model: max |diff| {report['chain_max_abs_diff']:.2e}"
    )
    if report.get("outputs_not_served"):
        console.print(f"serves output {report['output']!r}; not served: {', '.join(report['outputs_not_served'])}")
    exits = report.get("exits")
    if exits is not None:
        _print_exits(console, exits, report)
    if report.get("head_heldout_accuracy") is not None:
        console.print(f"  head: accuracy {report['head_heldout_accuracy']:.3f} on {report['heldout_size']} held-out")
    if converted is not None:
        record = converted["precision"]
        worst = min(record["ramp_agreement"].values(), default=1.0)
        console.print(
            f"{record['name']} bundle [bold]{converted['path']}[/bold] (from {converted['fp32_path']}): final answers "
            f"agree with fp32 on {record['final_agreement']:.2%} of {record['heldout_rows']} held-out inputs, max "
            f"score difference {record['max_score_diff']:.2e}, exit ramps at least {worst:.2%}; thresholds "
            f"calibrated in {record['name']}"
        )
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        document = {"path": str(result.path), "reused": result.reused, **report, **(converted or {})}
        json_path.write_text(json.dumps(document, indent=2))


def _print_exits(console: Console, exits: dict[str, Any], report: dict[str, Any]) -> None:
    """What the exits buy at the budget, in compute (FLOPs from the graph), beside the per-input oracle."""
    from exitplan.cli_common import table

    if not exits["ramps"]:
        console.print("no exit ramp: the bundle serves the plain model (no exits)")
        return
    rows = table(
        "ramp",
        "place (% compute)",
        "agreement with final",
        "exit share",
        "saving / cost ms",
        title=f"exit ramps at the accuracy budget {exits['budget']:g} ({report['heldout_size']} held-out inputs)",
    )
    accuracy = report.get("ramp_heldout_accuracy", {})
    for ramp in exits["ramps"]:
        name = ramp["name"]
        agreement = f"{ramp['agreement']:.3f}" + (f" (accuracy {accuracy[name]:.3f})" if name in accuracy else "")
        timing = f"{report['saving_ms'][name]:.3f} / {report['cost_ms'][name]:.4f}"
        rows.add_row(name, f"{100 * ramp['place']:.1f}", agreement, f"{100 * ramp['exit_share']:.1f} %", timing)
    console.print(rows)
    console.print(
        f"expected compute saved {100 * exits['compute_saved']:.1f} % at agreement {exits['agreement']:.3f}; "
        f"the per-input oracle over the same ramps saves {100 * exits['oracle_compute_saved']:.1f} %"
    )
