"""`exitplan router`: the router process (the command of every router pod)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from exitplan.cli_common import fail
from exitplan.cli_pods import (
    BODY_TIMEOUT,
    CONTROL_TOKEN_FILE,
    DRAIN_DELAY,
    DRAIN_TIMEOUT,
    HEADER_TIMEOUT,
    KEEPALIVE_TIMEOUT,
    MAX_CONNECTIONS,
    device_refused,
    required_token,
    server_limits,
    trim_choice,
)
from exitplan.worker_image.device import DeviceUnavailable, providers_for, require
from exitplan.worker_image.serve import port_from_env, serve

PEERS = typer.Option(
    "",
    help="host:port[,...] of the split-0 workers (the split-0 headless Service); with --colocate, of split 1's (none for a one-split plan).",
)
ADVERTISE = typer.Option(
    "",
    help="host:port workers post feedback to (default: $POD_IP or 127.0.0.1, with the control port, else the port).",
)
CONTROL_PORT = typer.Option(
    0,
    help="Port of the control endpoints (/v1/...; EXITPLAN_CONTROL_PORT overrides); 0 = on --port, behind the token all the same.",
)
# With --colocate the router runs split 0 itself (worker_image/classify/colocated.py): its runtime's options.
COLOCATE = typer.Option(
    False,
    help="Run split 0 of every bucket in this process (no hop to a split-0 pod); the options below are its runtime's, as `exitplan worker`'s.",
)
CO_POOL = typer.Option("", help="With --colocate: the GPUPool this router runs on (a metrics label).")
CO_THREADS = typer.Option(1, min=1, help="With --colocate: ONNX Runtime intra-op threads of split 0.")
CO_PROVIDERS = typer.Option(
    "auto", help="With --colocate: split 0's execution providers (as `exitplan worker --providers`)."
)
CO_MAX_WAIT = typer.Option(-1.0, help="With --colocate: split 0's batching wait (as `exitplan worker --max-wait-ms`).")
CO_TRIM = typer.Option("auto", help="With --colocate: as `exitplan worker --trim` (auto|on|off).")
CO_DEVICE = typer.Option(
    "auto", help="With --colocate: split 0's device (as `exitplan worker --device`: auto|gpu|cpu)."
)

if TYPE_CHECKING:
    from exitplan.worker_image.classify.colocated import Colocation
    from exitplan.worker_image.generate.router import GenerationRouter


ACCURACY_BUDGET = typer.Option(0.01, min=0.0, max=0.999999, help="Allowed disagreement with the full model.")


def command(
    bundle: Path = typer.Option(..., help="Model bundle directory (for the tokenizer, labels and ramps)."),
    plan: Path = typer.Option(..., help="Plan file (plan.json). Re-read when it changes."),
    peers: str = PEERS,
    slo_ms: float = typer.Option(100.0, min=0.001, help="p99 latency SLO in ms: the deadline of each input."),
    accuracy_budget: float = ACCURACY_BUDGET,
    shadow_fraction: float = typer.Option(0.05, min=0.0, max=1.0, help="Share of inputs shadow-sampled for feedback."),
    queue_lambda: float = typer.Option(0.85, min=0.01, max=1.0, help="Arlo congestion threshold."),
    queue_alpha: float = typer.Option(0.9, min=0.01, max=1.0, help="Arlo threshold decay per demotion level."),
    peek_depth: int = typer.Option(6, min=0, help="Arlo: how many longer buckets a request may be demoted to."),
    max_body_bytes: int = typer.Option(1 << 20, min=1024, help="Largest request body (413 above)."),
    max_inflight: int = typer.Option(4096, min=1, help="Inputs in flight above which requests get 503."),
    truncate: bool = typer.Option(False, help="Truncate over-long inputs instead of answering 400."),
    timeout_ms: float = typer.Option(0.0, min=0.0, help="Hard per-request timeout (0 = max(5 x SLO, 2 s))."),
    window_seconds: float = typer.Option(30.0, min=0.5, help="Length of an observation window."),
    advertise: str = ADVERTISE,
    host: str = typer.Option("0.0.0.0", envvar="EXITPLAN_HOST", help="Address to listen on."),
    port: int = typer.Option(8080, help="Port to listen on (EXITPLAN_PORT overrides)."),
    control_port: int = CONTROL_PORT,
    control_token_file: Path = CONTROL_TOKEN_FILE,
    header_timeout_s: float = HEADER_TIMEOUT,
    keepalive_timeout_s: float = KEEPALIVE_TIMEOUT,
    body_timeout_s: float = BODY_TIMEOUT,
    max_connections: int = MAX_CONNECTIONS,
    drain_delay_s: float = DRAIN_DELAY,
    drain_timeout_s: float = DRAIN_TIMEOUT,
    colocate: bool = COLOCATE,
    pool: str = CO_POOL,
    threads: int = CO_THREADS,
    providers: str = CO_PROVIDERS,
    max_wait_ms: float = CO_MAX_WAIT,
    trim: str = CO_TRIM,
    device: str = CO_DEVICE,
    log_level: str = typer.Option("info", help="Logging level."),
) -> None:
    """Run the router: KServe v2 inference endpoints, Arlo dispatch, admission control, observations."""
    from exitplan.planner.dispatch import QueueParams
    from exitplan.worker_image.auth import control_port_from_env
    from exitplan.worker_image.classify.router import Router

    port = port_from_env(port)
    control_port = control_port_from_env(control_port)
    advertise = advertise or f"{os.environ.get('POD_IP', '127.0.0.1')}:{control_port or port}"
    try:
        token = required_token(control_token_file)
        colocation = (
            _colocation(pool, threads, providers_for(device, providers), max_wait_ms, trim) if colocate else None
        )
        port_or_none = control_port or None
        generation = _generation_router(bundle, plan, peers, token, port_or_none, host, colocate)
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
            colocate=colocation,
            control_token=token,
            control_port=port_or_none,
            control_host=host,
        )
        if isinstance(router, Router):
            for worker in router.local.values():  # split 0 in this process (--colocate)
                require(device, worker.runtime.session_providers())
    except DeviceUnavailable as err:
        device_refused(err)
    except (ValueError, OSError) as err:
        fail(err)
    limits = server_limits(
        header_timeout_s, keepalive_timeout_s, body_timeout_s, max_connections, drain_delay_s, drain_timeout_s
    )
    serve(router.app(), host, port, log_level, limits)


def _generation_router(
    bundle: Path, plan: Path, peers: str, token: str, control_port: int | None, host: str, colocate: bool
) -> GenerationRouter | None:
    """For a decoder bundle, the generation router (it drives the stage workers); None for a classifier."""
    from exitplan.worker_image.generate.router import GenerationRouter, is_generative

    if not is_generative(bundle):
        return None
    if colocate:
        raise ValueError("--colocate serves classifiers; a generation bundle's router drives its stages apart")
    return GenerationRouter(
        bundle, plan, peers=peers, control_token=token, control_port=control_port, control_host=host
    )


def _colocation(pool: str, threads: int, providers: tuple[str, ...], max_wait_ms: float, trim: str) -> Colocation:
    """The split-0 runtime of `--colocate` (ValueError: an unknown --trim value)."""
    from exitplan.worker_image.classify.colocated import Colocation

    return Colocation(pool, threads, providers, max_wait_ms, trim_choice(trim))
