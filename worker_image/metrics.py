"""Prometheus metrics of the data plane, declared in one place.

Names follow `exitplan_<thing>_<unit>`; labels are the fixed set service, split, bucket, pool, ramp
(plus `code`/`reason` on counters of outcomes). Each app gets its own registry so several routers
and workers can live in one process (tests) without clashing.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)


class Children:
    """Labelled children of metrics, each looked up once: on the request path `metric.labels(...)`
    costs more than the update itself. `fixed` are the leading label values every lookup shares."""

    def __init__(self, *fixed: str) -> None:
        self.fixed = fixed
        self.cache: dict[tuple, object] = {}

    def __call__(self, metric, *labels: str):
        key = (id(metric), labels)
        child = self.cache.get(key)
        if child is None:
            child = self.cache[key] = metric.labels(*self.fixed, *labels)
        return child


class RouterMetrics:
    def __init__(self, service: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.service = service
        self.requests = Counter(
            "exitplan_router_requests_total",
            "Inference requests answered, by HTTP status code.",
            ["service", "code"],
            registry=r,
        )
        self.inputs = Counter(
            "exitplan_router_inputs_total",
            "Inputs answered with a result, by length bucket.",
            ["service", "bucket"],
            registry=r,
        )
        self.within_slo = Counter(
            "exitplan_router_within_slo_total", "Inputs answered with a result within the SLO.", ["service"], registry=r
        )
        self.errors = Counter(
            "exitplan_router_errors_total",
            "Inputs answered with an error, by reason.",
            ["service", "reason"],
            registry=r,
        )
        self.latency = Histogram(
            "exitplan_router_latency_seconds",
            "End-to-end latency of answered inputs.",
            ["service", "bucket"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.exits = Counter(
            "exitplan_router_exits_total",
            "Answers per ramp (the final head is ramp=final).",
            ["service", "ramp"],
            registry=r,
        )
        self.inflight = Gauge(
            "exitplan_router_inflight_inputs", "Inputs accepted and not yet answered.", ["service"], registry=r
        )
        self.bucket_load = Gauge(
            "exitplan_router_bucket_load_ratio",
            "Outstanding inputs over capacity, per bucket.",
            ["service", "bucket"],
            registry=r,
        )
        self.agreement = Gauge(
            "exitplan_router_agreement_ratio",
            "Shadow-sampled agreement of answers with the full model (last window).",
            ["service"],
            registry=r,
        )
        self.accuracy_budget = Gauge(
            "exitplan_router_accuracy_budget_ratio",
            "The accuracy budget: the agreement must stay >= 1 - budget.",
            ["service"],
            registry=r,
        )
        self.slo = Gauge("exitplan_router_slo_seconds", "The service's p99 latency SLO.", ["service"], registry=r)
        self.threshold = Gauge(
            "exitplan_threshold_ratio",
            "Exit threshold in force per ramp (above 1 = disabled).",
            ["service", "ramp"],
            registry=r,
        )
        self.threshold_updates = Counter(
            "exitplan_threshold_updates_total",
            "Threshold changes applied, by reason.",
            ["service", "reason"],
            registry=r,
        )
        self.length_inputs = Counter(
            "exitplan_router_length_inputs_total", "Inputs by ideal length bucket.", ["service", "bucket"], registry=r
        )


class WorkerMetrics:
    def __init__(self, service: str, split: int, bucket: int, pool: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.labels = {"service": service, "split": str(split), "bucket": str(bucket), "pool": pool}
        names = list(self.labels)
        self.batch_size = Histogram(
            "exitplan_worker_batch_inputs", "Inputs per executed batch.", names, buckets=BATCH_BUCKETS, registry=r
        ).labels(**self.labels)
        self.planned_batch = Gauge(
            "exitplan_worker_planned_batch_inputs", "The plan's batch size for this cell.", names, registry=r
        ).labels(**self.labels)
        self.batch_seconds = Histogram(
            "exitplan_worker_batch_seconds", "Compute time of one batch.", names, buckets=LATENCY_BUCKETS, registry=r
        ).labels(**self.labels)
        self.queue_seconds = Histogram(
            "exitplan_worker_queue_seconds",
            "Time inputs wait in the fusion queue.",
            names,
            buckets=LATENCY_BUCKETS,
            registry=r,
        ).labels(**self.labels)
        self.inputs = Counter(
            "exitplan_worker_inputs_total", "Inputs computed by this worker.", names, registry=r
        ).labels(**self.labels)
        self.exits = Counter(
            "exitplan_worker_exits_total", "Inputs answered at each ramp of this split.", [*names, "ramp"], registry=r
        )
        self.queued = Gauge(
            "exitplan_worker_queue_inputs", "Inputs waiting in the fusion queue.", names, registry=r
        ).labels(**self.labels)
        self.forward_bytes = Counter(
            "exitplan_worker_forward_bytes_total", "Activation bytes sent to the next split.", names, registry=r
        ).labels(**self.labels)
        self.forward_errors = Counter(
            "exitplan_worker_forward_errors_total",
            "Failed sends to a next-split pod (retried elsewhere).",
            names,
            registry=r,
        ).labels(**self.labels)
        self.stragglers = Gauge(
            "exitplan_worker_next_stragglers", "Next-split pods currently marked stragglers.", names, registry=r
        ).labels(**self.labels)
        self.threshold_updates = Counter(
            "exitplan_threshold_updates_total",
            "Threshold changes applied, by reason.",
            ["service", "reason"],
            registry=r,
        )
