"""What the operator keeps per service between handler calls, in kopf's per-object memo: the plan in force as
last read from its ConfigMap, and the planner's option tables of the service's last plan.

The drift loop asks for the plan in force at every router read (twice a period by default); it is read from the
API once and kept until this process writes the service's children again (`children_written`, called
after every apply), or kept as written when this process writes only the plan ConfigMap (`written`: a
re-tune's thresholds, live_thresholds.persist_thresholds). The planner's OptionCache (planner/problem.py)
lets a re-plan reuse the tables whose inputs did not change. Without a memo (tests, a one-off call) nothing
is kept.
"""

from __future__ import annotations

from typing import Any

from exitplan.api.plan import Plan
from exitplan.operator.kube import KubeClient
from exitplan.operator.service_state import current_plan, read_plan
from exitplan.planner.problem import OptionCache

PLAN_CACHE_KEY = "plan_cache"
"""The per-object memo's key for the service's planner OptionCache."""
PLAN_IN_FORCE_KEY = "plan_in_force"
"""The per-object memo's key for the plan in force as last read."""
PLAN_HASH_KEY = "plan_in_force_hash"
"""The per-object memo's key for (the plan in force as last read, its content hash)."""
CONFIGMAP_VERSION_KEY = "plan_configmap_version"
"""The per-object memo's key for the plan ConfigMap's resourceVersion as this process last read or wrote it."""


async def plan_in_force(memo: Any, client: KubeClient, name: str, namespace: str) -> Plan | None:
    """The plan in force (service_state.read_plan), read once and kept in the per-object memo until `children_written`."""
    if memo is None:
        return await current_plan(client, name, namespace)
    kept = memo.get(PLAN_IN_FORCE_KEY)
    if isinstance(kept, Plan):
        return kept
    plan, version = await read_plan(client, name, namespace)
    if plan is not None:
        memo[PLAN_IN_FORCE_KEY], memo[CONFIGMAP_VERSION_KEY] = plan, version
    return plan


def configmap_version(memo: Any) -> str | None:
    """The plan ConfigMap's resourceVersion when this process read or wrote it last and wrote no child since
    (a write of the ConfigMap alone can then carry it without reading the ConfigMap first); else None."""
    kept = memo.get(CONFIGMAP_VERSION_KEY) if memo is not None else None
    return kept if isinstance(kept, str) and kept else None


def content_hash(memo: Any, plan: Plan) -> str:
    """`plan.content_hash()`, kept in the per-object memo for the plan `plan_in_force` returned (the drift loop
    compares it with the routers' at every read; hashing the plan's JSON cost more than the rest of the read's
    bookkeeping). The plan kept is never changed in place: a new plan is a new object."""
    kept = memo.get(PLAN_HASH_KEY) if memo is not None else None
    if kept is not None and kept[0] is plan:
        return str(kept[1])
    digest = plan.content_hash()
    if memo is not None:
        memo[PLAN_HASH_KEY] = (plan, digest)
    return digest


def children_written(memo: Any) -> None:
    """After this process wrote the service's children (the plan ConfigMap among them): read the plan again."""
    if memo is not None:
        memo.pop(PLAN_IN_FORCE_KEY, None)
        memo.pop(PLAN_HASH_KEY, None)
        memo.pop(CONFIGMAP_VERSION_KEY, None)


def written(memo: Any, plan: Plan, version: str = "", digest: str = "") -> None:
    """After this process wrote `plan` into the plan ConfigMap (and no other child): it is the plan in force,
    kept without reading the ConfigMap back; `version`: the ConfigMap's resourceVersion as written; `digest`: its
    content hash when the caller has it (the ConfigMap's annotation as built), kept for `content_hash`."""
    if memo is not None:
        memo[PLAN_IN_FORCE_KEY] = plan
        memo.pop(PLAN_HASH_KEY, None)
        if digest:
            memo[PLAN_HASH_KEY] = (plan, digest)
        memo[CONFIGMAP_VERSION_KEY] = version


def plan_cache(memo: Any) -> OptionCache:
    """The service's planner OptionCache (a fresh one without a memo)."""
    if memo is None:
        return OptionCache()
    cache = memo.get(PLAN_CACHE_KEY)
    if not isinstance(cache, OptionCache):
        cache = memo[PLAN_CACHE_KEY] = OptionCache()
    return cache
