"""The operator's Prometheus metrics (one module; names `exitplan_<thing>_<unit>`, fixed labels).

One operator serves every namespace, so each series carries `namespace` beside `service`: two services
of the same name in different namespaces stay two series.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.solve_seconds = Histogram(
            "exitplan_planner_solve_seconds",
            "Wall time of one plan_service call (executor thread).",
            ["namespace", "service"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
            registry=registry,
        )
        self.replans = Counter(
            "exitplan_replan_total",
            "Plans made, by reason (initial, spec-change, length-drift, survival-drift, "
            "slo-risk); advisory plans count too.",
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
        self.survival_error = Gauge(
            "exitplan_drift_survival_error_ratio",
            "Max abs difference of the forecast vs planned survival curve.",
            ["namespace", "service"],
            registry=registry,
        )

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
        for metric in (self.desired, self.ready, self.cost, self.length_score, self.survival_error):
            for labels in list(metric._metrics):
                if labels[:2] == (namespace, service):
                    metric.remove(*labels)


METRICS = OperatorMetrics()
