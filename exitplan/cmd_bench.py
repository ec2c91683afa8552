"""`exitplan bench`: open-loop load from a trace against a router; goodput, latency, exits, accuracy, errors."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from exitplan.cli_common import fail

if TYPE_CHECKING:
    from rich.console import Console


class LengthModeOption(str, Enum):
    scale = "scale"
    clip = "clip"


BUNDLE = typer.Option(
    ...,
    "--bundle",
    exists=True,
    file_okay=False,
    help="The bundle the router serves (its held-out texts and full-model answers).",
)

LENGTH_MODE = typer.Option(
    LengthModeOption.scale,
    "--length-mode",
    help="Fit trace lengths to the largest bucket: scale (proportionally) or clip.",
)

REFERENCE_MAX = typer.Option(
    None,
    "--reference-max",
    min=1,
    help="With --length-mode scale: the trace length (tokens) that maps onto the largest bucket (default: the trace's longest; the shared trace's p99 is 4142).",
)

FIND_CAPACITY = typer.Option(
    False,
    "--find-capacity",
    help="Measure the capacity within the SLO: the highest rate at which >= 99 % of requests (errors and lost ones are misses) finish within it, over a step and its last third; doubles from --rps (default 5), then bisects.",
)


def command(
    url: str = typer.Option("http://127.0.0.1:8080", "--url", help="The router's base URL."),
    model: str = typer.Option(..., "--model", help="Model name served at /v2/models/{name}."),
    bundle: Path = BUNDLE,
    trace: Path | None = typer.Option(
        None, "--trace", dir_okay=False, help="Trace file (Azure CSV or JSON lines); default: the shared Azure trace."
    ),
    rps: float | None = typer.Option(
        None, "--rps", min=0.001, help="Rescale the trace window to this mean rate (requests/s)."
    ),
    speed: float = typer.Option(
        1.0, "--speed", min=0.001, help="Speed the trace up by this factor (ignored with --rps)."
    ),
    start: float = typer.Option(0.0, "--start", min=0.0, help="Skip this many seconds of the (sped-up) trace."),
    duration: float | None = typer.Option(60.0, "--duration", help="Seconds of trace to replay (0: no time bound)."),
    limit: int | None = typer.Option(None, "--limit", min=1, help="Send at most this many requests."),
    slo_ms: float | None = typer.Option(None, "--slo-ms", help="Latency SLO for goodput (default: the router's own)."),
    length_mode: LengthModeOption = LENGTH_MODE,
    reference_max: int | None = REFERENCE_MAX,
    seed: int = typer.Option(0, "--seed", help="Seed for the choice of texts."),
    timeout_s: float = typer.Option(
        30.0, "--timeout-s", min=0.1, help="A request with no answer by then counts as lost."
    ),
    capacity: bool = FIND_CAPACITY,
    step_duration: float = typer.Option(
        10.0, "--step-duration", min=1.0, help="Seconds per load step with --find-capacity."
    ),
    binary: bool = typer.Option(
        False, "--binary", help="Send tensors as raw bytes (binary tensor extension), not JSON."
    ),
    json_path: Path | None = typer.Option(None, "--json", dir_okay=False, help="Also write every figure as JSON here."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar."),
    control_url: str | None = typer.Option(
        None, help="The router's control endpoints (its observations go in the report)."
    ),
    control_token_file: Path | None = typer.Option(
        None, envvar="EXITPLAN_CONTROL_TOKEN_FILE", help="Its control token."
    ),
) -> None:
    """Replay a trace open-loop against a router (never waiting for answers); report goodput, p50/p95/p99, exits, agreement with the full model, errors by kind and lost requests."""
    from rich.console import Console

    console = Console()
    bounded_duration = duration if duration else None
    if bounded_duration is None and limit is None and not capacity:
        fail("give --duration (seconds) and/or --limit (requests): the whole trace runs for about an hour")
    shared: dict[str, object] = {"slo_ms": slo_ms, "seed": seed, "length_mode": length_mode.value}
    shared.update(reference_max=reference_max, timeout_s=timeout_s, progress=progress, binary=binary)
    load: dict[str, object]
    if capacity:
        load = {"start_rps": rps or 5.0, "step_duration": step_duration}
    else:
        load = {"rps": rps, "speed": speed, "start": start, "duration": bounded_duration, "limit": limit}
    control = (control_url, control_token_file.read_text().strip() if control_token_file else None)
    doc = _replay(console, url, model, bundle, trace, capacity, {**load, **shared}, control)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(doc, indent=2))
        console.print(f"wrote {json_path}")


def _replay(
    console: Console,
    url: str,
    model: str,
    bundle: Path,
    trace: Path | None,
    capacity: bool,
    options: dict[str, Any],
    control: tuple[str | None, str | None] = (None, None),
) -> dict[str, Any]:
    """Connect to the router, then step the load up to its capacity or run one bench with `options`; print the
    tables and return every figure as a dict (exit 2 on a bench, bundle or input error)."""
    from exitplan.api.bundle import BundleError
    from exitplan.client.bench import BenchError, BenchSetup, find_capacity, run_bench
    from exitplan.client.texts import InputError

    try:
        with console.status("reading the router's metadata and tokenizing held-out texts..."):
            setup = BenchSetup.connect(url, model, bundle)
            setup.control_url, setup.control_token = control
        if capacity:
            result = find_capacity(url, model, bundle, trace, setup=setup, **options)
            console.print(result.table())
            return result.to_dict()
        report = run_bench(url, model, bundle, trace, setup=setup, **options)
        for table in report.tables():
            console.print(table)
        inputs = report.run.get("inputs", {})
        if inputs.get("concatenated"):
            console.print(
                f"{inputs['concatenated']} of {report.requests} requests are concatenations of held-out texts "
                f"(the trace asked for inputs longer than any single text); their reference is the full model's answer."
            )
        return report.to_dict()
    except (BenchError, BundleError, InputError) as err:
        fail(err)
