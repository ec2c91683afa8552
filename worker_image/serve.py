"""Running an aiohttp app as a process: uvloop, port from the environment, logging, clean shutdown on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import os

PORT_ENV = "EXITPLAN_PORT"


def port_from_env(default: int) -> int:
    """EXITPLAN_PORT wins over the command line (the local pod runner gives each process its own port)."""
    value = os.environ.get(PORT_ENV)
    return int(value) if value else default


def serve(app, host: str, port: int, log_level: str = "info") -> None:
    from aiohttp import web

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    web.run_app(app, host=host, port=port, print=None, shutdown_timeout=5.0, access_log=None, loop=new_loop())


def new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop: libuv, its transports and polling in C, which takes ~0.1 ms off each
    request's hops between router and workers (bench/dataplane_overhead.py)."""
    import uvloop

    return uvloop.new_event_loop()
