"""The operator's garbage collector: what lives long is frozen, so that collections scan only what is new.

At 200 services the operator holds ~400,000 tracked objects, most of them long-lived (its modules, kopf's
and the watches' copies of every object, each service's windows). The collector's automatic full
collections scanned all of them about every other drift period (0.3-0.35 s each): with the middle
generation's passes, about a tenth of the operator's CPU in a drift period (bench/operator_scale.py
--cpu-profile gc:PREFIX). So whatever survives a full collection is moved out of the collector's
generations (`gc.freeze`, as a pre-forking server does with its startup heap), and the automatic
collections that follow scan only the objects created since; young collections run less often
(YOUNG_THRESHOLD), so that fewer short-lived objects reach the middle generation. Nothing is lost for good: every
REFREEZE_SECONDS everything is unfrozen and collected in full once, so a frozen cycle that became garbage
is collected at most that late.

Only where the operator owns its process (`exitplan operator` sets ENV_FREEZE): freezing is process-wide, and
an operator run inside another program (the tests run kopf in their own process) would freeze that program's
objects too, and collect them at its own stop, out of their owners' hands.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from typing import Any

log = logging.getLogger("exitplan.operator.heap")

ENV_FREEZE = "EXITPLAN_FREEZE_HEAP"
"""Set to "true" by `exitplan operator`: the operator's startup keeps the heap frozen (handlers.configure)."""
REFREEZE_SECONDS = 600.0
"""How often everything is unfrozen and collected in full (the longest a frozen garbage cycle waits)."""
YOUNG_THRESHOLD = 10_000
"""Allocations (less deallocations) of tracked objects between young collections (Python's default: 700). A drift
read's windows and a watch event's copies live a few hundred allocations: at 700 many outlived a young collection
and were scanned again by the middle generation's."""


def wanted() -> bool:
    """Whether this process's operator keeps the heap frozen (ENV_FREEZE)."""
    return os.environ.get(ENV_FREEZE, "").lower() == "true"


def refreeze() -> tuple[int, float]:
    """Collect everything (frozen objects too) and freeze the survivors: (objects frozen, seconds it took)."""
    start = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count(), time.perf_counter() - start


class FrozenHeap:
    """Freezes the survivors of each automatic full collection (on the event loop, right after it) and refreezes
    everything every `every` seconds; `start` on the operator's loop, `stop` at its cleanup (everything unfrozen
    and collected then)."""

    def __init__(self, every: float = REFREEZE_SECONDS) -> None:
        self.every = every
        self.task: asyncio.Task[None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thresholds: tuple[int, ...] = ()

    def _collected(self, phase: str, info: dict[str, Any]) -> None:
        # any thread may run a collection: the freeze runs on the loop, after the collection has finished
        if phase == "stop" and info.get("generation") == 2 and self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(gc.freeze)

    async def _every(self) -> None:
        while True:
            frozen, took = refreeze()
            log.debug("heap: %d objects frozen after a full collection (%.3f s)", frozen, took)
            await asyncio.sleep(self.every)

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.thresholds = gc.get_threshold()
        gc.set_threshold(YOUNG_THRESHOLD, *self.thresholds[1:])
        gc.callbacks.append(self._collected)
        self.task = asyncio.create_task(self._every())

    async def stop(self) -> None:
        if self._collected in gc.callbacks:
            gc.callbacks.remove(self._collected)
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
            self.task = None
        if self.thresholds:
            gc.set_threshold(*self.thresholds)
        gc.unfreeze()
        gc.collect()  # what became garbage while frozen goes now, while the loop its objects belong to still runs
