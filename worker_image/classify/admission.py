"""Admission control per length bucket: an AIMD limit on inputs in flight, driven by latency.

The limit starts from what the bucket's pods report: the inputs/s they can take times the SLO, the
most inputs that can be in flight and still be answered within it (Little's law). It then follows the
latency of the answers: an answer later than `target` (a fraction of the SLO) cuts the limit by
`decrease` (at most once per `cooldown`, so one late batch counts once); an answer in time while the
limit was at least half used raises it by 1/limit (about +1 per limit answers). A request whose bucket is at its limit is
refused with 429 rather than admitted to miss its deadline. Pure bookkeeping: no I/O, no clock of
its own (callers pass `now`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


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
