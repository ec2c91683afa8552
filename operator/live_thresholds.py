"""The exit thresholds the routers run, from the operator's side: Apparate's continual re-tuning on the
routers' shadow-sampled feedback (once a period per service, in the background of the drift loop,
driftloop.py), and thresholds the routers run with but the plan does not carry (the re-tune pushed them, or
someone else did) written into the plan in force, so a router that restarts reads them.

The routers are reached as the drift loop's last read reached them (RouterAccess: their control URLs, the
control token and the operator's connections), or looked up here when there is no such read.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from pydantic import ValidationError

from exitplan.api.plan import Plan
from exitplan.api.resources import EarlyExitServiceSpec, Mode
from exitplan.operator import apply as applying
from exitplan.operator import builders, control_token, drift, drift_writes, guards, plan_memory
from exitplan.operator.kube import ApiError, path
from exitplan.operator.names import A_PLAN_HASH
from exitplan.operator.ownership import adopt
from exitplan.operator.router_endpoints import router_urls
from exitplan.operator.service_state import Service
from exitplan.operator.status import ServiceStatus, parse_status, summarize
from exitplan.planner.tuning import autotune
from exitplan.planner.tuning.feedback import FeedbackWindow, WindowError
from exitplan.worker_image.control_client import ControlClient, ControlError, FeedbackArrays
from exitplan.worker_image.router_fleet import FeedbackFollower, fleet_feedback, fleet_thresholds, push_fleet
from exitplan.worker_image.threshold_set import ThresholdSet

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


TUNER_KEY = "tuner_state"
"""The per-object memo's key for the tuner's autotune.TunerState (fresh samples since the last breach or
drift, the unconfirmed drift alarm, the last look's newest samples): carried from one re-tune to the next."""


def _tune(
    arrays: FeedbackArrays, ramps: list[str], current: dict[str, float], budget: float, state: autotune.TunerState
) -> tuple[autotune.Decision, autotune.TunerState]:
    """The tuning policy on one feedback window, on the event loop: a few milliseconds of numpy once a period per
    service. A worker thread saved the loop no time and cost CPU of its own -- the hop, and the GIL's hand-overs
    while the loop runs, under which a look took up to 5-8x its CPU (bench/retune_cpu.py; BENCHMARKS.md, issue
    31). The live loop's (`exitplan up`'s) `advance` with its settings, autotune.LIVE. A single look without the state, at
    decide's defaults, tunes to the edge of the window's errors and breaks the budget on the inputs that
    follow (bench/retune_replay.py)."""
    window = FeedbackWindow(arrays.conf, arrays.pred, arrays.final, arrays.saving_ms, arrays.cost_ms)
    return autotune.advance(state, window, current, ramps, budget, autotune.LIVE)


FOLLOWER_KEY = "feedback_follower"
"""The per-object memo's key for the routers' feedback windows as last read (router_fleet.FeedbackFollower)."""


def feedback_follower(memo: Any) -> FeedbackFollower | None:
    """The service's routers' feedback as the last re-tune read it, so the next reads only what is new (None
    without a memo: each re-tune reads whole windows)."""
    if not isinstance(memo, dict):
        return None
    kept = memo.get(FOLLOWER_KEY)
    if not isinstance(kept, FeedbackFollower):
        kept = memo[FOLLOWER_KEY] = FeedbackFollower(TUNE_WINDOW)
    return kept


def tuner_state(memo: Any) -> autotune.TunerState:
    """The tuner's state kept for the service (a new one before the first re-tune)."""
    kept = memo.get(TUNER_KEY) if isinstance(memo, dict) else None
    return kept if isinstance(kept, autotune.TunerState) else autotune.TunerState()


async def _retune_step(
    urls: list[str],
    ramps: list[str],
    budget: float,
    apply: bool,
    token: str | None = None,
    session: aiohttp.ClientSession | None = None,
    in_force: dict[str, float] | None = None,
    state: autotune.TunerState = autotune.TunerState(),
    follower: FeedbackFollower | None = None,
    in_force_version: int | None = None,
) -> tuple[autotune.Decision, int | None, autotune.TunerState] | None:
    """Read every router's feedback (one merged window), decide (from the tuner's
    `state`) against the thresholds in force -- `in_force`, what the drift read just saw, or else the
    newest set among the routers -- and push new thresholds to every router as the version after the newest
    set when `apply` (`router_fleet`): after `in_force_version` (the highest the drift read saw) when given
    with `in_force`, else after the newest set the routers answer now (a GET per router). (decision, the
    version pushed, or the version in force when it was read, else None, and the state to keep once the
    decision is carried out); None when there is no feedback yet or a step failed. `session`: connections to
    reuse (the operator's; not closed here)."""
    clients = [ControlClient(url, timeout_s=TUNE_TIMEOUT, token=token, session=session) for url in urls]
    try:
        arrays, missed = await fleet_feedback(clients, TUNE_WINDOW, follower)
        for note in missed:
            log.info("a router's feedback is left out of this re-tune: %s", note)
        if arrays is None:  # no feedback yet
            return None
        if in_force and in_force_version is not None:  # the drift read's: no GET per router before the push
            current: ThresholdSet | None = ThresholdSet(dict(in_force), in_force_version)
        else:
            current = None if in_force else await fleet_thresholds(clients)
        values = in_force or (current.values if current else {})
        decision, after = _tune(arrays, ramps, values, budget, state)
        version = current.version if current else None
        if decision.thresholds is not None and apply:
            current = current or await fleet_thresholds(clients)  # the version to follow
            version = (await push_fleet(clients, current, decision.thresholds, f"tune-{decision.reason}")).version
        return decision, version, after
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
    in_force: dict[str, float] | None = None,
    in_force_version: int | None = None,
) -> None:
    """Apparate's continual tuning on the routers' shadow-sampled feedback (exitplan.planner.tuning.autotune):
    new thresholds when the ones in force break the accuracy budget or leave savings unclaimed, by the live
    loop's policy (`autotune.advance` with autotune.LIVE, its state kept in the memo from one re-tune to the
    next: after a breach only the samples since count). Advisory mode computes but does not push. Pushed
    thresholds are written into the plan ConfigMap (under the service's lock; `write_thresholds`: at most
    once per service every 5 periods or 5 minutes), so a router that restarts keeps them. A bundle with no
    exit ramp is the plain model: nothing to tune. `access`: the drift loop's routers, token and connections
    (looked up and read here when None); `in_force`: the thresholds the drift read just saw on them (read
    here when None or empty) and `in_force_version` the highest version it saw (what a push follows; the
    routers are asked for it when None: a router that predates it in its observations)."""
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
    budget, state = spec.accuracy.max_drop, tuner_state(svc.memo)
    follower = feedback_follower(svc.memo)  # only the samples since the last re-tune cross the wire
    stepped = await _retune_step(
        urls, ramps, budget, active, token, session, in_force, state, follower, in_force_version
    )
    if stepped is None:
        return
    decision, version, after = stepped
    if isinstance(svc.memo, dict) and (decision.thresholds is None or active):
        svc.memo[TUNER_KEY] = after  # the decision is carried out (advisory mode pushes nothing: the state stays)
    if decision.thresholds is not None:
        verb = "re-tuned" if active else "would re-tune"
        svc.event(
            "Normal",
            "ThresholdsTuned",
            f"{verb} exit thresholds ({decision.reason}): agreement "
            f"{decision.agreement_before:.4f} -> {decision.agreement_after:.4f} on {decision.samples} samples",
        )
        if active:
            period, source = float(spec.planner.period_seconds), f"tune-{decision.reason}"
            # the plan the routers ran when the tuner decided: status.plan.hash as stored (no parse of the status)
            base = str(((svc.body.get("status") or {}).get("plan") or {}).get("hash") or "")
            if isinstance(svc.memo, dict) and not write_due(
                svc.memo, time.monotonic(), period, svc.settings.drift_reads
            ):
                _wait(svc.memo, decision.thresholds, version or 0, source, base)  # no list of the service either
                return
            async with lock or asyncio.Lock():
                fresh = await svc.client.list(
                    path("EarlyExitService", svc.namespace), fields=f"metadata.name={svc.name}"
                )
                if fresh:
                    service = Service(body=fresh[0], client=svc.client, memo=svc.memo)
                    await write_thresholds(service, decision.thresholds, source, period, version or 0, base)


def same_thresholds(a: dict[str, float], b: dict[str, float]) -> bool:
    return set(a) == set(b) and all(abs(a[k] - b[k]) <= 1e-9 for k in a)


WRITTEN_KEY, PENDING_KEY = "thresholds_written", "thresholds_pending"
"""The per-object memo's keys: when thresholds were last written into the plan (time.monotonic()), and the
newest set that waits for its turn (values, version, source, the content hash of the plan it is for)."""


def write_due(memo: Any, now: float, period: float, reads: int = drift.CHECKS_PER_PERIOD) -> bool:
    """Whether thresholds may be written into the plan now: at most once per drift_writes.refresh_seconds
    (5 periods or 5 minutes), less half the time between two of the drift loop's reads (`reads` a period),
    as the drift loop's refresh of its figures (drift_writes.write_due) counts it: the two then fall on the same
    read and go out as one status write (driftloop.check_drift). The routers hold every pushed set meanwhile
    (versioned, passed between them), so only a restart of every router at once within that time falls back
    to the set written before."""
    written = memo.get(WRITTEN_KEY) if isinstance(memo, dict) else None
    return written is None or now - written + period / (2 * reads) >= drift_writes.refresh_seconds(period)


def stagger(uid: str, period: float) -> float:
    """What the write after a service's first is put off by: whole periods, within one refresh interval
    (drift_writes.refresh_seconds), chosen by the service's uid. Services whose first writes fell in the same
    period -- created together, or any after the operator restarted (every memo new) -- then write in different
    periods from the second on, not all in one every 5 periods (at 200 services that period cost the operator
    ~1 s more CPU than the others; BENCHMARKS.md, issue 31). The drift loop's figures follow: a threshold write
    is a status write, from which their own refresh counts."""
    slots = int(drift_writes.refresh_seconds(period) // period)
    if slots <= 1 or not uid:
        return 0.0
    return float(int.from_bytes(hashlib.sha256(uid.encode()).digest()[:4], "big") % slots) * period


def _wait(memo: dict[str, Any], thresholds: dict[str, float], version: int, source: str, base: str) -> None:
    """Keep `thresholds` as the newest set to write when a write is due (`write_pending`)."""
    memo[PENDING_KEY] = (dict(thresholds), version, source, base)


async def write_thresholds(
    svc: Service,
    thresholds: dict[str, float],
    source: str,
    period: float,
    version: int = 0,
    base: str = "",
    status: ServiceStatus | None = None,
) -> bool:
    """`persist_thresholds` when `write_due`, else the set waits in the memo as the newest to write
    (`write_pending` writes it when due, into the plan whose content hash is `base`). True when written now.
    `status`: see persist_thresholds."""
    now, memo = time.monotonic(), svc.memo if isinstance(svc.memo, dict) else None
    if memo is not None and not write_due(memo, now, period, svc.settings.drift_reads):
        _wait(memo, thresholds, version, source, base)
        return False
    written = await persist_thresholds(svc, thresholds, source, version, status)
    if memo is not None:  # written, or found already in the plan; the service's first: the next put off (stagger)
        first = WRITTEN_KEY not in memo
        uid = str((svc.body.get("metadata") or {}).get("uid") or "")
        memo[WRITTEN_KEY] = now + (stagger(uid, period) if first else 0.0)
        memo.pop(PENDING_KEY, None)
    return written


async def write_pending(svc: Service, period: float, plan_hash: str, status: ServiceStatus | None = None) -> bool:
    """Write the set that waits (the newest a re-tune pushed while a write was not due) when due, into the
    plan in force (content hash `plan_hash`); dropped when that is another plan than the one it was pushed
    for (a re-plan since: the new plan's own thresholds became the routers' next version). `status`: see
    persist_thresholds."""
    pending = svc.memo.get(PENDING_KEY) if isinstance(svc.memo, dict) else None
    if pending is None:
        return False
    values, version, source, base = pending
    if base and base != plan_hash:
        svc.memo.pop(PENDING_KEY, None)
        return False
    if not write_due(svc.memo, time.monotonic(), period, svc.settings.drift_reads):
        return False
    return await write_thresholds(svc, values, source, period, version, base, status)


async def persist_thresholds(
    svc: Service, thresholds: dict[str, float], source: str, version: int = 0, status: ServiceStatus | None = None
) -> bool:
    """Write `thresholds` into the plan in force when they differ from the plan's, with their `version` (the
    routers' set: a router that restarts reads it and keeps the version): the plan ConfigMap (plan.json and
    its plan hash) and status.plan; the other children are built from the plan less its thresholds
    (Plan.layout_hash) and stay as they are. The same cells, not a re-plan (no lastReplanTime). True when
    written. Call under the service's lock (a concurrent re-plan must not be overwritten). `status`: the
    service's status as the caller will write it in the same step (the drift loop's read): its plan summary
    is changed here and the caller writes it -- one status write and one watch event, not two; without it
    the status is written here."""
    plan = await plan_memory.plan_in_force(svc.memo, svc.client, svc.name, svc.namespace)  # read once per plan
    if plan is None or not thresholds or same_thresholds(plan.thresholds, thresholds):
        return False
    try:
        spec = EarlyExitServiceSpec.model_validate(svc.body.get("spec") or {})
    except ValidationError:
        return False
    if guards.bundle_refusal(spec, svc.settings) is not None:
        return False  # the spec names a bundle path this operator does not mount (the reconcile says so)
    values = {k: float(v) for k, v in thresholds.items()}
    updated = plan.model_copy(update={"thresholds": values, "thresholds_version": version})
    configmap = builders.build_configmap(svc.name, svc.namespace, updated)
    adopt([configmap], owner=svc.body)
    # the ConfigMap as this process last read or wrote it: patched without a GET first unless written since
    known = plan_memory.configmap_version(svc.memo)
    cm = await applying.apply_one(svc.client, configmap, applying.ApplyReport(), known)
    # the plan in force is what the ConfigMap now holds, as a read of it would parse it: no read of it back
    stored_at = str((cm.get("metadata") or {}).get("resourceVersion") or "")
    digest = str(configmap["metadata"]["annotations"][A_PLAN_HASH])  # updated.content_hash(), as built
    plan_memory.written(svc.memo, Plan.model_validate_json(configmap["data"]["plan.json"]), stored_at, digest)
    given = status is not None
    status = status if status is not None else parse_status(svc.body.get("status"))
    ready = {(c.split, c.bucket, c.pool): c.ready_replicas for c in (status.plan.cells if status.plan else [])}
    summary = summarize(updated, ready)
    summary.exits = status.plan.exits if status.plan else summary.exits  # the bundle's ramps: unchanged
    status.plan = summary
    if not given:
        await svc.write_status(status)
    log.info("%s/%s: thresholds %s written into plan %s (%s)", svc.namespace, svc.name, values, digest, source)
    svc.event("Normal", "ThresholdsPersisted", f"plan {digest} carries the live thresholds ({source})")
    return True
