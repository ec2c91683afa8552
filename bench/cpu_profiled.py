"""Run a console script (bench/operator_scale.py: `exitplan operator`) with a CPU-time profiler of its main
thread that signals switch on and off: SIGUSR1 starts a cProfile.Profile timed by time.thread_time (the
thread's CPU, not the wall clock: on a shared 2-core machine a thread that waits for a core is not charged),
SIGUSR2 stops it and writes its stats to OUT.0, OUT.1, ... Threads other than the main one (the tuner's
worker threads) are not in it. The garbage collector's passes in between (their count and CPU, per
generation, of whichever thread ran them, and the garbage objects they found) go to OUT.<n>.gc.json; with --gc-only no profiler runs (its
overhead then does not inflate the passes).

With --sections, no profiler either: the functions EXITPLAN_SECTIONS names (comma-separated
`module:function` or `module:Class.method`) are wrapped, each charged the CPU time of the thread that runs
it while it runs (a coroutine: only its own steps, not the other tasks that run while it waits; charged step by step,
so a coroutine that runs for good counts too), and
OUT.<n>.sections.json holds, per function, its calls and its inclusive CPU seconds. Wrapping a few large
functions costs little (cProfile's hook on every call inflates small Python functions ~3x, which skews
its shares); a function called inside another is counted in both. Wrap synchronous functions, or coroutines
that run inside a read (`exitplan.operator.driftloop:_read`), never a coroutine the per-service daemon's loop
awaits between its waits (kopf's `_daemon`, `handlers:tick`, `driftloop:on_tick`, `check_drift`): with one of
those wrapped the daemons ticked about ten times as often (sessions 22 and 23: 39 ticks per service and period
for 4), so the run measured another load. Count ticks with a synchronous function called once a tick
(`exitplan.operator.driftloop:_spec`).

With --garbage, no profiler: the collector keeps what it finds (gc.DEBUG_SAVEALL) while switched on, and
OUT.<n>.garbage.json counts those objects by type, and the frames among them by their function (which code
leaves objects in reference cycles for the collector to free).

    python -P bench/cpu_profiled.py [--gc-only | --sections | --garbage] OUT SCRIPT [ARGS...]
"""

from __future__ import annotations

import collections
import cProfile
import functools
import gc
import importlib
import inspect
import json
import os
import runpy
import signal
import sys
import time
import types
from collections.abc import Callable, Generator
from typing import Any


class Sections:
    """Inclusive CPU time (of the thread that runs them) of the wrapped functions while switched on."""

    def __init__(self) -> None:
        self.on = False
        self.calls: dict[str, list[float]] = {}

    def _charge(self, key: str, seconds: float, calls: int) -> None:
        if self.on:
            entry = self.calls.setdefault(key, [0, 0.0])
            entry[0] += calls
            entry[1] += seconds

    def wrap(self, key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(fn):

            @types.coroutine
            def stepped(coro: Any) -> Generator[Any, Any, Any]:
                steps, sent, thrown = coro.__await__(), None, None
                while True:
                    start = time.thread_time()
                    try:
                        out = steps.throw(thrown) if thrown is not None else steps.send(sent)
                    except StopIteration as done:
                        self._charge(key, time.thread_time() - start, 1)
                        return done.value
                    except BaseException:
                        self._charge(key, time.thread_time() - start, 1)
                        raise
                    self._charge(key, time.thread_time() - start, 0)  # each step: a coroutine that never ends counts
                    try:
                        sent, thrown = (yield out), None
                    except BaseException as err:  # noqa: BLE001 -- passed on into the coroutine
                        sent, thrown = None, err

            @functools.wraps(fn)
            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                return await stepped(fn(*args, **kwargs))

            return timed_async

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self._charge(key, time.thread_time() - start, 1)

        return timed

    def install(self, names: list[str]) -> None:
        """Wrap each `module:function` / `module:Class.method`, and every module's own binding of it."""
        for name in names:
            module_name, _, attr = name.partition(":")
            owner: Any = importlib.import_module(module_name)
            *path, leaf = attr.split(".")
            for part in path:
                owner = getattr(owner, part)
            original = inspect.getattr_static(owner, leaf)
            wrapped = self.wrap(name, getattr(owner, leaf))
            setattr(owner, leaf, staticmethod(wrapped) if isinstance(original, staticmethod) else wrapped)
            if not path:  # `from module import function` elsewhere: those bindings too
                for module in list(sys.modules.values()):
                    for key, value in list(getattr(module, "__dict__", {}).items()):
                        if value is original and module is not owner:
                            setattr(module, key, wrapped)


class Switch:
    def __init__(self, out: str, gc_only: bool, sections: Sections | None = None, garbage: bool = False) -> None:
        self.out, self.count, self.gc_only, self.on = out, 0, gc_only or garbage, False
        self.garbage = garbage
        self.sections = sections
        self.profile: cProfile.Profile | None = None
        self.gc: dict[int, list[Any]] = {}
        self._gc_start = 0.0
        gc.callbacks.append(self._collected)

    def _collected(self, phase: str, info: dict[str, Any]) -> None:
        if not self.on:
            return
        if phase == "start":
            self._gc_start = time.thread_time()
        else:
            passes = self.gc.setdefault(int(info["generation"]), [0, 0.0, 0])
            passes[0] += 1
            passes[1] += time.thread_time() - self._gc_start
            passes[2] += int(info.get("collected", 0))

    def _dump_garbage(self) -> None:
        gc.collect()
        gc.set_debug(0)
        kinds = collections.Counter(type(o).__qualname__ for o in gc.garbage)
        frames = collections.Counter(
            f"{o.f_code.co_filename.rsplit('/', 2)[-1]}:{o.f_code.co_name}" for o in gc.garbage if inspect.isframe(o)
        )
        with open(f"{self.out}.{self.count}.garbage.json", "w") as f:
            json.dump({"objects": len(gc.garbage), "types": kinds.most_common(40), "frames": frames.most_common(40)}, f)
        gc.garbage.clear()

    def start(self, *_: Any) -> None:
        if self.on:
            return
        self.on, self.gc = True, {}
        self.thread_cpu = time.thread_time()
        if self.garbage:
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
        if self.sections is not None:
            self.sections.on, self.sections.calls = True, {}
        elif not self.gc_only:
            self.profile = cProfile.Profile(time.thread_time)
            self.profile.enable()

    def stop(self, *_: Any) -> None:
        if not self.on:
            return
        self.on = False
        if self.garbage:
            self._dump_garbage()
        if self.sections is not None:
            self.sections.on = False
            main = {"main_thread_cpu_s": round(time.thread_time() - self.thread_cpu, 4)}
            table = {k: {"calls": int(n), "cpu_s": round(t, 4)} for k, (n, t) in sorted(self.sections.calls.items())}
            with open(f"{self.out}.{self.count}.sections.json", "w") as f:
                json.dump({**main, "sections": table}, f, indent=1)
        if self.profile is not None:
            self.profile.disable()
            self.profile.dump_stats(f"{self.out}.{self.count}")
            self.profile = None
        gen = {str(g): {"passes": n, "cpu_s": round(t, 4), "collected": c} for g, (n, t, c) in sorted(self.gc.items())}
        with open(f"{self.out}.{self.count}.gc.json", "w") as f:
            json.dump(
                {"generations": gen, "tracked_objects": len(gc.get_objects()), "frozen": gc.get_freeze_count()}, f
            )
        self.count += 1


def main() -> None:
    gc_only, sections = sys.argv[1] == "--gc-only", None
    if sys.argv[1] == "--sections":
        sections = Sections()
        sections.install([n for n in os.environ.get("EXITPLAN_SECTIONS", "").split(",") if n])
    garbage = sys.argv[1] == "--garbage"
    if sys.argv[1] in ("--gc-only", "--sections", "--garbage"):
        del sys.argv[1]
    out, script = sys.argv[1], sys.argv[2]
    switch = Switch(out, gc_only, sections, garbage)
    signal.signal(signal.SIGUSR1, switch.start)
    signal.signal(signal.SIGUSR2, switch.stop)
    sys.argv = sys.argv[2:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
