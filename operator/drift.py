"""The drift loop's statistics and re-plan steps, as pure functions of (plan, observations, limits);
what the loop does about them (re-plan, hold, propose, re-tune) is drift_policy.decide's.

Statistics and thresholds (spec.planner.drift):

- length drift: total-variation distance TV(p, q) = 1/2 * sum |p_i - q_i| between the observed
  share of requests per bucket and the plan's `length_histogram`; re-plan (`length-drift`) when
  TV > lengthScore (default 0.15).
- survival drift: the survival curve is forecast one window ahead by the planner's forecaster
  (exitplan.planner.forecast: AR(1) in closed form, every ramp at once, falling back to an EWMA on
  short or flat series); re-plan (`survival-drift`) when the max abs difference from the plan's
  `survival` exceeds survivalError (default 0.1).
- SLO risk: re-plan (`slo-risk`) when the window's p99 exceeds sloRisk x slo.latencyMs.

A window with fewer than MIN_REQUESTS arrivals (length test) or answered requests (survival and
latency tests) is too small for that test and raises nothing.

What is judged (driftloop.py): the drift loop reads each router CHECKS_PER_PERIOD times a period (the
operator's setting, guards.Settings.drift_reads) and keeps only what arrived since its last read
(`since_last`: the router's counters of the window in progress less what the previous read saw, across a
window roll); the judged window is the newest of those slices covering at least half a period and
MIN_REQUESTS arrivals (`recent`). A shift therefore fills the judged window half a period after it starts
(sooner when its share alone crosses the limit), not after a whole router window has closed and been read.
Precedence when several limits are crossed: slo-risk, length-drift, survival-drift; then
plan-mismatch (plan_accuracy.py: measured goodput persistently off the plan's under load; driftloop.py
adds it to a report that raised nothing else).
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence

import numpy as np

from exitplan.api.observations import (
    LATENCY_EDGES_MS,
    BucketObservations,
    ErrorCounts,
    Observations,
    RampAgreement,
    histogram_quantiles_ms,
    overall_from,
    wilson,
)
from exitplan.api.plan import Cell, Plan
from exitplan.api.resources import DriftLimits
from exitplan.operator.status import DriftReport, iso_ms, now_iso
from exitplan.planner.forecast import forecast_survival as planner_forecast

MIN_REQUESTS = 50
CHECKS_PER_PERIOD = 2
"""Router reads per spec.planner.periodSeconds by default (the operator's setting: guards.Settings.drift_reads;
bounded below by the timer tick). Two keep a length shift's re-plan within one period of its start plus the plan
and the apply (driftloop.py); four bring it to 3/4 of a period at ~1.4x the operator's CPU per period
(bench/operator_scale.py --reads: 200 services, BENCHMARKS.md issue 31)."""
MAX_CHECKS_PER_PERIOD = 12
"""The most reads per period the setting accepts."""
JUDGED_PERIODS = 0.5
"""The judged window covers at least this many periods (and MIN_REQUESTS arrivals)."""
KEEP_PERIODS = 2.0
"""Slices older than this many periods are dropped."""


def bucket_shares(obs: Observations, buckets: Sequence[int]) -> list[float]:
    """Observed share of requests per plan bucket (an observed bucket goes to the smallest plan
    bucket that holds its max length; lengths beyond the largest go to the largest)."""
    counts = [0.0] * len(buckets)
    for length, n in zip(obs.length_buckets or buckets, obs.length_histogram):
        idx = next((i for i, b in enumerate(buckets) if length <= b), len(buckets) - 1)
        counts[idx] += n
    total = sum(counts)
    return [c / total for c in counts] if total else counts


def tv_distance(p: Sequence[float], q: Sequence[float]) -> float:
    """Total-variation distance of two distributions over the same support (shorter one padded)."""
    n = max(len(p), len(q))
    p = list(p) + [0.0] * (n - len(p))
    q = list(q) + [0.0] * (n - len(q))
    return 0.5 * sum(abs(a - b) for a, b in zip(p, q))


def forecast_survival(history: Sequence[Sequence[float]]) -> list[float]:
    """One-window-ahead survival forecast from the windows so far (oldest first): the planner's default
    forecaster (exitplan.planner.forecast: AR(1) in closed form, every ramp at once)."""
    usable = [list(h) for h in history if h]
    if not usable:
        return []
    usable = [h for h in usable if len(h) == len(usable[-1])]  # a new ramp set restarts the series
    return [float(x) for x in planner_forecast(np.asarray(usable, dtype=np.float64))]


def since_last(windows: Sequence[Observations], seen: Observations | None) -> Observations | None:
    """What arrived after `seen` (the router's window in progress as the previous read saw it),
    given the router's windows now (its last closed one and the one in progress, any order).

    Counts within one router window only grow, so a window that started where `seen` started
    contributes its counts less `seen`'s; a later window contributes all of it; an earlier one
    nothing. None when nothing is new. With no `seen` (the first read) everything counts."""
    latest: dict[float, Observations] = {}  # one read per router window (the closed one may repeat the current)
    for w in windows:
        if w.since not in latest or w.until > latest[w.since].until:
            latest[w.since] = w
    parts = []
    for since, w in sorted(latest.items()):
        if seen is None or since > seen.since + 1e-6:
            parts.append(w)
        elif abs(since - seen.since) <= 1e-6 and w.until > seen.until:
            parts.append(subtract(w, seen))
    return combine(parts) if parts else None


# The windows combined or subtracted on every read of every service: built here field by field, from figures
# computed here (a generic deep copy, or pydantic's model_construct and attribute hooks per field, took most of
# a drift read's judging time). Every list, dict and model of a result is its own: a caller may change them.


def _window(base: Observations, **fields: object) -> Observations:
    """`base` with `fields` replaced, its lists, dicts and models copied (the result shares nothing with it)."""
    own = {
        "ramps": list(base.ramps),
        "length_buckets": list(base.length_buckets),
        "load": dict(base.load),
        "thresholds": dict(base.thresholds),
        "latency": base.latency.model_copy(),
    }
    for name in ("exit_counts", "survival", "length_histogram", "latency_histogram", "agreement"):
        if name not in fields:
            own[name] = list(getattr(base, name))
    if "errors" not in fields:
        own["errors"] = base.errors.model_copy()
    if "per_bucket" not in fields:
        own["per_bucket"] = {k: v.model_copy() for k, v in base.per_bucket.items()}
    return base.model_copy(update={**own, **fields})


def _latency(base: Observations, histogram: list[int] | None, p99_ms: float, max_ms: float) -> dict[str, object]:
    """The latency fields of a result: p50/p95/p99 read from `histogram` (all 0 when it is empty), or with no
    histogram `base`'s p50/p95 and `p99_ms` (an upper bound); `max_ms` either way."""
    if histogram is None:
        latency = base.latency.model_copy(update={"p99_ms": p99_ms, "max_ms": max_ms})
        return {"latency": latency, "latency_histogram": []}
    p50, p95, p99 = histogram_quantiles_ms(histogram, (0.50, 0.95, 0.99))
    latency = base.latency.model_copy(update={"p50_ms": p50, "p95_ms": p95, "p99_ms": p99, "max_ms": max_ms})
    return {"latency": latency, "latency_histogram": histogram}


def _agreement(base: Observations, exit_counts: list[int], agree: list[int], samples: list[int]) -> dict[str, object]:
    """The agreement fields of a result (per ramp and overall, with their intervals) from the shadow samples'
    counts and its exit counts, as a router computes them over its own (worker_image/classify/observe.py)."""
    intervals = [wilson(a, n) for a, n in zip(agree, samples)]
    fields: dict[str, object] = {
        "agreement": [
            RampAgreement(ramp=was.ramp, samples=n, agree=a, ci_low=low, ci_high=high, utility_ms=was.utility_ms)
            for a, n, was, (_, low, high) in zip(agree, samples, base.agreement, intervals)
        ]
    }
    if len(exit_counts) == len(intervals) + 1:
        overall = overall_from(exit_counts, intervals)
        fields.update(agreement_overall=overall[0], agreement_ci_low=overall[1], agreement_ci_high=overall[2])
    return fields


def _errors(windows: Sequence[Observations], sign: Sequence[int]) -> ErrorCounts:
    """The error counts of `windows` added with `sign` (+1 / -1 each), none below 0."""
    return ErrorCounts(
        **{k: max(0, sum(s * getattr(w.errors, k) for w, s in zip(windows, sign))) for k in ErrorCounts.model_fields}
    )


def subtract(new: Observations, old: Observations) -> Observations:
    """The part of router window `new` after `old`, an earlier read of the same window (same since):
    counts (per bucket too, and the capacity-in-use seconds) are differences; survival is recomputed
    from the survivor counts; p50/p95/p99 from the difference of the latency histograms and agreement
    from the difference of the shadow samples' counts (`new`'s own where either lacks them); load and
    thresholds are `new`'s."""
    requests = max(0, new.requests - old.requests)
    fields: dict[str, object] = {
        "since": old.until,
        "requests": requests,
        "within_slo": max(0, new.within_slo - old.within_slo),
        "errors": _errors((new, old), (1, -1)),
    }
    if len(new.length_histogram) == len(old.length_histogram):
        fields["length_histogram"] = [max(0, a - b) for a, b in zip(new.length_histogram, old.length_histogram)]
    exit_counts = list(new.exit_counts)
    if len(new.exit_counts) == len(old.exit_counts):
        exit_counts = [max(0, a - b) for a, b in zip(new.exit_counts, old.exit_counts)]
    fields["exit_counts"] = exit_counts
    if len(new.survival) == len(old.survival):
        fields["survival"] = [
            min(1.0, max(0.0, (a * new.requests - b * old.requests) / requests)) if requests else 0.0
            for a, b in zip(new.survival, old.survival)
        ]
    if len(new.latency_histogram) == len(old.latency_histogram) == len(LATENCY_EDGES_MS) + 1:
        histogram = [max(0, a - b) for a, b in zip(new.latency_histogram, old.latency_histogram)]
        fields.update(_latency(new, histogram, 0.0, new.latency.max_ms))
    if [a.ramp for a in new.agreement] == [a.ramp for a in old.agreement]:
        agree = [max(0, a.agree - b.agree) for a, b in zip(new.agreement, old.agreement)]
        samples = [max(0, a.samples - b.samples) for a, b in zip(new.agreement, old.agreement)]
        fields.update(_agreement(new, exit_counts, agree, samples))
    per_bucket = {}
    for key, now in new.per_bucket.items():
        was = old.per_bucket.get(key)
        per_bucket[key] = (
            now.model_copy()
            if was is None
            else BucketObservations(
                requests=max(0, now.requests - was.requests),
                within_slo=max(0, now.within_slo - was.within_slo),
                refused=max(0, now.refused - was.refused),
                p99_ms=now.p99_ms,
                load_seconds=max(0.0, now.load_seconds - was.load_seconds),
            )
        )
    fields["per_bucket"] = per_bucket
    return _window(new, **fields)


def combine(windows: Sequence[Observations]) -> Observations:
    """Several windows (slices in time, or routers) as one: counts add, survival is weighted by
    answered requests, p50/p95/p99 are read from the summed latency histograms (the max where a window
    has none, and per bucket), agreement is recomputed from the summed shadow samples' counts;
    thresholds, load and plan hash are the newest window's, the thresholds' version the highest (None when a window
    has none: a router that predates it)."""
    if len(windows) == 1:
        return windows[0]
    newest = max(windows, key=lambda w: w.until)
    n = len(newest.length_histogram)
    histogram = [sum(col) for col in zip(*(w.length_histogram for w in windows if len(w.length_histogram) == n))]
    n = len(newest.exit_counts)
    exit_counts = [sum(col) for col in zip(*(w.exit_counts for w in windows if len(w.exit_counts) == n))]
    fields: dict[str, object] = {
        "since": min(w.since for w in windows),
        "until": newest.until,
        "requests": sum(w.requests for w in windows),
        "within_slo": sum(w.within_slo for w in windows),
        "length_histogram": histogram,
        "exit_counts": exit_counts,
        "survival": pooled_survival(windows),
        "errors": _errors(windows, [1] * len(windows)),
        "per_bucket": combine_buckets(windows),
    }
    versions = [w.thresholds_version for w in windows]
    fields["thresholds_version"] = None if None in versions else max(v for v in versions if v is not None)
    counted = [w for w in windows if w.requests or w.latency_histogram]
    p99, top = max(w.latency.p99_ms for w in windows), max(w.latency.max_ms for w in windows)
    if counted and all(len(w.latency_histogram) == len(LATENCY_EDGES_MS) + 1 for w in counted):
        fields.update(_latency(newest, [sum(col) for col in zip(*(w.latency_histogram for w in counted))], p99, top))
    else:
        fields.update(_latency(newest, None, p99, top))  # a router without counts: p99 is the max (an upper bound)
    ramps = [a.ramp for a in newest.agreement]
    if all([a.ramp for a in w.agreement] == ramps for w in windows):
        agree = [sum(col) for col in zip(*([a.agree for a in w.agreement] for w in windows))]
        samples = [sum(col) for col in zip(*([a.samples for a in w.agreement] for w in windows))]
        fields.update(_agreement(newest, exit_counts, agree, samples))
    return _window(newest, **fields)


def span(windows: Sequence[Observations]) -> float:
    """Seconds from the earliest window's start to the newest one's end: `combine(windows)`'s span."""
    return max(w.until for w in windows) - min(w.since for w in windows)


def pooled_survival(windows: Sequence[Observations]) -> list[float]:
    """`combine(windows)`'s survival alone: each ramp's weighted by answered requests over the windows
    with the newest one's ramps (the newest one's when none answered)."""
    newest = max(windows, key=lambda w: w.until)
    k = len(newest.survival)
    total = sum(w.requests for w in windows if len(w.survival) == k)
    if not total or len(windows) == 1:
        return list(newest.survival)
    return [sum(w.survival[i] * w.requests for w in windows if len(w.survival) == k) / total for i in range(k)]


def pooled_arrivals(windows: Sequence[Observations]) -> int:
    """`arrivals(combine(windows))` without combining: the arrivals of the windows whose length histogram has
    the newest one's buckets."""
    n = len(max(windows, key=lambda w: w.until).length_histogram)
    return sum(arrivals(w) for w in windows if len(w.length_histogram) == n)


def combine_buckets(windows: Sequence[Observations]) -> dict[str, BucketObservations]:
    """The per-bucket figures of several windows: counts and capacity-in-use seconds add (over
    routers they add up to the service's outstanding inputs; over time, to its integral), p99 is the max."""
    keys = list(dict.fromkeys(key for w in windows for key in w.per_bucket))
    out: dict[str, BucketObservations] = {}
    for key in keys:
        parts = [w.per_bucket[key] for w in windows if key in w.per_bucket]
        out[key] = BucketObservations(
            requests=sum(p.requests for p in parts),
            within_slo=sum(p.within_slo for p in parts),
            refused=sum(p.refused for p in parts),
            p99_ms=max([0.0, *(p.p99_ms for p in parts)]),
            load_seconds=sum(p.load_seconds for p in parts),
        )
    return out


def recent(slices: Sequence[Observations], period_s: float) -> Observations | None:
    """The judged window: the newest slices (oldest first in `slices`) covering at least
    JUDGED_PERIODS periods and MIN_REQUESTS arrivals, or all of them when they cover less."""
    chosen: list[Observations] = []
    for piece in reversed(slices):
        chosen.append(piece)
        span = chosen[0].until - piece.since
        if span >= JUDGED_PERIODS * period_s and sum(arrivals(p) for p in chosen) >= MIN_REQUESTS:
            break
    return combine(chosen) if chosen else None


def after_change(
    slices: Sequence[Observations], plan: Plan, min_arrivals: int = MIN_REQUESTS // 2
) -> Observations | None:
    """The traffic after the change point: of the newest slices holding at least `min_arrivals`
    arrivals (1, 2, ... slices back), the run whose length histogram is furthest from the plan's
    (the CUSUM-style estimate of where the shift began). A length-drift re-plan sizes buckets for
    it rather than for the judged window, which mixes traffic from before the shift."""
    best, best_score, chosen = None, -1.0, []
    for piece in reversed(slices):
        chosen.append(piece)
        if sum(arrivals(p) for p in chosen) < min_arrivals:
            continue
        window = combine(chosen)
        score = tv_distance(bucket_shares(window, plan.buckets), plan.length_histogram)
        if score > best_score + 1e-9:
            best, best_score = window, score
    return best


def arrivals(obs: Observations) -> int:
    """Requests that arrived in the window (the length histogram counts each at dispatch)."""
    return int(sum(obs.length_histogram))


def assess(
    plan: Plan,
    obs: Observations,
    limits: DriftLimits,
    slo_latency_ms: float,
    survival_history: Sequence[Sequence[float]],
) -> DriftReport:
    """Score one observation window against the plan; `trigger` names the re-plan reason or ''.

    The length test counts arrivals (a plan short of capacity for the new lengths answers fewer
    requests, which must not hide the shift); survival and latency count answered requests."""
    window = max(obs.until - obs.since, 1e-9)
    goodput = obs.within_slo / window
    planned = plan.prediction.goodput_rps
    report = DriftReport(
        observed_at=now_iso(),
        p99_ms=obs.latency.p99_ms,
        requests=obs.requests,
        window_start=iso_ms(obs.since) if obs.since > 0 else "",
        window_end=iso_ms(obs.until) if obs.until > 0 else "",
        goodput_rps=goodput,
        goodput_ratio=goodput / planned if planned > 0 else 0.0,
    )
    if plan.length_histogram and arrivals(obs) >= MIN_REQUESTS:
        report.length_score = round(tv_distance(bucket_shares(obs, plan.buckets), plan.length_histogram), 4)
    if obs.requests >= MIN_REQUESTS:
        forecast = forecast_survival(list(survival_history) + [obs.survival])
        if plan.survival and forecast and len(forecast) == len(plan.survival):
            report.survival_error = round(max(abs(a - b) for a, b in zip(forecast, plan.survival)), 4)
        if obs.latency.p99_ms > limits.slo_risk * slo_latency_ms:
            report.trigger = "slo-risk"
    if not report.trigger and report.length_score > limits.length_score:
        report.trigger = "length-drift"
    elif not report.trigger and report.survival_error > limits.survival_error:
        report.trigger = "survival-drift"
    return report


def cooldown_left(last_replan: str, cooldown_seconds: int, now: dt.datetime | None = None) -> float:
    """Seconds until another re-plan may be applied (0 when none was applied yet)."""
    if not last_replan:
        return 0.0
    try:
        then = dt.datetime.fromisoformat(last_replan.replace("Z", "+00:00"))
    except ValueError:
        return 0.0
    now = now or dt.datetime.now(dt.UTC)
    return max(0.0, cooldown_seconds - (now - then).total_seconds())


def _key(cell: Cell) -> tuple[int, int, str]:
    return (cell.split, cell.bucket, cell.pool)


def moved_replicas(old: Plan, new: Plan) -> int:
    """Worker replicas a switch from `old` to `new` starts or stops (each move counts once). Across
    a change of layout every worker runs other blocks or buckets: all of them move."""
    if not same_layout(old, new):
        return max(sum(c.replicas for c in old.cells), sum(c.replicas for c in new.cells))
    before = {_key(c): c.replicas for c in old.cells}
    after = {_key(c): c.replicas for c in new.cells}
    delta = sum(abs(after.get(k, 0) - before.get(k, 0)) for k in set(before) | set(after))
    return math.ceil(delta / 2)


def same_layout(old: Plan, new: Plan) -> bool:
    """Same splits (block ranges) and buckets: replicas can move between the plans step by step."""
    return [s.model_dump() for s in old.splits] == [s.model_dump() for s in new.splits] and old.buckets == new.buckets


def move_budget(old: Plan, max_fraction: float) -> int:
    """Replica moves one step may make: max_fraction of `old`'s worker replicas, at least one."""
    return max(1, math.floor(max_fraction * sum(c.replicas for c in old.cells)))


def limit_moves(old: Plan, new: Plan, max_fraction: float) -> tuple[Plan, int]:
    """The step toward `new` that moves at most max_fraction of `old`'s worker replicas (at least
    one), and how many moves remain after it. Steps keep `new`'s splits, buckets, thresholds and
    curves; only replica counts are interpolated, so a step is a valid plan of the same shape.
    A new plan with another split structure or other buckets cannot be interpolated (the data
    plane runs one structure at a time; routers take new buckets on restart) and is taken whole."""
    same_shape = same_layout(old, new)
    budget = move_budget(old, max_fraction)
    moves = moved_replicas(old, new)
    if not same_shape or moves <= budget:
        return new, 0
    before = {_key(c): c.replicas for c in old.cells}
    frac = budget / moves
    cells = []
    for cell in new.cells:
        start = before.get(_key(cell), 0)
        step = start + int(round((cell.replicas - start) * frac))
        cells.append(cell.model_copy(update={"replicas": step}))
    step_keys = {_key(c) for c in new.cells}
    for cell in old.cells:  # cells the new plan drops shrink gradually too
        if _key(cell) not in step_keys and cell.bucket in new.buckets:
            remaining = cell.replicas - int(round(cell.replicas * frac))
            if remaining > 0:
                cells.append(cell.model_copy(update={"replicas": remaining}))
    step_plan = new.model_copy(update={"cells": cells})
    return step_plan, moved_replicas(step_plan, new)
