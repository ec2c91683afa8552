"""A deterministic stand-in for a served model in capacity-search tests: one FIFO server."""

from __future__ import annotations

from exitplan.client.loadgen import Outcome
from exitplan.client.report import BenchReport, summarize


def queue_probe(capacity_rps: float, *, slo_ms: float = 100.0, duration: float = 10.0, calls: list | None = None):
    """`probe(rps)` for `search_capacity`: requests arrive evenly at `rps` for `duration` seconds and one
    server answers them in order, 1 / `capacity_rps` seconds each. At or below its capacity every answer
    takes that long; above it the queue (and the latency) grows through the run. Appends each rate to `calls`."""

    def probe(rps: float) -> BenchReport:
        if calls is not None:
            calls.append(rps)
        n = max(1, round(rps * duration))
        free_at = 0.0
        outcomes = []
        for i in range(n):
            arrival = i / rps
            free_at = max(arrival, free_at) + 1.0 / capacity_rps
            outcomes.append(Outcome(i, arrival, arrival, "ok", 200, free_at, "a", "final"))
        return summarize(outcomes, ["a"] * n, [None] * n, slo_ms=slo_ms, window_s=duration)

    return probe
