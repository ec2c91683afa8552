"""Routers that run split 0 (`Plan.colocate`, `exitplan router --colocate`): pure helpers of the builders.

A co-located plan has no split-0 worker Deployments and no split-0 Service: the router Deployment runs
on split 0's pool (its image, resources and placement, as a split-0 worker's, builders.py), as many
replicas as the most split-0 replicas of a bucket (each router holds split 0 of every bucket; at least
spec.router.replicas), with split 1's Service as its peers (none for a one-split plan). The operator's
readiness counts a split-0 cell's ready replicas from the routers (reconcile.refresh_readiness), and
the routers' PodDisruptionBudget follows the Deployment's replicas (disruption.py). Switching a plan
to or from co-location needs nothing more: apply.py prunes the children the new plan does not have.
"""

from __future__ import annotations

from exitplan.api.manifest import Manifest
from exitplan.api.plan import Plan, colocated_routers
from exitplan.api.resources import GPUPoolSpec


def split_zero_pool(plan: Plan, pools: dict[str, GPUPoolSpec] | None) -> tuple[str, GPUPoolSpec]:
    """The pool a co-located plan's routers run on: split 0's (name, spec). ValueError, saying what to
    do, when split 0's cells are not on exactly one pool (a router runs on one) or it is not given."""
    names = sorted({c.pool for c in plan.cells if c.split == 0})
    if len(names) != 1:
        raise ValueError(
            f"plan {plan.content_hash()} runs split 0 in the routers (colocate) but places split 0's cells on "
            f"pools {names}: a router runs on one pool; re-plan with split 0 on one pool (spec.pools) or "
            "without co-location (spec.planner.colocate: off)"
        )
    if not pools or names[0] not in pools:
        raise ValueError(f"plan places split 0 (in the routers) on pool {names[0]!r}, which is not given")
    return names[0], pools[names[0]]


def router_replicas(routers: int, plan: Plan) -> int:
    """The router Deployment's replicas: `routers` (spec.router.replicas); for a co-located plan, at
    least the most split-0 replicas of a bucket."""
    return colocated_routers(plan.cells, routers) if plan.colocate else routers


def runs_split_zero(deployment: Manifest) -> bool:
    """Whether a router Deployment (as built, or as read back) runs split 0 in its pods (`--colocate`)."""
    containers = deployment.get("spec", {}).get("template", {}).get("spec", {}).get("containers") or []
    return any("--colocate" in (c.get("args") or []) for c in containers)
