"""The CPU of the operator's once-a-period re-tune look, side by side in one run (alternated rounds):
the tuner's look (live_thresholds._tune on the stand-in router's feedback stream, 10 ramps, 40 looks, 200
  new samples each) on the calling thread, against the same looks in a worker thread while the calling thread
  runs Python meanwhile -- as the operator's event loop did while a re-tune ran in `asyncio.to_thread` (the loop
  is busy only part of the time, so this is the worst case); CPU is the looking thread's own (time.thread_time),
  so the GIL's hand-overs it pays are in it.

    python -P bench/retune_cpu.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import stand_in_router  # noqa: E402

from exitplan.operator.live_thresholds import _tune  # noqa: E402
from exitplan.planner.tuning import autotune  # noqa: E402
from exitplan.worker_image.control_bodies import FeedbackArrays  # noqa: E402

RAMPS, LOOKS, NEW, WINDOW, BUDGET = 10, 40, 200, 1024, 0.01


def windows() -> list[FeedbackArrays]:
    pool = stand_in_router.sample_pool(RAMPS)
    out = []
    for k in range(LOOKS):
        newest = 5000 + NEW * k
        rows = np.arange(newest - WINDOW, newest) % stand_in_router.POOL
        out.append(FeedbackArrays(pool.conf[rows], pool.pred[rows], pool.final[rows], pool.saving_ms, pool.cost_ms))
    return out


def looks(arrays: list[FeedbackArrays], cpu: list[float]) -> None:
    """The live loop's looks, one after another, each one's thread CPU appended to `cpu`."""
    ramps = [f"ramp{i}" for i in range(RAMPS)]
    state, current = autotune.TunerState(), {r: 1.01 for r in ramps}
    for a in arrays:
        start = time.thread_time()
        decision, state = _tune(a, ramps, current, BUDGET, state)
        cpu.append(time.thread_time() - start)
        current = decision.thresholds or current


def in_thread_beside_work(arrays: list[FeedbackArrays]) -> list[float]:
    cpu: list[float] = []
    worker = threading.Thread(target=looks, args=(arrays, cpu))
    worker.start()
    while worker.is_alive():  # the event loop's own Python work meanwhile
        {i: str(i) for i in range(200)}  # noqa: B018
    worker.join()
    return cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    arrays = windows()
    for r in range(args.rounds):
        here: list[float] = []
        looks(arrays, here)
        there = in_thread_beside_work(arrays)
        print(
            f"round {r + 1}: tuner look {1e3 * np.mean(here):.2f} ms on the calling thread, "
            f"{1e3 * np.mean(there):.2f} ms in a thread beside work ({np.mean(there) / np.mean(here):.2f}x)"
        )


if __name__ == "__main__":
    main()
