"""The exit thresholds the routers run, from the operator's side: Apparate's continual re-tuning on the
routers' shadow-sampled feedback (once a period per service, in the background of the drift loop,
driftloop.py), and thresholds the routers run with but the plan does not carry (the re-tune pushed them, or
someone else did) written into the plan in force, so a router that restarts reads them.

The routers are reached as the drift loop's last read reached them (RouterAccess: their control URLs, the
control token and the operator's connections), or looked up here when there is no such read.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import aiohttp
from pydantic import ValidationError

from exitplan.api.resources import EarlyExitServiceSpec, Mode
from exitplan.operator import apply as applying
from exitplan.operator import builders, control_token, guards, plan_memory
from exitplan.operator.kube import ApiError, path
from exitplan.operator.rollout import all_children
from exitplan.operator.router_endpoints import router_urls
from exitplan.operator.service_state import Service, current_plan, read_inputs
from exitplan.operator.status import parse_status, summarize
from exitplan.planner.tuning import autotune
from exitplan.planner.tuning.feedback import FeedbackWindow, WindowError
from exitplan.worker_image.control_client import ControlClient, ControlError, FeedbackArrays
from exitplan.worker_image.router_fleet import fleet_feedback, fleet_thresholds, push_fleet

log = logging.getLogger("exitplan.operator.drift")
TUNE_WINDOW = 1024
"""Shadow-sampled inputs read from the router for threshold tuning."""
TUNE_TIMEOUT = 10.0
"""Seconds a threshold-tuning request to a router may take."""


async def router_token(svc: Service) -> str | None:
    """The service's control token (None when it cannot be read: the routers then answer 401, which
    the caller reports like any unreachable router)."""
    try:
        return await control_token.read_token(svc.client, svc.name, svc.namespace)
    except ApiError as err:
        log.warning("%s/%s: cannot read the control token: %s", svc.namespace, svc.name, err)
        return None


@dataclass(frozen=True)
class RouterAccess:
    """How the drift loop reaches a service's routers: their control URLs, the control token, the
    operator's connections (a re-tune reuses them rather than looking up, reading the Secret and
    connecting again)."""

    urls: list[str]
    token: str | None
    session: aiohttp.ClientSession | None


def _tune(arrays: FeedbackArrays, ramps: list[str], current: dict[str, float], budget: float) -> autotune.Decision:
    """The tuning policy on one feedback window (numpy work: run it off the event loop)."""
    window = FeedbackWindow(arrays.conf, arrays.pred, arrays.final, arrays.saving_ms, arrays.cost_ms)
    return autotune.decide(window, ramps, current, budget, autotune.TuneConfig())


async def _retune_step(
    urls: list[str],
    ramps: list[str],
    budget: float,
    apply: bool,
    token: str | None = None,
    session: aiohttp.ClientSession | None = None,
) -> tuple[autotune.Decision, int] | None:
    """Read every router's feedback (one merged window) and the newest thresholds among them, decide
    (in a worker thread), and push new thresholds to every router as the next version when `apply`
    (`router_fleet`). (decision, the version pushed or in force); None when there is no feedback yet or
    a step failed. `session`: connections to reuse (the operator's; not closed here)."""
    clients = [ControlClient(url, timeout_s=TUNE_TIMEOUT, token=token, session=session) for url in urls]
    try:
        arrays, missed = await fleet_feedback(clients, TUNE_WINDOW)
        for note in missed:
            log.info("a router's feedback is left out of this re-tune: %s", note)
        if arrays is None:  # no feedback yet
            return None
        current = await fleet_thresholds(clients)
        decision = await asyncio.to_thread(_tune, arrays, ramps, current.values, budget)
        version = current.version
        if decision.thresholds is not None and apply:
            version = (await push_fleet(clients, current, decision.thresholds, f"tune-{decision.reason}")).version
        return decision, version
    except (ControlError, WindowError, KeyError) as err:  # unreachable routers, short/odd window
        log.info("threshold re-tune skipped: %s", err)
        return None
    finally:
        for client in clients:
            await client.close()


async def retune(
    svc: Service,
    spec: EarlyExitServiceSpec,
    ramps: list[str],
    lock: asyncio.Lock | None = None,
    access: RouterAccess | None = None,
) -> None:
    """Apparate's continual tuning on the routers' shadow-sampled feedback (exitplan.planner.tuning.autotune):
    new thresholds when the ones in force break the accuracy budget or leave savings unclaimed.
    Advisory mode computes but does not push. Pushed thresholds are written into the plan
    ConfigMap at once (under the service's lock), so a router that restarts keeps them. A bundle with no
    exit ramp is the plain model: nothing to tune. `access`: the drift loop's routers, token and connections
    (looked up and read here when None)."""
    if not ramps:
        return
    if access is None:
        try:
            urls = await router_urls(svc)
        except ApiError as err:
            log.info("threshold re-tune skipped: %s", err)
            return
        token = await router_token(svc) if urls else None
        session = None
    else:
        urls, token, session = access.urls, access.token, access.session
    if not urls:
        return
    active = spec.planner.mode == Mode.active
    stepped = await _retune_step(urls, ramps, spec.accuracy.max_drop, active, token, session)
    if stepped is None:
        return
    decision, version = stepped
    if decision.thresholds is not None:
        verb = "re-tuned" if active else "would re-tune"
        svc.event(
            "Normal",
            "ThresholdsTuned",
            f"{verb} exit thresholds ({decision.reason}): agreement "
            f"{decision.agreement_before:.4f} -> {decision.agreement_after:.4f} on {decision.samples} samples",
        )
        if active:
            async with lock or asyncio.Lock():
                fresh = await svc.client.list(
                    path("EarlyExitService", svc.namespace), fields=f"metadata.name={svc.name}"
                )
                if fresh:
                    await persist_thresholds(
                        Service(body=fresh[0], client=svc.client, memo=svc.memo),
                        decision.thresholds,
                        f"tune-{decision.reason}",
                        version,
                    )


def same_thresholds(a: dict[str, float], b: dict[str, float]) -> bool:
    return set(a) == set(b) and all(abs(a[k] - b[k]) <= 1e-9 for k in a)


async def persist_thresholds(svc: Service, thresholds: dict[str, float], source: str, version: int = 0) -> bool:
    """Write `thresholds` into the plan in force (plan ConfigMap, children's plan hash, status.plan)
    when they differ from the plan's, with their `version` (the routers' set: a router that restarts
    reads it and keeps the version): the same cells, not a re-plan (no lastReplanTime). True when
    written. Call under the service's lock (a concurrent re-plan must not be overwritten)."""
    plan = await current_plan(svc.client, svc.name, svc.namespace)
    if plan is None or not thresholds or same_thresholds(plan.thresholds, thresholds):
        return False
    try:
        spec = EarlyExitServiceSpec.model_validate(svc.body.get("spec") or {})
    except ValidationError:
        return False
    if guards.bundle_refusal(spec, svc.settings) is not None:
        return False  # the spec names a bundle path this operator does not mount (the reconcile says so)
    inputs = await read_inputs(svc.client, spec, svc.namespace)
    if inputs.unknown_pools or {c.pool for c in plan.cells} - set(inputs.pools):
        return False  # the next reconcile reports it; the routers keep the pushed values meanwhile
    values = {k: float(v) for k, v in thresholds.items()}
    updated = plan.model_copy(update={"thresholds": values, "thresholds_version": version})
    children = all_children(svc, spec, updated, builders.build_children(svc.body, spec, updated, inputs.pools))
    await applying.apply_children(svc.client, children, svc.name, svc.namespace)  # the budget and policies kept
    plan_memory.children_written(svc.memo)
    status = parse_status(svc.body.get("status"))
    ready = {(c.split, c.bucket, c.pool): c.ready_replicas for c in (status.plan.cells if status.plan else [])}
    status.plan = summarize(updated, ready, max((len(p.ramps) for p in inputs.profiles.values()), default=None))
    await svc.write_status(status)
    log.info(
        "%s/%s: thresholds %s written into plan %s (%s)",
        svc.namespace,
        svc.name,
        updated.thresholds,
        updated.content_hash(),
        source,
    )
    svc.event("Normal", "ThresholdsPersisted", f"plan {updated.content_hash()} carries the live thresholds ({source})")
    return True
