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

from typing import Any

from exitplan.api import termination
from exitplan.api.bundle_source import SourceError, parse_bundle_uri
from exitplan.api.manifest import Manifest
from exitplan.operator import names
from exitplan.operator.bundle_volumes import IMAGE_COPY, STORAGE_INIT
from exitplan.operator.health_condition import degraded_by
from exitplan.operator.kube import path
from exitplan.operator.service_state import Service
from exitplan.operator.status import ServiceStatus

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
        said = termination.error_line(str(term.get("message") or "")) or str(term.get("reason") or "")
        return f"exited {term.get('exitCode')}: {said}"
    return None


def pod_failures(pods: list[Manifest]) -> list[str]:
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


def reads_pods(svc: Service) -> bool:
    """Whether `surface` reads the service's pods (a remote bundle: its pods' init containers fetch it)."""
    return _remote(svc)


async def surface(svc: Service, status: ServiceStatus, degraded: bool) -> bool:
    """Set or clear Degraded/BundleFetchFailed from the service's pods; the new `degraded`."""
    failures: list[str] = []
    if _remote(svc):
        failures = pod_failures(await svc.client.list(path("Pod", svc.namespace), f"{names.L_SERVICE}={svc.name}"))
    message = None
    if failures:
        bundle = (svc.body.get("spec") or {}).get("model", {}).get("bundle", "")
        message = (
            f"the bundle {bundle} cannot be fetched or verified: {failures[0]}"
            + (f" (and {len(failures) - 1} more pod(s))" if len(failures) > 1 else "")
            + "; the pods retry with back-off; fix the source (or spec.model) and they start"
        )
    return degraded_by(svc, status, REASON, message, ("BundleFetched", "the pods fetched the bundle"), degraded)
