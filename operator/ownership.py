"""Who owns a service's children: the EarlyExitService, through kopf.adopt.

Every child the operator creates (Deployments, Services, ConfigMaps, Jobs, the PodDisruptionBudget,
the control-token Secret) gets an ownerReference to its EarlyExitService and the service's namespace,
so deleting the service lets the garbage collector take them.
"""

from __future__ import annotations

from typing import cast

import kopf

from exitplan.api.manifest import Manifest


def kopf_body(obj: Manifest) -> kopf.Body:
    """kopf's read-only view of an object as read from the API (what kopf.adopt and kopf.event read)."""
    return kopf.Body(cast(kopf.RawBody, obj))


def adopt(children: list[Manifest], owner: Manifest) -> None:
    """Make `owner` (an EarlyExitService as read from the API) the owner of `children`: the
    ownerReference, the owner's namespace, and its name as a prefix where a child has none."""
    kopf.adopt(children, owner=kopf_body(owner))
