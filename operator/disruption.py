"""The routers' PodDisruptionBudget: voluntary disruptions (a node drain, a cluster upgrade) never take
the last ready router of a service.

| object | name | what |
|---|---|---|
| PodDisruptionBudget (policy/v1) | `<svc>-router` | `minAvailable: 1` over the router pods, while there are 2 or more (`spec.router.replicas`, or more for a plan whose routers run split 0) |

With one router replica there is no budget: `minAvailable: 1` over one pod would refuse every
eviction and hold a node drain forever. A rolling update does not go through the budget; the router
Deployment's `maxUnavailable: 0` keeps its replicas serving during one. A router that leaves drains
(its preStop hook, then SIGTERM, pod_template.py and worker_image/serve.py).

`with_router_budget` adds the budget to the children of a plan (rollout.py `propose_or_apply`,
for classification and generation services alike); apply.py creates, patches and deletes it with
the other children.
"""

from __future__ import annotations

from exitplan.api.manifest import Manifest
from exitplan.api.resources import EarlyExitServiceSpec
from exitplan.operator import names
from exitplan.operator.ownership import adopt

MIN_AVAILABLE = 1


def build_router_budget(
    service: str, namespace: str, spec: EarlyExitServiceSpec, plan_hash: str, replicas: int | None = None
) -> Manifest | None:
    """The PodDisruptionBudget of the service's routers, or None with fewer than 2 router replicas
    (`replicas`: the router Deployment's, when it has more than spec.router.replicas)."""
    if (spec.router.replicas if replicas is None else replicas) < 2:
        return None
    labels = names.selector_labels(service, "router")
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": names.router_name(service),
            "namespace": namespace,
            "labels": {**names.MANAGED, **labels},
            "annotations": {names.A_PLAN_HASH: plan_hash},
        },
        "spec": {"minAvailable": MIN_AVAILABLE, "selector": {"matchLabels": labels}},
    }


def with_router_budget(
    owner: Manifest, spec: EarlyExitServiceSpec, plan_hash: str, children: list[Manifest]
) -> list[Manifest]:
    """`children` and, when the service has 2 or more routers, their budget, adopted by `owner`."""
    routers = [
        int(c["spec"]["replicas"])
        for c in children
        if c["kind"] == "Deployment" and c["metadata"]["labels"].get(names.L_COMPONENT) == "router"
    ]
    replicas = max([spec.router.replicas, *routers])
    budget = build_router_budget(owner["metadata"]["name"], owner["metadata"]["namespace"], spec, plan_hash, replicas)
    if budget is None:
        return children
    adopt([budget], owner=owner)
    return [*children, budget]
