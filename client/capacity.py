"""Capacity within an SLO: the highest offered rate at which at least 99 % of the requests finish within it.

A step replays a short window of the trace at one rate (`probe(rps)`, a `BenchReport`) and passes when
at least `target` of its requests are answered within the SLO, over the whole step and over its last
third (errors and lost requests are misses: a refused request is not served; the last third catches a
queue that grows through the step before it shows in the whole step's share).

The search brackets, then bisects: from `start_rps` it doubles the rate while steps pass (or halves
it while they fail), then tries the geometric midpoint of the highest rate that passed and the lowest
that failed until the two are within `resolution` of each other. The capacity is the offered rate of
the highest step that passed, and a step at a rate above it failed (`failed_rps`) -- unless the search
passed at `max_rps` (then the capacity is a lower bound: `ended == "ceiling"`), failed even at
`min_rps` (capacity 0, `ended == "floor"`) or ran out of steps (`ended == "steps"`).

`settle(rps)`, when given, runs before the first step (at half its rate) and before every step that
follows a miss (at the highest rate that passed, else half the next rate), and is not counted: a
miss leaves the service in a state of its own (the router's admission limits cut by late answers grow
back only under load), which would otherwise count against the next, lower rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from exitplan.client.report import BenchReport

if TYPE_CHECKING:
    from rich.table import Table

TARGET = 0.99
"""The share of requests that must finish within the SLO, over a step and over its last third."""


def meets_slo(report: BenchReport, target: float = TARGET) -> bool:
    """Whether at least `target` of the run's requests finished within the SLO, over the run and over its
    last third (errors and lost requests count as misses)."""
    last = report.last_third_within_slo_share
    return report.requests > 0 and report.within_slo_share >= target and (last is None or last >= target)


@dataclass
class CapacityStep:
    rps: float
    """The rate asked for (the report's `offered_rps` is the rate the window achieved)."""
    report: BenchReport
    passed: bool


@dataclass
class CapacityResult:
    capacity_rps: float
    """The offered rate of the highest step that passed (0.0 when none did)."""
    steps: list[CapacityStep]
    reason: str
    """How the search ended, in words."""
    ended: str
    """"bracketed" (a step above the capacity failed, within the resolution), "ceiling" (passed at the
    highest rate allowed: a lower bound), "floor" (failed at the lowest rate allowed) or "steps" (ran
    out of steps)."""
    failed_rps: float | None = None
    """The offered rate of the lowest step that failed above the capacity (None: none did)."""
    target: float = TARGET

    @property
    def at_capacity(self) -> BenchReport | None:
        """The report of the step that set the capacity (None when no step passed)."""
        passed = [s for s in self.steps if s.passed]
        return max(passed, key=lambda s: s.rps).report if passed else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "capacity_rps": self.capacity_rps,
            "failed_rps": self.failed_rps,
            "ended": self.ended,
            "reason": self.reason,
            "target_share_within_slo": self.target,
            "steps": [{**s.report.to_dict(), "target_rps": s.rps, "passed": s.passed} for s in self.steps],
        }

    def table(self) -> Table:
        from rich.table import Table

        slo = f" {self.steps[0].report.slo_ms:g} ms" if self.steps else ""
        table = Table(
            title=f"capacity within the{slo} SLO: {self.capacity_rps:.1f} rps offered "
            f"(>= {self.target:.0%} of requests within it, over each step and its last third; {self.reason})"
        )
        for col in ("offered rps", "within SLO", "last third", "p50 ms", "p99 ms", "errors", "lost", "step"):
            table.add_column(col, justify="right")
        for s in self.steps:
            r = s.report
            last = r.last_third_within_slo_share
            table.add_row(
                f"{r.offered_rps:.1f}",
                f"{r.within_slo_share:.1%}",
                "-" if last is None else f"{last:.1%}",
                _ms(r.latency_ms["p50"]),
                _ms(r.latency_ms["p99"]),
                str(r.error_total),
                str(r.lost),
                "pass" if s.passed else "[red]miss[/red]",
            )
        return table


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def search_capacity(
    probe: Callable[[float], BenchReport],
    *,
    start_rps: float,
    max_rps: float,
    min_rps: float = 0.25,
    resolution: float = 0.05,
    max_steps: int = 10,
    target: float = TARGET,
    on_step: Callable[[CapacityStep], None] | None = None,
    settle: Callable[[float], object] | None = None,
) -> CapacityResult:
    """Bracket by doubling (halving), then bisect; see the module's doc. `probe(rps)` runs one step,
    `settle(rps)` a run that is not counted."""
    if not 0 < min_rps <= max_rps:
        raise ValueError(f"need 0 < min_rps <= max_rps, got {min_rps} and {max_rps}")
    if resolution <= 0 or max_steps < 1 or not 0 < target <= 1:
        raise ValueError("need resolution > 0, max_steps >= 1 and a target share within (0, 1]")
    steps: list[CapacityStep] = []
    low: CapacityStep | None = None  # the highest rate that passed
    high: CapacityStep | None = None  # the lowest rate that failed
    while len(steps) < max_steps:
        rps = _next_rate(low, high, start_rps, min_rps, max_rps, resolution)
        if rps is None:
            break
        if settle is not None and (not steps or not steps[-1].passed):
            settle(low.rps if low is not None else rps / 2)
        report = probe(rps)
        step = CapacityStep(rps, report, meets_slo(report, target))
        steps.append(step)
        if on_step is not None:
            on_step(step)
        if step.passed:
            low = step
        else:
            high = step
    done = _next_rate(low, high, start_rps, min_rps, max_rps, resolution) is None
    return _result(steps, low, high, done, target)


def _next_rate(
    low: CapacityStep | None,
    high: CapacityStep | None,
    start: float,
    floor: float,
    ceiling: float,
    resolution: float,
) -> float | None:
    """The next rate to try, or None when the search is over."""
    if high is None:
        if low is None:
            return min(max(start, floor), ceiling)
        return None if low.rps >= ceiling else min(2 * low.rps, ceiling)
    if low is None:
        return None if high.rps <= floor else max(high.rps / 2, floor)
    return None if high.rps <= low.rps * (1 + resolution) else math.sqrt(low.rps * high.rps)


def _result(
    steps: list[CapacityStep], low: CapacityStep | None, high: CapacityStep | None, done: bool, target: float
) -> CapacityResult:
    capacity = low.report.offered_rps if low else 0.0
    failed = high.report.offered_rps if high else None
    if low is None:
        ended = "floor" if done else "steps"
        reason = f"missed even at {high.report.offered_rps:.1f} rps offered" if high else "no step ran"
    elif high is None:
        ended = "ceiling" if done else "steps"
        reason = f"passed up to {capacity:.1f} rps offered, the highest tried: the capacity is at least that"
    else:
        ended = "bracketed" if done else "steps"
        reason = f"passed at {capacity:.1f}, missed at {failed:.1f} rps offered"
    if not done:
        reason = f"out of steps after {len(steps)}; {reason}"
    return CapacityResult(capacity, steps, reason, ended, failed, target)
