"""One cause of a Degraded service, set while the pods report it and cleared once they stop: the shape every
health check that reads the pods shares (a bundle the pods cannot fetch, bundle_health.py; a GPU their
processes cannot use, provider_health.py)."""

from __future__ import annotations

from exitplan.operator.service_state import Service
from exitplan.operator.status import Phase, ServiceStatus, set_condition


def degraded_by(
    svc: Service,
    status: ServiceStatus,
    reason: str,
    message: str | None,
    recovered: tuple[str, str],
    degraded: bool,
) -> bool:
    """Degraded with `reason` and `message` while `message` is given (a Warning event when it changes); once
    it is None, the condition cleared with `recovered` (reason, message) if this reason had set it. Returns
    whether the service is degraded now."""
    gen = svc.generation
    reported = any(c.type == "Degraded" and c.status == "True" and c.reason == reason for c in status.conditions)
    if message is not None:
        if not reported or status.message != message:
            svc.event("Warning", reason, message)
        status.conditions = set_condition(status.conditions, "Degraded", True, reason, message, gen)
        status.phase, status.message = Phase.degraded, message
        return True
    if reported:
        status.conditions = set_condition(status.conditions, "Degraded", False, recovered[0], recovered[1], gen)
        status.phase = Phase.deploying
        return False
    return degraded
