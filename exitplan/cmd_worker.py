"""`exitplan worker`: one split worker process (the command of every worker pod)."""

from __future__ import annotations

from pathlib import Path

import typer

from exitplan import cli_pods
from exitplan.cli_common import fail
from exitplan.worker_image.serve import port_from_env, serve


def command(
    bundle: Path = typer.Option(..., help="Model bundle directory (holds bundle.yaml)."),
    plan: Path = typer.Option(
        ..., help="Plan file (plan.json; the plan ConfigMap in a cluster). Re-read when it changes."
    ),
    split: int = typer.Option(..., min=0, help="Index of the split this worker runs."),
    bucket: int = typer.Option(
        ..., min=1, help="Length bucket (max sequence length) of this worker's runtime; 1 for fixed-size models."
    ),
    pool: str = typer.Option("", help="GPUPool this worker runs on (a label for metrics and dispatch)."),
    next: str = typer.Option(
        "", "--next", help="host:port[,host:port...] of the next split (a headless Service); omit for the last split."
    ),
    host: str = typer.Option("0.0.0.0", envvar="EXITPLAN_HOST", help="Address to listen on."),
    port: int = typer.Option(8080, help="Port to listen on (EXITPLAN_PORT overrides)."),
    max_wait_ms: float = typer.Option(
        -1.0,
        help="Longest time the oldest input waits for the batch to fill; negative = until the batch is full or the oldest deadline needs it (E3; best on GPUs).",
    ),
    threads: int = typer.Option(1, min=1, help="ONNX Runtime intra-op threads."),
    providers: str = typer.Option(
        "auto",
        help="ONNX Runtime execution providers, comma-separated; auto = CUDA when this onnxruntime has it and a GPU is visible, else CPU.",
    ),
    control_token_file: Path = typer.Option(
        None,
        envvar="EXITPLAN_CONTROL_TOKEN_FILE",
        help="File holding the service's control token (else env EXITPLAN_CONTROL_TOKEN). Required.",
    ),
    header_timeout_s: float = cli_pods.HEADER_TIMEOUT,
    keepalive_timeout_s: float = cli_pods.KEEPALIVE_TIMEOUT,
    body_timeout_s: float = cli_pods.BODY_TIMEOUT,
    max_connections: int = cli_pods.MAX_CONNECTIONS,
    drain_delay_s: float = cli_pods.DRAIN_DELAY,
    drain_timeout_s: float = cli_pods.DRAIN_TIMEOUT,
    trim: str = typer.Option(
        "auto",
        help="auto|on|off: a last split pads each batch only to its longest row, rounded up to 8 tokens (sessions with a free length; auto = on for CPU providers).",
    ),
    device: str = cli_pods.DEVICE,
    log_level: str = typer.Option("info", help="Logging level."),
) -> None:
    """Run one split worker: a contiguous range of blocks for one length bucket, with exits and a fusion queue."""
    from exitplan.worker_image.classify.worker import SplitWorker
    from exitplan.worker_image.device import DeviceUnavailable, providers_for, require

    try:
        token = cli_pods.required_token(control_token_file)
        chosen = providers_for(device, providers)
        worker = SplitWorker(
            bundle,
            plan,
            split=split,
            bucket=bucket,
            pool=pool,
            next_peers=next or None,
            max_wait_ms=max_wait_ms,
            threads=threads,
            providers=chosen,
            control_token=token,
            trim=cli_pods.trim_choice(trim),
        )
        require(device, worker.runtime.session_providers())
    except DeviceUnavailable as err:
        cli_pods.device_refused(err)
    except (ValueError, OSError) as err:
        fail(err)
    limits = cli_pods.server_limits(
        header_timeout_s, keepalive_timeout_s, body_timeout_s, max_connections, drain_delay_s, drain_timeout_s
    )
    serve(
        worker.app(), host, port_from_env(port), log_level, limits, on_drain=lambda: setattr(worker, "draining", True)
    )
