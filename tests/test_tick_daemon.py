"""The drift loop's daemon (operator/handlers.py:ticks): a tick that fails is logged and followed by the next
one, a kopf.TemporaryError's delay is kept, and the loop ends when kopf stops it (the service deleted, the
operator pausing or exiting). Run on kopf's own stop flag; the operator's runs through kopf are in
tests/test_operator_integration.py and tests/test_tick_reads.py."""

from __future__ import annotations

import asyncio
import logging

import kopf
from kopf._cogs.aiokits import aioenums

from exitplan.operator import handlers


class Failing:
    """A tick that raises each time, first a TemporaryError, then a plain error."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    async def __call__(self, body: object, memo: object) -> None:
        self.calls.append(asyncio.get_running_loop().time())
        if len(self.calls) == 1:
            raise kopf.TemporaryError("the apply failed", delay=0.2)
        raise RuntimeError("something broke")


def test_a_failed_tick_is_logged_and_the_next_follows_until_kopf_stops_the_loop(monkeypatch, caplog):
    failing = Failing()
    monkeypatch.setattr(handlers, "tick", failing)
    monkeypatch.setattr(handlers, "TICK", 0.05)
    monkeypatch.setattr(handlers, "RETRY_SECONDS", 0.1)

    async def run() -> None:
        setter: aioenums.FlagSetter[object] = aioenums.FlagSetter()
        loop = asyncio.create_task(
            handlers.ticks({}, kopf.Memo(), aioenums.AsyncFlagWaiter(setter), logging.getLogger("test.ticks"))
        )
        while len(failing.calls) < 4:
            if loop.done():
                loop.result()  # a failure ended the loop: raise it here
            await asyncio.sleep(0.01)
        setter.set()  # as kopf stops a daemon
        await asyncio.wait_for(loop, 60.0)  # the loop ends (a hang guard, not a timing check)

    with caplog.at_level(logging.WARNING, logger="test.ticks"):
        asyncio.run(run())
    gaps = [b - a for a, b in zip(failing.calls, failing.calls[1:])]
    assert gaps[0] >= 0.19  # the TemporaryError's delay, not the tick's
    assert all(gap >= 0.09 for gap in gaps[1:])  # after an unexpected failure: RETRY_SECONDS
    messages = [r.getMessage() for r in caplog.records]
    assert any("the apply failed" in m for m in messages)
    assert sum("tick failed" in m for m in messages) >= 3 and any(r.exc_info for r in caplog.records)


def test_the_loop_waits_between_ticks_without_leaving_garbage_and_ends_as_soon_as_kopf_stops_it(monkeypatch):
    """The wait between ticks leaves nothing for the collector (`await stopped.wait(TICK)` left ~50 objects in
    reference cycles a tick: its time limit's TimeoutError), and a stop during a long wait ends the loop at once,
    within a few turns of the event loop, not at the wait's end."""
    import gc

    ticks: list[int] = []

    async def quiet(body: object, memo: object) -> None:
        ticks.append(1)

    monkeypatch.setattr(handlers, "tick", quiet)
    monkeypatch.setattr(handlers, "TICK", 0.0005)

    async def run() -> tuple[int, int, bool]:
        setter: aioenums.FlagSetter[object] = aioenums.FlagSetter()
        loop = asyncio.create_task(
            handlers.ticks({}, kopf.Memo(), aioenums.AsyncFlagWaiter(setter), logging.getLogger("test.ticks"))
        )
        while len(ticks) < 5:  # warm up (first-call caches), then count from a clean heap
            await asyncio.sleep(0.001)
        gc.collect()
        counted = len(ticks)
        while len(ticks) < counted + 200:
            await asyncio.sleep(0.001)
        garbage = gc.collect()  # unreachable objects found: what the ticks' waits left in cycles
        done = len(ticks) - counted
        monkeypatch.setattr(handlers, "TICK", 3600.0)  # a long wait: only the stop can end it
        at = len(ticks)
        while len(ticks) == at:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)  # into the hour-long wait
        setter.set()  # as kopf stops a daemon
        for _ in range(100):  # a few turns of the event loop, not a clock
            if loop.done():
                break
            await asyncio.sleep(0)
        ended = loop.done()
        loop.cancel()
        return garbage, done, ended

    gc.disable()
    try:
        garbage, done, ended = asyncio.run(run())
    finally:
        gc.enable()
    assert done >= 200
    assert garbage < done, f"{garbage} objects in cycles over {done} ticks"
    assert ended
