"""The operator's Prometheus metrics (one module; names `exitplan_<thing>_<unit>`, fixed labels)."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from exitplan.api.plan import Plan


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.solve_seconds = Histogram(
            "exitplan_planner_solve_seconds", "Wall time of one plan_service call (executor thread).", ["service"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60), registry=registry)
        self.replans = Counter(
            "exitplan_replan_total", "Plans made, by reason (initial, spec-change, length-drift, survival-drift, "
            "slo-risk); advisory plans count too.", ["service", "reason"], registry=registry)
        self.applies_failed = Counter(
            "exitplan_apply_errors_total", "Applies that failed (the previous plan kept serving).", ["service"],
            registry=registry)
        self.desired = Gauge("exitplan_cell_desired_replicas", "Replicas the current plan wants per cell.",
                             ["service", "split", "bucket", "pool"], registry=registry)
        self.ready = Gauge("exitplan_cell_ready_replicas", "Replicas the cell's Deployment reports ready.",
                           ["service", "split", "bucket", "pool"], registry=registry)
        self.length_score = Gauge("exitplan_drift_length_score_ratio",
                                  "Total-variation distance of the observed vs planned length histogram.",
                                  ["service"], registry=registry)
        self.cost = Gauge("exitplan_plan_cost_per_hour", "Cost per hour of the plan in force (replicas x their pools' costPerHour).",
                          ["service"], registry=registry)
        self.survival_error = Gauge("exitplan_drift_survival_error_ratio",
                                    "Max abs difference of the forecast vs planned survival curve.",
                                    ["service"], registry=registry)

    def record_cells(self, service: str, plan: Plan, ready: dict[tuple[int, int, str], int]) -> None:
        self.cost.labels(service).set(plan.prediction.cost_per_hour)
        for cell in plan.cells:
            labels = (service, str(cell.split), str(cell.bucket), cell.pool)
            self.desired.labels(*labels).set(cell.replicas)
            self.ready.labels(*labels).set(ready.get((cell.split, cell.bucket, cell.pool), 0))


METRICS = OperatorMetrics()
