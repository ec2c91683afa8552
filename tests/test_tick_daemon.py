"""The drift loop's daemon (operator/handlers.py:ticks): a tick that fails is logged and followed by the next
one, a kopf.TemporaryError's delay is kept, and the loop ends when kopf stops it (the service deleted, the
operator pausing or exiting). Run on kopf's own stop flag; the operator's runs through kopf are in
tests/test_operator_integration.py and tests/test_tick_reads.py."""

from __future__ import annotations

import asyncio
import logging
import os

import kopf
from kopf._cogs.aiokits import aioenums

# handlers reads the tick once, at import: the operator tests' tick (test_operator_support), whichever of these
# files a test process imports first (a tick of 5 s left the drift loop's tests after this file reading too seldom)
os.environ.setdefault("EXITPLAN_TICK_SECONDS", "0.5")

from exitplan.operator import driftloop, handlers  # noqa: E402


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


def test_the_grid_point_is_the_next_multiple_of_the_tick_at_least_a_tenth_of_a_tick_away():
    assert driftloop.next_tick(12.0, 5.0) == 3.0
    assert driftloop.next_tick(14.0, 5.0) == 1.0  # a tick that ended late in its burst: the next point still
    assert abs(driftloop.next_tick(14.7, 5.0) - 5.3) < 1e-9  # 0.3 s to the next point: the one after it
    assert driftloop.next_tick(15.0, 5.0) == 5.0
    for k in range(1, 400):
        now = 1000.0 + k * 0.0371
        wait = driftloop.next_tick(now, 0.5)
        assert 0.05 <= wait <= 0.55
        assert abs((now + wait) / 0.5 - round((now + wait) / 0.5)) < 1e-6


def test_a_large_fleet_ticks_at_several_points_chosen_by_uid():
    assert [driftloop.tick_points(n) for n in (0, 1, 200, 201, 400, 1000)] == [1, 1, 1, 2, 2, 5]
    assert {driftloop.tick_phase(f"uid-{k}", 5.0) for k in range(50)} == {0.0}  # one point: every service on it
    phases = [driftloop.tick_phase(f"uid-{k}", 5.0, 5) for k in range(200)]
    assert phases == [driftloop.tick_phase(f"uid-{k}", 5.0, 5) for k in range(200)]  # the same on every start
    points = sorted(set(phases))
    assert points == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert min(phases.count(p) for p in points) > 200 / 5 / 2  # the fleet spread over them
    assert driftloop.tick_phase("", 5.0, 5) == 0.0
    assert driftloop.next_tick(12.0, 5.0, phase=1.0) == 4.0  # 16 = 1 + 3 * 5


def test_services_tick_on_one_grid_whenever_they_started(monkeypatch):
    """Each daemon waits until the next point of its grid (the multiples of TICK on the event loop's clock, shifted
    by its point within the tick on a large fleet), so services created at different times but sharing a point
    tick in the same burst: the waits they ask for end on the grid."""
    tick, uid = 0.05, "uid-7"
    fleet: dict[tuple[str, str], dict[str, object]] = {}  # the operator's services (handlers.SERVICE_MEMOS)
    phase = driftloop.tick_phase(uid, tick, driftloop.tick_points(450)) / tick
    assert phase > 0  # a point other than the multiples of the tick themselves
    monkeypatch.setattr(handlers, "TICK", tick)
    ends: dict[str, list[float]] = {"a": [], "b": []}
    wait = asyncio.wait

    async def recorded(tasks, timeout=None, **kwargs):  # type: ignore[no-untyped-def]
        if timeout is not None:
            name = asyncio.current_task().get_name()  # type: ignore[union-attr]
            ends[name].append((asyncio.get_running_loop().time() + timeout) / tick - phase)
        return await wait(tasks, timeout=timeout, **kwargs)

    async def quiet(body: object, memo: object) -> None:
        await asyncio.sleep(0)

    monkeypatch.setattr(handlers, "tick", quiet)
    monkeypatch.setattr(handlers.asyncio, "wait", recorded)

    async def run() -> None:
        setter: aioenums.FlagSetter[object] = aioenums.FlagSetter()
        stopped = aioenums.AsyncFlagWaiter(setter)
        log = logging.getLogger("test.ticks")
        body, memo = {"metadata": {"uid": uid}}, kopf.Memo({handlers.SERVICE_MEMOS: fleet})
        first = asyncio.create_task(handlers.ticks(body, memo, stopped, log), name="a")
        await asyncio.sleep(tick * 0.37)  # the second service comes later, off the first one's phase
        fleet.update({("ns", f"svc-{k}"): {} for k in range(450)})  # the fleet grew since the first began: 3 points
        ends["a"].clear()  # its waits before that: on the one-point grid
        second = asyncio.create_task(handlers.ticks(body, memo, stopped, log), name="b")
        while min(len(v) for v in ends.values()) < 4:
            await asyncio.sleep(tick / 5)
        setter.set()
        await asyncio.wait_for(asyncio.gather(first, second), 60.0)  # a hang guard, not a timing check

    asyncio.run(run())
    assert all(len(points) >= 4 for points in ends.values())
    for points in ends.values():
        # every wait ends on a grid point (within the few microseconds between the daemon's reading of the clock
        # and its call; the second service started 0.37 of a tick off the first one's phase)
        assert all(abs(p - round(p)) < 0.02 for p in points), points
