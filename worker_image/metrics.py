"""Prometheus metrics of the data plane, declared in one place.

Names follow `exitplan_<thing>_<unit>`; labels are the fixed set service, split, bucket, pool, ramp
(plus `code`/`reason` on counters of outcomes, each from a fixed set: never text a request brought).
Each app gets its own registry so several routers and workers can live in one process (tests)
without clashing.

Two rules keep the series truthful for PromQL. A counter exists at 0 for every label set it will
carry before anything is counted (`zero()`: the codes, reasons, buckets and ramps are known at start):
`increase()` and `rate()` see a counter's first increments only when the series was scraped at 0
first. A gauge exists only while it has evidence: the agreement of a window without shadow samples,
the load of a bucket without capacity and the threshold of a disabled ramp are absent, never a
sentinel such as -1 or 2; a ratio comes with its sample count and its Wilson interval.
One name per ramp everywhere: the final head is named by the bundle's final ramp (e.g. "head") in
the router's and the workers' `ramp` label alike.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

if TYPE_CHECKING:
    from exitplan.worker.generate.decoder import TokenEvent

ROUTER_CODES = ("200", "400", "413", "422", "429", "502", "503", "504")
"""The HTTP codes a router counts in exitplan_router_requests_total (each at 0 from the start)."""
ERROR_REASONS = ("worker", "deadline", "bad_input", "overload", "too_large")
"""The `reason` label values of exitplan_router_errors_total."""
GENERATION_CODES = ("200", "400", "404", "499", "500", "503")
"""The HTTP codes of exitplan_generation_requests_total (499: the client went away mid-stream)."""


class _Merged:
    """Several registries as one exposition: a family's samples from every registry under one HELP/TYPE
    (a router that co-locates split 0 serves its own metrics and one set per bucket's worker)."""

    def __init__(self, registries: Iterable[CollectorRegistry]) -> None:
        self.registries = list(registries)

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for registry in self.registries:
            for family in registry.collect():
                kept = families.get(family.name)
                if kept is None:
                    kept = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                kept.samples.extend(family.samples)
        yield from families.values()


def merged(registries: Iterable[CollectorRegistry]) -> CollectorRegistry | _Merged:
    """What `generate_latest` exposes for these registries (the one registry itself when alone)."""
    registries = list(registries)
    return registries[0] if len(registries) == 1 else _Merged(registries)


LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)
TOKEN_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
UPDATE_REASONS = frozenset({"api", "plan-update", "tune-accuracy", "tune-savings"})
"""The `reason` label values of exitplan_threshold_updates_total: a threshold post names its reason in
free text, which goes to the log; the label is one of these or "other" (a label value from request
data would let any caller grow /metrics without bound)."""


THRESHOLD_REASONS = (*sorted(UPDATE_REASONS), "other")


def reason_label(reason: str) -> str:
    return reason if reason in UPDATE_REASONS else "other"


def drop(metric, *labels: str) -> None:
    """Remove one label set of a labelled metric (nothing when it is not there)."""
    try:
        metric.remove(*labels)
    except KeyError:
        pass


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
            "Answers per ramp (the final head by the bundle's name for it, as on the workers).",
            ["service", "ramp"],
            registry=r,
        )
        self.inflight = Gauge(
            "exitplan_router_inflight_inputs", "Inputs accepted and not yet answered.", ["service"], registry=r
        )
        self.bucket_load = Gauge(
            "exitplan_router_bucket_load_ratio",
            "Outstanding inputs over capacity, per bucket (absent while the bucket has no ready capacity).",
            ["service", "bucket"],
            registry=r,
        )
        self._declare_agreement(r)
        self.accuracy_budget = Gauge(
            "exitplan_router_accuracy_budget_ratio",
            "The accuracy budget: the agreement must stay >= 1 - budget.",
            ["service"],
            registry=r,
        )
        self.slo = Gauge("exitplan_router_slo_seconds", "The service's p99 latency SLO.", ["service"], registry=r)
        self.threshold = Gauge(
            "exitplan_threshold_ratio",
            "Exit threshold in force per exit ramp, in [0, 1] (absent while the ramp is disabled).",
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

    def _declare_agreement(self, r: CollectorRegistry) -> None:
        """The last window's agreement with the full model: estimate, interval and the samples behind them."""
        self.agreement = Gauge(
            "exitplan_router_agreement_ratio",
            "Agreement of the answers with the full model in the last window with answers, estimated from shadow "
            "samples (absent when that window had early exits but no shadow sample).",
            ["service"],
            registry=r,
        )
        self.agreement_low = Gauge(
            "exitplan_router_agreement_low_ratio",
            "Lower bound of the last window's agreement (95 % Wilson intervals per ramp, weighted by exits).",
            ["service"],
            registry=r,
        )
        self.agreement_high = Gauge(
            "exitplan_router_agreement_high_ratio",
            "Upper bound of the last window's agreement (95 % Wilson intervals per ramp, weighted by exits).",
            ["service"],
            registry=r,
        )
        self.agreement_samples = Gauge(
            "exitplan_router_agreement_samples",
            "Shadow samples behind the agreement estimate (the last window with answers).",
            ["service"],
            registry=r,
        )

    def zero(self, buckets: list[int], ramps: list[str]) -> None:
        """Every label set the router will count, at 0 (`ramps`: the exit ramps and the final head)."""
        s = self.service
        for code in ROUTER_CODES:
            self.requests.labels(s, code)
        for reason in ERROR_REASONS:
            self.errors.labels(s, reason)
        for reason in THRESHOLD_REASONS:
            self.threshold_updates.labels(s, reason)
        for bucket in map(str, buckets):
            self.inputs.labels(s, bucket)
            self.latency.labels(s, bucket)
            self.length_inputs.labels(s, bucket)
        for ramp in ramps:
            self.exits.labels(s, ramp)
        self.within_slo.labels(s)
        self.inflight.labels(s).set(0)

    def set_bucket_load(self, bucket: int, load: float) -> None:
        if math.isfinite(load):
            self.bucket_load.labels(self.service, str(bucket)).set(load)
        else:  # no ready capacity: no load to tell
            drop(self.bucket_load, self.service, str(bucket))

    def set_threshold(self, ramp: str, value: float | None) -> None:
        if value is not None and 0.0 <= value <= 1.0:
            self.threshold.labels(self.service, ramp).set(value)
        else:  # disabled: the ramp takes no exits
            drop(self.threshold, self.service, ramp)

    def set_agreement(self, samples: int, estimate: float, low: float, high: float, evidence: bool) -> None:
        """The last window's agreement: its sample count always, the ratios only with `evidence`."""
        self.agreement_samples.labels(self.service).set(samples)
        for gauge, value in ((self.agreement, estimate), (self.agreement_low, low), (self.agreement_high, high)):
            if evidence:
                gauge.labels(self.service).set(value)
            else:
                drop(gauge, self.service)


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
        self.rejected = Counter(
            "exitplan_worker_rejected_inputs_total",
            "Inputs the model could not run: each failed alone after its batch failed and was split.",
            names,
            registry=r,
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

    def zero(self, ramps: list[str]) -> None:
        """Every label set the worker will count, at 0 (`ramps`: the ramps of its split, final head included)."""
        for ramp in ramps:
            self.exits.labels(**self.labels, ramp=ramp)
        for reason in THRESHOLD_REASONS:
            self.threshold_updates.labels(self.labels["service"], reason)


class GenerationMetrics:
    """Prometheus metrics of generation (labels: service, mode; ramp on per-token counters)."""

    def __init__(self, service: str, mode: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        labels = ["service", "mode"]
        self.labels = {"service": service, "mode": mode}
        self.token_seconds = Histogram(
            "exitplan_generation_token_seconds",
            "Time per generated token (one forward pass).",
            labels,
            buckets=TOKEN_BUCKETS,
            registry=r,
        ).labels(**self.labels)
        self.first_token_seconds = Histogram(
            "exitplan_generation_first_token_seconds",
            "Time to the first token (prompt pass).",
            labels,
            buckets=TOKEN_BUCKETS,
            registry=r,
        ).labels(**self.labels)
        self.tokens = Counter(
            "exitplan_generation_tokens_total",
            "Generated tokens, by the head that chose them (ramp=final head's name for full passes).",
            [*labels, "ramp"],
            registry=r,
        )
        self.requests = Counter(
            "exitplan_generation_requests_total",
            "Generation requests answered, by HTTP status code.",
            [*labels, "code"],
            registry=r,
        )
        self.disconnects = Counter(
            "exitplan_generation_disconnects_total", "Streams stopped because the client went away.", labels, registry=r
        ).labels(**self.labels)
        self.recomputed = Counter(
            "exitplan_generation_recomputed_positions_total",
            "Positions whose missing KV entries were recomputed.",
            labels,
            registry=r,
        ).labels(**self.labels)
        self.full_passes = Counter(
            "exitplan_generation_full_passes_total",
            "Tokens that ran every block (final head or forced by the pending bound).",
            labels,
            registry=r,
        ).labels(**self.labels)
        self.sequences = Gauge(
            "exitplan_generation_active_sequences", "Sequences holding a KV cache now.", labels, registry=r
        ).labels(**self.labels)

    def zero(self, ramps: list[str]) -> None:
        """Every label set generation will count, at 0 (`ramps`: the exit heads and the final head)."""
        for ramp in ramps:
            self.tokens.labels(**self.labels, ramp=ramp)
        for code in GENERATION_CODES:
            self.requests.labels(**self.labels, code=code)

    def token(self, event: TokenEvent) -> None:
        (self.first_token_seconds if event.index == 0 else self.token_seconds).observe(event.seconds)
        self.tokens.labels(**self.labels, ramp=event.exit).inc()
        self.recomputed.inc(event.recomputed)
        if event.full_pass:
            self.full_passes.inc()

    def answered(self, code: int) -> None:
        self.requests.labels(**self.labels, code=str(code)).inc()
