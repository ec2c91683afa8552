"""The planner's own threads: plans are solved here, never in the event loop's default executor.

The default executor also resolves host names for aiohttp (the drift loop reads every service's
routers each period). With hundreds of services those jobs queue up -- a lookup of a router name
that does not resolve can take seconds -- and a service being planned holds the operator-wide
capacity lock (capacity.py) while its solve waits behind them, so every other service waits too: at
200 services on the emulated API, plans fell from three a second to one every ten seconds once the
drift loop started reading (bench/operator_scale.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
PLANNER_THREADS = 2
"""Plans run one at a time under the capacity lock; a second thread serves a plan made outside it
(a capacity explanation, a generation service) meanwhile."""

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_lock = threading.Lock()


def planner_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The process's planner threads (created on first use)."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(PLANNER_THREADS, thread_name_prefix="exitplan-planner")
        return _pool


async def run_planner(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in the planner's threads, awaited from the event loop."""
    return await asyncio.get_running_loop().run_in_executor(planner_pool(), fn, *args)
