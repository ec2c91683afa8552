"""The drift loop's rules (exitplan.operator.drift_policy), tested directly: no kopf, no HTTP."""

from __future__ import annotations

import datetime as dt

import pytest

from exitplan.api.observations import Observations
from exitplan.api.resources import DriftLimits
from exitplan.operator.drift_policy import Do, DriftState, Hold, cooldown_text, decide, hold_of, needs_reassess
from exitplan.operator.status import DriftReport, Phase, Proposal

PERIOD = 60.0
LIMITS = DriftLimits(cooldown_seconds=300)
REPLANNED = "2026-01-01T12:00:00Z"
T0 = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.UTC)


def report(trigger: str = "length-drift") -> DriftReport:
    return DriftReport(
        length_score=0.4 if trigger == "length-drift" else 0.05,
        survival_error=0.02,
        p99_ms=40.0,
        requests=500,
        trigger=trigger,
    )


def at(seconds: float) -> dt.datetime:
    """Wall-clock time `seconds` after the last re-plan."""
    return T0 + dt.timedelta(seconds=seconds)


def run(
    state: DriftState,
    rep: DriftReport | None,
    now: float,
    *,
    active: bool = True,
    phase: Phase = Phase.ready,
    proposal: Proposal | None = None,
    last_replan_time: str = REPLANNED,
    after_replan: float = 1000.0,
    ramps: tuple[str, ...] = (),
    tuning: bool = False,
):
    """decide, booked in `state` as the loop books it."""
    action = decide(
        state,
        rep,
        LIMITS,
        now,
        active=active,
        phase=phase,
        proposal=proposal,
        last_replan_time=last_replan_time,
        period=PERIOD,
        ramps=ramps,
        tuning=tuning,
        utc_now=at(after_replan),
    )
    state.record(action, now)
    return action


def move_cap(reason: str = "length-drift") -> Proposal:
    return Proposal(reason=reason, hash="abc", held_back="move cap: 2 more replica move(s) follow in later periods")


def test_a_trigger_in_active_mode_replans():
    action = run(DriftState(), report("length-drift"), 100.0)
    assert action.do is Do.replan and action.reason == "length-drift" and action.plans
    assert action.hold is None and action.proposal is None and not action.write_status
    assert action.event is not None and action.event.reason == "Replan"
    assert action.event.message.startswith("length-drift: length score 0.4 (limit 0.15)")
    # the first plan ever (no lastReplanTime) has no cooldown either
    assert run(DriftState(), report("slo-risk"), 100.0, last_replan_time="", after_replan=0.0).do is Do.replan


def test_inside_the_cooldown_it_holds_then_replans_once_it_is_over():
    state = DriftState()
    held = run(state, report(), 100.0, after_replan=120.0)
    assert held.do is Do.hold and held.hold is Hold.cooldown and held.reason == "length-drift"
    assert held.message == "cooldown: 180s left" == cooldown_text(180.0)
    assert held.proposal == Proposal(reason="length-drift", hash="", held_back="cooldown: 180s left")
    assert held.write_status and held.event is not None and held.event.reason == "ReplanHeld"
    assert hold_of(held.proposal) is Hold.cooldown
    # the next read under the same hold: the status is refreshed, the event is not repeated
    again = run(state, report(), 115.0, proposal=held.proposal, after_replan=135.0)
    assert again.hold is Hold.cooldown and again.message == "cooldown: 165s left" and again.event is None
    # another reason is a new hold: one more event
    other = run(state, report("slo-risk"), 130.0, proposal=again.proposal, after_replan=150.0)
    assert other.hold is Hold.cooldown and other.event is not None and other.event.reason == "ReplanHeld"
    # the cooldown is over: the held drift re-plans
    over = run(state, report("slo-risk"), 300.0, proposal=other.proposal, after_replan=300.0)
    assert over.do is Do.replan and over.reason == "slo-risk" and over.event.reason == "Replan"


def test_advisory_mode_proposes_a_reason_at_most_once_a_period():
    state = DriftState()
    first = run(state, report(), 100.0, active=False, phase=Phase.advisory, after_replan=10.0)
    assert first.do is Do.propose and first.plans and first.event.reason == "Replan"  # no cooldown in advisory mode
    standing = Proposal(reason="length-drift", hash="h1", held_back="advisory mode: nothing applied")
    assert hold_of(standing) is Hold.advisory
    repeat = run(state, report(), 100.0 + PERIOD - 1, active=False, phase=Phase.advisory, proposal=standing)
    assert repeat.do is Do.hold and repeat.hold is Hold.advisory_repeat and repeat.write_status and repeat.event is None
    assert state.proposed == 100.0  # a repeat does not restart the period
    # another reason is proposed at once; the same one again a period after the last proposal
    assert run(state, report("slo-risk"), 130.0, active=False, phase=Phase.advisory, proposal=standing).do is Do.propose
    slo = Proposal(reason="slo-risk", hash="h2", held_back="advisory mode: nothing applied")
    assert run(state, report("slo-risk"), 130.0 + PERIOD - 1, active=False, proposal=slo).hold is Hold.advisory_repeat
    assert run(state, report("slo-risk"), 130.0 + PERIOD, active=False, proposal=slo).do is Do.propose


def test_a_capped_replan_steps_once_a_period_and_only_when_ready():
    state = DriftState(last_step=100.0)
    pending = move_cap()
    assert hold_of(pending) is Hold.move_cap
    rolling = run(state, None, 100.0 + 2 * PERIOD, phase=Phase.deploying, proposal=pending)
    assert rolling.do is Do.hold and rolling.hold is Hold.rollout and not rolling.write_status
    early = run(state, report(""), 100.0 + PERIOD - 1, proposal=pending)
    assert early.do is Do.hold and early.hold is Hold.move_cap and early.write_status  # a new report is written
    step = run(state, None, 100.0 + PERIOD, proposal=pending)
    assert step.do is Do.step and step.reason == "length-drift" and step.plans
    assert step.event.reason == "ReplanStep"
    assert step.event.message == (
        "length-drift: the next step toward the capped re-plan "
        "(move cap: 2 more replica move(s) follow in later periods)"
    )
    # a trigger during a capped re-plan is its next step (no cooldown check), named after the trigger
    trig = run(DriftState(), report("slo-risk"), 100.0, proposal=pending, after_replan=1.0)
    assert trig.do is Do.step and trig.reason == "slo-risk" and trig.event.reason == "Replan"
    # advisory mode takes no steps: the drift rules apply
    assert run(DriftState(), None, 100.0, active=False, proposal=pending).do is Do.nothing


def test_without_a_trigger_the_thresholds_are_retuned_at_most_once_a_period():
    state = DriftState()
    ramps = ("ramp1", "ramp3")
    first = run(state, report(""), 100.0, ramps=ramps)
    assert first.do is Do.retune and first.write_status and not first.clear_proposal
    assert state.last_tune == 100.0
    assert run(state, None, 100.0 + PERIOD - 1, ramps=ramps).do is Do.nothing
    assert run(state, None, 100.0 + PERIOD, ramps=ramps, tuning=True).do is Do.nothing  # the last one still runs
    assert run(state, None, 100.0 + PERIOD, ramps=ramps).do is Do.retune
    assert run(DriftState(), None, 100.0, ramps=()).do is Do.nothing  # no ramps: nothing to tune
    quiet = run(DriftState(), None, 100.0)
    assert quiet.do is Do.nothing and not quiet.write_status and quiet.event is None


def test_a_held_cooldown_whose_drift_has_gone_clears_the_proposal():
    held = Proposal(reason="length-drift", hash="", held_back="cooldown: 120s left")
    gone = run(DriftState(), report(""), 100.0, proposal=held, after_replan=200.0)
    assert gone.do is Do.nothing and gone.clear_proposal and gone.write_status
    # a move-cap or advisory proposal is not a cooldown hold: it stays
    assert not run(DriftState(), report(""), 100.0, proposal=move_cap(), active=False).clear_proposal
    # nothing new arrived: the judged window that raised the hold is scored again
    window = Observations(service="s", model="m", since=0.0, until=30.0)
    assert needs_reassess(DriftState(judged=window), None, held)
    assert not needs_reassess(DriftState(judged=window), report(), held)
    assert not needs_reassess(DriftState(), None, held)
    assert not needs_reassess(DriftState(judged=window), None, move_cap())


def test_hold_of_reads_the_status_wording():
    assert hold_of(None) is None
    assert hold_of(Proposal(reason="r", hash="", held_back="")) is None
    assert hold_of(Proposal(reason="r", hash="", held_back="cooldown: 3s left")) is Hold.cooldown
    assert hold_of(Proposal(reason="r", hash="", held_back="advisory mode: nothing applied")) is Hold.advisory


def test_reads_fall_on_a_grid_of_the_interval():
    state = DriftState()
    assert state.take_read(100.0, 15.0) and state.last_check == 100.0
    assert not state.take_read(114.0, 15.0)
    assert state.take_read(117.0, 15.0) and state.last_check == 115.0  # on the grid, not at the tick
    assert state.take_read(200.0, 15.0) and state.last_check == 200.0  # a missed read restarts the grid


def test_a_read_up_to_half_a_tick_early_is_taken_and_booked_on_the_grid():
    """Ticks on a shared grid start a little apart (where each service falls within their burst): a tick just
    short of the interval reads rather than leaving the read to the next tick, and the grid stays where it was."""
    state = DriftState()
    assert state.take_read(100.3, 10.0, early=2.5) and state.last_check == 100.3
    assert not state.take_read(105.0, 10.0, early=2.5)  # half an interval: not yet
    # 0.2 s short: read, and booked on the grid
    assert state.take_read(110.1, 10.0, early=2.5) and state.last_check == 110.3
    assert not state.take_read(115.0, 10.0, early=2.5)
    assert state.take_read(120.0, 10.0, early=2.5) and state.last_check == 120.3
    assert state.take_read(129.9, 10.0, early=2.5) and state.last_check == 130.3  # never drifts a tick late
    without = DriftState()
    assert without.take_read(100.3, 10.0) and not without.take_read(110.1, 10.0)  # the next tick, 5 s late


def test_slices_keep_two_periods_and_full_blocks_feed_the_survival_series():
    state = DriftState()

    def piece(since: float, until: float, n: int) -> Observations:
        return Observations(
            service="s",
            model="m",
            since=since,
            until=until,
            requests=n,
            survival=[0.5, 0.2],
            length_buckets=[32],
            length_histogram=[n],
        )

    for t in range(0, 300, 15):
        state.add_slice(piece(t, t + 15, 25), PERIOD)
        state.add_to_survival(piece(t, t + 15, 25), PERIOD)
    assert state.slices[-1].until - state.slices[0].until <= 2 * PERIOD
    assert state.survival and all(s == pytest.approx([0.5, 0.2]) for s in state.survival)
    assert len(state.survival) == 10  # 300 s in half-period (30 s) blocks of >= 50 answered
