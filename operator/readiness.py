"""Ready, Progressing and Degraded from what runs: the service's Deployments and pods, every timer tick.

Owns `refresh_readiness`: per plan cell the ready replicas (a co-located plan's split 0 counted from
its routers, colocation.py), the cell metrics, a rollout that stalls (Degraded, reason RolloutStalled)
and recovers, a bundle the pods cannot fetch (bundle_health.py), and Ready once every Deployment has
its replicas, pods that refuse to serve on the CPU in place of their pool's GPU (provider_health.py). It
writes the status only when something changed, and skips the whole refresh while nothing it reads changed
(the service's spec generation and the parts of its status a refresh reads and writes, and its Deployments at
their resourceVersions, as at a refresh that wrote nothing and needed no pods). The service's own
resourceVersion is not among them: the drift loop's status writes (its figures, once a period, and thresholds
written into the plan) change it without changing anything a refresh reads.
"""

from __future__ import annotations

import orjson

from exitplan.api.manifest import Manifest
from exitplan.operator import bundle_health, colocation, provider_health, tick_reads
from exitplan.operator.kube import path
from exitplan.operator.metrics import METRICS
from exitplan.operator.names import L_BUCKET, L_COMPONENT, L_POOL, L_SERVICE, L_SPLIT, bundle_path
from exitplan.operator.service_state import Service
from exitplan.operator.status import Phase, ServiceStatus, parse_status, set_condition

IDLE = {p.value for p in (Phase.infeasible, Phase.advisory, Phase.profiling, Phase.profiling_failed)}
"""The phases in which nothing is served from a plan: no readiness to refresh."""
SETTLED_KEY = "readiness_settled"
"""The per-object memo's key for what the last refresh read (see `_inputs`) when it wrote nothing and read no pods."""


READ_FIELDS = ("phase", "message", "conditions")
"""The status fields a refresh reads and may write, besides its plan's cells and cost (`_inputs`)."""


def _inputs(svc: Service, deployments: list[Manifest]) -> tuple[bytes | str, ...] | None:
    """What a refresh reads: the service's uid and spec generation, the status fields it reads and writes (as
    JSON: kopf's view of the body is live, a kept reference would change with it), and its Deployments'
    names and resourceVersions; None where one has no resourceVersion."""
    meta, raw = svc.body["metadata"], svc.body.get("status") or {}
    plan = raw.get("plan") or {}
    read = [raw.get(k) for k in READ_FIELDS] + [plan.get("cells"), plan.get("costPerHour")]
    versions: list[bytes | str] = [str(meta.get("uid") or ""), str(meta.get("generation") or 0), orjson.dumps(read)]
    for dep in sorted(deployments, key=lambda d: str(d["metadata"].get("name"))):
        versions += [str(dep["metadata"].get("name")), str(dep["metadata"].get("resourceVersion") or "")]
    return tuple(versions) if all(versions[3:]) else None


async def refresh_readiness(svc: Service) -> ServiceStatus | None:
    """Ready / Progressing from the Deployments' status (the timer calls it every tick). None: nothing it reads
    changed since its last refresh, which wrote nothing and read no pods (a steady service costs no more)."""
    raw = svc.body.get("status") or {}
    if not raw.get("plan") or raw.get("phase") in IDLE:
        return parse_status(raw)
    deployments = await tick_reads.service_deployments(svc.memo, svc.namespace, svc.name)
    if deployments is None:  # no shared list fresh enough (tick_reads.py): the service's own
        deployments = await svc.client.list(path("Deployment", svc.namespace), f"{L_SERVICE}={svc.name}")
    inputs = _inputs(svc, deployments)
    memo = svc.memo if svc.memo is not None else {}
    if inputs is not None and memo.get(SETTLED_KEY) == inputs:
        return None
    memo.pop(SETTLED_KEY, None)
    status = parse_status(raw)
    if status.plan is None or status.phase.value in IDLE:
        return status
    before = status.model_dump(mode="json")  # what the API has, to write only what changed
    gen = svc.generation
    ready: dict[tuple[int, int, str], int] = {}
    all_ready = True
    colocated_routers = None  # ready routers that run split 0 (a co-located plan), else None
    for dep in deployments:
        labels = dep["metadata"].get("labels", {})
        want = int(dep.get("spec", {}).get("replicas") or 0)
        have = int((dep.get("status") or {}).get("readyReplicas") or 0)
        all_ready &= have >= want
        if labels.get(L_COMPONENT) == "worker":
            ready[(int(labels[L_SPLIT]), int(labels[L_BUCKET]), labels[L_POOL])] = have
        elif labels.get(L_COMPONENT) == "router" and colocation.runs_split_zero(dep):
            colocated_routers = have
    for cell in status.plan.cells:
        cell.ready_replicas = ready.get((cell.split, cell.bucket, cell.pool), 0)
        if colocated_routers is not None and cell.split == 0:  # every ready router holds split 0 of each bucket
            cell.ready_replicas = min(cell.replicas, colocated_routers)
    METRICS.record_plan(
        svc.namespace,
        svc.name,
        status.plan.cost_per_hour,
        [(c.split, c.bucket, c.pool, c.replicas, c.ready_replicas) for c in status.plan.cells],
    )
    all_ready &= bool(deployments)
    degraded = _stalled_rollout(svc, status, deployments)
    degraded = await bundle_health.surface(svc, status, degraded)
    read_pods = bundle_health.reads_pods(svc)
    if not all_ready or any(c.reason == provider_health.REASON for c in status.conditions):  # ready: no pod refuses
        pods = await svc.client.list(path("Pod", svc.namespace), f"{L_SERVICE}={svc.name}")
        degraded = await provider_health.surface(svc, status, degraded, pods)
        read_pods = True
    if all_ready:
        status.conditions = set_condition(
            status.conditions, "Ready", True, "AllReady", "every Deployment is ready", gen
        )
        status.conditions = set_condition(status.conditions, "Progressing", False, "Complete", "rollout complete", gen)
        if not degraded:
            status.phase = Phase.ready
    else:
        status.conditions = set_condition(
            status.conditions, "Ready", False, "Waiting", "some Deployments have fewer ready replicas than desired", gen
        )
    if status.model_dump(mode="json") != before:
        await svc.write_status(status)
    elif not read_pods and inputs is not None:  # pods change without the Deployments: a refresh that read them repeats
        memo[SETTLED_KEY] = inputs
    return status


def _stalled_rollout(svc: Service, status: ServiceStatus, deployments: list[Manifest]) -> bool:
    """Set or clear Degraded/RolloutStalled from the Deployments' Progressing conditions; whether the service
    is degraded now (for any reason)."""
    gen = svc.generation
    stalled = [
        f"Deployment {d['metadata']['name']}: {c.get('message') or c.get('reason')}"
        for d in deployments
        for c in (d.get("status") or {}).get("conditions") or []
        if c.get("type") == "Progressing" and c.get("status") == "False"
    ]
    degraded = any(c.type == "Degraded" and c.status == "True" for c in status.conditions)
    if stalled:
        bundle = bundle_path((svc.body.get("spec") or {}).get("model", {}).get("bundle", ""))
        message = (
            "; ".join(stalled) + f". Pods of the plan do not start: check that the bundle {bundle} is "
            "reachable from the pods and their logs; the replicas that run keep serving"
        )
        if not degraded or status.message != message:
            svc.event("Warning", "RolloutStalled", message)
        status.conditions = set_condition(status.conditions, "Degraded", True, "RolloutStalled", message, gen)
        status.phase, status.message = Phase.degraded, message
        return True
    if degraded and any(c.type == "Degraded" and c.reason == "RolloutStalled" for c in status.conditions):
        status.conditions = set_condition(status.conditions, "Degraded", False, "Recovered", "rollout progresses", gen)
        status.phase = Phase.deploying
        return False
    return degraded
