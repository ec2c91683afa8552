"""The operator's own listening ports, `/metrics` (Prometheus) and `/healthz` (liveness), behind the guard
every exitplan server has (worker_image/server_guard.py): a header and a body timeout, a connection limit
with 503 past it, aiohttp's own errors as JSON. Both run on the operator's event loop: `/healthz` answers
while the loop is responsive, so a stuck loop fails the liveness probe; `/metrics` renders the process's
registry (prometheus_client's aiohttp handler). Unguarded, a flood of unfinished connections to either
port would hold file descriptors the operator needs for its API watches.
"""

from __future__ import annotations

import logging

from aiohttp import web
from prometheus_client import REGISTRY
from prometheus_client.aiohttp import make_aiohttp_handler

from exitplan.worker_image.server_guard import Guard, GuardedRunner
from exitplan.worker_image.server_limits import ServerLimits, within_fd_limit

log = logging.getLogger("exitplan.operator")

ENV_METRICS_PORT = "EXITPLAN_OPERATOR_METRICS_PORT"
ENV_HEALTH_PORT = "EXITPLAN_OPERATOR_HEALTH_PORT"
ENV_LISTEN = "EXITPLAN_OPERATOR_LISTEN"
LIMITS = ServerLimits(max_connections=128, drain_delay_s=0.0, drain_timeout_s=0.0)
"""Prometheus and the kubelet are the clients: a few connections at a time."""


async def healthz(_request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def app() -> web.Application:
    routes = web.Application()
    routes.router.add_get("/metrics", make_aiohttp_handler(REGISTRY))
    routes.router.add_get("/healthz", healthz)
    return routes


async def start(listen: str, metrics_port: int, health_port: int) -> GuardedRunner | None:
    """Serve /metrics on `metrics_port` and /healthz on `health_port` (0: that port off; both off: None)."""
    ports = [p for p in (metrics_port, health_port) if p]
    if not ports:
        return None
    runner = GuardedRunner(app(), Guard(within_fd_limit(LIMITS)), access_log=None)
    await runner.setup()
    for port in ports:
        await web.TCPSite(runner, listen, port).start()
    log.info("/metrics on %s:%s, /healthz on %s:%s (0: off)", listen, metrics_port, listen, health_port)
    return runner
