"""`exitplan router`: the router process (the command of every router pod)."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from exitplan.worker.serve import ServerLimits, port_from_env, serve


def required_token(file: Path | None) -> str:
    """The control token from `file` / the environment; ValueError naming the options when there is none."""
    from exitplan.worker.auth import TOKEN_ENV, token_from

    token = token_from(file)
    if token is None:
        raise ValueError(
            f"no control token: give --control-token-file (or env EXITPLAN_CONTROL_TOKEN_FILE, or {TOKEN_ENV}); "
            "`exitplan up` and the operator give their processes one"
        )
    return token


# The HTTP server's limits and drain (worker_image/server_guard.py, serve.py), shared with `exitplan worker`.
_D = ServerLimits()

HEADER_TIMEOUT = typer.Option(
    _D.header_timeout_s,
    min=0.001,
    help="Seconds a client has, from opening a connection (or the first byte of a later request), to send a request's whole head; then the connection is closed.",
)
KEEPALIVE_TIMEOUT = typer.Option(
    _D.keepalive_timeout_s, min=0.001, help="Seconds a kept-alive connection may stay idle between requests."
)
BODY_TIMEOUT = typer.Option(
    _D.body_timeout_s, min=0.001, help="Seconds a client has, after a request's head, to send its body (408 past it)."
)
MAX_CONNECTIONS = typer.Option(
    _D.max_connections, min=1, help="Open connections past which a new one is answered 503 and closed."
)
DRAIN_DELAY = typer.Option(
    _D.drain_delay_s,
    min=0.0,
    help="After SIGTERM: keep serving, readiness off and answers with Connection: close, at least this many seconds.",
)
DRAIN_TIMEOUT = typer.Option(
    _D.drain_timeout_s,
    min=0.0,
    help="After SIGTERM: the longest wait, in seconds, for requests in flight before exiting (the delay included).",
)


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
CONTROL_TOKEN_FILE = typer.Option(
    None,
    envvar="EXITPLAN_CONTROL_TOKEN_FILE",
    help="File holding the service's control token (else env EXITPLAN_CONTROL_TOKEN). Required.",
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


def server_limits(
    header_timeout_s: float,
    keepalive_timeout_s: float,
    body_timeout_s: float,
    max_connections: int,
    drain_delay_s: float,
    drain_timeout_s: float,
) -> ServerLimits:
    """The limits from the options; a bad combination exits 2 with the reason."""
    try:
        return ServerLimits(
            header_timeout_s, keepalive_timeout_s, body_timeout_s, max_connections, drain_delay_s, drain_timeout_s
        )
    except ValueError as err:
        from exitplan.cli import fail

        fail(err)


def command(
    bundle: Path = typer.Option(..., help="Model bundle directory (for the tokenizer, labels and ramps)."),
    plan: Path = typer.Option(..., help="Plan file (plan.json). Re-read when it changes."),
    peers: str = PEERS,
    slo_ms: float = typer.Option(100.0, min=0.001, help="p99 latency SLO in ms: the deadline of each input."),
    accuracy_budget: float = typer.Option(
        0.01, min=0.0, max=0.999999, help="Allowed disagreement with the full model."
    ),
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
    host: str = typer.Option("0.0.0.0", help="Address to listen on."),
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
    log_level: str = typer.Option("info", help="Logging level."),
) -> None:
    """Run the router: KServe v2 inference endpoints, Arlo dispatch, admission control, observations."""
    from exitplan.cli import fail
    from exitplan.planner.dispatch import QueueParams
    from exitplan.worker.auth import control_port_from_env
    from exitplan.worker.classify.router import Router

    port = port_from_env(port)
    control_port = control_port_from_env(control_port)
    advertise = advertise or f"{os.environ.get('POD_IP', '127.0.0.1')}:{control_port or port}"
    try:
        from exitplan.worker.generate.router import GenerationRouter, is_generative

        token = required_token(control_token_file)
        colocation = _colocation(pool, threads, providers, max_wait_ms, trim) if colocate else None
        control = {"control_token": token, "control_port": control_port or None, "control_host": host}
        # a decoder bundle: the generation router drives the stage workers instead
        generation = GenerationRouter(bundle, plan, peers=peers, **control) if is_generative(bundle) else None
        if generation is not None and colocate:
            raise ValueError("--colocate serves classifiers; a generation bundle's router drives its stages apart")
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
            **control,
        )
    except (ValueError, OSError) as err:
        fail(err)
    limits = server_limits(
        header_timeout_s, keepalive_timeout_s, body_timeout_s, max_connections, drain_delay_s, drain_timeout_s
    )
    serve(router.app(), host, port, log_level, limits)


def _colocation(pool: str, threads: int, providers: str, max_wait_ms: float, trim: str):
    """The split-0 runtime of `--colocate` (ValueError: an unknown provider or --trim value)."""
    from exitplan.cmd_worker import trim_choice
    from exitplan.worker.bundle_runtime import choose_providers
    from exitplan.worker.classify.colocated import Colocation

    return Colocation(pool, threads, tuple(choose_providers(providers)), max_wait_ms, trim_choice(trim))
