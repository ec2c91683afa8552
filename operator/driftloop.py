"""The drift loop (the kopf timer). The loop reads every router CHECKS_PER_PERIOD times a period
(drift.py) and keeps what arrived since its previous read: the router's window in progress
(`/v1/observations?window=current`) less what the previous read saw of it, plus the rest of that
window when it closed meanwhile (`/v1/observations`, the last closed window). The judged window is
the newest of those slices covering half a period and drift.MIN_REQUESTS arrivals, judged once per
read that brought new arrivals; a limit crossed re-plans, with a cooldown and a cap on how many
replicas move at once (the rest follows in steps, one per period once the previous step is rolled
out). A length-drift re-plan sizes the buckets for the traffic since the shift (drift.after_change),
and a new plan is judged only on what arrives after it. Advisory mode only reports (status.drift,
status.proposal, events).

Why a length shift is re-planned within two periods (P): from its start at t, the judged window
holds only shifted arrivals by t + P/2 (given MIN_REQUESTS arrivals by then; a mix crosses the
limit sooner), a read falls at most P/4 (or one timer tick, if longer) later, and the plan and the
apply follow at once: t + 3P/4 + plan + apply. Router windows (one period long) matter only for
how much history a read can recover: a read sees the window in progress and the one before it.

Thresholds the routers run with but the plan does not carry (the loop's own re-tuning pushed them,
or someone else did) are written into the plan ConfigMap, so a router that restarts reads them.

Where the routers' `/v1/observations` is read from, first that answers:
1. router Pods with a podIP (in a cluster: every replica, windows merged);
2. the router Service's `status.loadBalancer.ingress` ip:port (a LoadBalancer, or the local
   endpoint the dev-cluster's Service stand-in publishes there);
3. the router Service's cluster DNS name `<svc>.<ns>.svc:8080`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp
from pydantic import ValidationError

from exitplan.api.observations import Observations
from exitplan.api.resources import EarlyExitServiceSpec, Mode
from exitplan.operator import apply as applying
from exitplan.operator import builders, drift
from exitplan.operator import reconcile as rec
from exitplan.operator.kube import ApiError, path
from exitplan.operator.metrics import METRICS
from exitplan.operator.status import Phase, Proposal, parse_status, summarize

log = logging.getLogger("exitplan.operator.drift")
HISTORY = 12
"""Observation windows kept per service (in the handler memo) for the survival forecast."""
TUNE_WINDOW = 1024
"""Shadow-sampled inputs read from the router for threshold tuning."""


async def router_urls(svc: rec.Service) -> list[str]:
    pods = await svc.client.list(path("Pod", svc.namespace),
                                 f"{builders.L_SERVICE}={svc.name},{builders.L_COMPONENT}=router")
    urls = [f"http://{p['status']['podIP']}:{builders.PORT}" for p in pods if (p.get("status") or {}).get("podIP")]
    if urls:
        return urls
    try:
        service = await svc.client.get(path("Service", svc.namespace, builders.dns_name(svc.name)))
    except ApiError as err:
        if err.status == 404:
            return []
        raise
    for ingress in ((service.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []:
        host = ingress.get("ip") or ingress.get("hostname")
        ports = ingress.get("ports") or [{"port": builders.PORT}]
        if host:
            return [f"http://{host}:{ports[0]['port']}"]
    return [f"http://{builders.dns_name(svc.name)}.{svc.namespace}.svc:{builders.PORT}"]


def merge_windows(windows: list[Observations]) -> Observations:
    """Several routers' windows as one (counts add, survival weighted by requests, p99 = max)."""
    return drift.combine(windows)


async def _get(session: aiohttp.ClientSession, url: str) -> Observations:
    async with session.get(url) as rsp:
        if rsp.status != 200:
            raise aiohttp.ClientResponseError(rsp.request_info, (), status=rsp.status, message=f"HTTP {rsp.status}")
        return Observations.model_validate(await rsp.json(content_type=None))


async def read_routers(svc: rec.Service, seen: dict[str, Observations], urls: list[str] | None = None,
                       timeout: float = 5.0) -> tuple[Observations | None, Observations | None, str]:
    """(what arrived since the previous read, over every router that answers; the newest full
    window, merged over routers; a note on what failed). `seen` (router URL -> that router's
    window in progress as last read) is updated in place; `urls`: the routers (default: looked up)."""
    urls = await router_urls(svc) if urls is None else urls
    slices, latest, notes = [], [], []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        for url in urls:
            try:
                current = await _get(session, f"{url}/v1/observations?window=current")
                closed = await _get(session, f"{url}/v1/observations")
            except (aiohttp.ClientError, asyncio.TimeoutError, ValidationError, ValueError) as err:
                notes.append(f"{url}: {type(err).__name__} {getattr(err, 'status', '')}".strip())
                continue
            windows = [closed, current]  # before the first roll `closed` is the window in progress too
            piece = drift.since_last(windows, seen.get(url))
            newest = max(windows, key=lambda w: (w.since, w.until))
            seen[url] = newest
            latest.append(newest)
            if piece is not None:
                slices.append(piece)
    for url in list(seen):
        if url not in urls:
            del seen[url]
    return (drift.combine(slices) if slices else None), (drift.combine(latest) if latest else None), "; ".join(notes)


async def fetch_observations(svc: rec.Service, timeout: float = 5.0) -> tuple[Observations | None, str]:
    """The merged last closed window of every router that answers, and a note on what failed."""
    urls = await router_urls(svc)
    windows, notes = [], []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        for url in urls:
            try:
                windows.append(await _get(session, f"{url}/v1/observations"))
            except (aiohttp.ClientError, asyncio.TimeoutError, ValidationError, ValueError) as err:
                notes.append(f"{url}: {type(err).__name__}")
    return (merge_windows(windows) if windows else None), "; ".join(notes)


def _retune_step(urls: list[str], ramps: list[str], budget: float, apply: bool) -> Any:
    from exitplan.planner.tuning import autotune
    from exitplan.planner.tuning.thresholds import WindowError

    try:
        window = autotune.fetch_window(urls[0], TUNE_WINDOW)
        if window is None:  # no feedback yet
            return None
        decision = autotune.decide(window, ramps, autotune.current_thresholds(urls[0]), budget)
        if decision.thresholds is not None and apply:
            for url in urls:
                autotune.push(url, decision.thresholds, f"tune-{decision.reason}")
        return decision
    except (OSError, ValueError, KeyError, WindowError) as err:  # unreachable router, short/odd window
        log.info("threshold re-tune skipped: %s", err)
        return None


async def retune(svc: rec.Service, spec: EarlyExitServiceSpec, ramps: list[str], lock: asyncio.Lock | None = None) -> None:
    """Apparate's continual tuning on the routers' shadow-sampled feedback (exitplan.planner.tuning.autotune):
    new thresholds when the ones in force break the accuracy budget or leave savings unclaimed.
    Advisory mode computes but does not push. Pushed thresholds are written into the plan
    ConfigMap at once (under the service's lock), so a router that restarts keeps them."""
    try:
        urls = await router_urls(svc)
    except ApiError as err:
        log.info("threshold re-tune skipped: %s", err)
        return
    if not urls:
        return
    active = spec.planner.mode == Mode.active
    decision = await asyncio.get_running_loop().run_in_executor(
        None, _retune_step, urls, ramps, spec.accuracy.max_drop, active)
    if decision is not None and decision.thresholds is not None:
        verb = "re-tuned" if active else "would re-tune"
        svc.event("Normal", "ThresholdsTuned", f"{verb} exit thresholds ({decision.reason}): agreement "
                  f"{decision.agreement_before:.4f} -> {decision.agreement_after:.4f} on {decision.samples} samples")
        if active:
            async with (lock or asyncio.Lock()):
                fresh = await svc.client.list(path("EarlyExitService", svc.namespace), fields=f"metadata.name={svc.name}")
                if fresh:
                    await persist_thresholds(rec.Service(body=fresh[0], client=svc.client), decision.thresholds,
                                             f"tune-{decision.reason}")


def _same_thresholds(a: dict[str, float], b: dict[str, float]) -> bool:
    return set(a) == set(b) and all(abs(a[k] - b[k]) <= 1e-9 for k in a)


async def persist_thresholds(svc: rec.Service, thresholds: dict[str, float], source: str) -> bool:
    """Write `thresholds` into the plan in force (plan ConfigMap, children's plan hash, status.plan)
    when they differ from the plan's: the same cells, not a re-plan (no lastReplanTime). True when
    written. Call under the service's lock (a concurrent re-plan must not be overwritten)."""
    plan = await rec.current_plan(svc.client, svc.name, svc.namespace)
    if plan is None or not thresholds or _same_thresholds(plan.thresholds, thresholds):
        return False
    try:
        spec = EarlyExitServiceSpec.model_validate(svc.body.get("spec") or {})
    except ValidationError:
        return False
    inputs = await rec.read_inputs(svc.client, spec, svc.namespace)
    if inputs.unknown_pools or {c.pool for c in plan.cells} - set(inputs.pools):
        return False  # the next reconcile reports it; the routers keep the pushed values meanwhile
    updated = plan.model_copy(update={"thresholds": {k: float(v) for k, v in thresholds.items()}})
    children = builders.build_children(svc.body, spec, updated, inputs.pools)
    await applying.apply_children(svc.client, children, svc.name, svc.namespace)
    status = parse_status(svc.body.get("status"))
    ready = {(c.split, c.bucket, c.pool): c.ready_replicas for c in (status.plan.cells if status.plan else [])}
    status.plan = summarize(updated, ready)
    await svc.write_status(status)
    log.info("%s/%s: thresholds %s written into plan %s (%s)", svc.namespace, svc.name, updated.thresholds,
             updated.content_hash(), source)
    svc.event("Normal", "ThresholdsPersisted", f"plan {updated.content_hash()} carries the live thresholds ({source})")
    return True


PROFILE_RECHECK_SECONDS = 30.0
"""A service waiting for a profile re-checks this often (in case a ModelProfile event was missed)."""


async def on_tick(svc: rec.Service, memo: Any) -> None:
    """One timer tick: re-check a profiling wait, refresh readiness, read the routers for drift."""
    if (svc.body.get("status") or {}).get("phase") == "Profiling":
        now = time.monotonic()
        if now - memo.get("profile_check", 0.0) > PROFILE_RECHECK_SECONDS:
            memo["profile_check"] = now
            await rec.reconcile(svc, reason="initial")
        return
    await rec.refresh_readiness(svc)
    await check_drift(svc, memo)


def _service_lock(svc: rec.Service, memo: Any) -> asyncio.Lock | None:
    """The per-service lock the handlers hold (handlers.py keeps them in kopf's operator memo)."""
    locks = memo.get("locks")
    return locks[(svc.namespace, svc.name)] if locks is not None else None


async def check_drift(svc: rec.Service, memo: Any) -> None:
    """One drift-loop read (the timer calls it every tick; it reads CHECKS_PER_PERIOD times a period)."""
    status = parse_status(svc.body.get("status"))
    try:
        spec = EarlyExitServiceSpec.model_validate(svc.body.get("spec") or {})
    except ValidationError:
        return
    if status.phase in (Phase.profiling, Phase.pending) or status.plan is None:
        return
    period = float(spec.planner.period_seconds)
    interval = period / drift.CHECKS_PER_PERIOD
    now = time.monotonic()
    last = memo.get("last_check")
    if last is not None and now - last < interval:
        return
    # reads on a grid of `interval` (a tick longer than it rounds single reads up, not the average)
    memo["last_check"] = now if last is None or now - last >= 2 * interval else last + interval
    seen: dict[str, Observations] = memo.setdefault("seen", {})
    urls, looked_up = memo.get("router_urls") or (None, 0.0)
    if not urls or now - looked_up >= period:  # the routers' addresses, looked up once a period
        urls = await router_urls(svc)
        memo["router_urls"] = (urls, now)
    piece, latest, note = await read_routers(svc, seen, urls)
    if note:
        memo["router_urls"] = None  # a router did not answer: look them up again next read
    if latest is None:
        log.info("%s/%s: no observations (%s)", svc.namespace, svc.name, note or "no router endpoint")
        return
    plan = await rec.current_plan(svc.client, svc.name, svc.namespace)
    if plan is None:  # advisory from the start: nothing applied to compare against
        return
    active = spec.planner.mode == Mode.active
    if (active and latest.thresholds and latest.plan_hash == plan.content_hash()
            and not _same_thresholds(latest.thresholds, plan.thresholds)):
        # the routers run this plan with other thresholds (pushed live): the plan carries them from now on
        if await persist_thresholds(svc, latest.thresholds, "observed on the routers"):
            plan = await rec.current_plan(svc.client, svc.name, svc.namespace) or plan
            status = parse_status(svc.body.get("status"))

    slices: list[Observations] = memo.setdefault("slices", [])
    report = None
    if piece is not None:
        slices.append(piece)
        del slices[:-64]
        while slices and slices[-1].until - slices[0].until > drift.KEEP_PERIODS * period:
            slices.pop(0)
    if piece is not None and (drift.arrivals(piece) or piece.requests):
        judged = drift.recent(slices, period)
        history: list[list[float]] = memo.setdefault("survival", [])
        # the survival forecast fits ARIMA per ramp (tens of ms): off the event loop every service shares
        report = await asyncio.get_running_loop().run_in_executor(
            None, drift.assess, plan, judged, spec.planner.drift, spec.slo.latency_ms, list(history))
        log.info("%s/%s: %.1f s until %.1f (%d new, %d judged arrivals; %d answered): length score %.3f, "
                 "survival error %.3f, p99 %.0f ms%s", svc.namespace, svc.name, judged.until - judged.since,
                 judged.until, drift.arrivals(piece), drift.arrivals(judged), judged.requests, report.length_score,
                 report.survival_error, report.p99_ms, f" -> {report.trigger}" if report.trigger else "")
        block: list[Observations] = memo.setdefault("survival_block", [])
        block.append(piece)  # the forecaster's series: consecutive half-period blocks
        whole = drift.combine(block)
        if whole.until - whole.since >= drift.JUDGED_PERIODS * period and whole.requests >= drift.MIN_REQUESTS:
            history.append(list(whole.survival))
            del history[:-HISTORY]
            block.clear()
        METRICS.length_score.labels(svc.namespace, svc.name).set(report.length_score)
        METRICS.survival_error.labels(svc.namespace, svc.name).set(report.survival_error)
        status.drift = report
        memo["judged"] = judged
    held = status.proposal if status.proposal and status.proposal.held_back.startswith("cooldown") else None
    if report is None and held is not None and memo.get("judged") is not None:
        # nothing new arrived, but a re-plan waits for its cooldown: the window that raised it still stands
        report = await asyncio.get_running_loop().run_in_executor(
            None, drift.assess, plan, memo["judged"], spec.planner.drift, spec.slo.latency_ms, list(memo.get("survival", [])))
    limits = spec.planner.drift
    trigger = report.trigger if report else ""
    pending = status.proposal if status.proposal and status.proposal.held_back.startswith("move cap") else None

    if pending is not None and active:
        # the next step of a capped re-plan: once the previous step is rolled out, one per period
        due = status.phase == Phase.ready and now - memo.get("last_step", 0.0) >= period
        if not due:
            if report is not None:
                await svc.write_status(status)
            return
        reason = trigger or pending.reason
    elif trigger:
        reason = trigger
        if not active and status.proposal and status.proposal.reason == reason and now - memo.get("proposed", -period) < period:
            await svc.write_status(status)  # advisory: the same proposal at most once a period
            return
        memo["proposed"] = now
        wait = drift.cooldown_left(status.last_replan_time, limits.cooldown_seconds)
        if wait > 0 and active:
            status.proposal = Proposal(reason=reason, hash="", held_back=f"cooldown: {wait:.0f}s left")
            await svc.write_status(status)
            if held is None or held.reason != reason:  # once per hold, not every read
                svc.event("Normal", "ReplanHeld", f"{reason} (length score {report.length_score}, survival error "
                          f"{report.survival_error}, p99 {report.p99_ms} ms): cooldown, {wait:.0f}s left")
            return
    else:  # no re-plan: the thresholds may still need re-tuning
        if status.proposal and status.proposal.held_back.startswith("cooldown"):
            status.proposal = None  # the drift that was held back is gone
        if report is not None:
            await svc.write_status(status)
        task = memo.get("tune_task")
        if latest.ramps and (task is None or task.done()) and now - memo.get("last_tune", -period) >= period:
            memo["last_tune"] = now  # once a period, in the background: never delays a drift check
            memo["tune_task"] = asyncio.create_task(retune(svc, spec, latest.ramps, _service_lock(svc, memo)))
        return

    if trigger:
        svc.event("Normal", "Replan", f"{reason}: length score {report.length_score} (limit {limits.length_score}), "
                  f"survival error {report.survival_error} (limit {limits.survival_error}), p99 {report.p99_ms} ms")
    else:
        svc.event("Normal", "ReplanStep", f"{reason}: the next step toward the capped re-plan ({pending.held_back})")
    inputs = await rec.read_inputs(svc.client, spec, svc.namespace)
    if inputs.unknown_pools or inputs.missing_profiles:
        return  # the next spec reconcile reports these
    status.pools_digest = inputs.digest()
    memo["last_step"] = now
    observed = memo.get("judged") or latest
    if reason == "length-drift" and (shifted := drift.after_change(slices, plan)) is not None:
        # size the buckets for the traffic since the shift, not for the mix the judged window holds
        observed = observed.model_copy(update={"length_buckets": list(shifted.length_buckets),
                                               "length_histogram": list(shifted.length_histogram)})
    after = await rec.plan_and_apply(svc, spec, inputs, status, reason=reason, previous=plan,
                                     observations=observed, max_move_fraction=limits.max_move_fraction)
    if active and after.plan is not None and after.plan.hash != plan.content_hash():
        slices.clear()  # judged against the old plan; the new one is judged on what arrives from now on
