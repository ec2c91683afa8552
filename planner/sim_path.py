"""The serving path around the simulated workers (planner/simulator.py): the routers and the cores they share.

The data plane's workers are not alone on their machine: every request also costs its router CPU (decode,
tokenize, admission, answer: the profile's `serving.routerMs`, or `colocatedMs` where split 0 runs in the
router), and on a pool whose processes share a machine's cores (`GPUPool.spec.sharedCores`, a CPU pool) the
workers, the routers and anything else running there take turns on the same cores. A fluid capacity counts
that work on average; under a trace's bursts it is what turns a queue that drains into one that does not.

`ServingPath` says what the simulation counts:

- `router_ms` per request on one of `routers` single-threaded routers (an event loop takes one core at
  most): requests wait for their router in order, then are admitted; with `colocated`, split 0 runs in
  the routers and its batches pay no hop;
- `sender_ms` per request in one single-threaded process every request passes before the routers, on the
  same cores: the load generator of a measurement on the same machine (`exitplan bench` sends and reads
  every request in one event loop), 0 for a service whose clients run elsewhere;
- `cores` shared by all of them and the workers (each running batch keeps `threads` of them busy): a
  batch launched, or a request the sender or a router takes up, while more wants the cores than there are
  runs proportionally longer (processor sharing, read when it starts: for a request, the batches running,
  the routers busy and the sender busy then; for a batch, which outlasts many requests, the batches
  running and the sender's and routers' CPU for the requests of the last WINDOW_S), `background` cores'
  worth of other processes always counted beside them.

`RouterState` is one run's routers: per bucket the data plane's own admission limit
(`dispatch.BucketLimiter`, started at the bucket's capacity x the SLO and following the answers' latency, as
worker_image/classify/admission.py), and the sender's and the routers' queues.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from exitplan.planner.dispatch import LATE_FRACTION, BucketLimiter

WINDOW_S = 0.1
"""A batch counts the requests sent over this many seconds for the sender's and the routers' CPU."""


@dataclass(frozen=True)
class ServingPath:
    router_ms: float = 0.0
    """CPU per request in its router; 0: the routers cost nothing (the block cost model alone)."""
    routers: int = 1
    cores: float | None = None
    """Cores the workers, the routers and the sender share; None: each worker has its own accelerator."""
    sender_ms: float = 0.0
    """CPU per request of the one process that sends every request (a load generator on those cores)."""
    threads: int = 1
    """Cores one running batch keeps busy (the workers' intra-op threads)."""
    background: float = 0.0
    """Cores' worth of other work always running on those cores (processes not part of the service nor
    the sender: they take their fair share whenever anything else runs)."""
    colocated: bool = False
    """Split 0 runs in the routers (Plan.colocate): its batches pay no hop (the worker's own work per
    batch, the profile's hopMs), which `router_ms` (colocatedMs) holds."""

    def __post_init__(self) -> None:
        if self.router_ms < 0 or self.sender_ms < 0 or self.background < 0 or self.routers < 1 or self.threads < 1:
            raise ValueError(f"invalid serving path {self}: costs and background >= 0, routers and threads >= 1")
        if self.cores is not None and self.cores <= 0:
            raise ValueError(f"invalid serving path {self}: cores must be > 0 (or None for dedicated accelerators)")


class RouterState:
    """One simulated run's sender and routers: admission per bucket, their queues."""

    def __init__(self, path: ServingPath, capacity: Sequence[float], slo_s: float) -> None:
        self.path = path
        self.limiters = [BucketLimiter(target_s=LATE_FRACTION * slo_s) for _ in capacity]
        for limiter, cap in zip(self.limiters, capacity):
            limiter.ensure(cap, slo_s)
        self.free_at = [0.0] * path.routers
        self.sender_free = 0.0
        self.next_router = 0
        self.recent: deque[float] = deque()
        """Times the requests of the last WINDOW_S seconds were sent."""

    def loads(self, outstanding: Sequence[int]) -> list[float]:
        return [lim.load(n) for lim, n in zip(self.limiters, outstanding)]

    def routed(self, now: float, busy_workers: int) -> float:
        """A request is sent at `now`: when it reaches split 0, once the sender and its router (round robin)
        have done their work on it, each in order and slower while the shared cores are oversubscribed."""
        path = self.path
        self.recent.append(now)
        while self.recent[0] < now - WINDOW_S:
            self.recent.popleft()
        at = now
        if path.sender_ms > 0:
            start = max(self.sender_free, at)
            at = start + path.sender_ms / 1e3 * self.stretch(busy_workers, start, sender=True)
            self.sender_free = at
        if path.router_ms > 0:
            r = self.next_router
            self.next_router = (r + 1) % path.routers
            start = max(self.free_at[r], at)
            at = start + path.router_ms / 1e3 * self.stretch(busy_workers, start, router=r)
            self.free_at[r] = at
        return at

    def answered(self, bucket: int, latency_s: float, outstanding: int, now: float) -> None:
        self.limiters[bucket].on_answer(latency_s, outstanding, now)

    def stretch(self, busy_workers: int, now: float, *, router: int = -1, sender: bool = False) -> float:
        """How much longer a request's work in the sender or `router` (an index), started at `now`, runs than
        alone (1.0 without shared cores), processor sharing: what wants the cores then -- the running
        batches (x their threads; they outlast it), the routers and the sender busy then, itself included --
        over the cores."""
        path = self.path
        if path.cores is None:
            return 1.0
        routers = sum(1 for j, f in enumerate(self.free_at) if f > now or j == router)
        busy = busy_workers * path.threads + routers + (sender or self.sender_free > now) + path.background
        return max(1.0, busy / path.cores)

    def batch_stretch(self, busy_workers: int) -> float:
        """The same for a batch launched now (its worker among `busy_workers`): it outlasts many requests'
        sender and router work, so those count by their recent rate (the last `WINDOW_S`), each process at
        most one core."""
        path = self.path
        if path.cores is None:
            return 1.0
        rate = len(self.recent) / WINDOW_S
        per_router = rate * path.router_ms / 1e3 / path.routers
        fluid = path.routers * min(1.0, per_router) + min(1.0, rate * path.sender_ms / 1e3)
        return max(1.0, (busy_workers * path.threads + fluid + path.background) / path.cores)
