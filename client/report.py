"""What a load run measured, computed from its outcomes (pure arithmetic), and shown as rich tables.

Definitions (stated once, used everywhere):
- run time `run_s`: from the first arrival (t = 0) to the last answer received (results and
  errors; lost requests do not stretch it), at least the arrival window;
- offered load: requests / arrival window (the run's duration, else up to the last arrival);
- goodput: results answered within the SLO per second of run time; throughput: results per second;
- share within the SLO: results answered within the SLO / requests (an error or a lost request is a
  miss), over the whole run and over its last third (the requests scheduled in the last third of the
  arrival window: a queue that grows through the run shows there first);
- latency: client-side, from sending a request to receiving its whole answer, over results only;
- exit histogram: the share of results answered by each ramp (the final head included);
- agreement: the share of results whose label equals the full model's label for exactly that input;
  accuracy: the share of results (single held-out texts, where the true label is known) whose label
  is the true one, beside the full model's accuracy on the same inputs;
- every request is counted once: results + errors of each kind + lost = requests.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from exitplan.client.loadgen import ERROR_KINDS, Outcome

if TYPE_CHECKING:
    from rich.table import Table

PERCENTILES = (50, 95, 99)


def latency_summary(latencies_s: Sequence[float]) -> dict[str, float | None]:
    """Keys p50/p95/p99/mean/max, in milliseconds (linear interpolation); None entries when there is no value."""
    values = np.asarray(latencies_s, dtype=np.float64) * 1000.0
    if values.size == 0:
        return {**{f"p{q}": None for q in PERCENTILES}, "mean": None, "max": None}
    out: dict[str, float | None] = {f"p{q}": float(np.percentile(values, q)) for q in PERCENTILES}
    out["mean"] = float(values.mean())
    out["max"] = float(values.max())
    return out


def run_seconds(outcomes: Sequence[Outcome]) -> float:
    """From t = 0 to the last answer received, at least the span of the arrivals (see the module doc)."""
    last_arrival = max((o.scheduled_s for o in outcomes), default=0.0)
    last_answer = max((o.done_s for o in outcomes if o.done_s is not None), default=0.0)
    return max(last_arrival, last_answer, 1e-9)


@dataclass
class BenchReport:
    url: str
    model: str
    slo_ms: float
    requests: int
    offered_rps: float
    """Requests per second of the arrival window."""
    run_s: float
    results: int
    within_slo: int
    goodput_rps: float
    throughput_rps: float
    latency_ms: dict[str, float | None]
    """Client-side latency of results: p50, p95, p99, mean, max (milliseconds)."""
    exits: dict[str, int]
    exit_share: dict[str, float]
    agreement: float | None
    """Share of results that agree with the full model's answer (None: no results)."""
    accuracy: float | None
    """Share of results with a known true label that are correct."""
    full_model_accuracy: float | None
    """The full model's accuracy on those same inputs."""
    accuracy_n: int
    errors: dict[str, int]
    by_status: dict[str, int]
    lost: int
    overload_without_retry_after: int
    send_lag_ms: dict[str, float | None]
    """How late the generator sent requests against the trace (open-loop fidelity)."""
    within_slo_share: float = 0.0
    """Requests answered within the SLO / requests (errors and lost requests are misses)."""
    last_third_within_slo_share: float | None = None
    """The same over the requests scheduled in the last third of the arrival window (None: none there)."""
    error_samples: dict[str, list[str]] = field(default_factory=dict)
    run: dict[str, Any] = field(default_factory=dict)
    """How the run was set up: trace, length mode, speed or rps, seed, window, inputs."""
    router: dict[str, Any] | None = None
    """The router's own /v1/observations for the window in progress at the end (when reachable)."""

    @property
    def latency(self) -> dict[str, float | None]:
        """Same as `latency_ms` (keys p50, p95, p99, mean, max; milliseconds)."""
        return self.latency_ms

    @property
    def error_total(self) -> int:
        return sum(self.errors.values())

    @property
    def accounted(self) -> int:
        return self.results + self.error_total + self.lost

    @property
    def agreement_drop(self) -> float | None:
        return None if self.agreement is None else 1.0 - self.agreement

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["error_total"] = self.error_total
        out["accounted"] = self.accounted
        out["agreement_drop"] = self.agreement_drop
        return out

    # ------------------------------------------------------------------ display

    def tables(self) -> list[Table]:
        from rich.table import Table

        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v:.1f}"

        def pct(v: float | None) -> str:
            return "-" if v is None else f"{100 * v:.2f} %"

        title = f"bench {self.model} at {self.url}  ({self.run.get('trace_name', '')}, SLO {self.slo_ms:g} ms)"
        summary = Table(title=title, show_header=True)
        summary.add_column("measure")
        summary.add_column("value", justify="right")
        rows = [
            ("requests sent", str(self.requests)),
            ("offered load", f"{self.offered_rps:.2f} rps"),
            ("run time", f"{self.run_s:.2f} s"),
            ("results", str(self.results)),
            ("goodput (within SLO)", f"{self.goodput_rps:.2f} rps"),
            ("throughput", f"{self.throughput_rps:.2f} rps"),
            (
                "latency p50 / p95 / p99",
                f"{ms(self.latency_ms['p50'])} / {ms(self.latency_ms['p95'])} / {ms(self.latency_ms['p99'])} ms",
            ),
            ("within SLO", f"{self.within_slo} ({pct(self.within_slo / self.results if self.results else None)})"),
            (
                "requests within SLO (last third)",
                f"{pct(self.within_slo_share)} ({pct(self.last_third_within_slo_share)})",
            ),
            ("agreement with full model", pct(self.agreement)),
            (
                "accuracy vs labels (full model)",
                f"{pct(self.accuracy)} ({pct(self.full_model_accuracy)}) on {self.accuracy_n}",
            ),
            ("errors", str(self.error_total)),
            ("lost (no answer)", f"[red]{self.lost}[/red]" if self.lost else "0"),
            ("generator lag p99 / max", f"{ms(self.send_lag_ms['p99'])} / {ms(self.send_lag_ms['max'])} ms"),
        ]
        for name, value in rows:
            summary.add_row(name, value)
        exits = Table(title="exits (share of results)")
        exits.add_column("ramp")
        exits.add_column("results", justify="right")
        exits.add_column("share", justify="right")
        for ramp, count in self.exits.items():
            exits.add_row(ramp, str(count), pct(self.exit_share.get(ramp)))
        errors = Table(title="errors and lost requests")
        errors.add_column("kind")
        errors.add_column("count", justify="right")
        errors.add_column("example")
        for kind, count in self.errors.items():
            samples = self.error_samples.get(kind) or [""]
            errors.add_row(kind, str(count), samples[0][:100])
        errors.add_row("lost", str(self.lost), (self.error_samples.get("lost") or [""])[0][:100])
        if self.by_status:
            errors.add_row("by HTTP status", "", ", ".join(f"{k}: {v}" for k, v in sorted(self.by_status.items())))
        if self.overload_without_retry_after:
            errors.add_row("[red]overload without Retry-After[/red]", str(self.overload_without_retry_after), "")
        return [summary, exits, errors]


def summarize(
    outcomes: Sequence[Outcome],
    reference: Sequence[str],
    truth: Sequence[str | None],
    *,
    slo_ms: float,
    url: str = "",
    model: str = "",
    ramp_order: Sequence[str] = (),
    window_s: float | None = None,
    run: dict[str, Any] | None = None,
    samples_per_kind: int = 3,
) -> BenchReport:
    """The report of a run: `outcomes[i]` answers request `outcomes[i].index`, checked against `reference`/`truth`.

    `window_s` is the length of the arrival window (the run's `duration`); without it the window
    ends at the last arrival.
    """
    if slo_ms <= 0:
        raise ValueError(f"slo_ms must be > 0, got {slo_ms}")
    indices = [o.index for o in outcomes]
    if len(set(indices)) != len(indices):
        raise ValueError("outcomes name some request twice; each request must end exactly once")
    if any(not 0 <= i < len(reference) for i in indices):
        raise ValueError(f"outcome index out of range for {len(reference)} references")
    n = len(outcomes)
    slo_s = slo_ms / 1000.0
    ok = [o for o in outcomes if o.kind == "ok"]
    latencies = [lat for o in ok if (lat := o.latency_s) is not None]  # every answer has its latency
    within = sum(1 for lat in latencies if lat <= slo_s)
    run_s = max(run_seconds(outcomes), window_s or 0.0)
    span = window_s if window_s else max((o.scheduled_s for o in outcomes), default=0.0)
    offered = n / span if span > 0 else float(n)

    counts = Counter(o.ramp for o in ok if o.ramp is not None)  # every answer names its ramp
    order = [r for r in ramp_order if r in counts] + sorted(r for r in counts if r not in ramp_order)
    exits = {r: counts[r] for r in order}
    exit_share = {r: counts[r] / len(ok) for r in order} if ok else {}

    agree = [o.label == reference[o.index] for o in ok]
    known = [o for o in ok if truth[o.index] is not None]
    accuracy = float(np.mean([o.label == truth[o.index] for o in known])) if known else None
    full_accuracy = float(np.mean([reference[o.index] == truth[o.index] for o in known])) if known else None

    kinds = Counter(o.kind for o in outcomes)
    errors = {k: kinds.get(k, 0) for k in ERROR_KINDS}
    by_status = Counter(str(o.status) for o in outcomes if o.status is not None and o.status != 200)
    samples: dict[str, list[str]] = {}
    for o in outcomes:
        if o.kind != "ok" and o.error and len(samples.setdefault(o.kind, [])) < samples_per_kind:
            samples[o.kind].append(f"{o.status or ''} {o.error}".strip())
    lags = [max(0.0, o.sent_s - o.scheduled_s) for o in outcomes]
    return BenchReport(
        url=url,
        model=model,
        slo_ms=slo_ms,
        requests=n,
        offered_rps=offered,
        run_s=run_s,
        results=len(ok),
        within_slo=within,
        goodput_rps=within / run_s,
        throughput_rps=len(ok) / run_s,
        latency_ms=latency_summary(latencies),
        exits=exits,
        exit_share=exit_share,
        agreement=float(np.mean(agree)) if agree else None,
        accuracy=accuracy,
        full_model_accuracy=full_accuracy,
        accuracy_n=len(known),
        errors=errors,
        by_status=dict(by_status),
        lost=kinds.get("lost", 0),
        overload_without_retry_after=sum(1 for o in outcomes if o.kind == "overload" and not o.retry_after),
        send_lag_ms=latency_summary(lags),
        within_slo_share=within / n if n else 0.0,
        last_third_within_slo_share=_last_third_share(outcomes, slo_s, span),
        error_samples=samples,
        run=dict(run or {}),
    )


def _last_third_share(outcomes: Sequence[Outcome], slo_s: float, span: float) -> float | None:
    """The share of the requests scheduled in the last third of the arrival window (`span` seconds) that
    were answered within the SLO (None when no request was scheduled there)."""
    last_third = [o for o in outcomes if o.scheduled_s >= span * 2 / 3]
    within = sum(1 for o in last_third if o.kind == "ok" and o.latency_s is not None and o.latency_s <= slo_s)
    return within / len(last_third) if last_third else None
