"""Admission control: which length bucket takes each input of a request, or why none can.

`Admission.admit(lengths)` is the router's one admission decision. In order: a request that can never
be admitted is refused for good (413, no Retry-After): more inputs than the router's limit on inputs
in flight, or more than the ready pods of every bucket together answer before the router's hard
timeout (their reported inputs/s times the timeout: the request would time out, a 504, even on an
idle service). Then the router's own limit on inputs in flight (else 503, Retry-After 1 s); then per
input, Arlo's bucket choice (`exitplan.planner.dispatch.choose_bucket`, the policy the simulator
shares) over each bucket's load, and a bucket at its limit refuses (429, Retry-After from its recent
latency) rather than admit an input to miss its deadline. An idle bucket takes a request whatever its
size (else a request larger than the limit would starve). The inputs of an admitted request count as
in flight until `answered` / `release`.

Each bucket's limit is an AIMD limit on inputs in flight, driven by latency
(`exitplan.planner.dispatch.BucketLimiter`, the policy the simulator shares).

Pure bookkeeping: no I/O, no clock of its own (callers pass `now`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from exitplan.planner.dispatch import LATE_FRACTION, BucketLimiter, QueueParams, choose_bucket, ideal_bucket


@dataclass(frozen=True, slots=True)
class Admitted:
    buckets: list[int]
    """Per input: the index of the bucket that takes it."""
    ideal: list[int]
    """Per input: the index of the smallest bucket that holds it (-1: none), for the length histogram."""

    def groups(self) -> dict[int, list[int]]:
        """Bucket index -> the inputs (positions in the request) it takes, in request order."""
        groups: dict[int, list[int]] = {}
        for i, b in enumerate(self.buckets):
            groups.setdefault(b, []).append(i)
        return groups


@dataclass(frozen=True, slots=True)
class Refusal:
    status: int
    """503: the router's in-flight limit; 429: no bucket can answer within the SLO; 413: never (too many inputs)."""
    reason: str
    retry_after_s: float
    """Whole seconds, at least 1 (the Retry-After header); 0 for a request that can never be admitted (413)."""
    ideal: list[int] | tuple[int, ...] = ()
    """As `Admitted.ideal` for a refusal of bucket choice (429); empty when refused before it (503)."""


class Admission:
    """The router's admission state: inputs in flight (all, and per bucket) and each bucket's limit.

    `capacity(b)`: the inputs/s bucket b's pods report (0 while none is ready), asked at each
    decision. Pure bookkeeping: no I/O, no clock of its own."""

    def __init__(
        self,
        buckets: Sequence[int],
        slo_s: float,
        capacity: Callable[[int], float],
        *,
        queue: QueueParams | None = None,
        max_inflight: int = 4096,
        timeout_s: float | None = None,
    ) -> None:
        """`timeout_s`: the router's hard timeout (None: requests are not sized against it)."""
        self.buckets = list(buckets)
        self.timeout_s = timeout_s
        self.slo_s = slo_s
        self.capacity = capacity
        self.queue = queue or QueueParams()
        self.max_inflight = max_inflight
        self.limiters = [BucketLimiter(target_s=LATE_FRACTION * slo_s) for _ in self.buckets]
        self.outstanding = [0] * len(self.buckets)
        """Per bucket: admitted inputs not yet answered."""
        self.inflight = 0
        """Inputs of admitted requests not yet answered."""

    def loads(self) -> list[float]:
        """Per bucket: inputs in flight over its limit (inf when it has no ready pod)."""
        loads = []
        for b, limiter in enumerate(self.limiters):
            cap = self.capacity(b)
            if cap <= 0:
                loads.append(math.inf)
                continue
            limiter.ensure(cap, self.slo_s)
            loads.append(limiter.load(self.outstanding[b]))
        return loads

    def admit(self, lengths: Sequence[int]) -> Admitted | Refusal:
        """Buckets for a request's inputs (`lengths` in tokens), counted in flight at once so that
        concurrent decisions see each other; or a refusal, and nothing counted."""
        n = len(lengths)
        never = self.never_fits(n)
        if never is not None:
            return never
        if self.inflight + n > self.max_inflight:
            return Refusal(503, f"router is at its limit of {self.max_inflight} inputs in flight; retry later", 1.0)
        loads = self.loads()
        ideal = [ideal_bucket(length, self.buckets) for length in lengths]
        chosen = []
        for length in lengths:
            b = choose_bucket(length, self.buckets, loads, self.queue)
            # An idle bucket takes a request whatever its size (else a request above its limit would starve).
            if b < 0 or (loads[b] >= 1.0 and self.outstanding[b] > 0):
                wait = self.limiters[b].retry_after_s(self.outstanding[b]) if b >= 0 else 1
                what = f"bucket {self.buckets[b]}" if b >= 0 else "every bucket"
                return Refusal(
                    429,
                    f"{what} cannot answer within the SLO of {self.slo_s * 1000:.0f} ms at the current load",
                    float(max(1, math.ceil(wait))),
                    ideal,
                )
            loads[b] += 1.0 / self.limiters[b].limit
            chosen.append(b)
        for b in chosen:  # counted before the caller awaits anything, so concurrent admissions see each other
            self.outstanding[b] += 1
        self.inflight += n
        return Admitted(chosen, ideal)

    def never_fits(self, n: int) -> Refusal | None:
        """The 413 of a request of n inputs that can never be admitted, or None."""
        if n > self.max_inflight:
            return Refusal(
                413,
                f"the request holds {n} inputs, more than the router's limit of {self.max_inflight} inputs in flight, "
                f"so it can never be admitted; send at most {self.max_inflight} inputs per request",
                0.0,
            )
        total = sum(self.capacity(b) for b in range(len(self.buckets)))
        if self.timeout_s is None or total <= 0:
            return None  # no ready pod: the usual refusal (429) says so
        most = max(1, math.floor(total * self.timeout_s))
        if n <= most:
            return None
        return Refusal(
            413,
            f"the request holds {n} inputs, more than this service answers before the router's timeout of "
            f"{self.timeout_s:g} s even when idle (its ready pods report {total:.0f} inputs/s, about {most} "
            f"inputs in that time); send at most {most} inputs per request",
            0.0,
        )

    def answered(self, b: int, rows: int, latency_s: float, now: float) -> None:
        """`rows` inputs of bucket b got their answers (or errors) after `latency_s`."""
        limiter = self.limiters[b]
        for _ in range(rows):
            limiter.on_answer(latency_s, self.outstanding[b], now)
        self.outstanding[b] -= rows

    def release(self, n: int) -> None:
        """An admitted request of n inputs is answered."""
        self.inflight -= n
