"""The fixed `status` of an EarlyExitService: typed models (the CRD's status schema is generated
from them) and pure helpers that fill them.

Conditions follow the standard Kubernetes shape (type, status, reason, message,
lastTransitionTime, observedGeneration). The five condition types are fixed:

- Planned: a plan exists for the current generation of the spec.
- Ready: every child Deployment has its desired replicas ready.
- Progressing: children are being created or rolled to a new plan (or a profile is being measured).
- Degraded: something the operator cannot fix by itself (an apply failed, a bundle is unreachable).
- PlanInfeasible: the planner proved the spec cannot be met (unknown pool, SLO no pool can meet).
"""

from __future__ import annotations

import datetime as dt
from enum import Enum
from typing import Annotated, Literal

from pydantic import Field

from exitplan.api.plan import Plan
from exitplan.api.resources import Model

CONDITION_TYPES = ("Planned", "Ready", "Progressing", "Degraded", "PlanInfeasible")


class Phase(str, Enum):
    pending = "Pending"
    """Accepted, nothing planned yet."""
    profiling = "Profiling"
    """Waiting for a ModelProfile (a profiling Job runs)."""
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
    type: Literal["Planned", "Ready", "Progressing", "Degraded", "PlanInfeasible"]
    status: Literal["True", "False", "Unknown"]
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
    """Plan.content_hash(): the annotation exitplan.io/plan-hash on every child."""
    reason: str
    splits: Annotated[int, Field(ge=1)]
    buckets: list[int]
    replicas: Annotated[int, Field(ge=0)]
    """Worker replicas over all cells."""
    goodput_rps: Annotated[float, Field(ge=0.0)] = 0.0
    p99_ms: Annotated[float, Field(ge=0.0)] = 0.0
    cost_per_hour: Annotated[float, Field(ge=0.0)] = 0.0
    cells: list[CellSummary] = Field(default_factory=list)


class DriftReport(Model):
    """What the drift loop measured in the last observation window."""

    observed_at: str = ""
    length_score: Annotated[float, Field(ge=0.0)] = 0.0
    """Total-variation distance between the observed and the planned length histogram (0..1)."""
    survival_error: Annotated[float, Field(ge=0.0)] = 0.0
    """Max abs difference between the forecast and the planned survival curve."""
    p99_ms: Annotated[float, Field(ge=0.0)] = 0.0
    """Observed p99 latency of the window."""
    requests: Annotated[int, Field(ge=0)] = 0
    goodput_rps: Annotated[float, Field(ge=0.0)] = 0.0
    trigger: str = ""
    """The re-plan reason the window raised (length-drift, survival-drift, slo-risk) or empty."""


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
    drift: DriftReport | None = None
    proposal: Proposal | None = None
    message: str = ""
    pools_digest: str = ""
    """Digest of the GPUPool specs the last plan was made with (a pool change re-plans when it differs)."""


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def set_condition(
    conditions: list[Condition], type_: str, status: bool | None, reason: str, message: str, generation: int
) -> list[Condition]:
    """Conditions with `type_` set; lastTransitionTime moves only when the status flips."""
    value = "Unknown" if status is None else ("True" if status else "False")
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


def summarize(plan: Plan, ready: dict[tuple[int, int, str], int] | None = None) -> PlanSummary:
    """The status summary of a plan; `ready` maps (split, bucket, pool) to ready replicas."""
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
        cells=cells,
    )


def parse_status(raw: dict | None) -> ServiceStatus:
    """The stored status, or a fresh one when it is absent or from an older schema."""
    known = {f.alias or name for name, f in ServiceStatus.model_fields.items()}
    try:
        return ServiceStatus.model_validate({k: v for k, v in (raw or {}).items() if k in known})
    except ValueError:
        return ServiceStatus()
