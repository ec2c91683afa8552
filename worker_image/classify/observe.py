"""The router's observation windows and shadow-sampled feedback (pure bookkeeping, no I/O).

`WindowStats` accumulates one window of answers (exit ramp, latency, ideal bucket, errors; per bucket
that answered: answers, within the SLO, latency; per ideal bucket: overload refusals; per bucket: the
capacity in use, sampled) and rolls over into an `Observations` document. `FeedbackRing` keeps the last N shadow-sampled inputs
(confidence and answer at every exit ramp, and the full model's answer): the window format of
`exitplan tune` and the planner's threshold tuner.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

import numpy as np

from exitplan.api.observations import (
    LATENCY_EDGES_MS,
    BucketObservations,
    ErrorCounts,
    LatencySummary,
    Observations,
    RampAgreement,
    overall_agreement,
    wilson,
)
from exitplan.worker_image.control_bodies import FeedbackArrays


@dataclass
class WindowStats:
    service: str
    model: str
    ramps: list[str]
    buckets: list[int]
    since: float = field(default_factory=time.time)
    answered: int = 0
    within_slo: int = 0
    exit_counts: np.ndarray = field(init=False)
    length_counts: np.ndarray = field(init=False)
    latencies: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    agree: np.ndarray = field(init=False)
    samples: np.ndarray = field(init=False)
    bucket_answered: np.ndarray = field(init=False)
    bucket_within_slo: np.ndarray = field(init=False)
    bucket_refused: np.ndarray = field(init=False)
    bucket_latencies: list[list[float]] = field(init=False)
    bucket_load_seconds: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.exit_counts = np.zeros(len(self.ramps) + 1, dtype=np.int64)
        self.length_counts = np.zeros(len(self.buckets), dtype=np.int64)
        self.agree = np.zeros(len(self.ramps), dtype=np.int64)
        self.samples = np.zeros(len(self.ramps), dtype=np.int64)
        self.bucket_answered = np.zeros(len(self.buckets), dtype=np.int64)
        self.bucket_within_slo = np.zeros(len(self.buckets), dtype=np.int64)
        self.bucket_refused = np.zeros(len(self.buckets), dtype=np.int64)
        self.bucket_latencies = [[] for _ in self.buckets]
        self.bucket_load_seconds = np.zeros(len(self.buckets), dtype=np.float64)

    def record_length(self, bucket_index: int) -> None:
        if bucket_index >= 0:
            self.length_counts[bucket_index] += 1

    def record_answer(self, ramp_index: int, latency_s: float, within_slo: bool, bucket_index: int = -1) -> None:
        """`ramp_index` = position in `ramps`, or len(ramps) for the final head; `bucket_index`: the
        bucket that answered (-1: not counted per bucket)."""
        self.answered += 1
        self.within_slo += within_slo
        self.exit_counts[ramp_index] += 1
        self.latencies.append(latency_s)
        if 0 <= bucket_index < len(self.buckets):
            self.bucket_answered[bucket_index] += 1
            self.bucket_within_slo[bucket_index] += within_slo
            self.bucket_latencies[bucket_index].append(latency_s)

    def record_refused(self, ideal: list[int] | tuple[int, ...]) -> None:
        """Inputs refused for overload, per ideal bucket (-1: none holds the input; not counted)."""
        for b in ideal:
            if 0 <= b < len(self.buckets):
                self.bucket_refused[b] += 1

    def record_load(self, loads: list[float], interval_s: float) -> None:
        """One sample of each bucket's capacity in use (outstanding / capacity), standing for
        `interval_s` seconds; a bucket without a ready pod (inf) adds nothing."""
        for b, load in enumerate(loads[: len(self.buckets)]):
            if np.isfinite(load):
                self.bucket_load_seconds[b] += load * interval_s

    def record_error(self, reason: str, count: int = 1) -> None:
        self.errors[reason] = self.errors.get(reason, 0) + count

    def record_feedback(self, ramp_index: int, agrees: bool) -> None:
        if ramp_index < len(self.ramps):
            self.samples[ramp_index] += 1
            self.agree[ramp_index] += agrees

    def agreement_summary(
        self, saving_ms: np.ndarray, cost_ms: np.ndarray, thresholds: dict[str, float]
    ) -> tuple[list[RampAgreement], float, float, float]:
        """Per-ramp agreement with Wilson intervals and utility, plus the overall estimate and its interval."""
        total = int(self.exit_counts.sum())
        reached = total - np.concatenate([[0], np.cumsum(self.exit_counts[:-1])])
        per_ramp = []
        overall, low, high = overall_agreement(self.exit_counts.tolist(), self.agree.tolist(), self.samples.tolist())
        for r, name in enumerate(self.ramps):
            p, lo, hi = wilson(int(self.agree[r]), int(self.samples[r]))
            active = thresholds.get(name, 2.0) <= 1.0
            saved = self.exit_counts[r] * (saving_ms[r] if r < len(saving_ms) else 0.0)
            added = (reached[r] - self.exit_counts[r]) * (cost_ms[r] if r < len(cost_ms) and active else 0.0)
            per_ramp.append(
                RampAgreement(
                    ramp=name,
                    samples=int(self.samples[r]),
                    agree=int(self.agree[r]),
                    ci_low=lo,
                    ci_high=hi,
                    utility_ms=float((saved - added) / total) if total else 0.0,
                )
            )
        return per_ramp, float(overall), float(low), float(high)

    def observations(
        self,
        until: float,
        load: dict[str, float],
        thresholds: dict[str, float],
        plan_hash: str,
        saving_ms: np.ndarray | None = None,
        cost_ms: np.ndarray | None = None,
        thresholds_version: int | None = None,
    ) -> Observations:
        total = max(int(self.exit_counts.sum()), 1)
        survival = (1.0 - np.cumsum(self.exit_counts[:-1]) / total).tolist() if self.answered else []
        lat = np.asarray(self.latencies) * 1000.0
        latency = (
            LatencySummary(
                p50_ms=float(np.percentile(lat, 50)),
                p95_ms=float(np.percentile(lat, 95)),
                p99_ms=float(np.percentile(lat, 99)),
                max_ms=float(lat.max()),
            )
            if lat.size
            else LatencySummary()
        )
        zeros = np.zeros(len(self.ramps))
        per_ramp, overall, low, high = self.agreement_summary(
            zeros if saving_ms is None else saving_ms, zeros if cost_ms is None else cost_ms, thresholds
        )
        per_bucket = {
            str(bucket): BucketObservations(
                requests=int(self.bucket_answered[b]),
                within_slo=int(self.bucket_within_slo[b]),
                refused=int(self.bucket_refused[b]),
                p99_ms=float(np.percentile(self.bucket_latencies[b], 99)) * 1000.0 if self.bucket_latencies[b] else 0.0,
                load_seconds=float(self.bucket_load_seconds[b]),
            )
            for b, bucket in enumerate(self.buckets)
        }
        known = set(ErrorCounts.model_fields)
        errors = ErrorCounts(**{k: v for k, v in self.errors.items() if k in known})
        return Observations(
            service=self.service,
            model=self.model,
            since=self.since,
            until=until,
            requests=self.answered,
            within_slo=self.within_slo,
            errors=errors,
            ramps=list(self.ramps),
            exit_counts=self.exit_counts.tolist(),
            survival=survival,
            length_buckets=list(self.buckets),
            length_histogram=self.length_counts.tolist(),
            latency=latency,
            latency_histogram=np.bincount(
                np.searchsorted(LATENCY_EDGES_MS, lat, side="left"), minlength=len(LATENCY_EDGES_MS) + 1
            ).tolist(),
            load=load,
            per_bucket=per_bucket,
            agreement=per_ramp,
            agreement_overall=overall,
            agreement_ci_low=low,
            agreement_ci_high=high,
            thresholds=dict(thresholds),
            thresholds_version=thresholds_version,
            plan_hash=plan_hash,
        )


class FeedbackRing:
    """The last `capacity` shadow-sampled inputs, as arrays (conf, pred [N, R]; final [N])."""

    def __init__(self, n_ramps: int, capacity: int = 4096) -> None:
        self.ring = secrets.token_hex(8)
        """This ring's identity: a reader that names it with a sample number gets only the samples after it."""
        self.conf = np.zeros((capacity, n_ramps), dtype=np.float32)
        self.pred = np.zeros((capacity, n_ramps), dtype=np.int64)
        self.final = np.zeros(capacity, dtype=np.int64)
        self.size = 0
        self.next = 0
        self.added = 0

    def add(self, conf: list[float | None], pred: list[int | None], final: int) -> bool:
        """Store one sample; False (and nothing stored) if a ramp's value is missing or not finite."""
        if len(conf) != self.conf.shape[1] or any(c is None for c in conf) or any(p is None for p in pred):
            return False
        c = np.asarray(conf, dtype=np.float32)
        if not np.isfinite(c).all():
            return False
        i = self.next
        self.conf[i], self.pred[i], self.final[i] = c, np.asarray(pred, dtype=np.int64), final
        self.next = (i + 1) % len(self.final)
        self.size = min(self.size + 1, len(self.final))
        self.added += 1
        return True

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self.size < len(self.final):
            return self.conf[: self.size].copy(), self.pred[: self.size].copy(), self.final[: self.size].copy()
        order = np.r_[self.next : len(self.final), 0 : self.next]
        return self.conf[order], self.pred[order], self.final[order]

    def window(
        self,
        saving_ms: np.ndarray,
        cost_ms: np.ndarray,
        last: int | None = None,
        after: tuple[str, int] | None = None,
    ) -> FeedbackArrays:
        """The stored samples (the most recent `last` of them) in the `exitplan tune` window format, numbered
        (`added`: the newest one's number; `ring`: this ring's). `after` (a ring and a sample number a reader
        already holds, this ring's): only the samples after it (at most `last`); another ring's, or a number
        this ring never reached: as without it."""
        conf, pred, final = self.arrays()
        take = last
        if after is not None and after[0] == self.ring and 0 <= after[1] <= self.added:
            new = self.added - after[1]
            take = new if take is None else min(take, new)
        if take is not None:
            start = max(0, len(final) - take)
            conf, pred, final = conf[start:], pred[start:], final[start:]
        return FeedbackArrays(conf, pred, final, saving_ms, cost_ms, self.added, self.ring)
