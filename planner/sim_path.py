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
- `cores` shared by the workers (each batch keeps `threads` of them busy) and by the routers' and
  `other_ms` of other CPU per request (a load generator on the same machine, say): a batch launched, or a
  request a router takes up, while more work is running than there are cores runs proportionally longer
  (processor sharing, read when it starts from the workers busy then and the requests of the last
  `window_s` seconds).

`RouterState` is one run's routers: per bucket the data plane's own admission limit
(`dispatch.BucketLimiter`, started at the bucket's capacity x the SLO and following the answers' latency, as
worker_image/classify/admission.py), the routers' queues and the recent arrivals.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from exitplan.planner.dispatch import BucketLimiter

LATE_FRACTION = 0.8
"""An answer later than this fraction of the SLO shrinks its bucket's limit (as the router's)."""


@dataclass(frozen=True)
class ServingPath:
    router_ms: float = 0.0
    """CPU per request in its router; 0: the routers cost nothing (the block cost model alone)."""
    routers: int = 1
    cores: float | None = None
    """Cores the workers, routers and `other_ms` share; None: each worker has its own accelerator."""
    other_ms: float = 0.0
    """CPU per request of other processes on those cores (not part of the service)."""
    threads: int = 1
    """Cores one running batch keeps busy (the workers' intra-op threads)."""
    window_s: float = 0.25
    """The arrivals of this many seconds give the routers' (and other) CPU demand at a batch's launch."""
    colocated: bool = False
    """Split 0 runs in the routers (Plan.colocate): its batches pay no hop (the worker's own work per
    batch, the profile's hopMs), which `router_ms` (colocatedMs) holds."""

    def __post_init__(self) -> None:
        if self.router_ms < 0 or self.other_ms < 0 or self.routers < 1 or self.threads < 1 or self.window_s <= 0:
            raise ValueError(f"invalid serving path {self}: costs >= 0, routers and threads >= 1, window > 0")
        if self.cores is not None and self.cores <= 0:
            raise ValueError(f"invalid serving path {self}: cores must be > 0 (or None for dedicated accelerators)")


class RouterState:
    """One simulated run's routers: admission per bucket, the routers' queues, recent arrivals."""

    def __init__(self, path: ServingPath, capacity: Sequence[float], slo_s: float) -> None:
        self.path = path
        self.slo_s = slo_s
        self.limiters = [BucketLimiter(target_s=LATE_FRACTION * slo_s) for _ in capacity]
        for limiter, cap in zip(self.limiters, capacity):
            limiter.ensure(cap, slo_s)
        self.free_at = [0.0] * path.routers
        self.next_router = 0
        self.recent: deque[float] = deque()

    def loads(self, outstanding: Sequence[int]) -> list[float]:
        return [lim.load(n) for lim, n in zip(self.limiters, outstanding)]

    def routed(self, now: float, busy_workers: int) -> float:
        """A request reached the routers at `now`: when its router has done its work (round robin, in order;
        slower while the shared cores are oversubscribed, as a batch)."""
        path = self.path
        self.recent.append(now)
        while self.recent and self.recent[0] < now - path.window_s:
            self.recent.popleft()
        if path.router_ms <= 0:
            return now
        r = self.next_router
        self.next_router = (r + 1) % path.routers
        self.free_at[r] = max(self.free_at[r], now) + path.router_ms / 1e3 * self.stretch(busy_workers)
        return self.free_at[r]

    def answered(self, bucket: int, latency_s: float, outstanding: int, now: float) -> None:
        self.limiters[bucket].on_answer(latency_s, outstanding, now)

    def stretch(self, busy_workers: int) -> float:
        """How much longer a batch launched now runs than alone (1.0 without shared cores): the cores the
        running batches (this one included) and the recent requests' router and other CPU want, over the
        cores there are."""
        path = self.path
        if path.cores is None:
            return 1.0
        per_request_s = (path.router_ms + path.other_ms) / 1e3
        demand = busy_workers * path.threads + len(self.recent) / path.window_s * per_request_s
        return max(1.0, demand / path.cores)
