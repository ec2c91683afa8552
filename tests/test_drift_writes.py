"""What the drift loop writes and reads per service and period, with the real operator under kopf against the
emulated API (tier 2 of DESIGN.md): a read that brings only new figures of the judged window writes the status
at most once a period, and figures that do not move only as a refresh every few periods (at 200 services a
status write per read was most of the fleet's API traffic), what a user must see at once (a trigger, a router
shortfall, a condition, a proposal) is never held back, and the once-a-period re-tune reaches the routers
with the read's token and connections, not a Secret read each time."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import kmock
from test_operator_integration import ObservationServer, deployed, publish_endpoint, window
from test_operator_support import ClusterThread, install_profiles, operator, pool, service, status, wait_for

from exitplan.operator import drift, drift_writes, guards
from exitplan.operator.status import Condition, DriftReport, Proposal, ServiceStatus

PERIOD = 5
QUIET = {"periodSeconds": PERIOD, "drift": {"lengthScore": 1.0, "survivalError": 1.0}}
"""No length or survival trigger: only the window's figures move."""


class Requests:
    """Counts the EarlyExitService status writes and the Secret reads the API server gets."""

    def __init__(self, cluster: ClusterThread) -> None:
        self.seen: dict[int, tuple[kmock.Request, str]] = {}  # each request once (kmock may show one twice)
        cluster.api[lambda req: self._count(req)] << 500  # the filter never matches: it only counts

    def _count(self, req: kmock.Request) -> bool:
        if req.resource is None:
            return False
        if req.method == "PATCH" and req.resource.plural == "earlyexitservices" and req.subresource == "status":
            self.seen[id(req)] = (req, "status write")
        elif req.method == "GET" and req.resource.plural == "secrets":
            self.seen[id(req)] = (req, "secret read")
        return False

    def count(self, what: str) -> int:
        return sum(1 for _, w in self.seen.values() if w == what)


class Traffic:
    """The routers' window in progress, growing with the wall clock at `rate` answered a second (half of them
    short): every read brings new arrivals and new figures, none of them a reason to re-plan. `swing`: the
    rate alternates between `rate` and `rate * swing` every half period (MEASURED moves on every read)."""

    def __init__(self, server: ObservationServer, rate: float = 100.0) -> None:
        self.t0, self.reads, self.rate, self.swing = time.time(), 0, rate, 1.0
        self.last, self.n = self.t0, 0.0
        server.in_progress = self  # type: ignore[method-assign]

    def __call__(self) -> dict:
        self.reads += 1
        now = time.time()
        phase = int((now - self.t0) / (PERIOD / 2)) % 2
        self.n += (now - self.last) * self.rate * (self.swing if phase else 1.0)
        self.last = now
        n = int(self.n)
        doc = window(n // 2, n - n // 2)
        return {**doc, "since": self.t0, "until": now}


def _writes_over(
    requests: Requests, traffic: Traffic, periods: int, reads: int = drift.CHECKS_PER_PERIOD
) -> tuple[int, int, float]:
    """(status writes, router reads, seconds) over `periods` periods of reads (`reads` a period)."""
    writes0, reads0, start = requests.count("status write"), traffic.reads, time.monotonic()
    wait_for(
        f"{periods} periods of reads",
        lambda: traffic.reads - reads0 >= periods * reads and time.monotonic() - start > periods * PERIOD,
        guard=40 * periods,
    )
    return requests.count("status write") - writes0, traffic.reads - reads0, time.monotonic() - start


@contextlib.contextmanager
def serving(
    tmp_path: Path, ns: str, env: dict[str, str] | None = None
) -> Iterator[tuple[ClusterThread, Requests, Traffic]]:
    """One service planned by the real operator (`env`: its settings) whose routers' control endpoint is the
    observation server, answering a window that grows with the clock; yielded once a first judged window is in
    its status."""
    server = ObservationServer()
    with ClusterThread(tmp_path) as cluster:
        cluster.create(pool("gpu-a", 4, 3.0))
        cluster.create(pool("gpu-b", 6, 1.0))
        install_profiles(cluster, ns)
        requests = Requests(cluster)
        try:
            with operator(cluster, env=env):
                cluster.create(service("minilm", ns, planner=QUIET))
                wait_for("the plan applied", lambda: deployed(cluster, ns, "minilm"))
                server.window = window(500, 500)
                traffic = Traffic(server)
                publish_endpoint(cluster, ns, "minilm", server)
                wait_for("a first judged window in status", lambda: status(cluster, ns, "minilm").get("drift"))
                yield cluster, requests, traffic
        finally:
            server.close()


def test_the_window_figures_are_written_once_a_period_when_they_move_and_the_retune_reuses_the_token(tmp_path):
    ns = "writes"
    with serving(tmp_path, ns) as (cluster, requests, traffic):
        traffic.swing = 0.4  # MEASURED swings between 100 and 40 req/s
        secrets0 = requests.count("secret read")
        moving = _writes_over(requests, traffic, 3)
        traffic.swing = 1.0  # steady from now on: the figures stop moving
        _writes_over(requests, traffic, 1)  # the judged window forgets the swings
        steady = _writes_over(requests, traffic, 3)
        secrets = requests.count("secret read") - secrets0
        st = status(cluster, ns, "minilm")
    assert st["drift"]["requests"] > 0 and not st["drift"]["trigger"], st["drift"]
    assert not st.get("proposal") and st.get("lastReplanReason", "") in ("", "initial"), st
    # every read brought new figures; those that moved reached the status about once a period
    writes, reads, elapsed = moving
    assert 2 <= writes <= elapsed / PERIOD + 2 < reads, moving
    assert reads <= (elapsed / PERIOD + 1) * drift.CHECKS_PER_PERIOD, moving  # the default: two reads a period
    # steady figures: written again only as the refresh (every drift_writes.REFRESH_PERIODS periods)
    writes, reads, elapsed = steady
    assert writes <= elapsed / (drift_writes.REFRESH_PERIODS * PERIOD) + 1 < reads, steady
    # the token was read with the first read; neither the reads nor the re-tunes read it again
    assert secrets == 0, secrets


def test_the_operator_setting_decides_how_often_a_period_the_routers_are_read(tmp_path):
    with serving(tmp_path, "reads", env={guards.ENV_DRIFT_READS: "4"}) as (_, requests, traffic):  # --drift-reads 4
        _, reads, elapsed = _writes_over(requests, traffic, 3, reads=4)
    # four reads a period: more than the default two could make in that time, fewer than the tick (0.5 s) allows
    assert (elapsed / PERIOD + 1) * drift.CHECKS_PER_PERIOD < reads <= (elapsed / PERIOD + 1) * 4, (reads, elapsed)


def test_figures_are_written_when_they_read_differently_at_most_once_a_period():
    before = DriftReport(goodput_rps=100.0, goodput_ratio=0.95, length_score=0.1, p99_ms=80.0, requests=500)
    assert not drift_writes.moved(before, before.model_copy(update={"goodput_rps": 103.0, "p99_ms": 85.0}))
    for change in (
        {"goodput_rps": 94.0},
        {"goodput_ratio": 0.89},
        {"length_score": 0.13},
        {"survival_error": 0.03},
        {"p99_ms": 90.0},
        {"requests": 0, "goodput_rps": 0.0},
    ):
        assert drift_writes.moved(before, before.model_copy(update=change)), change
    assert drift_writes.moved(None, before) and not drift_writes.moved(None, None)
    period = 20.0
    due = drift_writes.write_due
    assert due(None, 0.0, period, says_other=False, figures_moved=False)  # the first read writes
    assert due(100.0, 101.0, period, says_other=True, figures_moved=False)  # a condition: at once
    assert not due(100.0, 110.0, period, says_other=False, figures_moved=True)  # moved, but within the period
    assert due(100.0, 118.0, period, says_other=False, figures_moved=True)  # a period on (reads jitter)
    assert not due(100.0, 160.0, period, says_other=False, figures_moved=False)  # still, before the refresh
    assert due(100.0, 100.0 + drift_writes.REFRESH_PERIODS * period, period, says_other=False, figures_moved=False)
    assert due(0.0, drift_writes.REFRESH_SECONDS, 120.0, says_other=False, figures_moved=False)  # 300 s < 5 periods
    assert not due(0.0, drift_writes.REFRESH_SECONDS, 600.0, says_other=False, figures_moved=False)  # < a period


def test_what_a_user_must_see_at_once_changes_what_the_status_says_and_the_figures_do_not():
    base = ServiceStatus(drift=DriftReport(observed_at="t0", length_score=0.1, requests=10, goodput_rps=5.0))
    said = drift_writes.what_status_says(base)
    figures = base.model_copy(deep=True)
    figures.drift = DriftReport(observed_at="t1", length_score=0.12, requests=20, goodput_rps=6.0, p99_ms=9.0)
    assert drift_writes.what_status_says(figures) == said
    changes = []
    for change in (
        lambda s: setattr(s.drift, "trigger", "length-drift"),
        lambda s: setattr(s.drift, "routers", "1 of 2 router replicas answered"),
        lambda s: setattr(s, "proposal", Proposal(reason="length-drift", hash="abc")),
        lambda s: setattr(s, "conditions", [Condition(type="PlanAccurate", status="False", reason="Short")]),
    ):
        changed = base.model_copy(deep=True)
        change(changed)
        changes.append(drift_writes.what_status_says(changed) != said)
    assert changes == [True, True, True, True]
