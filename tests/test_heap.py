"""operator/heap.py: survivors of a full collection are frozen, and a frozen cycle that became garbage is still
collected by the next refreeze (nothing leaks for good)."""

from __future__ import annotations

import asyncio
import gc
import weakref

from exitplan.operator import heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def _cycle() -> weakref.ref[Node]:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_refreeze_collects_a_frozen_cycle_that_became_garbage() -> None:
    try:
        gc.collect()
        gc.freeze()
        held = [Node()]
        held[0].other = held[0]
        alive = weakref.ref(held[0])
        gone = _cycle()  # garbage already, but not collected yet: frozen with the rest
        gc.freeze()
        gc.collect()
        assert gone() is not None, "a frozen object is not collected"
        frozen, _ = heap.refreeze()
        assert gone() is None, "the refreeze unfroze and collected it"
        assert alive() is not None and frozen > 0, "what is still referenced survives, frozen"
    finally:
        gc.unfreeze()


def test_survivors_of_a_full_collection_are_frozen_then_unfrozen_at_stop() -> None:
    """Young collections run less often while the heap is kept frozen; all of it is undone at stop."""
    default = gc.get_threshold()

    async def run() -> tuple[int, int, int]:
        frozen = heap.FrozenHeap(every=3600.0)
        frozen.start()
        assert gc.get_threshold()[0] == heap.YOUNG_THRESHOLD
        await asyncio.sleep(0)  # the first refreeze
        gc.unfreeze()
        before = gc.get_freeze_count()
        gc.collect()  # a full collection: its survivors are frozen on the loop right after it
        await asyncio.sleep(0.01)
        after = gc.get_freeze_count()
        await frozen.stop()
        return before, after, gc.get_freeze_count()

    try:
        before, after, stopped = asyncio.run(run())
    finally:
        gc.unfreeze()
    assert before == 0 and after > 0, (before, after)
    assert stopped == 0, "stop leaves the heap unfrozen"
    assert gc.get_threshold() == default, "and the collector's thresholds as they were"
