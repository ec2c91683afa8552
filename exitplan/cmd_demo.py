"""`exitplan demo`: prepare the MiniLM bundle, profile it, and measure the capacity of vanilla / naive early exit / exitplan."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from exitplan.cli_common import fail


def command(
    service: Path = typer.Option(
        Path("examples/minilm-local.yaml"), help="The service file (its bundle path is where the bundle is prepared)."
    ),
    trace: Path | None = typer.Option(None, help="Trace to replay (default: the shared Azure LLM inference trace)."),
    step_duration: float = typer.Option(
        10.0, min=2.0, help="Seconds of trace replayed per step of each configuration's capacity search."
    ),
    resolution: float = typer.Option(
        0.05, min=0.01, help="Bisect until the rate that met the SLO and the rate that missed it are this close."
    ),
    port: int = typer.Option(8080, help="Router port."),
    base_port: int = typer.Option(9100, help="First worker port."),
    keep: bool = typer.Option(False, "--keep", help="Leave exitplan serving after the comparison (Ctrl-C stops it)."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the results as JSON."),
) -> None:
    """Prepare, profile, plan, and measure the capacity within the SLO of vanilla, naive early exit and exitplan on the same trace."""
    import sys

    from rich.console import Console

    from exitplan.api import SpecError
    from exitplan.api.resources import EarlyExitService
    from exitplan.client.bench import BenchError
    from exitplan.localrun.demo import DemoOptions, run_demo
    from exitplan.localrun.deployment import StartError
    from exitplan.localrun.service_setup import ServiceFileError
    from exitplan.prepare.build import BuildOptions, tqdm_bar
    from exitplan.prepare.presets import prepare_bundle

    console = Console(width=None if sys.stdout.isatty() else 160)  # the comparison table needs the width in logs too
    try:
        import yaml

        docs = [d for d in yaml.safe_load_all(service.read_text()) if d and d.get("kind") == "EarlyExitService"]
        bundle_dir = Path(EarlyExitService.model_validate(docs[0]).spec.model.bundle)
        console.rule("prepare")
        prepare_bundle(BuildOptions(model="minilm"), bundle_dir, bar=tqdm_bar(enabled=True))
        result = run_demo(
            DemoOptions(
                service_file=service,
                trace=trace,
                step_duration=step_duration,
                resolution=resolution,
                port=port,
                base_port=base_port,
            ),
            console,
            keep=keep,
        )
    except (SpecError, ServiceFileError, StartError, BenchError, OSError, IndexError, ValueError) as err:
        fail(err, 1)
    if json_path:
        json_path.write_text(json.dumps(result.to_dict(), indent=2))
        console.print(f"results written to {json_path}")
