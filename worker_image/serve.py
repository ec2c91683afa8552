"""Running an aiohttp app as a process: uvloop, port from the environment, logging, the server's
limits (`server_limits.py`, enforced by `server_guard.py`) and a drain on SIGTERM.

SIGTERM (what the kubelet sends after the pod's preStop hook) drains: readiness answers 503 at once,
requests keep being served (with `Connection: close`, so kept-alive clients reconnect elsewhere) for
at least `drain_delay_s` and until none is in flight, at most `drain_timeout_s`; then the listener
closes, idle connections close, what is still running gets one more second before it is cancelled,
the app's cleanup runs, and the process exits 0. SIGINT (`exitplan up` stopping every process at
once, or Ctrl-C) drains the same way without the delay: nobody is left to move to.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from exitplan.worker_image.server_limits import ServerLimits, within_fd_limit

if TYPE_CHECKING:
    from aiohttp import web

__all__ = ["PORT_ENV", "ServerLimits", "new_loop", "port_from_env", "serve"]

PORT_ENV = "EXITPLAN_PORT"
CANCEL_GRACE_S = 1.0
"""After the drain, how long aiohttp's shutdown still waits for a handler before cancelling it."""

log = logging.getLogger(__name__)


def port_from_env(default: int) -> int:
    """EXITPLAN_PORT wins over the command line (the local pod runner gives each process its own port)."""
    value = os.environ.get(PORT_ENV)
    return int(value) if value else default


def serve(
    app: web.Application,
    host: str,
    port: int,
    log_level: str = "info",
    limits: ServerLimits | None = None,
    on_drain: Callable[[], None] | None = None,
) -> None:
    """Serve `app` until SIGTERM or SIGINT, then drain and return. `on_drain` runs when the drain
    begins (a worker reports itself not ready to the hops that send to it)."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(_serve(app, host, port, limits or ServerLimits(), on_drain))


async def _serve(
    app: web.Application, host: str, port: int, limits: ServerLimits, on_drain: Callable[[], None] | None
) -> None:
    # aiohttp (and the guard built on it) load when a server starts, not with the CLI that imports this module.
    from aiohttp import web

    from exitplan.worker_image.server_guard import LIMITS, Guard, GuardedRunner

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    received: list[signal.Signals] = []

    def on_signal(sig: signal.Signals) -> None:
        if not received:
            received.append(sig)
            stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):  # before startup: a worker warming up drains too
        loop.add_signal_handler(sig, on_signal, sig)
    limits = within_fd_limit(limits)
    app[LIMITS] = limits  # the control port's listener (auth.ControlPlane) is guarded the same way
    guard = Guard(limits)
    runner = GuardedRunner(
        app,
        guard,
        keepalive_timeout=limits.keepalive_timeout_s,
        shutdown_timeout=CANCEL_GRACE_S,
        access_log=None,
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        await stop.wait()
        if received[0] == signal.SIGINT:
            limits = guard.limits = replace(limits, drain_delay_s=0.0)
        guard.begin_drain()
        if on_drain is not None:
            on_drain()
        log.info(
            "%s: draining (readiness off), %d request(s) in flight, at most %g s",
            received[0].name,
            guard.inflight,
            limits.drain_timeout_s,
        )
        started = loop.time()
        if await guard.drained():
            log.info("drained in %.2f s; exiting", loop.time() - started)
        else:
            log.warning(
                "drain timeout (%g s): %d request(s) still in flight are cut off",
                limits.drain_timeout_s,
                guard.inflight,
            )
    finally:
        await runner.cleanup()


def new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop: libuv, its transports and polling in C, which takes ~0.1 ms off each
    request's hops between router and workers (bench/dataplane_overhead.py)."""
    import uvloop

    return uvloop.new_event_loop()
