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
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

if TYPE_CHECKING:
    from exitplan.worker_image.generate.decoder import TokenEvent
    from exitplan.worker_image.peer_choice import Peer

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
THRESHOLD_UPDATES_DOC = "Threshold changes applied, by reason."


def reason_label(reason: str) -> str:
    return reason if reason in UPDATE_REASONS else "other"


M = TypeVar("M", bound=MetricWrapperBase)


def drop(metric: MetricWrapperBase, *labels: str) -> None:
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
        self.cache: dict[tuple[int, tuple[str, ...]], MetricWrapperBase] = {}

    def __call__(self, metric: M, *labels: str) -> M:
        key = (id(metric), labels)
        child = self.cache.get(key)
        if child is None:
            child = self.cache[key] = metric.labels(*self.fixed, *labels)
        return cast(M, child)  # the child of `metric` stored under its id: a metric of the same class


class Declare:
    """Declares one component's metrics in its registry: each with the component's fixed labels first
    (`labels`), then its own (`extra`). tests/test_dashboards.py reads these calls from the source
    (`d = Declare(registry, [labels])`, then `d.counter("literal_name", "doc", "extra", ...)`)."""

    def __init__(self, registry: CollectorRegistry, labels: Sequence[str]) -> None:
        self.registry, self.labels = registry, list(labels)

    def counter(self, name: str, doc: str, *extra: str) -> Counter:
        return self._make(Counter, name, doc, extra)

    def gauge(self, name: str, doc: str, *extra: str) -> Gauge:
        return self._make(Gauge, name, doc, extra)

    def histogram(self, name: str, doc: str, buckets: Sequence[float], *extra: str) -> Histogram:
        return self._make(Histogram, name, doc, extra, buckets=buckets)

    def _make(self, kind: type[M], name: str, doc: str, extra: Sequence[str], **more: Any) -> M:
        return kind(name, doc, [*self.labels, *extra], registry=self.registry, **more)


class RouterMetrics:
    def __init__(self, service: str) -> None:
        self.registry = CollectorRegistry()
        self.service = service
        d = Declare(self.registry, ["service"])
        self.requests = d.counter(
            "exitplan_router_requests_total", "Inference requests answered, by HTTP status code.", "code"
        )
        self.inputs = d.counter(
            "exitplan_router_inputs_total", "Inputs answered with a result, by length bucket.", "bucket"
        )
        self.within_slo = d.counter("exitplan_router_within_slo_total", "Inputs answered with a result within the SLO.")
        self.errors = d.counter("exitplan_router_errors_total", "Inputs answered with an error, by reason.", "reason")
        self.latency = d.histogram(
            "exitplan_router_latency_seconds", "End-to-end latency of answered inputs.", LATENCY_BUCKETS, "bucket"
        )
        self.exits = d.counter(
            "exitplan_router_exits_total",
            "Answers per ramp (the final head by the bundle's name for it, as on the workers).",
            "ramp",
        )
        self.inflight = d.gauge("exitplan_router_inflight_inputs", "Inputs accepted and not yet answered.")
        self.bucket_load = d.gauge(
            "exitplan_router_bucket_load_ratio",
            "Outstanding inputs over capacity, per bucket (absent while the bucket has no ready capacity).",
            "bucket",
        )
        self._declare_agreement()
        self.accuracy_budget = d.gauge(
            "exitplan_router_accuracy_budget_ratio", "The accuracy budget: the agreement must stay >= 1 - budget."
        )
        self.slo = d.gauge("exitplan_router_slo_seconds", "The service's p99 latency SLO.")
        self.threshold = d.gauge(
            "exitplan_threshold_ratio",
            "Exit threshold in force per exit ramp, in [0, 1] (absent while the ramp is disabled).",
            "ramp",
        )
        self.threshold_updates = d.counter("exitplan_threshold_updates_total", THRESHOLD_UPDATES_DOC, "reason")
        self.length_inputs = d.counter(
            "exitplan_router_length_inputs_total", "Inputs by ideal length bucket.", "bucket"
        )
        self.stragglers_marked = d.counter(
            "exitplan_router_stragglers_marked_total",
            "Pods this router (or split 0 in its process) marked stragglers: service times far above what they "
            "promise (E3), skipped for hops until they recover; by the pod's split and pool.",
            "split",
            "pool",
        )

    def _declare_agreement(self) -> None:
        """The last window's agreement with the full model: estimate, interval and the samples behind them."""
        d = Declare(self.registry, ["service"])
        self.agreement = d.gauge(
            "exitplan_router_agreement_ratio",
            "Agreement of the answers with the full model in the last window with answers, estimated from shadow "
            "samples (absent when that window had early exits but no shadow sample).",
        )
        bound = "bound of the last window's agreement (95 % Wilson intervals per ramp, weighted by exits)."
        self.agreement_low = d.gauge("exitplan_router_agreement_low_ratio", f"Lower {bound}")
        self.agreement_high = d.gauge("exitplan_router_agreement_high_ratio", f"Upper {bound}")
        self.agreement_samples = d.gauge(
            "exitplan_router_agreement_samples",
            "Shadow samples behind the agreement estimate (the last window with answers).",
        )

    def straggler_marked(self, peer: Peer) -> None:
        """Count a pod marked a straggler (a PeerSet's on_straggler)."""
        self.stragglers_marked.labels(self.service, str(peer.split), peer.pool).inc()

    def zero(self, buckets: list[int], ramps: list[str], cells: Iterable[tuple[int, str]] = ()) -> None:
        """Every label set the router will count, at 0 (`ramps`: the exit ramps and the final head;
        `cells`: the (split, pool) of the pods it may mark stragglers)."""
        s = self.service
        for split, pool in cells:
            self.stragglers_marked.labels(s, str(split), pool)
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
        self.labels = {"service": service, "split": str(split), "bucket": str(bucket), "pool": pool}
        d = Declare(self.registry, list(self.labels))
        cell = self.labels
        self.batch_size = d.histogram(
            "exitplan_worker_batch_inputs", "Inputs per executed batch.", BATCH_BUCKETS
        ).labels(**cell)
        self.planned_batch = d.gauge(
            "exitplan_worker_planned_batch_inputs", "The plan's batch size for this cell."
        ).labels(**cell)
        self.batch_seconds = d.histogram(
            "exitplan_worker_batch_seconds", "Compute time of one batch.", LATENCY_BUCKETS
        ).labels(**cell)
        self.queue_seconds = d.histogram(
            "exitplan_worker_queue_seconds", "Time inputs wait in the fusion queue.", LATENCY_BUCKETS
        ).labels(**cell)
        self.inputs = d.counter("exitplan_worker_inputs_total", "Inputs computed by this worker.").labels(**cell)
        self.exits = d.counter("exitplan_worker_exits_total", "Inputs answered at each ramp of this split.", "ramp")
        self.queued = d.gauge("exitplan_worker_queue_inputs", "Inputs waiting in the fusion queue.").labels(**cell)
        self.forward_bytes = d.counter(
            "exitplan_worker_forward_bytes_total", "Activation bytes sent to the next split."
        ).labels(**cell)
        self.rejected = d.counter(
            "exitplan_worker_rejected_inputs_total",
            "Inputs the model could not run: each failed alone after its batch failed and was split.",
        ).labels(**cell)
        self.forward_errors = d.counter(
            "exitplan_worker_forward_errors_total", "Failed sends to a next-split pod (retried elsewhere)."
        ).labels(**cell)
        self.stragglers = d.gauge(
            "exitplan_worker_next_stragglers", "Next-split pods currently marked stragglers."
        ).labels(**cell)
        self.threshold_updates = Declare(self.registry, ["service"]).counter(
            "exitplan_threshold_updates_total", THRESHOLD_UPDATES_DOC, "reason"
        )
        self.info = d.gauge(
            "exitplan_worker_info",
            "1 for the worker's runtime: the provider its sessions run on, its device, the bundle's precision.",
            "provider",
            "device",
            "precision",
        )

    def runtime_info(self, providers: Sequence[str], dtype: str) -> None:
        """The runtime the worker serves on: its sessions' first provider, the device it puts batches on, and
        the bundle's activation dtype (fp32/fp16), as exitplan_worker_info (a GPU pool serving on the CPU shows)."""
        provider = providers[0] if providers else "none"
        device = "gpu" if provider in ("CUDAExecutionProvider", "TensorrtExecutionProvider") else "cpu"
        precision = {"float16": "fp16", "bfloat16": "bf16"}.get(dtype, "fp32")
        self.info.labels(**self.labels, provider=provider, device=device, precision=precision).set(1)

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
        self.labels = {"service": service, "mode": mode}
        d = Declare(self.registry, list(self.labels))
        own = self.labels
        self.token_seconds = d.histogram(
            "exitplan_generation_token_seconds", "Time per generated token (one forward pass).", TOKEN_BUCKETS
        ).labels(**own)
        self.first_token_seconds = d.histogram(
            "exitplan_generation_first_token_seconds", "Time to the first token (prompt pass).", TOKEN_BUCKETS
        ).labels(**own)
        self.tokens = d.counter(
            "exitplan_generation_tokens_total",
            "Generated tokens, by the head that chose them (ramp=final head's name for full passes).",
            "ramp",
        )
        self.requests = d.counter(
            "exitplan_generation_requests_total", "Generation requests answered, by HTTP status code.", "code"
        )
        self.disconnects = d.counter(
            "exitplan_generation_disconnects_total", "Streams stopped because the client went away."
        ).labels(**own)
        self.recomputed = d.counter(
            "exitplan_generation_recomputed_positions_total", "Positions whose missing KV entries were recomputed."
        ).labels(**own)
        self.full_passes = d.counter(
            "exitplan_generation_full_passes_total",
            "Tokens that ran every block (final head or forced by the pending bound).",
        ).labels(**own)
        self.sequences = d.gauge("exitplan_generation_active_sequences", "Sequences holding a KV cache now.").labels(
            **own
        )

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
