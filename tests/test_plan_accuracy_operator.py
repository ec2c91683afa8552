"""PlanAccurate and the plan-mismatch re-plan with the real operator under kopf against the emulated API
server (tier 2 of DESIGN.md), in the style of tests/test_operator_integration.py: a real HTTP endpoint
stands in for the routers and serves observation windows that roll (a new closed window each time the
test advances it), first idle far below the plan, then saturated and short of it."""

from __future__ import annotations

import pytest
from test_operator_integration import ObservationServer, deployed, plan_of, publish_endpoint
from test_operator_support import (
    ClusterThread,
    condition,
    events_where,
    install_profiles,
    operator,
    pool,
    service,
    status,
    wait_for,
)

from exitplan.operator import names, plan_accuracy, profiling

PLANNER = {"periodSeconds": 5, "drift": {"cooldownSeconds": 0, "maxMoveFraction": 1.0}}
SPAN = 4.0
"""Seconds each published window covers (the judged windows need half a period)."""


@pytest.fixture
def cluster(tmp_path):
    with ClusterThread(tmp_path) as c:
        c.create(pool("gpu-a", 4, 3.0))
        c.create(pool("gpu-b", 6, 1.0))
        yield c


class Router:
    """Rolls the stand-in router's windows: each `roll()` (once the operator read the last one) closes a
    window of SPAN seconds in which each bucket answered `rps` within the SLO, refused `refused` of its
    inputs and kept `load` of its capacity in use; the window in progress is empty. `reads` counts the
    operator's reads (one GET of the window in progress per read)."""

    def __init__(self, server: ObservationServer) -> None:
        self.server = server
        self.t = 1000.0
        self.rolled, self.rolled_at = False, 0
        self.reads = 0
        self.rps, self.refused, self.load = 0.0, 0.0, 0.0
        inner = server.in_progress

        def counted() -> dict:
            self.reads += 1
            return inner()

        server.in_progress = counted  # type: ignore[method-assign]

    def set(self, rps: float, refused: float, load: float) -> None:
        self.rps, self.refused, self.load = rps, refused, load

    def roll(self) -> None:
        if self.rolled and self.reads <= self.rolled_at:
            return  # each window is read before the next one closes (as a router's period-long windows are)
        self.rolled, self.rolled_at = True, self.reads
        within = round(self.rps * SPAN)
        refused = round(self.refused * within / (1 - self.refused))
        per = {
            "requests": within,
            "withinSlo": within,
            "refused": refused,
            "p99Ms": 30.0,
            "loadSeconds": self.load * SPAN,
        }
        since, self.t = self.t, self.t + SPAN
        self.server.window = {
            "service": "minilm",
            "model": "minilm",
            "since": since,
            "until": self.t,
            "requests": 2 * within,
            "withinSlo": 2 * within,
            "errors": {"overload": 2 * refused},
            "lengthBuckets": [32, 128],
            "lengthHistogram": [within + refused, within + refused],
            "latency": {"p99Ms": 30.0},
            "perBucket": {"32": per, "128": per},
        }
        self.server.current = {
            "service": "minilm",
            "model": "minilm",
            "since": self.t,
            "until": self.t,
            "lengthBuckets": [32, 128],
            "lengthHistogram": [0, 0],
        }


def profiler_jobs(cluster: ClusterThread, ns: str, name: str) -> dict[str, dict]:
    jobs = cluster.list("Job", ns, f"{names.L_SERVICE}={name},{names.L_COMPONENT}=profiler")
    return {j["metadata"]["labels"][names.L_POOL]: j for j in jobs}


def test_goodput_short_of_the_plan_under_load_replans_and_reprofiles(cluster):
    ns = "accuracy"
    install_profiles(cluster, ns)
    server = ObservationServer()
    router = Router(server)
    try:
        with operator(cluster):
            cluster.create(service("minilm", ns, planner=PLANNER))
            first = wait_for("first plan applied", lambda: deployed(cluster, ns, "minilm"))
            plan0 = plan_of(cluster, ns, "minilm")
            planned = plan0.prediction.goodput_rps
            assert planned > 0 and first["plan"]["goodputRps"] == round(planned, 1)
            share = planned / 2  # the plan's share per bucket (sized for 50/50 here)

            def rolled(probe):
                def run():
                    router.roll()
                    return probe()

                return run

            # Idle: a tenth of the plan's goodput, nothing refused, little capacity in use: not judged.
            router.set(0.1 * share, 0.0, 0.2)
            router.roll()
            publish_endpoint(cluster, ns, "minilm", server)
            st = wait_for(
                "the first window compared",
                rolled(lambda: (s := status(cluster, ns, "minilm")) and condition(s, "PlanAccurate") and s),
            )
            cond = condition(st, "PlanAccurate")
            assert (cond["status"], cond["reason"]) == ("Unknown", "NotJudged")
            assert "measured/planned goodput 0.10" in cond["message"] and "not saturated" in cond["message"]
            seen = router.reads
            wait_for("eight more reads of idle windows", rolled(lambda: router.reads >= seen + 8))
            st = status(cluster, ns, "minilm")
            assert condition(st, "PlanAccurate")["status"] == "Unknown" and st["lastReplanReason"] == "initial"
            assert st["drift"]["goodputRatio"] == pytest.approx(0.1, abs=0.01)
            assert profiler_jobs(cluster, ns, "minilm") == {}

            # Saturated (5 % refused, capacity 95 % in use) at 40 % of the plan: persistently off.
            router.set(0.4 * share, 0.05, 0.95)
            st = wait_for(
                "PlanAccurate False",
                rolled(
                    lambda: (
                        (s := status(cluster, ns, "minilm")) and condition(s, "PlanAccurate")["status"] == "False" and s
                    )
                ),
            )
            cond = condition(st, "PlanAccurate")
            assert cond["reason"] == "MeasuredBelowPlan"
            assert f"plan {plan0.content_hash()}: measured/planned goodput 0.40" in cond["message"]
            assert "below the plan by more than 30%" in cond["message"] and "3 consecutive windows" in cond["message"]
            st = wait_for(
                "a plan-mismatch re-plan applied",
                rolled(
                    lambda: (
                        (s := deployed(cluster, ns, "minilm")) and s.get("lastReplanReason") == "plan-mismatch" and s
                    )
                ),
            )
            plan1 = plan_of(cluster, ns, "minilm")
            assert plan1.reason == "plan-mismatch" == st["plan"]["reason"]
            # re-planned on the measured speed: the plan now promises about what was measured
            assert plan1.prediction.goodput_rps == pytest.approx(0.4 * planned, rel=0.3)
            assert st["plan"]["goodputRps"] < first["plan"]["goodputRps"]
            # the pools of the short cells are measured again, while the plan keeps serving
            jobs = profiler_jobs(cluster, ns, "minilm")
            assert set(jobs) == {c.pool for c in plan0.cells}
            for pool_name, job in jobs.items():
                assert job["metadata"]["annotations"][profiling.A_REASON] == plan_accuracy.REASON
                assert job["spec"]["template"]["spec"]["nodeSelector"] == {"exitplan.io/pool": pool_name}
            events_where(
                cluster,
                ns,
                "minilm",
                lambda e: e["reason"] == "Reprofiling" and "plan-mismatch" in e["message"],
                "a Reprofiling (plan-mismatch) event",
            )
            events_where(
                cluster,
                ns,
                "minilm",
                lambda e: e["reason"] == "Replan" and e["message"].startswith("plan-mismatch"),
                "a Replan (plan-mismatch) event",
            )
            cond = condition(status(cluster, ns, "minilm"), "PlanAccurate")
            assert "re-planned (plan-mismatch) with the measured ratio 0.40" in cond["message"]
            from prometheus_client import REGISTRY

            labels = {"namespace": ns, "service": "minilm", "reason": "plan-mismatch"}
            assert REGISTRY.get_sample_value("exitplan_replan_total", labels) >= 1
            # The same load against the new plan: it holds, and PlanAccurate says so.
            st = wait_for(
                "PlanAccurate True against the new plan",
                rolled(
                    lambda: (
                        (s := status(cluster, ns, "minilm")) and condition(s, "PlanAccurate")["status"] == "True" and s
                    )
                ),
            )
            assert condition(st, "PlanAccurate")["reason"] == "MeasuredMatchesPlan"
            assert condition(st, "PlanAccurate")["message"].startswith(f"plan {plan1.content_hash()}")
            assert set(profiler_jobs(cluster, ns, "minilm")) == set(jobs)  # no second round of Jobs
    finally:
        server.close()


def test_a_service_serving_what_its_plan_as_served_holds_matches_it(tmp_path):
    """Pools whose workers and routers share two cores (`sharedCores`) with a router cost per request: the
    solver's rate is several times what the plan serves. Saturated at 95 % of the plan as served (a third
    of the solver's rate), the service is judged against the plan as served: PlanAccurate True, no re-plan,
    no re-profiling."""
    import copy

    from test_operator_support import load_docs

    from exitplan.api.resources import EarlyExitServiceSpec, GPUPoolSpec, ModelProfileSpec
    from exitplan.planner.predict import plan_as_served

    ns = "served"
    bodies = {n: pool(n, cap, cost) for n, cap, cost in (("gpu-a", 4, 3.0), ("gpu-b", 6, 1.0))}
    profiles = {}
    with ClusterThread(tmp_path) as cluster:
        for body in bodies.values():
            body["spec"]["sharedCores"] = 2
            cluster.create(body)
        for doc in load_docs("profiles.yaml"):
            doc = copy.deepcopy(doc)
            doc["metadata"]["namespace"] = ns
            doc["spec"]["serving"] = {"routerMs": 1.0, "hopMs": 0.1, "threads": 1}
            profiles[doc["spec"]["pool"]] = ModelProfileSpec.model_validate(doc["spec"])
            cluster.create(doc)
        server = ObservationServer()
        router = Router(server)
        try:
            with operator(cluster):
                body = service("minilm", ns, planner=PLANNER)
                cluster.create(body)
                wait_for("first plan applied", lambda: deployed(cluster, ns, "minilm"))
                plan0 = plan_of(cluster, ns, "minilm")
                spec = EarlyExitServiceSpec.model_validate(body["spec"])
                pools = {n: GPUPoolSpec.model_validate(b["spec"]) for n, b in bodies.items()}
                served = plan_as_served(spec, pools, profiles, plan0).rate_rps
                fluid = plan0.prediction.goodput_rps
                assert 0 < served < 0.6 * fluid, (served, fluid)
                router.set(0.95 * served / 2, 0.05, 0.95)  # per bucket, the plan's mix is 50/50
                router.roll()
                publish_endpoint(cluster, ns, "minilm", server)

                def accurate():
                    router.roll()
                    s = status(cluster, ns, "minilm")
                    return s if condition(s, "PlanAccurate").get("status") == "True" else None

                st = wait_for("PlanAccurate True against the plan as served", accurate)
                cond = condition(st, "PlanAccurate")
                assert cond["reason"] == "MeasuredMatchesPlan"
                assert f"planned as served, the solver's {fluid:.1f}" in cond["message"]
                assert "measured/planned goodput 0.9" in cond["message"]
                seen = router.reads
                wait_for("six more reads", lambda: (router.roll(), router.reads >= seen + 6)[1])
                st = status(cluster, ns, "minilm")
                assert condition(st, "PlanAccurate")["status"] == "True"
                assert st["lastReplanReason"] == "initial" and profiler_jobs(cluster, ns, "minilm") == {}
        finally:
            server.close()


def test_a_read_that_misses_a_router_is_reported_and_never_judged_against_the_plan(cluster):
    """Two routers listed, one of which never answers: what the other reports (saturated, 40 % of the plan,
    which read alone would turn PlanAccurate False) is only part of the service's traffic. The reads say
    so (status.drift.routers, a RoutersUnread event) and PlanAccurate is not judged on them; once every
    listed router answers, it is."""
    ns = "partial"
    install_profiles(cluster, ns)
    server = ObservationServer()
    router = Router(server)
    try:
        with operator(cluster):
            cluster.create(service("minilm", ns, planner=PLANNER))
            wait_for("first plan applied", lambda: deployed(cluster, ns, "minilm"))
            share = plan_of(cluster, ns, "minilm").prediction.goodput_rps / 2
            router.set(0.4 * share, 0.05, 0.95)
            router.roll()
            publish_endpoint(cluster, ns, "minilm", server)
            dead = {"addresses": [{"ip": "127.0.0.1"}], "ports": [{"name": "control", "port": 1}]}  # refuses
            ep = cluster.get("Endpoints", ns, names.control_service_name("minilm"))
            cluster.patch("Endpoints", ns, names.control_service_name("minilm"), {"subsets": [*ep["subsets"], dead]})

            def partial() -> dict | None:
                router.roll()
                st = status(cluster, ns, "minilm")
                return st if "1 of 2 routers read" in ((st or {}).get("drift") or {}).get("routers", "") else None

            wait_for("a partial read reported", partial)
            seen = router.reads
            wait_for("ten more partial reads", lambda: (router.roll(), router.reads >= seen + 10)[1])
            st = status(cluster, ns, "minilm")
            assert condition(st, "PlanAccurate") == {}, st  # never judged on part of the traffic
            assert "1 of 2 routers read" in st["drift"]["routers"]
            events_where(cluster, ns, "minilm", lambda e: e["reason"] == "RoutersUnread", "a RoutersUnread event")
            publish_endpoint(cluster, ns, "minilm", server)  # the stand-in alone: every router answers

            def judged() -> dict | None:
                router.roll()
                st = status(cluster, ns, "minilm")
                return st if st and condition(st, "PlanAccurate") else None

            st = wait_for("PlanAccurate judged on whole reads", judged)
            assert st["drift"]["routers"] == ""
    finally:
        server.close()
