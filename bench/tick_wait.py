"""The drift loop daemon's wait between ticks, side by side in one run (alternated rounds): kopf's
`await stopped.wait(TICK)` (a task and asyncio.wait_for per wait, whose time limit ends in a TimeoutError: objects
in reference cycles every tick) against one task per daemon that waits for the stop flag and `asyncio.wait([it],
timeout=TICK)` between ticks (operator/handlers.py:ticks). 200 daemons with empty ticks, the operator's young
collection threshold (operator/heap.py); prints CPU per tick and the young collections each set off.

    python -P bench/tick_wait.py [--rounds 3] [--seconds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time

from kopf._cogs.aiokits import aioenums

from exitplan.operator import heap

TICK = 0.02
N = 200


async def old(stopped: aioenums.AsyncFlagWaiter, counter: list[int]) -> None:
    while not stopped:
        counter[0] += 1
        await stopped.wait(TICK)


async def _flag(stopped: aioenums.AsyncFlagWaiter) -> None:
    await stopped.wait()


async def new(stopped: aioenums.AsyncFlagWaiter, counter: list[int]) -> None:
    stop = asyncio.ensure_future(_flag(stopped))
    try:
        while not stopped:
            counter[0] += 1
            await asyncio.wait([stop], timeout=TICK)
    finally:
        stop.cancel()


async def run(kind: str, seconds: float) -> tuple[float, int]:
    gc.set_threshold(heap.YOUNG_THRESHOLD, 10, 10)
    setter = aioenums.FlagSetter()
    counter = [0]
    f = old if kind == "old" else new
    tasks = [asyncio.create_task(f(aioenums.AsyncFlagWaiter(setter), counter)) for _ in range(N)]
    await asyncio.sleep(0.5)
    c0, n0, g0 = time.process_time(), counter[0], gc.get_stats()[0]["collections"]
    await asyncio.sleep(seconds)
    c1, n1, g1 = time.process_time(), counter[0], gc.get_stats()[0]["collections"]
    setter.set()
    await asyncio.gather(*tasks)
    return (c1 - c0) / (n1 - n0) * 1e6, g1 - g0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="measured per daemon kind and round")
    args = parser.parse_args()
    for r in range(args.rounds):
        figures = {kind: asyncio.run(run(kind, args.seconds)) for kind in ("old", "new")}
        (old_us, old_gc), (new_us, new_gc) = figures["old"], figures["new"]
        print(
            f"round {r}: stopped.wait {old_us:.1f} us CPU a tick ({old_gc} young collections), "
            f"stop-flag task {new_us:.1f} us ({new_gc}): {old_us / new_us:.1f}x"
        )


if __name__ == "__main__":
    main()
