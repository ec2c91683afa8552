"""The drift loop (each service's timer tick: handlers.ticks). The loop reads every router drift_reads times a
period (the operator's setting, guards.Settings; default drift.CHECKS_PER_PERIOD = 2) and keeps what arrived
since its previous read: the router's window in progress (`/v1/observations?window=current`) less what the
previous read saw of it, plus the rest of that window when it closed meanwhile (`/v1/observations`, the last
closed window, parsed once: a closed window no longer changes). The judged window is
the newest of those slices covering half a period and drift.MIN_REQUESTS arrivals, judged once per
read that brought new arrivals; a limit crossed re-plans, with a cooldown and a cap on how many
replicas move at once (the rest follows in steps, one per period once the previous step is rolled
out). A length-drift re-plan sizes the buckets for the traffic since the shift (drift.after_change),
and a new plan is judged only on what arrives after it. Advisory mode only reports (status.drift,
status.proposal, events).

This module does the I/O (routers through ControlClient, the API server, events); what to do after
a read (re-plan, step, hold, propose, re-tune) is drift_policy.decide's, on the service's
drift_policy.DriftState (kept in kopf's per-object memo under STATE_KEY).

Why a length shift is re-planned within two periods (P): from its start at t, the judged window
holds only shifted arrivals by t + P/2 (given MIN_REQUESTS arrivals by then; a mix crosses the
limit sooner), a read falls at most P/n later (n = drift_reads; or one timer tick, if longer), and
the plan and the apply follow at once: t + P/2 + P/n + plan + apply -- t + P + plan + apply at the
default two reads, t + 3P/4 at four (which cost the operator ~1.4x the CPU per period at 200
services: BENCHMARKS.md, issue 31). Router windows (one period long) matter only for
how much history a read can recover: a read sees the window in progress and the one before it.

Each read also feeds the comparison of measured with planned goodput (plan_accuracy.py: condition
PlanAccurate, per non-overlapping window of half a period; below the solver's rate, against the plan
as served, plan_served.py); a mismatch that persists under load raises
the trigger plan-mismatch when nothing else did, and its re-plan first re-profiles the pools that are
off (profiling.reprofile) and plans on their profiles corrected by the measured ratio (kept for the
loop's later re-plans until the pools' ModelProfiles change).

Thresholds the routers run with but the plan does not carry (the loop's own re-tuning pushed them,
or someone else did) are written into the plan ConfigMap, so a router that restarts reads them
(live_thresholds.py, with the once-a-period re-tune).

The routers' control endpoints (`/v1/observations`, `/v1/window.npz`, `/v1/thresholds`; the
routers' control port, with the service's control token from its Secret, control_token.py) are read at
every router replica (router_endpoints.py: the control Service's Endpoints, else the pods' IPs), each
router's window followed on its own and the routers summed; a read that misses a router (or can only
reach them through one Service address) is reported in status.drift.routers and an event, and is not
used to judge the plan (PlanAccurate).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, cast

import aiohttp
from pydantic import ValidationError

from exitplan.api.observations import Observations
from exitplan.api.plan import Plan
from exitplan.api.resources import EarlyExitServiceSpec, Mode
from exitplan.operator import (
    capacity,
    drift,
    drift_writes,
    plan_accuracy,
    plan_memory,
    plan_served,
    profiling,
)
from exitplan.operator import reconcile as rec
from exitplan.operator.drift_policy import Action, Do, DriftState, decide, needs_reassess
from exitplan.operator.live_thresholds import (
    RouterAccess,
    retune,
    router_token,
    same_thresholds,
    write_pending,
    write_thresholds,
)
from exitplan.operator.metrics import METRICS
from exitplan.operator.readiness import refresh_readiness
from exitplan.operator.router_endpoints import find_routers, router_urls
from exitplan.operator.service_state import Service, ServiceResources, read_inputs
from exitplan.operator.status import DriftReport, Phase, ServiceStatus, parse_status, set_condition
from exitplan.worker_image.control_client import ControlClient, ControlError

log = logging.getLogger("exitplan.operator.drift")
STATE_KEY = "drift"
"""The key of the service's DriftState in kopf's per-object memo."""


def drift_state(memo: Any) -> DriftState:
    """The service's drift-loop state, kept in kopf's per-object memo (created at the first tick)."""
    state: DriftState | None = memo.get(STATE_KEY)
    if state is None:
        state = memo[STATE_KEY] = DriftState()
    return state


def merge_windows(windows: list[Observations]) -> Observations:
    """Several routers' windows as one (counts add, survival weighted by requests, p99 = max)."""
    return drift.combine(windows)


@dataclass(frozen=True)
class RouterRead:
    """What one read of a service's routers gave."""

    piece: Observations | None
    """What arrived since the previous read, over every router that answered."""
    latest: Observations | None
    """The newest full window, merged over the routers that answered."""
    note: str
    """What failed ('' when every router answered)."""
    answered: int
    refused: bool
    """A router refused the control token (HTTP 401 or 403): the token is read again before the next read."""


async def read_routers(
    svc: Service,
    seen: dict[str, Observations],
    urls: list[str] | None = None,
    timeout: float = 5.0,
    token: str | None = None,
    session: aiohttp.ClientSession | None = None,
    closed: dict[str, Observations] | None = None,
) -> RouterRead:
    """One read of the routers. `seen` (router URL -> that router's window in progress as last read) is
    updated in place; `urls`: the routers (default: looked up); `token`: the control token (default: read);
    `session`: connections to keep (default: one per read); `closed` (router URL -> its last closed window as
    last read, updated in place): a closed window read again is not parsed again."""
    closed = {} if closed is None else closed
    urls = await router_urls(svc) if urls is None else urls
    if token is None:
        token = await router_token(svc) if urls else None
    slices, latest, notes, refused = [], [], [], False
    for url in urls:
        try:
            async with ControlClient(url, timeout_s=timeout, token=token, session=session) as router:
                last, current = await router.recent_observations(closed.get(url))  # one request (two: an older router)
        except ControlError as err:
            notes.append(str(err))  # the URL and what failed
            refused = refused or err.status in (401, 403)
            continue
        closed[url] = last
        windows = [last, current]  # before the first roll `last` is the window in progress too
        piece = drift.since_last(windows, seen.get(url))
        newest = max(windows, key=lambda w: (w.since, w.until))
        seen[url] = newest
        latest.append(newest)
        if piece is not None:
            slices.append(piece)
    for kept in (seen, closed):
        for url in [u for u in kept if u not in urls]:
            del kept[url]
    piece = drift.combine(slices) if slices else None
    return RouterRead(piece, drift.combine(latest) if latest else None, "; ".join(notes), len(latest), refused)


async def fetch_observations(svc: Service, timeout: float = 5.0) -> tuple[Observations | None, str]:
    """The merged last closed window of every router that answers, and a note on what failed."""
    windows, notes = [], []
    token = await router_token(svc)
    for url in await router_urls(svc):
        try:
            async with ControlClient(url, timeout_s=timeout, token=token) as router:
                windows.append(await router.observations())
        except ControlError as err:
            notes.append(str(err))  # the URL and what failed
    return (merge_windows(windows) if windows else None), "; ".join(notes)


PROFILE_RECHECK_SECONDS = 30.0
"""A service waiting for a profile re-checks this often (in case a ModelProfile event was missed)."""


async def on_tick(svc: Service, memo: Any) -> None:
    """One timer tick: re-check a profiling wait (and start a failed profiling Job's successor once its
    backoff passed), re-plan a service refused for pool capacity when what is left changed, refresh
    readiness, read the routers for drift."""
    phase = (svc.body.get("status") or {}).get("phase")
    if phase in (Phase.profiling.value, Phase.profiling_failed.value):
        now = time.monotonic()
        state = drift_state(memo)
        if now - state.profile_check > min(PROFILE_RECHECK_SECONDS, svc.settings.profile_retry_seconds):
            state.profile_check = now
            await rec.reconcile(svc, reason="initial")
        return
    if phase == Phase.infeasible.value and await capacity.recheck(svc, memo):
        await rec.reconcile(svc, reason="capacity-freed")
        return
    await refresh_readiness(svc)
    await check_drift(svc, memo)


def _service_lock(svc: Service, memo: Any) -> asyncio.Lock | None:
    """The per-service lock the handlers hold (handlers.py keeps them in kopf's operator memo)."""
    locks = memo.get("locks")
    return locks[(svc.namespace, svc.name)] if locks is not None else None


async def _read(
    svc: Service, state: DriftState, now: float, period: float
) -> tuple[Observations | None, Observations | None, str]:
    """(what arrived since the previous read, the newest full window) over the routers that answer, and
    why the read does not hold every router's observations ('' when it does)."""
    if state.routers is None or state.urls_due(now, period):  # the addresses, once a period (routers scale)
        state.routers, state.urls_looked_up = await find_routers(svc), now  # from shared lists under kopf
    if state.router_token is None and state.routers.urls:  # first read, or a router refused the last one's
        state.router_token = await router_token(svc)
    session = getattr(svc.memo, "router_session", None)  # the operator's (handlers.configure), if it has one
    urls, token = state.routers.urls, state.router_token
    read = await read_routers(svc, state.seen, urls, token=token, session=session, closed=state.closed)
    piece, latest, note = read.piece, read.latest, read.note
    shortfall = state.routers.shortfall(read.answered)
    if read.refused:
        state.router_token = None  # a token rotated (or the Secret replaced): read it again next read
    if note:
        state.routers = None  # a router did not answer: look them up again next read
    if shortfall:
        shortfall += f" ({note})" if note else ""
    # each read of each service is a DEBUG line; INFO when what it says differs from the previous read's
    level = logging.INFO if (latest is None) != state.latest_missing or shortfall != state.shortfall else logging.DEBUG
    state.latest_missing = latest is None
    if latest is None:
        log.log(level, "%s/%s: no observations (%s)", svc.namespace, svc.name, note or "no router endpoint")
    if shortfall:
        log.log(level, "%s/%s: partial read: %s", svc.namespace, svc.name, shortfall)
    return piece, latest, shortfall


def _assess(spec: EarlyExitServiceSpec, plan: Plan, judged: Observations, state: DriftState) -> DriftReport:
    # on the event loop: the survival forecast is an AR(1) in closed form over every ramp at once (tens of
    # microseconds; a thread hop per read cost more than the forecast)
    return drift.assess(plan, judged, spec.planner.drift, spec.slo.latency_ms, list(state.survival))


async def _score_new(
    svc: Service,
    state: DriftState,
    spec: EarlyExitServiceSpec,
    plan: Plan,
    piece: Observations,
    status: ServiceStatus,
    period: float,
    plan_hash: str,
) -> DriftReport | None:
    """Score the judged window after a read that brought new arrivals (status.drift, the metrics,
    the survival series); `plan_hash`: the plan's content hash."""
    judged = drift.recent(state.slices, period)
    if judged is None:
        return None
    report = _assess(spec, plan, judged, state)
    log.log(
        logging.INFO if report.trigger else logging.DEBUG,  # a fleet's reads: DEBUG; a read that raises a trigger: INFO
        "%s/%s: %.1f s until %.1f (%d new, %d judged arrivals; %d answered): length score %.3f, "
        "survival error %.3f, p99 %.0f ms%s",
        svc.namespace,
        svc.name,
        judged.until - judged.since,
        judged.until,
        drift.arrivals(piece),
        drift.arrivals(judged),
        judged.requests,
        report.length_score,
        report.survival_error,
        report.p99_ms,
        f" -> {report.trigger}" if report.trigger else "",
    )
    state.add_to_survival(piece, period)
    report.routers = state.shortfall
    window = None
    if state.shortfall:  # part of the routers' traffic is missing: no reading to judge the plan on
        state.accuracy.block = []
    else:
        window = state.accuracy.fill(piece, plan, period, plan_hash)
    if window is not None:  # a window of the comparison with the plan is full (plan_accuracy.py)
        verdict = await plan_served.compare(svc, state, spec, plan, window)
        log.info("%s/%s: plan %s: %s", svc.namespace, svc.name, plan_hash, verdict.text())
        plan_accuracy.update_condition(status, state.accuracy, verdict, plan_hash, svc.generation)
    METRICS.length_score.labels(svc.namespace, svc.name).set(report.length_score)
    METRICS.survival_error.labels(svc.namespace, svc.name).set(report.survival_error)
    planned = status.plan.goodput_rps if status.plan is not None else None
    METRICS.record_goodput(svc.namespace, svc.name, planned, report.goodput_rps if report.observed_at else None)
    status.drift = report
    state.judged = judged
    return report


async def _judge(
    svc: Service,
    state: DriftState,
    spec: EarlyExitServiceSpec,
    plan: Plan,
    piece: Observations | None,
    status: ServiceStatus,
    period: float,
    plan_hash: str,
) -> DriftReport | None:
    """Keep the new slice and score the judged window when new arrivals came; a cooldown hold with
    nothing new re-scores the window that raised it. None: nothing to score."""
    report = None
    if piece is not None:
        state.add_slice(piece, period)
        if drift.arrivals(piece) or piece.requests:
            report = await _score_new(svc, state, spec, plan, piece, status, period, plan_hash)
    if needs_reassess(state, report, status.proposal) and state.judged is not None:
        report = _assess(spec, plan, state.judged, state)
    if report is not None and not report.trigger and state.accuracy.mismatch() is not None:
        report.trigger = plan_accuracy.REASON  # the other triggers explain a gap first
    return report


def _tuning(state: DriftState) -> bool:
    """A background re-tune is still running."""
    return isinstance(state.tune_task, asyncio.Future) and not state.tune_task.done()


SPEC_KEY = "drift_spec"
"""The per-object memo's key for ((uid, generation), the spec parsed): a tick parses it once per generation."""


def _spec(svc: Service, memo: Any) -> EarlyExitServiceSpec | None:
    """The service's spec parsed (None when it does not parse: reconcile reports that), once per generation
    (the API server bumps it on every spec change); only read here, never changed."""
    key = (str(svc.body["metadata"].get("uid") or ""), svc.generation)
    kept = memo.get(SPEC_KEY) if memo is not None else None
    if kept is not None and kept[0] == key:
        return cast(EarlyExitServiceSpec, kept[1])
    try:
        spec = EarlyExitServiceSpec.model_validate(svc.body.get("spec") or {})
    except ValidationError:
        return None
    if memo is not None:
        memo[SPEC_KEY] = (key, spec)
    return spec


BURST_SERVICES = 200
"""About how many services tick back to back in one burst of the event loop, at most (tick_points)."""


def tick_points(services: int) -> int:
    """How many points within a tick the operator's `services` tick at (handlers.ticks): one up to BURST_SERVICES
    services, one more for each BURST_SERVICES more. The services that share a point tick back to back, in one burst
    of the event loop; more points keep a large fleet's bursts short (at 200 services, 1.1 s of CPU a 20 s period,
    most of it in the two read ticks' bursts, during which a router's or the API server's answer waits to be
    handled)."""
    return max(1, math.ceil(services / BURST_SERVICES))


def tick_phase(uid: str, tick: float, points: int = 1) -> float:
    """Where within each tick a service ticks: one of `points` points a `points`-th of a tick apart, chosen by its
    uid (0 with one point)."""
    if not uid or points <= 1:
        return 0.0
    slot = int.from_bytes(hashlib.sha256(uid.encode()).digest()[:4], "big") % points
    return slot * tick / points


def next_tick(now: float, tick: float, phase: float = 0.0) -> float:
    """Seconds from `now` (the event loop's clock) to the next point of the grid `phase` + k * `tick` that is at
    least a tenth of a tick away: the grid a service's daemon ticks on (handlers.ticks; `phase`: tick_phase). A
    tick that ended late in its burst still takes the next point (with a margin of half a tick, a tick that ended
    late skipped a point: two ticks a whole tick apart, on a loaded machine)."""
    wait = tick - (now - phase) % tick
    return wait + tick if wait < tick / 10 else wait


UNPLANNED = (Phase.profiling.value, Phase.pending.value)
"""Phases with no plan to judge yet: the loop does not read the routers."""


async def check_drift(svc: Service, memo: Any) -> None:
    """One drift-loop read (the timer calls it every tick; it reads the settings' drift_reads times a period):
    read the routers, score the judged window, ask drift_policy.decide, carry its Action out."""
    written = svc.body.get("status") or {}  # as the API has it: parsed only for a read that is due
    spec = _spec(svc, memo)
    if spec is None or written.get("phase") in UNPLANNED or not written.get("plan"):
        return
    state = drift_state(memo)
    period = float(spec.planner.period_seconds)
    now = time.monotonic()
    interval = period / svc.settings.drift_reads  # reads on the ticks' grid: taken up to half a tick early
    if not state.take_read(now, interval, min(svc.settings.tick_seconds, interval) / 2):
        return
    status = parse_status(written)
    if status.plan is None:  # a status of another schema: as without a plan
        return
    piece, latest, shortfall = await _read(svc, state, now, period)
    if shortfall and latest is not None and shortfall != state.shortfall:  # none read yet: starting, logged
        svc.event("Warning", "RoutersUnread", f"{shortfall}: measured goodput is not judged against the plan")
    state.shortfall = shortfall
    if latest is None:
        return
    plan = await plan_memory.plan_in_force(svc.memo, svc.client, svc.name, svc.namespace)
    if plan is None:  # advisory from the start: nothing applied to compare against
        return
    active, plan_hash = spec.planner.mode == Mode.active, plan_memory.content_hash(svc.memo, plan)
    said, written = drift_writes.what_status_says(status), status.drift  # as stored, before anything below
    persisted = False  # thresholds written into the plan: its summary in `status`, written below (_carry_out)
    if (
        active
        and latest.thresholds
        and latest.plan_hash == plan_hash
        and not same_thresholds(latest.thresholds, plan.thresholds)
    ):
        # the routers run this plan with other thresholds (pushed live): the plan carries them from now on
        source = "observed on the routers"
        persisted = await write_thresholds(svc, latest.thresholds, source, period, base=plan_hash, status=status)
    elif active:  # a re-tune's set that waited its turn
        persisted = await write_pending(svc, period, plan_hash, status)
    if persisted:
        plan = await plan_memory.plan_in_force(svc.memo, svc.client, svc.name, svc.namespace) or plan
    plan_hash = plan_memory.content_hash(svc.memo, plan)  # the same unless a write above changed the plan
    report = await _judge(svc, state, spec, plan, piece, status, period, plan_hash)
    action = decide(
        state,
        report,
        spec.planner.drift,
        now,
        active=active,
        phase=status.phase,
        proposal=status.proposal,
        last_replan_time=status.last_replan_time,
        period=period,
        ramps=latest.ramps,
        tuning=_tuning(state),
        utc_now=dt.datetime.now(dt.UTC),
    )
    state.record(action, now)
    await _carry_out(svc, memo, state, spec, status, plan, latest, action, now, (said, written), persisted)


async def _carry_out(
    svc: Service,
    memo: Any,
    state: DriftState,
    spec: EarlyExitServiceSpec,
    status: ServiceStatus,
    plan: Plan,
    latest: Observations,
    action: Action,
    now: float,
    before: tuple[str, DriftReport | None],
    persisted: bool = False,
) -> None:
    """Do what `decide` chose: the status and event of a hold, a re-plan or step, a background re-tune.
    `before`: what the status said before the read and the figures it showed (drift_writes.py: what changed
    is written at once, the figures when they moved, at most once a period); `persisted`: the read wrote
    thresholds into the plan, whose summary `status` carries (written now, whatever `decide` chose)."""
    if action.proposal is not None:
        status.proposal = action.proposal
    if action.clear_proposal:
        status.proposal = None
    said, figures = before
    due = drift_writes.write_due(
        state.drift_written,
        now,
        float(spec.planner.period_seconds),
        says_other=drift_writes.what_status_says(status) != said,
        figures_moved=drift_writes.moved(figures, status.drift),
        reads=svc.settings.drift_reads,
    )
    if (action.write_status or persisted) and due:
        await svc.write_status(status)
        state.drift_written = now
    if action.event is not None:
        svc.event("Normal", action.event.reason, action.event.message)
    if action.do is Do.retune:  # once a period, in the background: never delays a drift check
        access = None
        if state.routers is not None and state.routers.urls:  # the routers the read just reached
            session = getattr(svc.memo, "router_session", None)
            access = RouterAccess(list(state.routers.urls), state.router_token, session)
        lock, in_force = _service_lock(svc, memo), dict(latest.thresholds)
        version = latest.thresholds_version  # the highest the routers hold: a push follows it
        state.tune_task = asyncio.create_task(retune(svc, spec, latest.ramps, lock, access, in_force, version))
    elif action.plans:
        await _replan(svc, state, spec, status, plan, latest, action, now)


async def _replan(
    svc: Service,
    state: DriftState,
    spec: EarlyExitServiceSpec,
    status: ServiceStatus,
    plan: Plan,
    latest: Observations,
    action: Action,
    now: float,
) -> None:
    """Plan again for the judged window and apply it (capped by maxMoveFraction) or propose it."""
    inputs = await read_inputs(svc.client, spec, svc.namespace)
    if inputs.unknown_pools or inputs.missing_profiles:
        return  # the next spec reconcile reports these
    status.pools_digest = inputs.digest()
    state.last_step = now
    if action.reason == plan_accuracy.REASON and (mismatch := state.accuracy.mismatch()) is not None:
        await _mismatched(svc, state, spec, status, inputs, mismatch, propose=action.do is Do.propose)
    inputs.profiles = state.accuracy.correct(inputs.profiles)  # measured ratios, until the pools are re-profiled
    observed = state.judged if state.judged is not None else latest
    if action.reason == "length-drift" and (shifted := drift.after_change(state.slices, plan)) is not None:
        # size the buckets for the traffic since the shift, not for the mix the judged window holds
        observed = observed.model_copy(
            update={"length_buckets": list(shifted.length_buckets), "length_histogram": list(shifted.length_histogram)}
        )
    after = await rec.plan_and_apply(
        svc,
        spec,
        inputs,
        status,
        reason=action.reason,
        previous=plan,
        observations=observed,
        max_move_fraction=spec.planner.drift.max_move_fraction,
    )
    if action.do is not Do.propose and after.plan is not None:
        state.accuracy.planned_with_corrections(after.plan.hash, after.plan.goodput_rps)
        if after.plan.hash != plan_memory.content_hash(svc.memo, plan):
            state.slices.clear()  # judged against the old plan; the new one is judged on what arrives from now on


async def _mismatched(
    svc: Service,
    state: DriftState,
    spec: EarlyExitServiceSpec,
    status: ServiceStatus,
    inputs: ServiceResources,
    mismatch: plan_accuracy.Mismatch,
    *,
    propose: bool,
) -> None:
    """A persistent plan mismatch is acted on: re-profile the pools (active mode; advisory only says
    it would), keep the measured ratio as a correction of their profiles for the re-plan that follows,
    and say so in PlanAccurate."""
    why = f"{plan_accuracy.REASON}: measured goodput {mismatch.text()}"
    if propose:
        done = {pool: "would be measured again (advisory mode)" for pool in mismatch.pools}
    else:
        done = await profiling.reprofile(svc, spec, inputs, list(mismatch.pools), why, plan_accuracy.REASON)
    state.accuracy.acted(mismatch, inputs.profiles)
    cond = next((c for c in status.conditions if c.type == plan_accuracy.CONDITION), None)
    if cond is not None and cond.status == "False":
        text = "; ".join(f"pool {pool}: {what}" for pool, what in done.items())
        status.conditions = set_condition(
            status.conditions,
            plan_accuracy.CONDITION,
            False,
            cond.reason,
            f"{cond.message}; {'proposed a plan' if propose else 're-planned'} ({plan_accuracy.REASON}) with the "
            f"measured ratio {mismatch.ratio:.2f}; {text}",
            svc.generation,
        )
