"""The fixed `status` of an EarlyExitService: typed models (the CRD's status schema is generated
from them) and pure helpers that fill them.

Conditions follow the standard Kubernetes shape (type, status, reason, message,
lastTransitionTime, observedGeneration). The seven condition types are fixed:

- Planned: a plan exists for the current generation of the spec.
- Ready: every child Deployment has its desired replicas ready.
- Progressing: children are being created or rolled to a new plan (or a profile is being measured).
- Degraded: something the operator cannot fix by itself (an apply failed, a bundle is unreachable).
- PlanInfeasible: the planner proved the spec cannot be met (unknown pool, SLO no pool can meet,
  a bundle host path the operator does not allow, no room left on a pool other services hold).
- ProfilingFailed: a profiling Job failed after its backoff limit (the reason and message are the
  Job's and its pod's); set only once a Job failed, False again when the profiles are there.
- PlanAccurate: the routers' measured goodput agrees with the plan's under real load (True), or has
  been off by more than 30 % in several consecutive saturated windows (False: the pools are
  re-profiled and the service re-planned, reason plan-mismatch); the message carries measured/planned
  (planned: the solver's rate, or the plan as served where that is lower and a window fell short, plan_served.py).
  Set by the drift loop once a window could be judged (plan_accuracy.py says the rule).
"""

from __future__ import annotations

import datetime as dt
from enum import Enum
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, Field

from exitplan.api.plan import Plan
from exitplan.api.resources import Model

ConditionType = Literal[
    "Planned", "Ready", "Progressing", "Degraded", "PlanInfeasible", "ProfilingFailed", "PlanAccurate"
]
"""The seven condition types (the module docstring says what each means)."""
ConditionStatus = Literal["True", "False", "Unknown"]
CONDITION_TYPES: tuple[ConditionType, ...] = get_args(ConditionType)


def _rounded(digits: int) -> AfterValidator:
    """Round a float as it enters the status: `kubectl get` and `-o yaml` show 172393.2, not 172393.1521609003."""
    return AfterValidator(lambda value: round(value, digits))


Rps = Annotated[float, Field(ge=0.0), _rounded(1)]
"""Requests per second, to 0.1."""
Ms = Annotated[float, Field(ge=0.0), _rounded(2)]
"""Milliseconds, to 0.01."""
Cost = Annotated[float, Field(ge=0.0), _rounded(3)]
"""Cost per hour, to 0.001."""
Score = Annotated[float, Field(ge=0.0), _rounded(4)]
"""A drift score (a distance or an error in 0..1), to 0.0001."""
Ratio = Annotated[float, Field(ge=0.0), _rounded(2)]
"""A ratio of two measures, to 0.01."""


class Phase(str, Enum):
    pending = "Pending"
    """Accepted, nothing planned yet."""
    profiling = "Profiling"
    """Waiting for a ModelProfile (a profiling Job runs)."""
    profiling_failed = "ProfilingFailed"
    """A profiling Job failed; the next one waits (exponential backoff), or none follows (attempts
    spent: a spec change retries). The ProfilingFailed condition says why."""
    deploying = "Deploying"
    """A plan is applied; children are not all ready yet."""
    ready = "Ready"
    """The plan serves: every child is ready."""
    advisory = "Advisory"
    """Advisory mode: the operator reports plans but does not apply them."""
    degraded = "Degraded"
    """The last apply failed or children are unhealthy; the previous plan keeps serving."""
    infeasible = "Infeasible"
    """No plan meets the spec; the message says what to change."""


class Condition(Model):
    type: ConditionType
    status: ConditionStatus
    reason: Annotated[str, Field(min_length=1)] = "Unknown"
    """A CamelCase word for machines (e.g. ProfileMissing, UnknownPool)."""
    message: str = ""
    """What happened, for a person, with what to do about it."""
    last_transition_time: str = ""
    """RFC 3339 time the status last changed."""
    observed_generation: Annotated[int, Field(ge=0)] = 0


class CellSummary(Model):
    split: Annotated[int, Field(ge=0)]
    bucket: Annotated[int, Field(ge=1)]
    pool: str
    replicas: Annotated[int, Field(ge=0)]
    """Replicas the plan wants for this cell."""
    ready_replicas: Annotated[int, Field(ge=0)] = 0
    """Replicas the cell's Deployment reports ready."""


class PlanSummary(Model):
    hash: str
    """Plan.content_hash(): the annotation exitplan.io/plan-hash of the plan ConfigMap (the other children carry
    Plan.layout_hash(), the plan less its exit thresholds, which a re-tune does not change)."""
    reason: str
    splits: Annotated[int, Field(ge=1)]
    buckets: list[int]
    replicas: Annotated[int, Field(ge=0)]
    """Worker replicas over all cells."""
    goodput_rps: Rps = 0.0
    p99_ms: Ms = 0.0
    cost_per_hour: Cost = 0.0
    exits: str = ""
    """The bundle's exit ramps the plan serves ("2 ramps"), or "no exits" for a bundle without any: the plain
    model, with no feedback and no tuning (kubectl's EXITS column)."""
    cells: list[CellSummary] = Field(default_factory=list)


class DriftReport(Model):
    """What the drift loop measured in the last observation window."""

    observed_at: str = ""
    length_score: Score = 0.0
    """Total-variation distance between the observed and the planned length histogram (0..1)."""
    survival_error: Score = 0.0
    """Max abs difference between the forecast and the planned survival curve."""
    p99_ms: Ms = 0.0
    """Observed p99 latency of the window."""
    requests: Annotated[int, Field(ge=0)] = 0
    window_start: str = ""
    window_end: str = ""
    """The window's bounds (RFC 3339, milliseconds): MEASURED and p99 are of what the routers answered between
    them, to line up with a load generator's or a dashboard's own figures."""
    goodput_rps: Rps = 0.0
    """Requests answered within the SLO per second in the window, as measured (kubectl's MEASURED column)."""
    goodput_ratio: Ratio = 0.0
    """Measured / planned goodput in the window (0 when the plan predicts none); condition PlanAccurate
    judges it under load."""
    trigger: str = ""
    """The re-plan reason the window raised (slo-risk, length-drift, survival-drift, plan-mismatch) or empty."""
    routers: str = ""
    """Why the last read did not hold every router replica's observations (then MEASURED under-reads and
    the window is not judged against the plan), or empty when it did."""


class Proposal(Model):
    """A plan the operator would apply (advisory mode) or holds back (cooldown, move cap)."""

    reason: str
    hash: str
    changes: list[str] = Field(default_factory=list)
    """Human-readable replica changes per cell, e.g. 'split-0/b128/gpu-a: 2 -> 3'."""
    held_back: str = ""
    """Why it was not applied (advisory mode, cooldown, ...)."""


class ServiceStatus(Model):
    phase: Phase = Phase.pending
    ready: str = ""
    """Worker replicas ready / planned, e.g. "3/4" (kubectl's READY column); empty without a plan applied."""
    reason: str = ""
    """Why the service is in its phase: the reason of the condition that explains it, e.g. AllReady,
    Rollout, ProfileMissing, PoolCapacity, RolloutStalled (kubectl's REASON column)."""
    observed_generation: Annotated[int, Field(ge=0)] = 0
    conditions: list[Condition] = Field(default_factory=list)
    plan: PlanSummary | None = None
    """The plan currently applied (in advisory mode: the plan that would be applied)."""
    last_replan_time: str = ""
    last_replan_reason: str = ""
    endpoint: str = ""
    """In-cluster URL of the router Service."""
    waiting_for_profiles: list[str] = Field(default_factory=list)
    """Pools whose ModelProfile is being measured; planning waits for them."""
    profile_attempts: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)
    """Profiling Jobs started per pool for the spec generation in observedGeneration (bounded by the
    operator's profiling attempts; a spec change starts the count again)."""
    drift: DriftReport | None = None
    proposal: Proposal | None = None
    message: str = ""
    pools_digest: str = ""
    """Digest of the GPUPool specs the last plan was made with (a pool change re-plans when it differs)."""


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def iso_ms(epoch_seconds: float) -> str:
    """An epoch time as RFC 3339 in UTC, to the millisecond."""
    at = dt.datetime.fromtimestamp(epoch_seconds, dt.UTC)
    return at.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def set_condition(
    conditions: list[Condition], type_: ConditionType, status: bool | None, reason: str, message: str, generation: int
) -> list[Condition]:
    """Conditions with `type_` set; lastTransitionTime moves only when the status flips."""
    value: ConditionStatus = "Unknown" if status is None else ("True" if status else "False")
    out: list[Condition] = []
    found = False
    for cond in conditions:
        if cond.type == type_:
            found = True
            when = cond.last_transition_time if cond.status == value else now_iso()
            out.append(
                Condition(
                    type=type_,
                    status=value,
                    reason=reason,
                    message=message,
                    last_transition_time=when,
                    observed_generation=generation,
                )
            )
        else:
            out.append(cond)
    if not found:
        out.append(
            Condition(
                type=type_,
                status=value,
                reason=reason,
                message=message,
                last_transition_time=now_iso(),
                observed_generation=generation,
            )
        )
    order = {t: i for i, t in enumerate(CONDITION_TYPES)}
    return sorted(out, key=lambda c: order[c.type])


def exits_column(ramps: int | None) -> str:
    """kubectl's EXITS: the bundle's ramps ("2 ramps"), "no exits" for a bundle without any, "" unknown."""
    if ramps is None:
        return ""
    return f"{ramps} ramp{'s' * (ramps != 1)}" if ramps else "no exits"


def summarize(
    plan: Plan, ready: dict[tuple[int, int, str], int] | None = None, ramps: int | None = None
) -> PlanSummary:
    """The status summary of a plan; `ready` maps (split, bucket, pool) to ready replicas, `ramps` is how many
    exit ramps the bundle has (its profiles' ramps; None: unknown)."""
    ready = ready or {}
    cells = [
        CellSummary(
            split=c.split,
            bucket=c.bucket,
            pool=c.pool,
            replicas=c.replicas,
            ready_replicas=ready.get((c.split, c.bucket, c.pool), 0),
        )
        for c in plan.cells
    ]
    return PlanSummary(
        hash=plan.content_hash(),
        reason=plan.reason,
        splits=len(plan.splits),
        buckets=list(plan.buckets),
        replicas=sum(c.replicas for c in plan.cells),
        goodput_rps=plan.prediction.goodput_rps,
        p99_ms=plan.prediction.p99_ms,
        cost_per_hour=plan.prediction.cost_per_hour,
        exits=exits_column(ramps),
        cells=cells,
    )


PHASE_CONDITION: dict[Phase, ConditionType] = {
    Phase.ready: "Ready",
    Phase.deploying: "Progressing",
    Phase.degraded: "Degraded",
    Phase.infeasible: "PlanInfeasible",
    Phase.profiling: "Progressing",
    Phase.profiling_failed: "ProfilingFailed",
    Phase.advisory: "Planned",
}
"""The condition whose reason says why a service is in a phase (status.reason)."""


def with_columns(status: ServiceStatus) -> ServiceStatus:
    """`status` with `ready` and `reason` derived from its plan and conditions (every status write
    fills them, so kubectl's READY and REASON columns never disagree with the rest)."""
    reasons: dict[str, str] = {c.type: c.reason for c in status.conditions}
    wanted = PHASE_CONDITION.get(status.phase)
    status.reason = reasons.get(wanted, reasons.get("Planned", "")) if wanted else ""
    if status.plan is None or status.phase == Phase.advisory:
        status.ready = ""  # nothing of this plan runs (advisory: it is only proposed)
    else:
        cells = status.plan.cells
        status.ready = f"{sum(c.ready_replicas for c in cells)}/{sum(c.replicas for c in cells)}"
    return status


def parse_status(raw: dict[str, Any] | None) -> ServiceStatus:
    """The stored status, or a fresh one when it is absent or from an older schema."""
    known = {f.alias or name for name, f in ServiceStatus.model_fields.items()}
    try:
        return ServiceStatus.model_validate({k: v for k, v in (raw or {}).items() if k in known})
    except ValueError:
        return ServiceStatus()
