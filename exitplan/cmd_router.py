"""`exitplan router`: the router process (the command of every router pod)."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from exitplan.worker.serve import port_from_env, serve


def command(
    bundle: Path = typer.Option(..., help="Model bundle directory (for the tokenizer, labels and ramps)."),
    plan: Path = typer.Option(..., help="Plan file (plan.json). Re-read when it changes."),
    peers: str = typer.Option(..., help="host:port[,...] of the split-0 workers (the split-0 headless Service)."),
    slo_ms: float = typer.Option(100.0, min=0.001, help="p99 latency SLO in ms: the deadline of each input."),
    accuracy_budget: float = typer.Option(
        0.01, min=0.0, max=0.999999, help="Allowed disagreement with the full model."
    ),
    shadow_fraction: float = typer.Option(
        0.05, min=0.0, max=1.0, help="Fraction of inputs shadow-sampled for accuracy feedback."
    ),
    queue_lambda: float = typer.Option(0.85, min=0.01, max=1.0, help="Arlo congestion threshold."),
    queue_alpha: float = typer.Option(0.9, min=0.01, max=1.0, help="Arlo threshold decay per demotion level."),
    peek_depth: int = typer.Option(6, min=0, help="Arlo: how many longer buckets a request may be demoted to."),
    max_body_bytes: int = typer.Option(1 << 20, min=1024, help="Largest request body (413 above)."),
    max_inflight: int = typer.Option(4096, min=1, help="Inputs in flight above which requests get 503."),
    truncate: bool = typer.Option(False, help="Truncate over-long inputs instead of answering 400."),
    timeout_ms: float = typer.Option(0.0, min=0.0, help="Hard per-request timeout (0 = max(5 x SLO, 2 s))."),
    window_seconds: float = typer.Option(30.0, min=0.5, help="Length of an observation window."),
    advertise: str = typer.Option(
        "", help="host:port workers post feedback to (default: $POD_IP or 127.0.0.1, with the port)."
    ),
    host: str = typer.Option("0.0.0.0", help="Address to listen on."),
    port: int = typer.Option(8080, help="Port to listen on (EXITPLAN_PORT overrides)."),
    log_level: str = typer.Option("info", help="Logging level."),
) -> None:
    """Run the router: KServe v2 inference endpoints, Arlo dispatch, admission control, observations."""
    from exitplan.planner.dispatch import QueueParams
    from exitplan.worker.classify.router import Router

    port = port_from_env(port)
    advertise = advertise or f"{os.environ.get('POD_IP', '127.0.0.1')}:{port}"
    try:
        from exitplan.worker.generate.router import GenerationRouter, is_generative

        # a decoder bundle: the generation router drives the stage workers instead
        generation = GenerationRouter(bundle, plan, peers=peers) if is_generative(bundle) else None
        router = generation or Router(
            bundle,
            plan,
            peers=peers,
            slo_ms=slo_ms,
            accuracy_budget=accuracy_budget,
            shadow_fraction=shadow_fraction,
            queue=QueueParams(queue_lambda, queue_alpha, peek_depth),
            max_body_bytes=max_body_bytes,
            max_inflight=max_inflight,
            truncate=truncate,
            timeout_ms=timeout_ms or None,
            window_seconds=window_seconds,
            advertise=advertise,
        )
    except (ValueError, OSError) as err:
        typer.secho(f"error: {err}", fg="red", err=True)
        raise typer.Exit(2) from err
    serve(router.app(), host, port, log_level)
