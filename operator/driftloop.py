"""The drift loop (the kopf timer). Routers close an observation window every half period
(router --window-seconds = spec.planner.periodSeconds / 2); the loop reads the last closed
window twice a period, judges each window once (drift.py), merged with the window before it when
it holds too few requests to judge, and re-plans when a limit is crossed, with a cooldown and a
cap on replica moves. A shift at time t fills a whole window by t + P (P = the period), which is
read by t + 1.5 P: the re-plan is applied within two periods. Advisory mode only reports
(status.drift, status.proposal, events).

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
from exitplan.operator import builders, drift
from exitplan.operator import reconcile as rec
from exitplan.operator.kube import ApiError, path
from exitplan.operator.metrics import METRICS
from exitplan.operator.status import Phase, Proposal, parse_status

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
    if len(windows) == 1:
        return windows[0]
    first = windows[0]
    total = sum(w.requests for w in windows) or 1
    merged = first.model_copy(deep=True)
    merged.since = min(w.since for w in windows)
    merged.until = max(w.until for w in windows)
    merged.requests = sum(w.requests for w in windows)
    merged.within_slo = sum(w.within_slo for w in windows)
    n = len(first.length_histogram)
    merged.length_histogram = [sum(w.length_histogram[i] for w in windows if len(w.length_histogram) == n) for i in range(n)]
    k = len(first.survival)
    merged.survival = [sum(w.survival[i] * w.requests for w in windows if len(w.survival) == k) / total for i in range(k)]
    merged.latency.p99_ms = max(w.latency.p99_ms for w in windows)
    return merged


async def fetch_observations(svc: rec.Service, timeout: float = 5.0) -> tuple[Observations | None, str]:
    """The merged window of every router that answers, and a note on what failed."""
    urls = await router_urls(svc)
    windows, notes = [], []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        for url in urls:
            try:
                async with session.get(f"{url}/v1/observations") as rsp:
                    if rsp.status != 200:
                        notes.append(f"{url}: HTTP {rsp.status}")
                        continue
                    windows.append(Observations.model_validate(await rsp.json(content_type=None)))
            except (aiohttp.ClientError, asyncio.TimeoutError, ValidationError, ValueError) as err:
                notes.append(f"{url}: {type(err).__name__}")
    return (merge_windows(windows) if windows else None), "; ".join(notes)


def _retune_step(urls: list[str], ramps: list[str], budget: float, apply: bool) -> Any:
    from exitplan import autotune
    from exitplan.planner.thresholds import WindowError

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


async def retune(svc: rec.Service, spec: EarlyExitServiceSpec, ramps: list[str]) -> None:
    """Apparate's continual tuning on the routers' shadow-sampled feedback (exitplan.autotune):
    new thresholds when the ones in force break the accuracy budget or leave savings unclaimed.
    Advisory mode computes but does not push. The next plan carries the thresholds in force."""
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


PROFILE_RECHECK_SECONDS = 30.0
"""A service waiting for a profile re-checks this often (in case a ModelProfile event was missed)."""


async def on_tick(svc: rec.Service, memo: Any) -> None:
    """One timer tick: re-check a profiling wait, refresh readiness, judge drift once per window."""
    if (svc.body.get("status") or {}).get("phase") == "Profiling":
        now = time.monotonic()
        if now - memo.get("profile_check", 0.0) > PROFILE_RECHECK_SECONDS:
            memo["profile_check"] = now
            await rec.reconcile(svc, reason="initial")
        return
    await rec.refresh_readiness(svc)
    await check_drift(svc, memo)


async def check_drift(svc: rec.Service, memo: Any) -> None:
    """One drift-loop tick (the timer calls it every few seconds; it acts once per period)."""
    status = parse_status(svc.body.get("status"))
    try:
        spec = EarlyExitServiceSpec.model_validate(svc.body.get("spec") or {})
    except ValidationError:
        return
    if status.phase in (Phase.profiling, Phase.pending) or status.plan is None:
        return
    now = time.monotonic()
    if now - memo.get("last_check", 0.0) < spec.planner.period_seconds / 2:
        return
    memo["last_check"] = now
    obs, note = await fetch_observations(svc)
    if obs is None:
        log.info("%s/%s: no observations (%s)", svc.namespace, svc.name, note or "no router endpoint")
        return
    waiting = status.proposal is not None and status.proposal.held_back.startswith(("cooldown", "move cap"))
    if obs.until == memo.get("last_window") and not waiting:
        return  # this window was judged already
    memo["last_window"] = obs.until
    plan = await rec.current_plan(svc.client, svc.name, svc.namespace)
    if plan is None and spec.planner.mode == Mode.active:
        return
    history: list[list[float]] = memo.setdefault("survival", [])
    limits = spec.planner.drift
    reference = plan
    if reference is None:  # advisory: nothing applied, compare against the proposed plan's shape
        return
    judged = obs
    previous_window: Observations | None = memo.get("previous_window")
    if (min(obs.requests, drift.arrivals(obs)) < drift.MIN_REQUESTS and previous_window is not None
            and previous_window.until < obs.until
            and previous_window.length_buckets == obs.length_buckets):
        judged = merge_windows([previous_window, obs])  # a slow half-period: judge the last full period
    if obs.until != getattr(previous_window, "until", None):
        memo["previous_window"] = obs
    report = drift.assess(reference, judged, limits, spec.slo.latency_ms, history)
    log.info("%s/%s: window until %.1f (%d arrivals, %d answered%s): length score %.3f, survival error %.3f, "
             "p99 %.0f ms%s", svc.namespace, svc.name, obs.until, drift.arrivals(judged), judged.requests,
             ", merged" if judged is not obs else "",
             report.length_score, report.survival_error, report.p99_ms, f" -> {report.trigger}" if report.trigger else "")
    history.append(list(obs.survival))
    del history[:-HISTORY]
    METRICS.length_score.labels(svc.name).set(report.length_score)
    METRICS.survival_error.labels(svc.name).set(report.survival_error)
    status.drift = report

    pending = status.proposal if status.proposal and status.proposal.held_back.startswith("move cap") else None
    reason = report.trigger or (pending.reason if pending else "")
    if not reason:  # no re-plan this window: the thresholds may still need re-tuning
        await svc.write_status(status)
        task = memo.get("tune_task")
        if obs.ramps and (task is None or task.done()):  # in the background: never delays a drift check
            memo["tune_task"] = asyncio.create_task(retune(svc, spec, obs.ramps))
        return
    wait = drift.cooldown_left(status.last_replan_time, limits.cooldown_seconds)
    if wait > 0 and spec.planner.mode == Mode.active:
        status.proposal = Proposal(reason=reason, hash="", held_back=f"cooldown: {wait:.0f}s left")
        await svc.write_status(status)
        svc.event("Normal", "ReplanHeld", f"{reason} (length score {report.length_score}, survival error "
                  f"{report.survival_error}, p99 {report.p99_ms} ms): cooldown, {wait:.0f}s left")
        return
    svc.event("Normal", "Replan", f"{reason}: length score {report.length_score} (limit {limits.length_score}), "
              f"survival error {report.survival_error} (limit {limits.survival_error}), p99 {report.p99_ms} ms")
    inputs = await rec.read_inputs(svc.client, spec, svc.namespace)
    if inputs.unknown_pools or inputs.missing_profiles:
        return  # the next spec reconcile reports these
    await rec.plan_and_apply(svc, spec, inputs, status, reason=reason, previous=plan, observations=obs,
                             max_move_fraction=limits.max_move_fraction)
