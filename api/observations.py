"""What a router reports for one observation window (`GET /v1/observations`).

The operator's drift loop and the planner read it; the router fills it. Counts are for the window
that ended at `until`; the router keeps the last complete window and the one in progress.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Annotated

from pydantic import Field

from exitplan.api.resources import Model


class LatencySummary(Model):
    p50_ms: float = 0.0
    p95_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0


class ErrorCounts(Model):
    bad_request: int = 0
    overload: int = 0
    deadline: int = 0
    worker: int = 0


class RampAgreement(Model):
    """Shadow-sampled feedback for one ramp: exited answers compared with the full model's."""

    ramp: str
    samples: Annotated[int, Field(ge=0)] = 0
    agree: Annotated[int, Field(ge=0)] = 0
    ci_low: float = 0.0
    """95 % Wilson interval of the ramp's agreement (0..1 when there are no samples)."""
    ci_high: float = 1.0
    utility_ms: float = 0.0
    """Per answered input: latency this ramp saved (inputs that exited there) minus latency it added
    (inputs that passed it while it was active)."""


class BucketObservations(Model):
    """One length bucket's part of the window: what its cells (the plan's workers of that bucket, over
    every split and pool) answered. The figures add over routers and over consecutive windows, except
    p99_ms (the max is kept)."""

    requests: Annotated[int, Field(ge=0)] = 0
    """Inputs this bucket answered with a result (the bucket that took them, after any demotion)."""
    within_slo: Annotated[int, Field(ge=0)] = 0
    """Of those, answered within the SLO."""
    refused: Annotated[int, Field(ge=0)] = 0
    """Inputs refused for overload (429: no bucket could answer them within the SLO) whose ideal
    bucket this is."""
    p99_ms: float = 0.0
    """p99 latency of the answers this bucket gave."""
    load_seconds: float = 0.0
    """Capacity in use integrated over the window: `load` (outstanding inputs / capacity) sampled
    each second, times the interval; / (until - since) is the mean capacity in use."""


LATENCY_EDGES_MS: tuple[float, ...] = tuple(round(0.5 * 1.1**i, 4) for i in range(131))
"""Upper edges of the latency histogram's buckets, 0.5 ms to about 127 s, 10 % apart (a quantile read
from it is within 10 % of the exact one); one more bucket holds the answers above the last edge."""


def latency_bucket_counts(latencies_ms: Sequence[float]) -> list[int]:
    """`latencies_ms` counted per bucket of LATENCY_EDGES_MS (len(LATENCY_EDGES_MS) + 1 entries)."""
    counts = [0] * (len(LATENCY_EDGES_MS) + 1)
    for ms in latencies_ms:
        counts[bisect.bisect_left(LATENCY_EDGES_MS, ms)] += 1
    return counts


def histogram_quantile_ms(counts: Sequence[int], q: float) -> float:
    """The `q` quantile of a latency histogram over LATENCY_EDGES_MS (linear within the bucket that holds
    it; the last edge for the open bucket above it); 0 when it is empty."""
    return histogram_quantiles_ms(counts, (q,))[0]


def histogram_quantiles_ms(counts: Sequence[int], qs: Sequence[float]) -> list[float]:
    """`histogram_quantile_ms` of each of `qs` (ascending), in one pass over the histogram."""
    total = sum(counts)
    if total <= 0:
        return [0.0] * len(qs)
    out: list[float] = []
    pending, seen = [q * total for q in qs], 0
    for i, c in enumerate(counts):
        while c and pending and seen + c >= pending[0]:
            rank = pending.pop(0)
            if i >= len(LATENCY_EDGES_MS):
                out.append(LATENCY_EDGES_MS[-1])
            else:
                low = LATENCY_EDGES_MS[i - 1] if i else 0.0
                out.append(low + (LATENCY_EDGES_MS[i] - low) * max(0.0, rank - seen) / c)
        if not pending:
            return out
        seen += c
    return out + [LATENCY_EDGES_MS[-1]] * len(pending)


class Observations(Model):
    service: str
    model: str
    since: float
    """Window start, seconds since the epoch."""
    until: float
    """Window end, seconds since the epoch."""
    requests: Annotated[int, Field(ge=0)] = 0
    """Requests answered with a result in the window."""
    within_slo: Annotated[int, Field(ge=0)] = 0
    """Of those, answered within the SLO (goodput = within_slo / (until - since))."""
    errors: ErrorCounts = Field(default_factory=ErrorCounts)
    ramps: list[str] = Field(default_factory=list)
    """Exit ramps in block order (the final head is not listed)."""
    exit_counts: list[int] = Field(default_factory=list)
    """Answers per exit ramp, then one more entry for the final head: len(ramps) + 1 entries."""
    survival: list[float] = Field(default_factory=list)
    """Fraction of answered inputs still running after each exit ramp: len(ramps) entries."""
    length_buckets: list[int] = Field(default_factory=list)
    length_histogram: list[int] = Field(default_factory=list)
    """Requests per ideal bucket (the smallest bucket that holds the input)."""
    latency: LatencySummary = Field(default_factory=LatencySummary)
    latency_histogram: list[int] = Field(default_factory=list)
    """Answers per latency bucket (LATENCY_EDGES_MS; empty from a router that does not count them): what
    lets the operator merge routers' and consecutive windows' p99 from their counts (operator/drift.py)."""
    load: dict[str, float] = Field(default_factory=dict)
    """Per bucket (as a string key): outstanding inputs / capacity at the end of the window."""
    per_bucket: dict[str, BucketObservations] = Field(default_factory=dict)
    """Per bucket (as a string key): answered, within the SLO, refused, p99 and capacity in use over
    the window (what the operator compares with the plan's goodput: operator/plan_accuracy.py)."""
    agreement: list[RampAgreement] = Field(default_factory=list)
    agreement_overall: float = 1.0
    """Estimated agreement of all answers with the full model: per exit ramp the shadow agreement
    weighted by the answers it gave; answers of the final head agree by definition."""
    agreement_ci_low: float = 0.0
    agreement_ci_high: float = 1.0
    thresholds: dict[str, float] = Field(default_factory=dict)
    """The thresholds in force at the end of the window."""
    thresholds_version: Annotated[int, Field(ge=0)] | None = None
    """Their version (worker_image/threshold_set.py); None from a router that predates it. What a threshold push
    follows (the version after it), so that a re-tune need not ask the routers for it again."""
    plan_hash: str = ""


def overall_agreement(
    exit_counts: Sequence[int], agree: Sequence[int], samples: Sequence[int]
) -> tuple[float, float, float]:
    """(estimate, low, high) of all answers' agreement with the full model: per exit ramp its shadow
    agreement (Wilson interval) weighted by the answers it gave; the final head's (the last exit count)
    agree by definition. (1, 1, 1) with no answers."""
    return overall_from(exit_counts, [wilson(int(a), int(n)) for a, n in zip(agree, samples)])


def overall_from(
    exit_counts: Sequence[int], intervals: Sequence[tuple[float, float, float]]
) -> tuple[float, float, float]:
    """overall_agreement from each exit ramp's (estimate, low, high) already computed."""
    total = sum(exit_counts)
    overall = low = high = 1.0
    if total:
        for count, (p, lo, hi) in zip(exit_counts, intervals):
            share = count / total
            overall -= share * (1 - p)
            low -= share * (1 - lo)
            high -= share * (1 - hi)
    return float(overall), float(low), float(high)


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float, float]:
    """(estimate, low, high) of a proportion: the Wilson score interval; (1, 0, 1) with no samples. Successes
    beyond `n` (counts that do not add up: a router's windows read across its restart) count as `n`."""
    if n <= 0:
        return 1.0, 0.0, 1.0
    p = min(1.0, max(0.0, successes / n))
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return p, max(0.0, centre - half), min(1.0, centre + half)
