"""The operator's per-cell gauges follow the plan in force: a cell the new plan drops loses its series, a
deleted service loses all of its, and another service's series stay (operator/metrics.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from exitplan.operator.metrics import OperatorMetrics


def cells(registry: CollectorRegistry, metric: str) -> set[tuple[str, str, str, str, str]]:
    return {
        (s.labels["namespace"], s.labels["service"], s.labels["split"], s.labels["bucket"], s.labels["pool"])
        for m in registry.collect()
        if m.name == metric
        for s in m.samples
    }


def test_cell_series_follow_the_plan_and_the_service() -> None:
    registry = CollectorRegistry()
    metrics = OperatorMetrics(registry)
    metrics.record_plan("ns", "a", 1.0, [(0, 32, "gpu", 2, 1), (1, 32, "gpu", 1, 0)])
    metrics.record_plan("ns", "b", 1.0, [(0, 128, "cpu", 1, 1)])
    metrics.record_plan("ns", "a", 1.0, [(0, 32, "gpu", 3, 3)])  # split 1 dropped by the new plan
    for metric in ("exitplan_cell_desired_replicas", "exitplan_cell_ready_replicas"):
        assert cells(registry, metric) == {("ns", "a", "0", "32", "gpu"), ("ns", "b", "0", "128", "cpu")}
    assert (
        registry.get_sample_value(
            "exitplan_cell_desired_replicas",
            dict(zip(("namespace", "service", "split", "bucket", "pool"), ("ns", "a", "0", "32", "gpu"), strict=True)),
        )
        == 3
    )
    metrics.forget("ns", "a")
    assert cells(registry, "exitplan_cell_desired_replicas") == {("ns", "b", "0", "128", "cpu")}
    metrics.record_plan("ns", "a", 1.0, [(1, 32, "gpu", 1, 1)])  # recreated: only its new cells
    assert cells(registry, "exitplan_cell_ready_replicas") == {
        ("ns", "a", "1", "32", "gpu"),
        ("ns", "b", "0", "128", "cpu"),
    }


def test_cell_series_set_before_the_first_record_go_at_that_record() -> None:
    """A cell series set other than through record_plan (record_plan keeps the cells it set per service)
    goes at the service's first record too."""
    registry = CollectorRegistry()
    metrics = OperatorMetrics(registry)
    metrics.desired.labels("ns", "a", "2", "32", "gpu").set(1)  # left by a plan this instance never recorded
    metrics.record_plan("ns", "a", 1.0, [(0, 32, "gpu", 1, 1)])
    assert cells(registry, "exitplan_cell_desired_replicas") == {("ns", "a", "0", "32", "gpu")}
