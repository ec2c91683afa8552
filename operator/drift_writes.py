"""When the drift loop writes the service's status: what a user must see at once is written at once; the
judged window's figures only when they moved enough to read differently, or as a refresh.

Every read scores a new judged window, and its figures (MEASURED goodput, p99, the drift scores, the window's
bounds) differ a little on every read. Written at every read, they were most of a fleet's API traffic and,
through the watch that echoes each write back (kopf's and the operator's own), a large part of the operator's
CPU. So, as the kubelet does with a Node's status (written when it changes, else every
nodeStatusReportFrequency):

- a trigger, a router shortfall, a condition, a proposal or anything else outside the figures: at once;
- figures that moved (`moved`: MEASURED by 5 % and at least 0.2 req/s, the measured/planned ratio by 0.05, a
  drift score by 0.02, p99 by 10 %, traffic that started or stopped): at most once a period;
- otherwise a refresh every REFRESH_PERIODS periods (or REFRESH_SECONDS, if shorter, but never more often than
  once a period), so `observedAt` and the window's bounds show that the loop reads.

The figures are live in the metrics (length score, survival error, measured goodput) on every read.
"""

from __future__ import annotations

from exitplan.operator import drift
from exitplan.operator.status import DriftReport, ServiceStatus

REFRESH_PERIODS = 5
"""Figures that did not move are written again after this many periods ..."""
REFRESH_SECONDS = 300.0
"""... or after this many seconds, whichever comes first."""
GOODPUT_CHANGE, GOODPUT_FLOOR = 0.05, 0.2
"""MEASURED moved: by this fraction of the written value, and by at least this many req/s."""
RATIO_CHANGE, SCORE_CHANGE, P99_CHANGE = 0.05, 0.02, 0.10
"""The measured/planned ratio moved by this much; a drift score (0..1) by this much; p99 by this fraction."""


def what_status_says(status: ServiceStatus) -> str:
    """The status less the judged window's figures: what differs here is written at once."""
    report = status.drift
    return status.model_dump_json(exclude={"drift"}) + (f"|{report.trigger}|{report.routers}" if report else "|")


def moved(before: DriftReport | None, after: DriftReport | None) -> bool:
    """Whether the figures of `after` read differently from those written (`before`)."""
    if before is None or after is None:
        return before is not after
    if (before.requests > 0) != (after.requests > 0):
        return True
    goodput = abs(after.goodput_rps - before.goodput_rps)
    return (
        goodput >= max(GOODPUT_CHANGE * before.goodput_rps, GOODPUT_FLOOR)
        or abs(after.goodput_ratio - before.goodput_ratio) >= RATIO_CHANGE
        or abs(after.length_score - before.length_score) >= SCORE_CHANGE
        or abs(after.survival_error - before.survival_error) >= SCORE_CHANGE
        or abs(after.p99_ms - before.p99_ms) >= P99_CHANGE * max(before.p99_ms, 1.0)
    )


def write_due(
    written_at: float | None,
    now: float,
    period: float,
    *,
    says_other: bool,
    figures_moved: bool,
    reads: int = drift.CHECKS_PER_PERIOD,
) -> bool:
    """Whether a read writes the status. `written_at`: when the loop last wrote it (None: never); `says_other`:
    the status says something else than before the read (what_status_says); `figures_moved`: see `moved`;
    `reads`: the loop's reads per period."""
    if says_other or written_at is None:
        return True
    since = now - written_at + period / (2 * reads)  # reads jitter around their grid
    return since >= period and (figures_moved or since >= refresh_seconds(period))


def refresh_seconds(period: float) -> float:
    """How often what did not move is written again: every REFRESH_PERIODS periods or REFRESH_SECONDS, whichever
    is sooner, but never more often than once a period."""
    return max(period, min(REFRESH_PERIODS * period, REFRESH_SECONDS))
