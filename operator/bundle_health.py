"""A remote bundle that the pods cannot fetch or verify, as the service's condition.

A pod whose storage-init (or bundle-image) init container fails stays in Init (Init:Error, then
Init:CrashLoopBackOff: the kubelet retries with back-off) and never becomes ready; its container
status holds the failure's one-line reason (the termination message storage-init writes). At each
readiness refresh the operator reads the service's pods and, while one is in that state, marks the
service Degraded with reason BundleFetchFailed and that reason in the message (a Warning event when
the message changes); the condition clears once no pod reports such a failure. A pod that cannot pull
the bundle image (oci://) counts too. Nothing here raises or retries: the kubelet retries, the
operator reports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from exitplan.api.bundle_source import SourceError, parse_bundle_uri
from exitplan.operator import builders
from exitplan.operator.bundle_volumes import IMAGE_COPY, STORAGE_INIT
from exitplan.operator.kube import path
from exitplan.operator.status import Phase, ServiceStatus, set_condition

if TYPE_CHECKING:
    from exitplan.operator.reconcile import Service

REASON = "BundleFetchFailed"
PULL_FAILURES = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName")


def container_failure(status: dict[str, Any]) -> str | None:
    """What a bundle init container's status says went wrong (None: nothing, or it since succeeded)."""
    state, last = status.get("state") or {}, status.get("lastState") or {}
    term = state.get("terminated")
    if term and int(term.get("exitCode") or 0) == 0:
        return None
    waiting = state.get("waiting") or {}
    if waiting.get("reason") in PULL_FAILURES:
        return f"cannot pull image {status.get('image', '')}: {waiting.get('message') or waiting['reason']}"
    term = term or last.get("terminated")
    if term and int(term.get("exitCode") or 0) != 0:
        said = " ".join(str(term.get("message") or term.get("reason") or "").split())
        return f"exited {term.get('exitCode')}: {said[-600:]}"
    return None


def pod_failures(pods: list[dict[str, Any]]) -> list[str]:
    """'pod P: container C exited 1: <reason>' for each pod whose bundle init container fails."""
    out = []
    for pod in pods:
        for cs in (pod.get("status") or {}).get("initContainerStatuses") or []:
            if cs.get("name") in (STORAGE_INIT, IMAGE_COPY) and (why := container_failure(cs)):
                out.append(f"pod {pod['metadata']['name']}: container {cs['name']} {why}")
    return out


def _remote(svc: Service) -> bool:
    try:
        return parse_bundle_uri(str(((svc.body.get("spec") or {}).get("model") or {}).get("bundle") or "")).remote
    except SourceError:
        return False


async def surface(svc: Service, status: ServiceStatus, degraded: bool) -> bool:
    """Set or clear Degraded/BundleFetchFailed from the service's pods; the new `degraded`."""
    gen = svc.generation
    reported = any(c.type == "Degraded" and c.status == "True" and c.reason == REASON for c in status.conditions)
    failures: list[str] = []
    if _remote(svc):
        failures = pod_failures(await svc.client.list(path("Pod", svc.namespace), f"{builders.L_SERVICE}={svc.name}"))
    if failures:
        bundle = (svc.body.get("spec") or {}).get("model", {}).get("bundle", "")
        message = (
            f"the bundle {bundle} cannot be fetched or verified: {failures[0]}"
            + (f" (and {len(failures) - 1} more pod(s))" if len(failures) > 1 else "")
            + "; the pods retry with back-off; fix the source (or spec.model) and they start"
        )
        if not reported or status.message != message:
            svc.event("Warning", REASON, message)
        status.conditions = set_condition(status.conditions, "Degraded", True, REASON, message, gen)
        status.phase, status.message = Phase.degraded, message
        return True
    if reported:
        status.conditions = set_condition(
            status.conditions, "Degraded", False, "BundleFetched", "the pods fetched the bundle", gen
        )
        status.phase = Phase.deploying
        return False
    return degraded
