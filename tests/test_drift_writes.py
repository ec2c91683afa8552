"""What the drift loop writes and reads per service and period, with the real operator under kopf against the
emulated API (tier 2 of DESIGN.md): a read that brings only new figures of the judged window writes the status
at most once a period (at 200 services a status write per read was most of the fleet's API traffic), what a
user must see at once (a trigger, a router shortfall, a condition, a proposal) is never held back, and the
once-a-period re-tune reaches the routers with the read's token and connections, not a Secret read each time."""

from __future__ import annotations

import time

import kmock
from test_operator_integration import ObservationServer, deployed, publish_endpoint, window
from test_operator_support import ClusterThread, install_profiles, operator, pool, service, status, wait_for

from exitplan.operator import drift
from exitplan.operator.driftloop import _what_status_says
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


class Steady:
    """The routers' window in progress, growing with the wall clock (100 answered a second, half of them
    short): every read brings new arrivals and new figures, none of them a reason to re-plan."""

    def __init__(self, server: ObservationServer) -> None:
        self.t0, self.reads = time.time(), 0
        server.in_progress = self  # type: ignore[method-assign]

    def __call__(self) -> dict:
        self.reads += 1
        now = time.time()
        n = int(100 * (now - self.t0))
        doc = window(n // 2, n - n // 2)
        return {**doc, "since": self.t0, "until": now}


def test_the_window_figures_are_written_once_a_period_and_the_retune_reuses_the_reads_token(tmp_path):
    server = ObservationServer()
    with ClusterThread(tmp_path) as cluster:
        cluster.create(pool("gpu-a", 4, 3.0))
        cluster.create(pool("gpu-b", 6, 1.0))
        ns = "writes"
        install_profiles(cluster, ns)
        requests = Requests(cluster)
        try:
            with operator(cluster):
                cluster.create(service("minilm", ns, planner=QUIET))
                wait_for("the plan applied", lambda: deployed(cluster, ns, "minilm"))
                server.window = window(500, 500)
                steady = Steady(server)
                publish_endpoint(cluster, ns, "minilm", server)
                wait_for("a first judged window in status", lambda: status(cluster, ns, "minilm").get("drift"))
                writes0, secrets0, reads0 = requests.count("status write"), requests.count("secret read"), steady.reads
                start = time.monotonic()
                wait_for(
                    "three periods of reads",
                    lambda: steady.reads - reads0 >= 3 * drift.CHECKS_PER_PERIOD and time.monotonic() - start > 15,
                    guard=120,
                )
                elapsed = time.monotonic() - start
                writes = requests.count("status write") - writes0
                secrets = requests.count("secret read") - secrets0
                reads = steady.reads - reads0
                st = status(cluster, ns, "minilm")
        finally:
            server.close()
    assert st["drift"]["requests"] > 0 and not st["drift"]["trigger"], st["drift"]
    assert not st.get("proposal") and st.get("lastReplanReason", "") in ("", "initial"), st
    # every read brought new figures; they reached the status about once a period
    assert 1 <= writes <= elapsed / PERIOD + 2 < reads, (writes, elapsed, reads)
    # the token was read with the first read; neither the reads nor the re-tunes read it again
    assert secrets == 0, secrets


def test_what_a_user_must_see_at_once_changes_what_the_status_says_and_the_figures_do_not():
    base = ServiceStatus(drift=DriftReport(observed_at="t0", length_score=0.1, requests=10, goodput_rps=5.0))
    said = _what_status_says(base)
    figures = base.model_copy(deep=True)
    figures.drift = DriftReport(observed_at="t1", length_score=0.12, requests=20, goodput_rps=6.0, p99_ms=9.0)
    assert _what_status_says(figures) == said
    changes = []
    for change in (
        lambda s: setattr(s.drift, "trigger", "length-drift"),
        lambda s: setattr(s.drift, "routers", "1 of 2 router replicas answered"),
        lambda s: setattr(s, "proposal", Proposal(reason="length-drift", hash="abc")),
        lambda s: setattr(s, "conditions", [Condition(type="PlanAccurate", status="False", reason="Short")]),
    ):
        changed = base.model_copy(deep=True)
        change(changed)
        changes.append(_what_status_says(changed) != said)
    assert changes == [True, True, True, True]
