"""The drift loop's router name lookups are bounded (operator/router_resolver.py): a read that gives up does not
free its lookup's slot until the lookup itself ends, so slow or failing lookups never take more than
LOOKUPS_AT_ONCE of the event loop's threads, where the API server's new connections resolve too."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp.abc import AbstractResolver, ResolveResult

from exitplan.operator.router_resolver import LOOKUPS_AT_ONCE, BoundedResolver


class SlowNames(AbstractResolver):
    """Lookups that end only when `answer` is set (as a resolver that waits for its timeout), counted."""

    def __init__(self) -> None:
        self.answer = asyncio.Event()
        self.running = self.most = self.asked = 0

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        self.asked += 1
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await asyncio.shield(self.answer.wait())  # a thread's lookup is not stopped by its caller
        finally:
            self.running -= 1
        raise OSError(f"{host}: Name or service not known")

    async def close(self) -> None:
        pass


async def test_readers_that_give_up_leave_their_lookups_bounded():
    names = SlowNames()
    resolver = BoundedResolver(inner=names)
    reads = [asyncio.wait_for(resolver.resolve(f"svc-{k}-control.ns.svc", 8081), 0.05) for k in range(8)]
    results = await asyncio.gather(*reads, return_exceptions=True)
    assert all(isinstance(r, TimeoutError) for r in results)  # every read gave up
    assert names.asked == LOOKUPS_AT_ONCE and names.most == LOOKUPS_AT_ONCE  # the others never started one
    assert resolver.running == LOOKUPS_AT_ONCE  # still held: their lookups go on
    names.answer.set()  # the lookups end (fail): their slots come back
    for _ in range(10):
        await asyncio.sleep(0)
    assert resolver.running == 0
    with pytest.raises(OSError, match="not known"):
        await resolver.resolve("svc-9-control.ns.svc", 8081)  # a new read gets a slot, and the lookup's answer


async def test_names_still_resolve_through_it():
    resolver = BoundedResolver()  # aiohttp's threaded resolver underneath
    found = await resolver.resolve("localhost", 8081)
    assert found and all(r["port"] == 8081 for r in found) and resolver.running == 0
    await resolver.close()
