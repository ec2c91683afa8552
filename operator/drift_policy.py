"""What the drift loop does after a read, as a pure function of a typed state (no I/O, no kopf).

driftloop.check_drift reads the routers, scores the judged window (drift.assess) and asks
:func:`decide` what to do; it then carries the :class:`Action` out (status, events, plan and
apply, the background re-tune). The rules, in order:

1. A capped re-plan in progress (active mode; status.proposal held back by the move cap) takes
   its next step once the previous one is rolled out (phase Ready) and a period has passed since
   it; until then it holds (:attr:`Hold.rollout`, :attr:`Hold.move_cap`). A step names the new
   trigger, if any, else the re-plan's own reason.
2. A trigger (drift.assess: slo-risk, length-drift, survival-drift; plan_accuracy: plan-mismatch)
   re-plans (active) or proposes (advisory), except that advisory mode proposes the same reason at most once a period
   (:attr:`Hold.advisory_repeat`) and active mode holds while the cooldown after the last re-plan
   runs (:attr:`Hold.cooldown`: status.proposal says so; the ReplanHeld event once per hold).
3. No trigger: a cooldown hold whose drift has gone is cleared, and the thresholds are re-tuned
   in the background at most once a period (when the routers run ramps and no re-tune is running).

The hold kinds written into status.proposal.heldBack are read back once, by :func:`hold_of`
(the status outlives the operator's memory: a restarted operator continues a capped re-plan).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from exitplan.api.observations import Observations
from exitplan.api.resources import DriftLimits
from exitplan.operator import drift, plan_accuracy
from exitplan.operator.router_endpoints import Routers
from exitplan.operator.status import DriftReport, Phase, Proposal

HISTORY = 12
"""Survival curves kept per service for the survival forecast (one per half-period block)."""
MAX_SLICES = 64
"""Slices kept at most (besides drift.KEEP_PERIODS)."""


class Hold(str, Enum):
    """Why a re-plan is not applied now. The values of the kinds written into status.proposal.heldBack
    are the prefixes of that text (see :func:`hold_of`)."""

    cooldown = "cooldown"
    """Active mode, a trigger inside spec.planner.drift.cooldownSeconds after the last re-plan
    (heldBack ``cooldown: <s>s left``)."""
    move_cap = "move cap"
    """A capped re-plan (maxMoveFraction): more steps follow, one per period (heldBack ``move cap: ...``,
    written by reconcile.plan_and_apply). As an action: the next step waits for its period."""
    advisory = "advisory mode"
    """Advisory mode: the plan is proposed, never applied (heldBack ``advisory mode: nothing applied``)."""
    rollout = "rollout"
    """The next step of a capped re-plan waits until the previous one is rolled out (phase Ready)."""
    advisory_repeat = "advisory repeat"
    """Advisory mode: the same reason was proposed less than a period ago."""


IN_STATUS = (Hold.cooldown, Hold.move_cap, Hold.advisory)
"""The hold kinds status.proposal.heldBack can carry."""


def hold_of(proposal: Proposal | None) -> Hold | None:
    """The kind of hold a stored proposal is under (parsed from its heldBack text), or None."""
    if proposal is None:
        return None
    return next((h for h in IN_STATUS if proposal.held_back.startswith(h.value)), None)


def cooldown_text(wait_s: float) -> str:
    """status.proposal.heldBack of a cooldown hold (user-visible wording)."""
    return f"cooldown: {wait_s:.0f}s left"


class Do(str, Enum):
    """What the drift loop does after a read."""

    replan = "replan"
    """Active mode: plan again and apply (reconcile.plan_and_apply, capped by maxMoveFraction)."""
    propose = "propose"
    """Advisory mode: plan again and report it in status.proposal (nothing applied)."""
    step = "step"
    """The next step of a capped re-plan (plan again, apply at most maxMoveFraction)."""
    hold = "hold"
    """A re-plan is due but held back (`Action.hold` says why)."""
    retune = "retune"
    """No re-plan: re-tune the exit thresholds in the background."""
    nothing = "nothing"


@dataclass(frozen=True)
class Event:
    """A Kubernetes event to post on the service."""

    reason: str
    message: str


@dataclass(frozen=True)
class Action:
    """One decision of :func:`decide`."""

    do: Do
    reason: str = ""
    """The re-plan reason (slo-risk, length-drift, survival-drift, plan-mismatch) for replan, propose, step
    and hold."""
    hold: Hold | None = None
    """Why nothing is applied (do == hold)."""
    message: str = ""
    """For a person: why it holds (a cooldown's is the heldBack text written into status), or what it does."""
    event: Event | None = None
    """The event to post, if any."""
    proposal: Proposal | None = None
    """A proposal to write into status (a cooldown hold)."""
    clear_proposal: bool = False
    """Remove status.proposal (a cooldown hold whose drift has gone)."""
    write_status: bool = False
    """Write the status (the new drift report, a proposal set or cleared); replan, propose and step
    write it through plan_and_apply."""

    @property
    def plans(self) -> bool:
        """The loop plans again (replan, propose or step)."""
        return self.do in (Do.replan, Do.propose, Do.step)


@dataclass
class DriftState:
    """What the drift loop keeps per service between reads (in kopf's per-object memo, under STATE_KEY).
    Times are time.monotonic() seconds; None: never."""

    last_check: float | None = None
    """When the routers were last read (on a grid of period / the operator's drift_reads)."""
    seen: dict[str, Observations] = field(default_factory=dict)
    """Router URL -> that router's window in progress as the last read saw it (drift.since_last)."""
    closed: dict[str, Observations] = field(default_factory=dict)
    """Router URL -> that router's last closed window as last read (not parsed again while it is the last)."""
    routers: Routers | None = None
    """The routers' addresses as last looked up (None: look them up at the next read)."""
    urls_looked_up: float = 0.0
    """When the routers were looked up."""
    router_token: str | None = None
    """The control token, read with the routers (and again whenever they are)."""
    shortfall: str = ""
    """Why the last read did not hold every router's observations ('' when it did)."""
    latest_missing: bool = False
    """The last read had no router's observations (driftloop logs a change at INFO, a repeat at DEBUG)."""
    slices: list[Observations] = field(default_factory=list)
    """What arrived between consecutive reads, oldest first, over at most drift.KEEP_PERIODS periods;
    cleared when a re-plan changes the plan (a new plan is judged on what arrives after it)."""
    survival: list[list[float]] = field(default_factory=list)
    """The survival curves of the last HISTORY half-period blocks (the forecaster's series)."""
    survival_block: list[Observations] = field(default_factory=list)
    """Slices of the block being filled (drift.JUDGED_PERIODS periods and drift.MIN_REQUESTS answered)."""
    judged: Observations | None = None
    """The last judged window (drift.recent); a re-plan plans for it."""
    proposed: float | None = None
    """When a trigger was last acted on (advisory: proposed at most once a period per reason)."""
    last_step: float | None = None
    """When the last re-plan or step was planned (a capped re-plan steps at most once a period)."""
    last_tune: float | None = None
    """When the last background re-tune started (at most once a period)."""
    drift_written: float | None = None
    """When the drift loop last wrote the status (drift_writes.py: the window's figures when they move, at most once a period)."""
    tune_task: object = None
    """The background re-tune (an asyncio.Task, owned by the loop), or None."""
    profile_check: float = 0.0
    """When a service waiting for a profile last re-checked."""
    accuracy: plan_accuracy.Tracker = field(default_factory=plan_accuracy.Tracker)
    """Measured against planned goodput over consecutive windows (condition PlanAccurate, trigger plan-mismatch)."""

    def take_read(self, now: float, interval: float, early: float = 0.0) -> bool:
        """Whether the routers are due for a read at `now` (reads `interval` apart, a read taken up to `early`
        seconds before it is due: ticks on a grid start a little apart, by where each service falls within
        their burst); when they are, the read is booked: on a grid of `interval` (a tick longer than it rounds
        single reads up, not the average), restarted when a whole read was missed."""
        last = self.last_check
        if last is not None and now - last < interval - early:
            return False
        self.last_check = now if last is None or now - last >= 2 * interval else last + interval
        return True

    def urls_due(self, now: float, period: float) -> bool:
        """The routers' addresses are looked up once a period (or when unknown)."""
        return self.routers is None or not self.routers.urls or now - self.urls_looked_up >= period

    def add_slice(self, piece: Observations, period: float) -> None:
        """Keep what one read brought (at most MAX_SLICES over drift.KEEP_PERIODS periods)."""
        self.slices.append(piece)
        del self.slices[:-MAX_SLICES]
        while self.slices and self.slices[-1].until - self.slices[0].until > drift.KEEP_PERIODS * period:
            self.slices.pop(0)

    def add_to_survival(self, piece: Observations, period: float) -> None:
        """Add a slice to the survival block; a full block becomes one point of the forecaster's series."""
        block = self.survival_block
        block.append(piece)  # the forecaster's series: consecutive half-period blocks
        if drift.span(block) >= drift.JUDGED_PERIODS * period and sum(w.requests for w in block) >= drift.MIN_REQUESTS:
            self.survival.append(drift.pooled_survival(block))  # what combining the block would say, alone
            del self.survival[:-HISTORY]
            self.survival_block.clear()

    def record(self, action: Action, now: float) -> None:
        """Book what `decide` chose at `now` (call it once per decision, before carrying it out):
        a trigger acted on (re-plan, proposal, cooldown hold) and a re-tune started."""
        if action.do in (Do.replan, Do.propose) or action.hold is Hold.cooldown:
            self.proposed = now
        elif action.do is Do.retune:
            self.last_tune = now


def needs_reassess(state: DriftState, report: DriftReport | None, proposal: Proposal | None) -> bool:
    """Nothing new arrived, but a re-plan waits for its cooldown: the window that raised it still
    stands and is scored again (so the hold ends in a re-plan once the cooldown is over)."""
    return report is None and state.judged is not None and hold_of(proposal) is Hold.cooldown


def _replan_event(reason: str, report: DriftReport, limits: DriftLimits) -> Event:
    return Event(
        "Replan",
        f"{reason}: length score {report.length_score} (limit {limits.length_score}), "
        f"survival error {report.survival_error} (limit {limits.survival_error}), p99 {report.p99_ms} ms, "
        f"measured/planned goodput {report.goodput_ratio}",
    )


def _since(then: float | None, now: float) -> float:
    return float("inf") if then is None else now - then


def _step(
    state: DriftState,
    report: DriftReport | None,
    limits: DriftLimits,
    now: float,
    pending: Proposal,
    phase: Phase,
    period: float,
) -> Action:
    """Rule 1: the next step of a capped re-plan, or a hold until it is due."""
    if phase != Phase.ready:
        return Action(
            Do.hold,
            pending.reason,
            Hold.rollout,
            "the previous step is still rolling out",
            write_status=report is not None,
        )
    if _since(state.last_step, now) < period:
        return Action(
            Do.hold,
            pending.reason,
            Hold.move_cap,
            "the next step follows a period after the previous one",
            write_status=report is not None,
        )
    trigger = report.trigger if report else ""
    reason = trigger or pending.reason
    message = f"{reason}: the next step toward the capped re-plan ({pending.held_back})"
    event = _replan_event(reason, report, limits) if trigger and report else Event("ReplanStep", message)
    return Action(Do.step, reason, message=message, event=event)


def _trigger(
    state: DriftState,
    report: DriftReport,
    limits: DriftLimits,
    now: float,
    *,
    active: bool,
    proposal: Proposal | None,
    last_replan_time: str,
    period: float,
    utc_now: dt.datetime | None,
) -> Action:
    """Rule 2: a limit was crossed."""
    reason = report.trigger
    if not active and proposal is not None and proposal.reason == reason and _since(state.proposed, now) < period:
        return Action(Do.hold, reason, Hold.advisory_repeat, "proposed less than a period ago", write_status=True)
    wait = drift.cooldown_left(last_replan_time, limits.cooldown_seconds, utc_now)
    if wait > 0 and active:
        text = cooldown_text(wait)
        held = proposal if hold_of(proposal) is Hold.cooldown else None
        event = None
        if held is None or held.reason != reason:  # once per hold, not every read
            event = Event(
                "ReplanHeld",
                f"{reason} (length score {report.length_score}, survival error "
                f"{report.survival_error}, p99 {report.p99_ms} ms, measured/planned goodput "
                f"{report.goodput_ratio}): cooldown, {wait:.0f}s left",
            )
        return Action(
            Do.hold,
            reason,
            Hold.cooldown,
            text,
            event=event,
            proposal=Proposal(reason=reason, hash="", held_back=text),
            write_status=True,
        )
    return Action(Do.replan if active else Do.propose, reason, event=_replan_event(reason, report, limits))


def decide(
    state: DriftState,
    report: DriftReport | None,
    limits: DriftLimits,
    now: float,
    *,
    active: bool,
    phase: Phase,
    proposal: Proposal | None,
    last_replan_time: str,
    period: float,
    ramps: Sequence[str] = (),
    tuning: bool = False,
    utc_now: dt.datetime | None = None,
) -> Action:
    """What to do after one read (pure: `state` is only read; book the result with DriftState.record).

    `report`: the judged window's score (None: nothing new arrived and nothing held to re-score);
    `now`: time.monotonic(); `active`: spec.planner.mode is active; `phase`, `proposal` and
    `last_replan_time`: from status; `period`: spec.planner.periodSeconds; `ramps`: the ramps the
    routers run (none: nothing to re-tune); `tuning`: a background re-tune is still running;
    `utc_now`: the wall-clock time the cooldown is measured against (None: now)."""
    standing = hold_of(proposal)
    if standing is Hold.move_cap and active and proposal is not None:
        return _step(state, report, limits, now, proposal, phase, period)
    if report is not None and report.trigger:
        return _trigger(
            state,
            report,
            limits,
            now,
            active=active,
            proposal=proposal,
            last_replan_time=last_replan_time,
            period=period,
            utc_now=utc_now,
        )
    # Rule 3: no re-plan; the thresholds may still need re-tuning
    clear = standing is Hold.cooldown  # the drift that was held back is gone
    if ramps and not tuning and _since(state.last_tune, now) >= period:
        return Action(
            Do.retune, clear_proposal=clear, write_status=report is not None, message="re-tune the exit thresholds"
        )
    return Action(Do.nothing, clear_proposal=clear, write_status=report is not None)
