"""Is the plan right about the capacity it promises? The routers' measured goodput against the plan's
(condition PlanAccurate), as pure functions and a small per-service tracker (no I/O).

What is compared. The plan promises `prediction.goodputRps`: the service's capacity within the SLO at
the length mix it was sized for (`length_histogram`), the rate at which its tightest cells saturate.
Its share for bucket b, goodputRps x share_b, is the rate that bucket's cells (every split and pool of
the bucket) sustain at that point: a lower bound of their capacity at any mix, tight for the bucket
that limits the plan. The routers measure, per window and per bucket (api/observations.py
`perBucket`): answers, answers within the SLO, overload refusals, p99 and the capacity in use
(outstanding inputs / capacity, integrated over the window). Measured goodput = within SLO / window.

The rule, one window (at least drift.JUDGED_PERIODS periods and drift.MIN_REQUESTS arrivals):

- A measured goodput below the plan's says something only when the traffic pressed on the capacity:
  a bucket is *saturated* when at least SATURATED_SHARE of its inputs were refused (429) or answered
  late, or its mean capacity in use was at least SATURATED_LOAD. An idle service answers what it is
  sent, which may be far below any plan: not judged, whatever the ratio.
- **below**: a saturated bucket answered within the SLO less than (1 - TOLERANCE) x its share of the
  planned goodput. Sound at any mix (its share is a lower bound of what the plan expects that bucket to
  sustain). A router without per-bucket figures is judged for the service as a whole the same way.
- **above**: the service answered within the SLO more than (1 + TOLERANCE) x the planned goodput.
  Saturation is not needed here: a measured goodput is a lower bound of the capacity whether or not the
  service is saturated (saturated, it *is* the capacity), so above the plan is above it either way;
  saturated only makes the ratio exact rather than "at least". But the plan's figure holds at the
  plan's mix: at another mix the buckets that do not limit the plan have slack, and the same cells
  answer more with an accurate profile; more exits than planned do the same. So "above" is judged
  only when the window's length mix is within MIX_LIMIT (total variation) of the plan's and its
  survival within MIX_LIMIT of the plan's; otherwise the window is not judged (verdict "mix").
- **match**: saturated somewhere, neither below nor above: the plan's capacity held under real load.

The plan's figure is the solver's fluid rate (every replica busy with full batches), which a serving
path reaches only where batches fill and queues stay short: on CPU pools, or with few replicas, the
plan holds its SLO at a lower rate (planner/predict.py "as served"). So a window that reads *below* the
fluid rate is judged again against the plan's capacity as served (`plan_as_served`, simulated once per
plan, off the event loop, only then: 1-3 s of CPU) and that lower figure is the planned goodput from then
on for this plan; a plan whose simulation serves at least the fluid rate keeps the fluid rate.

Persistence: PlanAccurate turns False after WINDOWS consecutive judged windows off in the same
direction; a window that matches resets the count, one that cannot be judged (idle, too little
traffic, another mix) neither counts nor resets it. A new plan (or a new prediction) starts over.
Length drift, survival drift and SLO risk take precedence (drift.assess): they explain a gap before
the profile is suspected.

What follows a persistent mismatch (driftloop.py, through drift_policy.decide as trigger
`plan-mismatch`, with its cooldown and advisory rules): the pools of the cells that are off (below:
the cells of the short buckets; above: every pool of the plan) are re-profiled (profiling.reprofile:
a profiling Job whose ModelProfile, once published, re-plans the service with reason profile-change),
and the service is re-planned at once with reason `plan-mismatch` on those pools' profiles corrected
by the measured ratio (:func:`corrected_profiles`, a stopgap until the Job measures them again).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from exitplan.api.observations import BucketObservations, Observations
from exitplan.api.plan import Plan
from exitplan.api.resources import ModelProfileSpec
from exitplan.operator import drift
from exitplan.operator.status import ConditionType, ServiceStatus, set_condition

CONDITION: ConditionType = "PlanAccurate"
REASON = "plan-mismatch"
"""The re-plan reason a persistent mismatch raises."""
TOLERANCE = 0.30
"""Measured / planned goodput outside 1 +- TOLERANCE is off."""
WINDOWS = 3
"""Consecutive judged windows off (in one direction) before PlanAccurate turns False."""
SATURATED_SHARE = 0.01
"""A bucket with at least this share of its inputs refused or late is saturated (the SLO is a p99)."""
SATURATED_LOAD = 0.9
"""... or with at least this mean capacity in use."""
MIN_BUCKET_INPUTS = 20
"""A bucket with fewer inputs in the window is not judged."""
MIX_LIMIT = 0.05
"""`above` is judged only at the plan's mix: length TV distance and survival error at most this."""
CORRECTION_RANGE = (0.25, 4.0)
"""The measured ratio a profile correction takes, clamped to this range."""


@dataclass(frozen=True)
class BucketJudgement:
    bucket: int
    planned_rps: float
    """The bucket's share of the planned goodput."""
    measured_rps: float
    inputs: int
    """Answered plus refused."""
    saturated: str
    """Why the bucket counts as saturated ('' when it does not)."""

    @property
    def ratio(self) -> float:
        return self.measured_rps / self.planned_rps if self.planned_rps > 0 else 0.0

    def short(self) -> bool:
        return bool(self.saturated) and self.planned_rps > 0 and self.ratio < 1 - TOLERANCE

    def text(self) -> str:
        tail = f", saturated ({self.saturated})" if self.saturated else ""
        return f"bucket {self.bucket}: {self.measured_rps:.1f}/{self.planned_rps:.1f} rps = {self.ratio:.2f}{tail}"


@dataclass(frozen=True)
class Judgement:
    """One window compared with the plan."""

    verdict: str
    """below, above, match; or not judged: idle (not saturated), mix (above the plan at another mix than
    the plan's), quiet (too little traffic, or a plan without a prediction)."""
    planned_rps: float
    measured_rps: float
    saturated: str = ""
    """Why the service counts as saturated ('' when it does not)."""
    buckets: tuple[BucketJudgement, ...] = ()
    pools: tuple[str, ...] = ()
    """The pools to re-profile (below: of the short buckets' cells; above: every pool of the plan)."""
    off_ratio: float = 1.0
    """The ratio that is off: the shortest bucket's (below), the service's (above)."""
    fluid_rps: float = 0.0
    """The solver's rate when the planned goodput is the plan's capacity as served (0: it is the solver's)."""

    @property
    def ratio(self) -> float:
        return self.measured_rps / self.planned_rps if self.planned_rps > 0 else 0.0

    @property
    def judged(self) -> bool:
        return self.verdict in ("below", "above", "match")

    @property
    def off(self) -> bool:
        return self.verdict in ("below", "above")

    def text(self) -> str:
        basis = f"; planned as served, the solver's {self.fluid_rps:.1f}" if self.fluid_rps else ""
        head = (
            f"measured/planned goodput {self.ratio:.2f} ({self.measured_rps:.1f} / {self.planned_rps:.1f} rps "
            f"within the SLO{basis})"
        )
        why = {
            "below": f"below the plan by more than {TOLERANCE:.0%} while saturated ({self.saturated})",
            "above": f"above the plan by more than {TOLERANCE:.0%}",
            "match": f"within {TOLERANCE:.0%} of the plan while saturated ({self.saturated})",
            "idle": "not saturated (no refusals, answers in time, capacity not in use): the plan's capacity "
            "was not tested",
            "mix": f"above the plan, but at another length mix or survival than the plan's (limit {MIX_LIMIT})",
            "quiet": "too little traffic to judge",
        }[self.verdict]
        parts = [f"{head}: {why}"]
        shown = [b for b in self.buckets if b.inputs]
        if len(shown) > 1 or (shown and self.verdict == "below"):
            parts.append("; ".join(b.text() for b in shown))
        return "; ".join(parts)


def _share(part: int, whole: int) -> float:
    return part / whole if whole > 0 else 0.0


def _bucket_saturation(stats: BucketObservations, span: float) -> str:
    inputs = stats.requests + stats.refused
    if inputs < MIN_BUCKET_INPUTS:
        return ""
    why = []
    if (refused := _share(stats.refused, inputs)) >= SATURATED_SHARE:
        why.append(f"{refused:.0%} refused")
    if (late := _share(stats.requests - stats.within_slo, stats.requests)) >= SATURATED_SHARE:
        why.append(f"{late:.0%} late")
    if (load := stats.load_seconds / span) >= SATURATED_LOAD:
        why.append(f"capacity {load:.0%} in use")
    return ", ".join(why)


def _service_saturation(obs: Observations) -> str:
    """The whole service's saturation, from the counters every router has (refusals, late answers,
    deadline errors)."""
    arrived = max(drift.arrivals(obs), obs.requests + obs.errors.overload)
    why = []
    if (refused := _share(obs.errors.overload, arrived)) >= SATURATED_SHARE:
        why.append(f"{refused:.0%} refused")
    late = obs.requests - obs.within_slo + obs.errors.deadline
    if (share := _share(late, obs.requests + obs.errors.deadline)) >= SATURATED_SHARE:
        why.append(f"{share:.0%} late")
    return ", ".join(why)


def _shares(plan: Plan) -> list[float]:
    hist = list(plan.length_histogram)
    if len(hist) != len(plan.buckets) or sum(hist) <= 0:
        return [1.0 / len(plan.buckets)] * len(plan.buckets)
    total = sum(hist)
    return [h / total for h in hist]


def _at_plan_mix(plan: Plan, obs: Observations) -> bool:
    if plan.length_histogram and drift.arrivals(obs):
        if drift.tv_distance(drift.bucket_shares(obs, plan.buckets), plan.length_histogram) > MIX_LIMIT:
            return False
    if plan.survival and len(obs.survival) == len(plan.survival):
        if max(abs(a - b) for a, b in zip(obs.survival, plan.survival)) > MIX_LIMIT:
            return False
    return True


def judge(plan: Plan, obs: Observations, served_rps: float | None = None) -> Judgement:
    """Compare one window with the plan (the module docstring's rule); `served_rps`: the plan's capacity
    as served, when known (the planned goodput is the lower of it and the solver's rate)."""
    fluid = plan.prediction.goodput_rps
    as_served = served_rps is not None and 0 < served_rps < fluid
    planned = served_rps if as_served and served_rps is not None else fluid
    span = max(obs.until - obs.since, 1e-9)
    measured = obs.within_slo / span
    if planned <= 0 or max(drift.arrivals(obs), obs.requests) < drift.MIN_REQUESTS:
        return Judgement("quiet", planned, measured)
    return _judged(plan, obs, planned, measured, span, fluid if as_served else 0.0)


def _judged(plan: Plan, obs: Observations, planned: float, measured: float, span: float, fluid: float) -> Judgement:
    """`judge` once the planned goodput is known (`fluid`: the solver's rate when that is the one as served)."""
    buckets = []
    for share, bucket in zip(_shares(plan), plan.buckets):
        stats = obs.per_bucket.get(str(bucket))
        if stats is not None:
            buckets.append(
                BucketJudgement(
                    bucket,
                    planned * share,
                    stats.within_slo / span,
                    stats.requests + stats.refused,
                    _bucket_saturation(stats, span),
                )
            )
    saturated = "; ".join(f"bucket {b.bucket}: {b.saturated}" for b in buckets if b.saturated)
    if not buckets:  # a router without per-bucket figures: the service as a whole
        saturated = _service_saturation(obs)
    short = [b for b in buckets if b.short()]
    if not buckets and saturated and measured < (1 - TOLERANCE) * planned:
        pools = tuple(sorted({c.pool for c in plan.cells}))
        return Judgement("below", planned, measured, saturated, (), pools, measured / planned, fluid)
    if short:
        pools = tuple(sorted({c.pool for c in plan.cells if c.bucket in {b.bucket for b in short}}))
        worst = min(b.ratio for b in short)
        return Judgement("below", planned, measured, saturated, tuple(buckets), pools, worst, fluid)
    if measured > (1 + TOLERANCE) * planned:
        if not _at_plan_mix(plan, obs):
            return Judgement("mix", planned, measured, saturated, tuple(buckets), fluid_rps=fluid)
        pools = tuple(sorted({c.pool for c in plan.cells}))
        return Judgement("above", planned, measured, saturated, tuple(buckets), pools, measured / planned, fluid)
    return Judgement("match" if saturated else "idle", planned, measured, saturated, tuple(buckets), fluid_rps=fluid)


@dataclass(frozen=True)
class Mismatch:
    """A persistent mismatch: what the re-plan and the re-profile act on."""

    direction: str
    """below or above."""
    ratio: float
    """The median off ratio over the windows (what the profiles are corrected by)."""
    pools: tuple[str, ...]
    windows: tuple[Judgement, ...]

    def text(self) -> str:
        ratios = ", ".join(f"{w.off_ratio:.2f}" for w in self.windows)
        return (
            f"{self.direction} the plan by more than {TOLERANCE:.0%} in {len(self.windows)} consecutive windows "
            f"(ratios {ratios}); pool(s) {', '.join(self.pools)}"
        )


@dataclass
class Tracker:
    """The comparison over consecutive windows, for one service (kept in drift_policy.DriftState)."""

    block: list[Observations] = field(default_factory=list)
    """Slices of the window being filled (drift.JUDGED_PERIODS periods and drift.MIN_REQUESTS arrivals)."""
    plan_key: tuple[str, float] = ("", 0.0)
    """(hash, planned goodput) of the plan the windows are judged against: a new one starts over."""
    streak: list[Judgement] = field(default_factory=list)
    """The consecutive judged windows off in one direction, oldest first."""
    last: Judgement | None = None
    """The last window judged (or not judged) against the plan."""
    corrections: dict[str, tuple[float, ModelProfileSpec]] = field(default_factory=dict)
    """Pool -> (measured ratio, the profile it corrects): applied to the drift loop's re-plans until the
    pool's ModelProfile changes (a re-profile measured it again)."""
    corrected_key: tuple[str, float] | None = None
    """The plan_key of the plan in force made with `corrections` (None: none is): a mismatch measured
    against it compounds them; one measured against another plan replaces them."""

    served: float | None = None
    """The plan's capacity as served (planner/predict.py `plan_as_served`), once simulated for the plan in
    force (0.0: the simulation failed; None: not simulated)."""

    def add(self, piece: Observations, plan: Plan, period: float) -> Judgement | None:
        """Add what one read brought; the judgement of a window once one is full, else None."""
        whole = self.fill(piece, plan, period, plan.content_hash())
        return None if whole is None else self.record(judge(plan, whole, self.served))

    def fill(self, piece: Observations, plan: Plan, period: float, plan_hash: str) -> Observations | None:
        """Add what one read brought to the window being filled; the window once it is full, else None.
        `plan_hash`: the plan's content hash (the caller has it)."""
        key = key_of(plan_hash, plan.prediction.goodput_rps)
        if key != self.plan_key:
            self.block, self.streak, self.last, self.plan_key, self.served = [], [], None, key, None
        self.block.append(piece)
        if (
            drift.span(self.block) < drift.JUDGED_PERIODS * period
            or drift.pooled_arrivals(self.block) < drift.MIN_REQUESTS
        ):
            return None  # not full yet (judged without combining the block on every read)
        whole = drift.combine(self.block)
        self.block = []
        return whole

    def needs_served(self, verdict: Judgement) -> bool:
        """A window read below the solver's rate and the plan's capacity as served is not known yet."""
        return verdict.verdict == "below" and self.served is None

    def record(self, verdict: Judgement) -> Judgement:
        """Count a judged window towards (or against) a persistent mismatch."""
        self.last = verdict
        if verdict.off:
            if self.streak and self.streak[-1].verdict != verdict.verdict:
                self.streak = []
            self.streak = [*self.streak, verdict][-WINDOWS:]
        elif verdict.verdict == "match":
            self.streak = []
        return verdict

    def mismatch(self) -> Mismatch | None:
        """The persistent mismatch (WINDOWS consecutive windows off in one direction), or None."""
        if len(self.streak) < WINDOWS:
            return None
        pools = tuple(sorted({p for w in self.streak for p in w.pools}))
        ratio = statistics.median(w.off_ratio for w in self.streak)
        return Mismatch(self.streak[-1].verdict, ratio, pools, tuple(self.streak))

    def acted(self, mismatch: Mismatch, profiles: Mapping[str, ModelProfileSpec]) -> None:
        """The mismatch was acted on (re-plan or proposal): its correction is kept for the pools' current
        profiles (compounding one already there when the plan it was measured against was made with
        it), and the count starts again from the next window."""
        compound = self.corrected_key is not None and self.corrected_key == self.plan_key
        for pool in mismatch.pools:
            if (prof := profiles.get(pool)) is not None:
                before = self.corrections.get(pool)
                ratio = mismatch.ratio * (before[0] if compound and before and before[1] == prof else 1.0)
                self.corrections[pool] = (ratio, prof)
        self.streak = []

    def planned_with_corrections(self, plan_hash: str, goodput_rps: float) -> None:
        """The plan now in force was made with the corrections (the drift loop's re-plan applied it)."""
        self.corrected_key = key_of(plan_hash, goodput_rps) if self.corrections else None

    def correct(self, profiles: Mapping[str, ModelProfileSpec]) -> dict[str, ModelProfileSpec]:
        """`profiles` with the kept corrections applied (a correction whose pool has another profile
        now, measured again, is dropped)."""
        out = dict(profiles)
        for pool, (ratio, prof) in list(self.corrections.items()):
            if profiles.get(pool) != prof:
                del self.corrections[pool]
                continue
            out.update(corrected_profiles(out, [pool], ratio))
        return out


def key_of(plan_hash: str, goodput_rps: float) -> tuple[str, float]:
    """What identifies the plan windows are judged against: its hash and its prediction (as the status
    rounds it)."""
    return (plan_hash, round(goodput_rps, 1))


def update_condition(
    status: ServiceStatus, tracker: Tracker, verdict: Judgement, plan_hash: str, generation: int
) -> ServiceStatus:
    """PlanAccurate after a judged window: False once off persistently, True on a window that matches;
    left as it is on a window that cannot be judged or while a streak builds (Unknown when absent)."""
    mismatch = tracker.mismatch()
    head = f"plan {plan_hash}: "
    if mismatch is not None:
        reason = "MeasuredBelowPlan" if mismatch.direction == "below" else "MeasuredAbovePlan"
        message = f"{head}{verdict.text()}; {mismatch.text()} to re-profile"
        value: bool | None = False
    elif verdict.verdict == "match":
        reason, message, value = "MeasuredMatchesPlan", head + verdict.text(), True
    elif any(c.type == CONDITION for c in status.conditions):
        return status
    else:
        reason, value = "NotJudged", None
        message = head + verdict.text()
        if verdict.off:
            message += f" (window {len(tracker.streak)} of {WINDOWS} before it counts)"
    status.conditions = set_condition(status.conditions, CONDITION, value, reason, message, generation)
    return status


def corrected_profiles(
    profiles: Mapping[str, ModelProfileSpec], pools: Sequence[str], ratio: float
) -> dict[str, ModelProfileSpec]:
    """The profiles with the named pools' block and ramp latencies divided by the measured ratio
    (clamped to CORRECTION_RANGE): below the plan (ratio < 1) they are slower than measured before,
    above it faster. A stopgap until a profiling Job measures the pool again."""
    lo, hi = CORRECTION_RANGE
    factor = 1.0 / min(hi, max(lo, ratio))
    out = dict(profiles)
    for pool in pools:
        prof = out.get(pool)
        if prof is None:
            continue
        blocks = [
            b.model_copy(update={"latency_ms": [[x * factor for x in row] for row in b.latency_ms]})
            for b in prof.blocks
        ]
        ramps = [
            r.model_copy(update={"latency_ms": [[x * factor for x in row] for row in r.latency_ms]}) for r in prof.ramps
        ]
        out[pool] = prof.model_copy(update={"blocks": blocks, "ramps": ramps})
    return out
