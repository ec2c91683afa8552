"""What the pod commands (`exitplan router`, `exitplan worker`) share: the control token, the HTTP server's
limits and drain as options (worker_image/server_guard.py, serve.py), and --trim."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import typer

from exitplan.cli_common import fail
from exitplan.worker_image.device import DeviceUnavailable, report
from exitplan.worker_image.serve import ServerLimits


def required_token(file: Path | None) -> str:
    """The control token from `file` / the environment; ValueError naming the options when there is none."""
    from exitplan.worker_image.auth import TOKEN_ENV, token_from

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


CONTROL_TOKEN_FILE = typer.Option(
    None,
    envvar="EXITPLAN_CONTROL_TOKEN_FILE",
    help="File holding the service's control token (else env EXITPLAN_CONTROL_TOKEN). Required.",
)


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
        fail(err)


def trim_choice(value: str) -> bool | None:
    """--trim: None (auto), True or False; anything else is a one-line error."""
    choices = {"auto": None, "on": True, "off": False}
    if value not in choices:
        raise typer.BadParameter(f"--trim takes auto, on or off, not {value!r}")
    return choices[value]


DEVICE = typer.Option(
    "auto",
    help="auto|gpu|cpu: gpu = every session must run on the GPU (a pool that asks for GPUs): else exit 3 with one line naming what is missing (ProviderUnavailable), never a silent CPU fallback; auto = CUDA where this onnxruntime has it and a GPU is visible, else CPU.",
)


def device_refused(err: DeviceUnavailable) -> NoReturn:
    """Exit 3 with the refusal's one line, written where Kubernetes reads the termination message too."""
    report(err)
    typer.echo(f"error: {err}", err=True)
    raise typer.Exit(3)
