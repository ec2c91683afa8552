"""Run a console script (bench/operator_scale.py: `exitplan operator`) with a CPU-time profiler of its main
thread that signals switch on and off: SIGUSR1 starts a cProfile.Profile timed by time.thread_time (the
thread's CPU, not the wall clock: on a shared 2-core machine a thread that waits for a core is not charged),
SIGUSR2 stops it and writes its stats to OUT.0, OUT.1, ... Threads other than the main one (the tuner's
worker threads) are not in it. The garbage collector's passes in between (their count and CPU, per
generation, of whichever thread ran them) go to OUT.<n>.gc.json; with --gc-only no profiler runs (its
overhead then does not inflate the passes).

    python -P bench/cpu_profiled.py [--gc-only] OUT SCRIPT [ARGS...]
"""

from __future__ import annotations

import cProfile
import gc
import json
import runpy
import signal
import sys
import time
from typing import Any


class Switch:
    def __init__(self, out: str, gc_only: bool) -> None:
        self.out, self.count, self.gc_only, self.on = out, 0, gc_only, False
        self.profile: cProfile.Profile | None = None
        self.gc: dict[int, list[float]] = {}
        self._gc_start = 0.0
        gc.callbacks.append(self._collected)

    def _collected(self, phase: str, info: dict[str, Any]) -> None:
        if not self.on:
            return
        if phase == "start":
            self._gc_start = time.thread_time()
        else:
            passes = self.gc.setdefault(int(info["generation"]), [0, 0.0])
            passes[0] += 1
            passes[1] += time.thread_time() - self._gc_start

    def start(self, *_: Any) -> None:
        if self.on:
            return
        self.on, self.gc = True, {}
        if not self.gc_only:
            self.profile = cProfile.Profile(time.thread_time)
            self.profile.enable()

    def stop(self, *_: Any) -> None:
        if not self.on:
            return
        self.on = False
        if self.profile is not None:
            self.profile.disable()
            self.profile.dump_stats(f"{self.out}.{self.count}")
            self.profile = None
        gen = {str(g): {"passes": n, "cpu_s": round(t, 4)} for g, (n, t) in sorted(self.gc.items())}
        with open(f"{self.out}.{self.count}.gc.json", "w") as f:
            json.dump({"generations": gen, "tracked_objects": len(gc.get_objects())}, f)
        self.count += 1


def main() -> None:
    gc_only = sys.argv[1] == "--gc-only"
    if gc_only:
        del sys.argv[1]
    out, script = sys.argv[1], sys.argv[2]
    switch = Switch(out, gc_only)
    signal.signal(signal.SIGUSR1, switch.start)
    signal.signal(signal.SIGUSR2, switch.stop)
    sys.argv = sys.argv[2:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
