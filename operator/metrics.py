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


SOLVE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
"""Seconds: the buckets of exitplan_planner_solve_seconds."""


class OperatorMetrics:
    """Every series the operator exports, in one registry (the process's default one unless given)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        service = ("namespace", "service")  # every series: one operator serves every namespace
        self._cells: dict[tuple[str, str], set[tuple[str, ...]]] = {}
        """The cells each service's last record_plan set (its stale ones go without scanning every series)."""
        self._plans: dict[tuple[str, str], tuple[float, tuple[tuple[int, int, str, int, int], ...]]] = {}
        """The last record_plan of each service (what its series now say)."""
        cell = (*service, "split", "bucket", "pool")  # a plan cell's series
        self.solve_seconds = Histogram(
            "exitplan_planner_solve_seconds",
            "Wall time of one plan_service call (executor thread).",
            service,
            buckets=SOLVE_BUCKETS,
            registry=registry,
        )
        self.last_solve = Gauge(
            "exitplan_planner_last_solve_seconds",
            "Wall time of the service's latest plan_service call.",
            service,
            registry=registry,
        )
        self.replans = Counter(
            "exitplan_replan_total",
            f"Plans made, by reason ({', '.join(REPLAN_REASONS)}); advisory plans count too.",
            (*service, "reason"),
            registry=registry,
        )
        self.applies_failed = Counter(
            "exitplan_apply_errors_total",
            "Applies that failed (the previous plan kept serving).",
            service,
            registry=registry,
        )
        self.desired = Gauge(
            "exitplan_cell_desired_replicas", "Replicas the current plan wants per cell.", cell, registry=registry
        )
        self.ready = Gauge(
            "exitplan_cell_ready_replicas", "Replicas the cell's Deployment reports ready.", cell, registry=registry
        )
        self.length_score = Gauge(
            "exitplan_drift_length_score_ratio",
            "Total-variation distance of the observed vs planned length histogram.",
            service,
            registry=registry,
        )
        self.cost = Gauge(
            "exitplan_plan_cost_per_hour",
            "Cost per hour of the plan in force (replicas x their pools' costPerHour).",
            service,
            registry=registry,
        )
        self.condition = Gauge(
            "exitplan_service_condition",
            "The service's status conditions: 1 True, 0 False (absent while Unknown or not set).",
            (*service, "condition"),
            registry=registry,
        )
        self.planned_goodput = Gauge(
            "exitplan_plan_goodput_per_second",
            "Inputs per second within the SLO that the plan in force promises (kubectl's GOODPUT).",
            service,
            registry=registry,
        )
        self.measured_goodput = Gauge(
            "exitplan_measured_goodput_per_second",
            "Inputs per second answered within the SLO in the routers' last observation window, as the operator "
            "read it (kubectl's MEASURED; absent before a window was read).",
            service,
            registry=registry,
        )
        self.survival_error = Gauge(
            "exitplan_drift_survival_error_ratio",
            "Max abs difference of the forecast vs planned survival curve.",
            service,
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

    def record_goodput(self, namespace: str, service: str, planned: float | None, measured: float | None) -> None:
        """The plan's goodput and the last measured one, each absent while there is none."""
        for gauge, value in ((self.planned_goodput, planned), (self.measured_goodput, measured)):
            if value is None:
                with contextlib.suppress(KeyError):
                    gauge.remove(namespace, service)
            else:
                gauge.labels(namespace, service).set(value)

    def record_plan(
        self, namespace: str, service: str, cost_per_hour: float, cells: list[tuple[int, int, str, int, int]]
    ) -> None:
        """The plan in force: its cost, and per cell (split, bucket, pool, desired, ready) replicas. Every tick
        of every service records it; the series are set only when something differs from the last record."""
        recorded = (cost_per_hour, tuple(cells))
        if self._plans.get((namespace, service)) == recorded:
            return
        self._plans[(namespace, service)] = recorded
        self.cost.labels(namespace, service).set(cost_per_hour)
        current: set[tuple[str, ...]] = set()
        for split, bucket, pool, desired, ready in cells:
            cell = (namespace, service, str(split), str(bucket), pool)
            current.add(cell)
            self.desired.labels(*cell).set(desired)
            self.ready.labels(*cell).set(ready)
        before = self._cells.get((namespace, service))
        if before is None:  # not recorded by this process yet: whatever series an earlier plan left
            before = {labels for gauge in (self.desired, self.ready) for labels in series(gauge)}
            before = {labels for labels in before if labels[:2] == (namespace, service)}
        for labels in before - current:  # cells an earlier plan had and this one does not
            for gauge in (self.desired, self.ready):
                with contextlib.suppress(KeyError):
                    gauge.remove(*labels)
        self._cells[(namespace, service)] = current

    def forget(self, namespace: str, service: str) -> None:
        """Drop a deleted service's series (its cells and its per-service gauges)."""
        gauges = (self.desired, self.ready, self.cost, self.length_score, self.survival_error, self.condition) + (
            self.planned_goodput,
            self.measured_goodput,
        )
        self._cells.pop((namespace, service), None)
        self._plans.pop((namespace, service), None)
        for metric in (*gauges, self.last_solve):
            for labels in series(metric):
                if labels[:2] == (namespace, service):
                    metric.remove(*labels)


def series(metric: Gauge) -> list[tuple[str, ...]]:
    """The label values of every series `metric` has now. prometheus_client has no public listing of a
    metric's children (collect() gives samples, not label tuples), so this reads its child table."""
    return [tuple(labels) for labels in metric._metrics]


METRICS = OperatorMetrics()
