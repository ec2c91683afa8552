"""Name lookups of the drift loop's router reads, bounded so that they cannot starve the operator's other
connections.

A router's control address is its Pod's IP when the operator can read it, else the control Service's cluster
DNS name (router_endpoints.py). Outside the cluster (an operator run with a kubeconfig) that name does not
resolve, and a lookup may take the resolver's whole timeout (seconds, per search domain). Every lookup runs
in a thread of the event loop's small pool (libuv's four under uvloop), the pool in which a new connection
to the API server resolves its address too; a read that times out does not stop its lookup. At 200 services
read four times a period the lookups queued without end, and the API server's new connections waited behind
them until their own timeout: five services' status writes failed for good (bench/operator_scale.py,
session 20). Here at most LOOKUPS_AT_ONCE run at once -- a slot is freed when its lookup ends, not when the
read that asked for it gives up -- and the others wait on the event loop, where their read's timeout
cancels them.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

LOOKUPS_AT_ONCE = 2
"""Router name lookups in the loop's threads at once (libuv's pool holds four: two stay free)."""


class BoundedResolver(AbstractResolver):
    """aiohttp's resolver (`inner`, default ThreadedResolver) with at most `at_once` lookups running."""

    def __init__(self, at_once: int = LOOKUPS_AT_ONCE, inner: AbstractResolver | None = None) -> None:
        self._inner = inner or aiohttp.ThreadedResolver()
        self._slots = asyncio.Semaphore(at_once)
        self.running = 0
        """Lookups running now (holding a slot)."""

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        await self._slots.acquire()  # a caller cancelled here holds no slot
        self.running += 1
        lookup = asyncio.ensure_future(self._inner.resolve(host, port, family))
        lookup.add_done_callback(self._done)
        return await asyncio.shield(lookup)  # a cancelled caller leaves the lookup running, and its slot held

    def _done(self, lookup: asyncio.Future[Any]) -> None:
        self.running -= 1
        self._slots.release()
        if not lookup.cancelled():
            lookup.exception()  # retrieved: a lookup whose caller gave up fails quietly

    async def close(self) -> None:
        await self._inner.close()
