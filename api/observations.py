"""What a router reports for one observation window (`GET /v1/observations`).

The operator's drift loop and the planner read it; the router fills it. Counts are for the window
that ended at `until`; the router keeps the last complete window and the one in progress.
"""

from __future__ import annotations

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
    plan_hash: str = ""
