"""The drift loop's decisions, as pure functions of (plan, observations, limits, state).

Statistics and thresholds (spec.planner.drift):

- length drift: total-variation distance TV(p, q) = 1/2 * sum |p_i - q_i| between the observed
  share of requests per bucket and the plan's `length_histogram`; re-plan (`length-drift`) when
  TV > lengthScore (default 0.15).
- survival drift: the survival curve is forecast one window ahead by the planner's forecaster
  (exitplan.planner.forecast: ARIMA per ramp, falling back as it decides on short series; an
  EWMA with alpha = 0.5 here if that module is absent); re-plan (`survival-drift`) when the max abs
  difference from the plan's `survival` exceeds survivalError (default 0.1).
- SLO risk: re-plan (`slo-risk`) when the window's p99 exceeds sloRisk x slo.latencyMs.

A window with fewer than MIN_REQUESTS arrivals (length test) or answered requests (survival and
latency tests) is too small for that test and raises nothing.
Precedence when several limits are crossed: slo-risk, length-drift, survival-drift.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence

from exitplan.api.observations import Observations
from exitplan.api.plan import Cell, Plan
from exitplan.api.resources import DriftLimits
from exitplan.operator.status import DriftReport, now_iso

MIN_REQUESTS = 50
EWMA_ALPHA = 0.5


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


def forecast_survival(history: Sequence[Sequence[float]], alpha: float = EWMA_ALPHA) -> list[float]:
    """One-window-ahead survival forecast from the windows so far (oldest first): the planner's
    forecaster (exitplan.planner.forecast, ARIMA per ramp) when importable, else an EWMA."""
    usable = [list(h) for h in history if h]
    if not usable:
        return []
    usable = [h for h in usable if len(h) == len(usable[-1])]  # a new ramp set restarts the series
    try:
        from exitplan.planner.forecast import forecast_survival as planner_forecast
    except ImportError:
        planner_forecast = None
    if planner_forecast is not None:
        return [float(x) for x in planner_forecast(usable)]
    level = usable[0]
    for window in usable[1:]:
        level = [alpha * w + (1 - alpha) * s for w, s in zip(window, level)]
    return level


def arrivals(obs: Observations) -> int:
    """Requests that arrived in the window (the length histogram counts each at dispatch)."""
    return int(sum(obs.length_histogram))


def assess(plan: Plan, obs: Observations, limits: DriftLimits, slo_latency_ms: float,
           survival_history: Sequence[Sequence[float]]) -> DriftReport:
    """Score one observation window against the plan; `trigger` names the re-plan reason or ''.

    The length test counts arrivals (a plan short of capacity for the new lengths answers fewer
    requests, which must not hide the shift); survival and latency count answered requests."""
    window = max(obs.until - obs.since, 1e-9)
    report = DriftReport(observed_at=now_iso(), p99_ms=obs.latency.p99_ms, requests=obs.requests,
                         goodput_rps=obs.within_slo / window)
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
    now = now or dt.datetime.now(dt.timezone.utc)
    return max(0.0, cooldown_seconds - (now - then).total_seconds())


def _key(cell: Cell) -> tuple[int, int, str]:
    return (cell.split, cell.bucket, cell.pool)


def moved_replicas(old: Plan, new: Plan) -> int:
    """Worker replicas a switch from `old` to `new` starts or stops (each move counts once)."""
    before = {_key(c): c.replicas for c in old.cells}
    after = {_key(c): c.replicas for c in new.cells}
    delta = sum(abs(after.get(k, 0) - before.get(k, 0)) for k in set(before) | set(after))
    return math.ceil(delta / 2)


def limit_moves(old: Plan, new: Plan, max_fraction: float) -> tuple[Plan, int]:
    """The step toward `new` that moves at most max_fraction of `old`'s worker replicas (at least
    one), and how many moves remain after it. Steps keep `new`'s splits, buckets, thresholds and
    curves; only replica counts are interpolated, so a step is a valid plan of the same shape.
    A new plan with another split structure cannot be interpolated and is taken whole."""
    same_shape = [s.model_dump() for s in old.splits] == [s.model_dump() for s in new.splits]
    total = sum(c.replicas for c in old.cells)
    budget = max(1, math.floor(max_fraction * total))
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
