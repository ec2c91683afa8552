"""Pods that refuse to run on the CPU in place of the GPU their pool promises, as the service's condition.

A worker, a router running split 0, or a profiling Job on a pool with a gpuResource runs with `--device
gpu` (api/commands.py): where the CUDA provider cannot run its sessions it exits 3 with one line,
`ProviderUnavailable: <what is missing>` (worker_image/device.py), its termination message. At each
readiness refresh of a service whose Deployments are not all ready, the operator reads its pods and, while
one reports that refusal, marks the service Degraded with reason ProviderUnavailable, per pool, with the
cause (a Warning event when the message changes); it clears once no pod reports it. A profiling Job that
refuses makes the ProfilingFailed condition's reason ProviderUnavailable (operator/profiling.py).
"""

from __future__ import annotations

from typing import Any

from exitplan.api.manifest import Manifest
from exitplan.operator.health_condition import degraded_by
from exitplan.operator.names import L_COMPONENT, L_POOL
from exitplan.operator.service_state import Service
from exitplan.operator.status import ServiceStatus

REASON = "ProviderUnavailable"
MARK = f"{REASON}: "


def refusal(container_status: dict[str, Any]) -> str | None:
    """The cause a container gave for refusing its device (its current or last termination), else None."""
    for state in (container_status.get("state") or {}, container_status.get("lastState") or {}):
        term = state.get("terminated") or {}
        said = str(term.get("message") or "")
        if MARK in said:
            return said.split(MARK, 1)[1].splitlines()[0].strip()
    return None


def pod_refusals(pods: list[Manifest]) -> dict[str, str]:
    """Pool -> 'pod P: <cause>' for the first pod of each pool whose container refused its device."""
    out: dict[str, str] = {}
    for pod in pods:
        labels = pod["metadata"].get("labels") or {}
        pool = labels.get(L_POOL) or f"the {labels.get(L_COMPONENT, 'pod')}s' pool"
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            if (cause := refusal(cs)) is not None and pool not in out:
                out[pool] = f"pod {pod['metadata']['name']}: {cause}"
    return out


async def surface(svc: Service, status: ServiceStatus, degraded: bool, pods: list[Manifest]) -> bool:
    """Set or clear Degraded/ProviderUnavailable from the service's pods; the new `degraded`."""
    refused = pod_refusals(pods)
    message = None
    if refused:
        message = (
            "; ".join(f"pool {pool}: {cause}" for pool, cause in sorted(refused.items()))
            + ". Its processes refuse to serve on the CPU in place of the GPU the pool promises: fix the nodes' "
            'driver or device plugin, or the image; a pool of CPU cores says gpuResource: ""'
        )
    recovered = ("ProviderAvailable", "the pods run on their pools' devices")
    return degraded_by(svc, status, REASON, message, recovered, degraded)
