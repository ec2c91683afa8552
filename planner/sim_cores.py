"""Processor sharing of a machine's cores among the simulated processes (planner/simulator.py).

On a pool whose processes share a machine's cores (`GPUPool.spec.sharedCores`), the workers' batches, the
routers' and the sender's work per request all run at once on the same cores, as the operating system
shares them: while the threads that want a core (each running batch keeps the workers' intra-op threads
busy, a router or the sender one, `background` more always) number no more than the cores, each runs at
full speed; past that every one runs at cores / threads of its speed (egalitarian processor sharing). A
job's work is its time alone; it finishes once it has received that much. The speed changes whenever a
job starts or ends, and every running job's finish moves with it: the simulator asks `due()` after each
change and calls `finished(now)` when that time comes (an earlier answer that a later change moved is stale).

Work-conserving: whatever runs, the cores do min(cores, threads) cores' worth of work per second. (A speed
fixed when a job starts, by what runs at that moment, would leave cores idle once the others end.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

DONE_MS = 1e-6
"""Work left below this (a nanosecond) is done: float round-off of many speed changes."""


@dataclass
class _Job(Generic[T]):
    left_ms: float
    threads: float
    payload: T


class SharedCores(Generic[T]):
    """The jobs running on `cores` shared cores, `background` cores' worth of other work beside them."""

    def __init__(self, cores: float, background: float = 0.0) -> None:
        if cores <= 0 or background < 0:
            raise ValueError(f"shared cores need cores > 0 and background >= 0, got {cores} and {background}")
        self.cores, self.background = cores, background
        self.jobs: list[_Job[T]] = []
        self.now = 0.0
        self.threads = 0.0
        """Threads of the running jobs."""

    def speed(self) -> float:
        """The share of a core each running thread gets now."""
        wanting = self.threads + self.background
        return min(1.0, self.cores / wanting) if wanting > 0 else 1.0

    def _advance(self, now: float) -> None:
        if now > self.now and self.jobs:
            done_ms = (now - self.now) * 1e3 * self.speed()
            for job in self.jobs:
                job.left_ms -= done_ms
        self.now = max(self.now, now)

    def start(self, now: float, work_ms: float, threads: float, payload: T) -> None:
        """A job of `work_ms` (its time alone) keeping `threads` threads busy starts at `now`."""
        self._advance(now)
        self.jobs.append(_Job(max(work_ms, 0.0), threads, payload))
        self.threads += threads

    def due(self) -> float:
        """When the next job finishes at the current speed (inf: none runs)."""
        if not self.jobs:
            return math.inf
        return self.now + min(j.left_ms for j in self.jobs) / self.speed() / 1e3

    def finished(self, now: float) -> list[T]:
        """The payloads of the jobs done by `now`, in the order they started; they leave the cores."""
        self._advance(now)
        done = [j for j in self.jobs if j.left_ms <= DONE_MS]
        if done:
            self.jobs = [j for j in self.jobs if j.left_ms > DONE_MS]
            self.threads = sum(j.threads for j in self.jobs)
        return [j.payload for j in done]
