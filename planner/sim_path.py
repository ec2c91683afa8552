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
- `cores` shared by all of them and the workers (each running batch keeps `threads` of them busy), with
  `background` cores' worth of other processes always running beside them: processor sharing, exact
  (planner/sim_cores.py: while more threads want the cores than there are, every one runs slower, and
  speeds up again the moment another finishes);
- `devices`: per pool whose worker processes share accelerators (`GPUPool.spec.sharedDevices`), how many:
  the batches of that pool's workers take turns on them the same way, one batch per device at full speed.

`RouterState` is one run's routers: per bucket the data plane's own admission limit
(`dispatch.BucketLimiter`, started at the bucket's capacity x the SLO and following the answers' latency, as
worker_image/classify/admission.py), and the sender's and the routers' queues. A router admits a request
once it has done its work on it (decoded it), as the data plane's does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from exitplan.planner.dispatch import LATE_FRACTION, BucketLimiter


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
    devices: tuple[tuple[str, float], ...] = ()
    """(pool, accelerators) for every pool whose worker processes share its accelerators
    (`GPUPool.spec.sharedDevices`): those workers' batches take turns on them (processor sharing, one
    batch's kernels at a time per device), apart from the host's cores."""

    def __post_init__(self) -> None:
        if self.router_ms < 0 or self.sender_ms < 0 or self.background < 0 or self.routers < 1 or self.threads < 1:
            raise ValueError(f"invalid serving path {self}: costs and background >= 0, routers and threads >= 1")
        if self.cores is not None and self.cores <= 0:
            raise ValueError(f"invalid serving path {self}: cores must be > 0 (or None for dedicated accelerators)")
        if any(n <= 0 for _, n in self.devices):
            raise ValueError(f"invalid serving path {self}: shared devices must be > 0")


class RouterState:
    """One simulated run's sender and routers: admission per bucket, and the requests each has yet to do
    its work on (in order: one request at a time per process)."""

    def __init__(self, path: ServingPath, capacity: Sequence[float], slo_s: float) -> None:
        self.path = path
        self.limiters = [BucketLimiter(target_s=LATE_FRACTION * slo_s) for _ in capacity]
        for limiter, cap in zip(self.limiters, capacity):
            limiter.ensure(cap, slo_s)
        self.waiting: list[deque[int]] = [deque() for _ in range(path.routers + 1)]
        """Per process (the sender last): the requests waiting for it, the one it works on first."""
        self.next_router = 0

    @property
    def sender(self) -> int:
        """The sender's index among the processes."""
        return self.path.routers

    def first_stop(self) -> int | None:
        """The process a new request goes to first: the sender, else the next router (round robin); None
        when neither costs anything (it is admitted at once)."""
        return self.sender if self.path.sender_ms > 0 else self.next_stop()

    def next_stop(self) -> int | None:
        """The router a request goes to after the sender (round robin); None when routers cost nothing."""
        if self.path.router_ms <= 0:
            return None
        r = self.next_router
        self.next_router = (r + 1) % self.path.routers
        return r

    def work_ms(self, process: int) -> float:
        return self.path.sender_ms if process == self.sender else self.path.router_ms

    def join(self, process: int, i: int) -> bool:
        """Request `i` waits for `process`; True when the process was idle (its work on it starts now)."""
        queue = self.waiting[process]
        queue.append(i)
        return len(queue) == 1

    def done(self, process: int) -> int | None:
        """The process finished its request: the next one it starts on, if any."""
        queue = self.waiting[process]
        queue.popleft()
        return queue[0] if queue else None

    def loads(self, outstanding: Sequence[int]) -> list[float]:
        return [lim.load(n) for lim, n in zip(self.limiters, outstanding)]

    def answered(self, bucket: int, latency_s: float, outstanding: int, now: float) -> None:
        self.limiters[bucket].on_answer(latency_s, outstanding, now)
