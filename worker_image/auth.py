"""The control plane's bearer token: where it comes from, how a request proves it, where control routes live.

Control routes (a router's /v1/thresholds, /v1/feedback, /v1/window.npz, /v1/observations, /v1/peers;
every /v1 route of a split worker: /v1/run, /v1/info, /v1/peers, /v1/thresholds, /v1/faults) answer
only a request carrying ``Authorization: Bearer <token>``, the service's shared secret. A request
without it gets 401 (and ``WWW-Authenticate: Bearer``), one with another token 403; both say why.
Tokens are compared in constant time (``hmac.compare_digest``). A pod with no token configured
refuses every control request (403): nothing is open by default.

The token comes from a file (``--control-token-file``, or env EXITPLAN_CONTROL_TOKEN_FILE: the
operator mounts the service's Secret there) or from env EXITPLAN_CONTROL_TOKEN. `exitplan up`
generates one per run and hands it to its processes the same way.

`ControlPlane` mounts control routes behind the token, on the app's own port or on a port of their
own (a router's ``--control-port``): a NetworkPolicy then opens that port only to the operator and the
service's own pods, while clients reach only the inference port. That port's listener is guarded as the
inference port is (server_guard.py: header and body timeouts, JSON errors), with a connection limit of
its own (`ServerLimits.control_max_connections`), so a flood of it cannot starve the inference port.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from pathlib import Path

from aiohttp import web

from exitplan.worker_image.protocol import error_response
from exitplan.worker_image.server_guard import LIMITS, Guard, GuardedRunner
from exitplan.worker_image.server_limits import ServerLimits

log = logging.getLogger(__name__)

TOKEN_ENV = "EXITPLAN_CONTROL_TOKEN"
TOKEN_FILE_ENV = "EXITPLAN_CONTROL_TOKEN_FILE"
CONTROL_PORT_ENV = "EXITPLAN_CONTROL_PORT"
"""Wins over --control-port (the dev cluster's pod runner gives each named port of a pod its own port)."""
MIN_TOKEN_CHARS = 16
HEADER = "Authorization"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class TokenError(ValueError):
    """No usable token where one was named (the message says where and why)."""


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def check_token(token: str, where: str) -> str:
    token = token.strip()
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise TokenError(f"{where}: a control token is at least {MIN_TOKEN_CHARS} characters, without spaces")
    return token


def read_token_file(path: str | Path) -> str:
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise TokenError(f"cannot read the control token file {path}: {err}") from err
    return check_token(text, str(path))


def token_from(file: str | Path | None = None) -> str | None:
    """The token of this process: `file`, else the file named by EXITPLAN_CONTROL_TOKEN_FILE, else
    EXITPLAN_CONTROL_TOKEN; None when none is configured. Raises TokenError for a bad one."""
    file = file or os.environ.get(TOKEN_FILE_ENV)
    if file:
        return read_token_file(file)
    value = os.environ.get(TOKEN_ENV)
    return check_token(value, TOKEN_ENV) if value else None


def control_port_from_env(default: int) -> int:
    value = os.environ.get(CONTROL_PORT_ENV)
    return int(value) if value else default


def bearer(token: str | None) -> dict[str, str]:
    """The request header that carries `token` ({} without one)."""
    return {HEADER: f"Bearer {token}"} if token else {}


def refusal(token: str | None, header: str | None) -> web.Response | None:
    """None when `header` (the request's Authorization) proves `token`; else the 401/403 answer."""
    if token is None:
        return error_response(
            403, "this pod has no control token configured, so its control endpoints refuse every request"
        )
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        answer = error_response(
            401, "control endpoints need 'Authorization: Bearer <token>' with the service's control token"
        )
        answer.headers["WWW-Authenticate"] = 'Bearer realm="exitplan-control"'
        return answer
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        return error_response(403, "the bearer token is not this service's control token")
    return None


def guarded(token: str | None, handler: Handler) -> Handler:
    """`handler` behind the token."""

    async def check(request: web.Request) -> web.StreamResponse:
        refused = refusal(token, request.headers.get(HEADER))
        if refused is not None:
            return refused
        return await handler(request)

    return check


class ControlPlane:
    """Mounts control routes behind `token`: on the app's port (`port` None or 0), or on a port of
    their own, served by a second listener that starts and stops with the app."""

    def __init__(self, token: str | None, port: int | None = None, host: str = "0.0.0.0", max_body: int = 1 << 20):
        self.token, self.port, self.host, self.max_body = token, port or None, host, max_body
        self._runner: web.AppRunner | None = None

    def guard(self, handler: Handler) -> Handler:
        return guarded(self.token, handler)

    def mount(self, app: web.Application, routes: Iterable[web.RouteDef]) -> None:
        wrapped = [web.route(r.method, r.path, self.guard(r.handler), **r.kwargs) for r in routes]
        if self.port is None:
            app.add_routes(wrapped)
            return
        control = web.Application(client_max_size=self.max_body)
        control.add_routes(wrapped)

        async def start(app: web.Application) -> None:
            limits = app.get(LIMITS) or ServerLimits()  # the inference port's, with a limit of its own
            guard = Guard(replace(limits, max_connections=limits.control_max_connections))
            self._runner = GuardedRunner(control, guard, keepalive_timeout=limits.keepalive_timeout_s, access_log=None)
            await self._runner.setup()
            await web.TCPSite(self._runner, self.host, self.port).start()
            log.info("control endpoints on %s:%d", self.host, self.port)

        async def stop(_: web.Application) -> None:
            if self._runner is not None:
                await self._runner.cleanup()
                self._runner = None

        app.on_startup.append(start)
        app.on_cleanup.append(stop)
