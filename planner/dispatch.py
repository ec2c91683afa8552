"""Dispatch policies shared by the data plane and the simulator (pure, allocation-free on the hot path).

- `choose_bucket`: Arlo's multi-level queue (Algorithm 1). A request goes to the runtime of the
  smallest bucket that fits it unless that runtime is congested; then it may be demoted to a longer
  bucket, one level at a time up to `peek` levels, where the congestion threshold tightens by `alpha`
  at each level (a longer runtime costs more per input, so it must be clearly idle to be worth it).
- `least_loaded`: DensePipe's hop policy: the capable replica with the least running / capacity.
- `choose_queue`: which fusion queue of a rebatching split worker (one queue per block) runs next.
- `BucketLimiter`: the router's admission limit per bucket, an AIMD limit on inputs in flight driven by
  latency. It starts from what the bucket's pods report: the inputs/s they can take times the SLO, the
  most inputs that can be in flight and still be answered within it (Little's law). It then follows the
  latency of the answers: an answer later than `target` (a fraction of the SLO) cuts the limit by
  `decrease` (at most once per `cooldown`, so one late batch counts once); an answer in time while the
  limit was at least half used raises it by 1/limit (about +1 per limit answers).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class QueueParams:
    lam: float = 0.85
    """A runtime is congested when load >= lam (load = outstanding inputs / capacity)."""
    alpha: float = 0.9
    """Threshold decay per demotion level: level k accepts when load < lam * alpha**k."""
    peek: int = 6
    """How many longer buckets may be considered."""


def ideal_bucket(length: int, buckets: Sequence[int]) -> int:
    """Index of the smallest bucket holding `length`, or -1 when none does."""
    i = bisect_left(buckets, length)
    return i if i < len(buckets) else -1


def choose_bucket(
    length: int, buckets: Sequence[int], load: Sequence[float], params: QueueParams = QueueParams()
) -> int:
    """Arlo Algorithm 1: index of the bucket runtime to dispatch to, or -1 if the input fits none.

    `load[i]` is bucket i's outstanding inputs divided by its capacity (a bucket with no capacity
    should report `float('inf')`). When every candidate is congested the request stays with its
    ideal bucket (it queues there; admission control is the caller's job).
    """
    first = bisect_left(buckets, length)
    n = len(buckets)
    if first >= n:
        return -1
    threshold = params.lam
    last = min(n - 1, first + params.peek)
    for j in range(first, last + 1):
        if load[j] < threshold:
            return j
        threshold *= params.alpha
    # Every candidate is congested: take the ideal bucket if it can serve at all, else the
    # least-loaded candidate that has capacity.
    if load[first] != float("inf"):
        return first
    best, best_load = -1, float("inf")
    for j in range(first + 1, last + 1):
        if load[j] < best_load:
            best, best_load = j, load[j]
    return best


def least_loaded(running: Sequence[float], capacity: Sequence[float], skip: Sequence[bool] | None = None) -> int:
    """Index of the replica with the least running/capacity, ignoring skipped ones; -1 if none."""
    best, best_load = -1, float("inf")
    for i, (r, c) in enumerate(zip(running, capacity)):
        if c <= 0 or (skip is not None and skip[i]):
            continue
        load = r / c
        if load < best_load:
            best, best_load = i, load
    return best


def choose_queue(held: Sequence[int], batch: int, launch_at: Callable[[int], float], now: float) -> tuple[int, float]:
    """The fusion queue of a rebatching worker (queue j feeds block first + j) to run next.

    First, among the queues whose launch time (`launch_at(j)`: the deadline rule, or the oldest
    row's maximum wait) has come, the one whose time came first (least laxity: those rows are
    closest to their deadlines; a tie goes to the deeper queue, whose rows are further along);
    else the deepest queue holding a full batch (deepest first drains rows already part-way
    through the split before taking new ones in, so few rows and activations are held); else none.
    Due rows go before full batches because under load a full batch is always ready somewhere,
    and rows whose deadline rule has fired would wait behind them and miss the SLO (the simulator
    measured 96.8-98.9 % within the SLO at 10-70 % load with full batches first, >= 99.1 % with
    due queues first and more goodput; BENCHMARKS.md, Planner). Returns (queue, now), or
    (-1, the earliest launch time; inf when every queue is empty).
    """
    best, soonest = -1, float("inf")
    for j in range(len(held) - 1, -1, -1):
        if held[j]:
            at = launch_at(j)
            if at < soonest:
                best, soonest = j, at
    if best >= 0 and soonest <= now:
        return best, now
    for j in range(len(held) - 1, -1, -1):
        if held[j] >= batch:
            return j, now
    return -1, soonest


LATE_FRACTION = 0.8
"""The router's admission target: an answer later than this fraction of the SLO shrinks its bucket's limit."""


@dataclass
class BucketLimiter:
    target_s: float
    """Answers later than this shrink the limit (e.g. 0.8 x the SLO)."""
    decrease: float = 0.9
    initial_fraction: float = 1.0
    """Of capacity x SLO. Half of it refused bursts of a bursty trace that the pods went on to serve:
    the limit grows only while at least half used, so at low load it stays where it starts."""
    cooldown_s: float = 0.1
    min_limit: float = 1.0
    limit: float = 0.0
    """0 until the bucket's capacity is first known."""
    last_decrease: float = -math.inf
    latency_ewma_s: float = 0.0

    def ensure(self, capacity_rps: float, budget_s: float) -> None:
        """Set the first limit from the pods' reported capacity (once)."""
        if self.limit <= 0 and capacity_rps > 0:
            self.limit = max(self.min_limit, self.initial_fraction * capacity_rps * budget_s)

    def load(self, outstanding: int) -> float:
        """Inputs in flight over the limit (Arlo's load); inf while the limit is unknown."""
        return outstanding / self.limit if self.limit > 0 else math.inf

    def on_answer(self, latency_s: float, outstanding: int, now: float) -> None:
        self.latency_ewma_s = latency_s if self.latency_ewma_s == 0 else 0.9 * self.latency_ewma_s + 0.1 * latency_s
        if self.limit <= 0:
            return
        if latency_s > self.target_s:
            if now - self.last_decrease >= self.cooldown_s:
                self.limit = max(self.min_limit, self.limit * self.decrease)
                self.last_decrease = now
        elif outstanding >= self.limit / 2:
            self.limit += 1.0 / self.limit

    def retry_after_s(self, outstanding: int) -> int:
        """Whole seconds until the bucket has room, from its recent latency (at least 1)."""
        per_input = self.latency_ewma_s / max(self.limit, 1.0)
        return max(1, math.ceil(outstanding * per_input))
