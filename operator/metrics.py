"""The operator's Prometheus metrics (one module; names `exitplan_<thing>_<unit>`, fixed labels).

One operator serves every namespace, so each series carries `namespace` beside `service`: two services
of the same name in different namespaces stay two series. A service's counters exist at 0 from the
moment the operator first sees it (`zero`), so that `increase()` counts its first re-plan or failed
apply; its gauges exist only once there is something to tell (a plan, a drift window, a condition).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

REPLAN_REASONS = (
    "initial",
    "spec-change",
    "resume",
    "profile-change",
    "pool-changed",
    "capacity-freed",
    "length-drift",
    "survival-drift",
    "slo-risk",
    "plan-mismatch",
)
"""The `reason` label values of exitplan_replan_total (what reconcile and the drift loop plan for)."""
CONDITIONS = ("Planned", "Ready", "Progressing", "Degraded", "PlanInfeasible", "ProfilingFailed", "PlanAccurate")
"""The condition types of an EarlyExitService's status (status.CONDITION_TYPES), exported as
exitplan_service_condition."""


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.solve_seconds = Histogram(
            "exitplan_planner_solve_seconds",
            "Wall time of one plan_service call (executor thread).",
            ["namespace", "service"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
            registry=registry,
        )
        self.last_solve = Gauge(
            "exitplan_planner_last_solve_seconds",
            "Wall time of the service's latest plan_service call.",
            ["namespace", "service"],
            registry=registry,
        )
        self.replans = Counter(
            "exitplan_replan_total",
            "Plans made, by reason (initial, spec-change, resume, profile-change, pool-changed, capacity-freed, "
            "length-drift, survival-drift, slo-risk, plan-mismatch); advisory plans count too.",
            ["namespace", "service", "reason"],
            registry=registry,
        )
        self.applies_failed = Counter(
            "exitplan_apply_errors_total",
            "Applies that failed (the previous plan kept serving).",
            ["namespace", "service"],
            registry=registry,
        )
        self.desired = Gauge(
            "exitplan_cell_desired_replicas",
            "Replicas the current plan wants per cell.",
            ["namespace", "service", "split", "bucket", "pool"],
            registry=registry,
        )
        self.ready = Gauge(
            "exitplan_cell_ready_replicas",
            "Replicas the cell's Deployment reports ready.",
            ["namespace", "service", "split", "bucket", "pool"],
            registry=registry,
        )
        self.length_score = Gauge(
            "exitplan_drift_length_score_ratio",
            "Total-variation distance of the observed vs planned length histogram.",
            ["namespace", "service"],
            registry=registry,
        )
        self.cost = Gauge(
            "exitplan_plan_cost_per_hour",
            "Cost per hour of the plan in force (replicas x their pools' costPerHour).",
            ["namespace", "service"],
            registry=registry,
        )
        self.condition = Gauge(
            "exitplan_service_condition",
            "The service's status conditions: 1 True, 0 False (absent while Unknown or not set).",
            ["namespace", "service", "condition"],
            registry=registry,
        )
        self.survival_error = Gauge(
            "exitplan_drift_survival_error_ratio",
            "Max abs difference of the forecast vs planned survival curve.",
            ["namespace", "service"],
            registry=registry,
        )

    def zero(self, namespace: str, service: str) -> None:
        """The service's counters (and solve-time histogram) at 0, before it is first planned."""
        for reason in REPLAN_REASONS:
            self.replans.labels(namespace, service, reason)
        self.applies_failed.labels(namespace, service)
        self.solve_seconds.labels(namespace, service)

    def record_solve(self, namespace: str, service: str, seconds: float) -> None:
        self.solve_seconds.labels(namespace, service).observe(seconds)
        self.last_solve.labels(namespace, service).set(seconds)

    def record_conditions(self, namespace: str, service: str, conditions: Iterable[tuple[str, str]]) -> None:
        """The status's (type, status) conditions: True 1, False 0; Unknown or missing ones absent."""
        given = dict(conditions)
        for kind in CONDITIONS:
            value = {"True": 1.0, "False": 0.0}.get(given.get(kind, ""))
            if value is None:
                with contextlib.suppress(KeyError):  # not there: nothing to remove
                    self.condition.remove(namespace, service, kind)
            else:
                self.condition.labels(namespace, service, kind).set(value)

    def record_plan(
        self, namespace: str, service: str, cost_per_hour: float, cells: list[tuple[int, int, str, int, int]]
    ) -> None:
        """The plan in force: its cost, and per cell (split, bucket, pool, desired, ready) replicas."""
        self.cost.labels(namespace, service).set(cost_per_hour)
        current = set()
        for split, bucket, pool, desired, ready in cells:
            labels = (namespace, service, str(split), str(bucket), pool)
            current.add(labels)
            self.desired.labels(*labels).set(desired)
            self.ready.labels(*labels).set(ready)
        for gauge in (self.desired, self.ready):  # cells an earlier plan had and this one does not
            for labels in list(gauge._metrics):
                if labels[:2] == (namespace, service) and labels not in current:
                    gauge.remove(*labels)

    def forget(self, namespace: str, service: str) -> None:
        """Drop a deleted service's series (its cells and its per-service gauges)."""
        gauges = (self.desired, self.ready, self.cost, self.length_score, self.survival_error, self.condition)
        for metric in (*gauges, self.last_solve):
            for labels in list(metric._metrics):
                if labels[:2] == (namespace, service):
                    metric.remove(*labels)


METRICS = OperatorMetrics()
