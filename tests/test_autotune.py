"""The continual tuning policy (pure: decide, advance, TuneConfig) and the live loop around it
(exitplan.localrun.autotune.AutoTuner) against a fake router; tests/test_dataplane.py runs one live
step against a real router."""

import math
import time
from dataclasses import replace

import numpy as np
import pytest

from exitplan.planner.tuning.autotune import LIVE, TuneConfig, TunerState, advance, decide
from exitplan.planner.tuning.thresholds import FeedbackWindow, evaluate


def window(n=1000, seed=0):
    """Two ramps; an input's ramp answer is right more often the more confident the ramp is."""
    rng = np.random.default_rng(seed)
    final = rng.integers(0, 3, n)
    conf = rng.uniform(0.34, 1.0, (n, 2))
    conf[:, 1] = np.clip(conf[:, 1] + 0.1, 0, 1)
    right = rng.uniform(0, 1, (n, 2)) < conf**2
    pred = np.where(right, final[:, None], (final[:, None] + 1) % 3)
    return FeedbackWindow(
        conf=conf, pred=pred, final=final, saving_ms=np.array([20.0, 10.0]), cost_ms=np.array([0.1, 0.1])
    )


def test_short_window_keeps_the_thresholds():
    d = decide(window(50), ["a", "b"], {"a": 2.0, "b": 2.0}, 0.01, TuneConfig(min_samples=200))
    assert d.thresholds is None and d.reason == "short-of-samples"


def test_thresholds_breaking_the_budget_are_repaired():
    w = window()
    d = decide(w, ["a", "b"], {"a": 0.4, "b": 0.4}, 0.01)
    assert d.reason == "accuracy" and d.agreement_before < 0.99 and d.trigger in ("breach", "margin")
    agreement, _ = evaluate(w, np.array([d.thresholds["a"], d.thresholds["b"]]))
    assert agreement >= 0.99 and d.agreement_after >= 0.99  # repaired on the recent samples, holds on all


def test_disabled_ramps_are_lowered_to_claim_savings():
    d = decide(window(), ["a", "b"], {"a": 2.0, "b": 2.0}, 0.05)
    assert d.reason == "savings" and d.trigger == "savings" and d.saving_after_ms > d.saving_before_ms > -1e-9
    assert min(d.thresholds.values()) <= 1.0


def test_no_gain_keeps_the_thresholds():
    w = window()
    first = decide(w, ["a", "b"], {"a": 2.0, "b": 2.0}, 0.05)
    again = decide(w, ["a", "b"], first.thresholds, 0.05)
    assert again.thresholds is None and again.reason == "no-gain" and again.trigger == ""


def test_sample_budget_is_below_the_budget_and_approaches_it_with_more_samples():
    from exitplan.planner.tuning.autotune import sample_budget

    values = [sample_budget(0.01, n) for n in (100, 600, 2000, 100000)]
    assert values[0] == 0.0  # 100 samples cannot vouch for 1 %
    assert all(a < b for a, b in zip(values[1:], values[2:]))
    assert 0.0 < values[1] < values[2] < values[3] < 0.01
    assert sample_budget(0.01, 0) == 0.0


def test_a_breach_in_the_recent_samples_is_repaired_on_them():
    """Old samples are easy, the newest are hard: the whole window looks fine, the recent part does not."""
    easy, hard = window(2000, seed=1), window(300, seed=2)
    hard_pred = (hard.final + 1) % 3  # the hard inputs' early answers are all wrong...
    hard_conf = np.full_like(hard.conf, 0.99)  # ...and confident
    w = FeedbackWindow(
        conf=np.vstack([easy.conf, hard_conf]),
        pred=np.vstack([easy.pred, np.stack([hard_pred] * 2, 1)]),
        final=np.concatenate([easy.final, hard.final]),
        saving_ms=easy.saving_ms,
        cost_ms=easy.cost_ms,
    )
    current = decide(easy, ["a", "b"], {"a": 2.0, "b": 2.0}, 0.05).thresholds
    d = decide(w, ["a", "b"], current, 0.05, TuneConfig(recent=300))
    assert d.reason == "accuracy" and d.samples == 300 and d.agreement_before < 0.95
    assert d.trigger == "breach" and d.detail.startswith("breach")
    assert all(t > 0.99 for t in d.thresholds.values())  # those confident wrong exits are shut


def _stack(*windows):
    return FeedbackWindow(
        conf=np.vstack([w.conf for w in windows]),
        pred=np.vstack([w.pred for w in windows]),
        final=np.concatenate([w.final for w in windows]),
        saving_ms=windows[0].saving_ms,
        cost_ms=windows[0].cost_ms,
    )


def test_new_samples_finds_the_previous_fetch_in_the_next():
    from exitplan.planner.tuning.autotune import _tail, new_samples

    w = window(300, seed=3)
    first = FeedbackWindow(
        conf=w.conf[:200], pred=w.pred[:200], final=w.final[:200], saving_ms=w.saving_ms, cost_ms=w.cost_ms
    )
    assert new_samples(None, w) == 300
    assert new_samples(first, w) == 100
    assert new_samples(first, _tail(w, 150)) == 100  # the ring only returns the newest samples
    assert new_samples(window(50, seed=9), w) == 300  # not found: everything is new


def test_binomial_tail_and_breach():
    from exitplan.planner.tuning.autotune import binomial_tail, breach

    assert binomial_tail(0, 10, 0.3) == 1.0 and binomial_tail(11, 10, 0.3) == 0.0
    assert abs(binomial_tail(2, 3, 0.5) - 0.5) < 1e-12  # P(X >= 2) for 3 fair coins
    w = window(400, seed=4)
    t = np.array([2.0, 2.0])
    assert breach(w, t, 0.01, (50, 100, 200), 0.01) is None  # no ramp active: every answer agrees
    bad = _stack(
        w,
        FeedbackWindow(
            conf=np.full((50, 2), 0.99),
            pred=np.stack([(w.final[:50] + 1) % 3] * 2, 1),
            final=w.final[:50],
            saving_ms=w.saving_ms,
            cost_ms=w.cost_ms,
        ),
    )
    fired = breach(bad, np.array([0.9, 0.9]), 0.01, (50, 100, 200), 0.01)
    assert fired is not None and fired[0] == 50 and fired[1] >= 45


def test_a_shift_in_the_early_exit_share_is_caught_before_the_disagreements_add_up():
    """The newest 100 samples are confident at ramp a (most exit there), the 600 before were not:
    one disagreement among them is no breach, but the exit share moved; the drift test resets and
    shuts the confident wrong exit."""
    rng = np.random.default_rng(5)
    old = window(600, seed=6)
    old = FeedbackWindow(
        conf=np.minimum(old.conf, 0.5), pred=old.pred, final=old.final, saving_ms=old.saving_ms, cost_ms=old.cost_ms
    )
    final = rng.integers(0, 3, 100)
    pred = np.stack([final, final], 1)
    pred[-1, 0] = (final[-1] + 1) % 3  # one wrong, confident early answer
    new = FeedbackWindow(
        conf=np.full((100, 2), 0.95), pred=pred, final=final, saving_ms=old.saving_ms, cost_ms=old.cost_ms
    )
    w = _stack(old, new)
    current = {"a": 0.9, "b": 2.0}
    quiet = decide(w, ["a", "b"], current, 0.01, TuneConfig(recent=200, min_samples=100))
    assert not quiet.detail.startswith(("breach", "drift"))  # 1 disagreement in 200: not a breach
    assert quiet.trigger not in ("breach", "drift")
    d = decide(w, ["a", "b"], current, 0.01, TuneConfig(recent=200, min_samples=100, drift_z=3.3, drift_recent=100))
    assert d.reason == "accuracy" and d.detail.startswith("drift") and d.trigger == "drift"
    assert d.thresholds["a"] > 0.95  # the confident wrong exit is shut
    assert evaluate(new, np.array([d.thresholds["a"], d.thresholds["b"]]))[0] == 1.0


def test_since_a_breach_no_disagreement_is_allowed_until_enough_fresh_samples():
    w = window(1000, seed=7)
    current = {"a": 0.5, "b": 2.0}
    agreement_tail, _ = evaluate(
        FeedbackWindow(
            conf=w.conf[-80:], pred=w.pred[-80:], final=w.final[-80:], saving_ms=w.saving_ms, cost_ms=w.cost_ms
        ),
        np.array([0.5, 2.0]),
    )
    assert agreement_tail < 1.0  # some fresh sample disagrees at these thresholds
    d = decide(
        w, ["a", "b"], current, 0.5, TuneConfig(min_samples=50, savings_samples=500), fresh=80
    )  # budget 50 %: no breach
    assert d.reason == "accuracy" and "since the last breach" in d.detail and d.samples == 80 and d.trigger == "margin"
    assert d.thresholds["a"] > 0.5 and d.agreement_after == 1.0


def test_headroom_keeps_a_safety_margin_below_the_budget():
    from exitplan.planner.tuning.autotune import sample_budget

    w = window(2000, seed=8)
    full = decide(w, ["a", "b"], {"a": 2.0, "b": 2.0}, 0.05, TuneConfig(headroom=1.0))
    half = decide(w, ["a", "b"], {"a": 2.0, "b": 2.0}, 0.05, TuneConfig(headroom=0.5))
    assert full.reason == half.reason == "savings"
    assert half.agreement_after > full.agreement_after
    assert 1 - half.agreement_after <= 0.5 * sample_budget(0.05, 2000) + 1e-12
    assert half.saving_after_ms < full.saving_after_ms


def _drifted():
    """600 old samples that rarely exit at ramp a, then 100 confident ones (one wrong): the exit share moved."""
    rng = np.random.default_rng(5)
    old = window(600, seed=6)
    old = FeedbackWindow(
        conf=np.minimum(old.conf, 0.5), pred=old.pred, final=old.final, saving_ms=old.saving_ms, cost_ms=old.cost_ms
    )
    final = rng.integers(0, 3, 100)
    pred = np.stack([final, final], 1)
    pred[-1, 0] = (final[-1] + 1) % 3
    new = FeedbackWindow(
        conf=np.full((100, 2), 0.95), pred=pred, final=final, saving_ms=old.saving_ms, cost_ms=old.cost_ms
    )
    return _stack(old, new)


def test_an_unconfirmed_drift_alarm_changes_nothing_but_reports_the_statistic():
    w = _drifted()
    current = {"a": 0.9, "b": 2.0}
    config = TuneConfig(recent=200, min_samples=100, drift_z=3.3, drift_recent=100)
    d = decide(w, ["a", "b"], current, 0.01, config, drift_armed=False)
    assert not d.detail.startswith("drift") and d.reason != "savings" and d.trigger != "drift"
    assert d.exit_z > 3.3  # the caller sees the alarm and confirms it on later samples
    armed = decide(w, ["a", "b"], current, 0.01, config, drift_armed=True)
    assert armed.detail.startswith("drift") and armed.trigger == "drift" and armed.exit_z == d.exit_z


def test_a_drift_alarm_is_acted_on_only_once_new_samples_confirm_it():
    from exitplan.planner.tuning.autotune import Decision, track_alarm

    config = replace(LIVE, drift_z=3.3, drift_recent=100)
    alarm = Decision(None, "short-of-samples", 500, exit_z=3.6)
    quiet = Decision(None, "no-gain", 500, exit_z=0.4)
    state, words = track_alarm(None, alarm, False, config)
    assert state == (1.0, 0) and words == ["alarm z = +3.6 on 500 samples"]  # raised, not acted on
    state, words = track_alarm((1.0, 60), quiet, False, config)
    assert state is not None and words == []  # 60 new samples: too few to judge it yet
    state, words = track_alarm((1.0, 120), quiet, True, config)
    assert state is None  # the next 100 samples did not show the move: a false alarm, dropped
    assert words == ["dropped: z = +0.4 after 120 new samples"]
    state, _ = track_alarm(None, alarm, False, config)
    assert state == (1.0, 0)
    state, _ = track_alarm((1.0, 120), Decision(None, "no-gain", 500, exit_z=-3.6), True, config)
    assert state is None  # a move the other way does not confirm it
    state, _ = track_alarm(None, alarm, False, config)
    drift = Decision(
        {"a": 2.0, "b": 2.0}, "accuracy", 100, detail="drift: early-exit share moved", exit_z=3.9, trigger="drift"
    )
    state, words = track_alarm(state, drift, True, config)
    assert state is None and words == ["acted on: z = +3.9"]  # confirmed and acted on
    breach = Decision(
        {"a": 2.0, "b": 2.0}, "accuracy", 100, detail="breach in the last 50 samples: 3 disagree", trigger="breach"
    )
    assert track_alarm((1.0, 30), breach, False, config) == (None, ["superseded by a breach"])
    assert track_alarm((1.0, 30), alarm, False, replace(config, drift_confirm=False)) == (None, [])


def _more(n, seed, conf_low=0.92):
    """n new samples confident at ramp a (above 0.9: they exit there), all agreeing with the full model."""
    rng = np.random.default_rng(seed)
    final = rng.integers(0, 3, n)
    return FeedbackWindow(
        conf=rng.uniform(conf_low, 1.0, (n, 2)),
        pred=np.stack([final, final], 1),
        final=final,
        saving_ms=np.array([20.0, 10.0]),
        cost_ms=np.array([0.1, 0.1]),
    )


def test_advance_counts_fresh_samples_from_zero_after_a_breach():
    from exitplan.planner.tuning.autotune import _tail

    config = replace(LIVE, tails=())
    w = window(1000, seed=7)
    before = TunerState(fresh=None, alarm_log=["earlier"])
    quiet, state = advance(before, w, {"a": 2.0, "b": 2.0}, ["a", "b"], 0.01, config)
    assert quiet.trigger not in ("breach", "drift") and state.fresh is None  # no breach yet: every sample counts
    assert state.alarm_log == ["earlier"] and state.reference is None
    kept = state.previous  # the window's newest samples, copied (not the whole window: one state per service)
    assert kept.n_inputs == 4 and np.array_equal(kept.conf, w.conf[-4:]) and kept.conf.base is None
    d, state = advance(state, w, {"a": 0.4, "b": 0.4}, ["a", "b"], 0.01, config)
    assert d.trigger == "breach" and d.thresholds is not None and state.fresh == 0
    assert state.reference == {"a": 0.4, "b": 0.4}  # thresholds that let inputs exit: the drift test's reference
    assert before.fresh is None and before.previous is None  # pure: the old state is untouched
    later = _stack(_tail(w, 950), _more(50, seed=11))  # the router's ring: the newest 1,000 samples
    d2, state2 = advance(state, later, d.thresholds, ["a", "b"], 0.01, config)
    assert d2.trigger not in ("breach", "drift") and state2.fresh == 50  # only the samples since the breach
    assert d2.samples == 50


def test_advance_arms_an_unconfirmed_drift_alarm_after_drift_recent_new_samples():
    config = replace(LIVE, recent=200, min_samples=100)
    assert config.drift_confirm and config.drift_z == 3.3 and config.drift_recent == 100
    current, ramps = {"a": 0.9, "b": 2.0}, ["a", "b"]
    w = _drifted()
    d, state = advance(TunerState(), w, current, ramps, 0.01, config)
    assert d.exit_z > 3.3 and d.trigger != "drift" and d.thresholds is None  # seen, not acted on
    assert state.alarm == (1.0, 0) and len(state.alarm_log) == 1 and state.alarm_log[0].startswith("alarm z = +")
    more = _more(100, seed=12)
    part = FeedbackWindow(
        conf=more.conf[:60], pred=more.pred[:60], final=more.final[:60], saving_ms=more.saving_ms, cost_ms=more.cost_ms
    )
    d, state = advance(state, _stack(w, part), current, ramps, 0.01, config)
    assert d.trigger != "drift" and state.alarm == (1.0, 60)  # 60 new samples: not armed yet
    d, state = advance(state, _stack(w, more), current, ramps, 0.01, config)
    assert (
        d.trigger == "drift" and d.thresholds is not None and d.thresholds["a"] >= 0.9
    )  # armed on 100 new samples: acted on
    assert d.samples == 100 and d.agreement_after == 1.0
    assert state.alarm is None and state.fresh == 0 and state.alarm_log[-1].startswith("acted on: z = +")
    unconfirmed = replace(config, drift_confirm=False)  # armed at once: acted on at the first alarm
    d, state = advance(TunerState(), w, current, ramps, 0.01, unconfirmed)
    assert d.trigger == "drift" and state.alarm is None and state.fresh == 0


@pytest.mark.parametrize(
    "field, value",
    [
        ("min_samples", -1),
        ("recent", 0),
        ("savings_samples", -5),
        ("min_gain_ms", -0.1),
        ("z", -1.0),
        ("z", math.inf),
        ("headroom", 1.5),
        ("headroom", -0.1),
        ("tails", (50, 0)),
        ("alpha", 0.0),
        ("alpha", 1.0),
        ("alpha", math.nan),
        ("drift_z", -3.3),
        ("drift_recent", -1),
        ("savings_check", -1),
        ("period_s", 0.0),
        ("period_s", math.nan),
        ("window", 0),
    ],
)
def test_tune_config_rejects_out_of_range_knobs_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"TuneConfig.{field}: expected"):
        TuneConfig(**{field: value})
    with pytest.raises(ValueError, match=f"TuneConfig.{field}"):
        replace(LIVE, **{field: value})


def test_tune_config_defaults_are_decides_and_live_is_the_live_loops():
    d = TuneConfig()
    assert (
        d.min_samples,
        d.recent,
        d.savings_samples,
        d.min_gain_ms,
        d.z,
        d.headroom,
        d.tails,
        d.alpha,
        d.drift_z,
        d.drift_recent,
        d.savings_check,
        d.period_s,
        d.window,
        d.drift_confirm,
    ) == (200, 300, 1000, 0.05, 1.645, 1.0, (50, 100, 200), 0.01, 0.0, 100, 0, 20.0, 1500, True)
    assert (
        LIVE.min_samples,
        LIVE.recent,
        LIVE.savings_samples,
        LIVE.headroom,
        LIVE.alpha,
        LIVE.drift_z,
        LIVE.drift_recent,
        LIVE.drift_confirm,
        LIVE.savings_check,
        LIVE.window,
        LIVE.period_s,
    ) == (100, 100, 1000, 0.25, 0.05, 3.3, 100, True, 200, 1500, 20.0)
    assert TuneConfig(tails=[50, 100]).tails == (50, 100)  # kept as a tuple (the config is frozen)


class FakeRouter:
    """The control endpoints the tuner uses (exitplan.worker_image.control_client.ControlClient's), in memory."""

    base_url = "http://fake"

    def __init__(self, window_, thresholds, fail_first=0):
        self.window, self.current, self.fail_first = window_, dict(thresholds), fail_first
        self.pushed, self.calls, self.closed, self.version = [], 0, False, 0

    async def feedback(self, last):
        from exitplan.worker_image.control_client import ControlError, FeedbackArrays

        self.calls += 1
        if self.calls <= self.fail_first:
            raise ControlError("http://fake/v1/window.npz", "connection refused")
        w = self.window
        return FeedbackArrays(w.conf[-last:], w.pred[-last:], w.final[-last:], w.saving_ms, w.cost_ms)

    async def threshold_set(self):
        from exitplan.worker_image.threshold_set import ThresholdSet

        return ThresholdSet(dict(self.current), self.version)

    async def push_set(self, new, reason):
        self.pushed.append((dict(new.values), reason))
        self.current, self.version = dict(new.values), new.version
        return new

    async def close(self):
        self.closed = True


def test_autotuner_step_reads_decides_pushes_and_carries_the_state():
    from exitplan.localrun.autotune import AutoTuner

    changes = []
    tuner = AutoTuner("http://fake", ["a", "b"], 0.01, config=replace(LIVE, tails=()), on_change=changes.append)
    router = FakeRouter(window(1000, seed=7), {"a": 0.4, "b": 0.4})
    tuner.clients = [router]
    d = tuner.step()
    assert d.trigger == "breach" and router.pushed == [(d.thresholds, "tune-accuracy")] and changes == [d]
    assert router.version == tuner.version == 1  # the next version of the set in force
    assert tuner.history == [d] and tuner.state.fresh == 0 and tuner.state.previous.n_inputs == 4
    again = tuner.step()  # no new sample: nothing fresh to act on
    assert again.thresholds is None and tuner.state.fresh == 0 and len(tuner.history) == 2
    tuner.stop()
    assert router.closed
    with pytest.raises(RuntimeError):
        tuner.step()


def test_autotuner_loop_survives_a_failed_read_and_stops():
    from exitplan.localrun.autotune import AutoTuner

    tuner = AutoTuner("http://fake", ["a", "b"], 0.05, config=replace(LIVE, period_s=0.02, tails=()))
    router = FakeRouter(window(1000, seed=1), {"a": 2.0, "b": 2.0}, fail_first=1)
    tuner.clients = [router]
    tuner.start()
    deadline = time.monotonic() + 10
    while not tuner.history and time.monotonic() < deadline:
        time.sleep(0.02)
    tuner.stop()
    assert router.calls >= 2 and tuner.history  # the first read failed, the next ones went through
    assert not tuner._thread.is_alive() and router.closed


def test_savings_are_held_when_the_new_thresholds_break_the_budget_on_the_newest_samples():
    """1,000 fresh samples whose newest 100 are a new kind of traffic: confident, wrong early answers."""
    w = window(1000, seed=10)
    final = w.final[-100:]
    bad_pred = np.stack([(final + 1) % 3, (final + 1) % 3], 1)
    shifted = _stack(
        FeedbackWindow(
            conf=w.conf[:-100], pred=w.pred[:-100], final=w.final[:-100], saving_ms=w.saving_ms, cost_ms=w.cost_ms
        ),
        FeedbackWindow(
            conf=np.full((100, 2), 0.97), pred=bad_pred, final=final, saving_ms=w.saving_ms, cost_ms=w.cost_ms
        ),
    )
    start = {"a": 2.0, "b": 2.0}
    plain = decide(shifted, ["a", "b"], start, 0.2, TuneConfig(recent=50, tails=(), min_samples=100))
    assert plain.reason == "savings"  # fitted to the 900 older samples, the move looks good on the window
    checked = TuneConfig(recent=50, tails=(), min_samples=100, savings_check=200)
    held = decide(shifted, ["a", "b"], start, 0.2, checked)
    assert held.thresholds is None and "newest 200 samples" in held.detail and held.trigger == ""
    calm = decide(w, ["a", "b"], start, 0.2, checked)
    assert calm.reason == "savings"  # without the shift the check lets the savings through


def test_initial_thresholds_without_a_calibration_window_say_how_to_rebuild_the_bundle(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from exitplan.planner.tuning import initial

    manifest = SimpleNamespace(exit_ramps=lambda: [SimpleNamespace(name="ramp0")])
    monkeypatch.setattr(initial, "read_manifest", lambda bundle: manifest)
    with pytest.raises(initial.MissingCalibrationWindow, match=r"data/window\.npz.*exitplan prepare --force"):
        initial.initial_thresholds(tmp_path, 0.01, [32, 128])
    assert issubclass(initial.MissingCalibrationWindow, ValueError)  # the operator and `exitplan up` catch ValueError
    monkeypatch.setattr(initial, "read_manifest", lambda bundle: SimpleNamespace(exit_ramps=list))
    assert initial.initial_thresholds(tmp_path, 0.01, [32, 128]) == ({}, [])  # no exit ramps: nothing to tune


def test_advance_searches_savings_again_only_once_savings_every_samples_arrived():
    """After a savings search that found nothing worth claiming, a look at a window that gained fewer than
    `savings_every` samples under the same thresholds skips the search (it would search mostly the same
    samples); once that many arrived, or the thresholds in force are others, it searches again."""
    from exitplan.planner.tuning.autotune import _tail

    config, ramps = replace(LIVE, savings_every=300), ["a", "b"]
    w = window(1200, seed=0)
    d, state = advance(TunerState(), w, {"a": 2.0, "b": 2.0}, ramps, 0.05, config)
    assert d.trigger == "savings" and state.unclaimed is None
    tuned = d.thresholds
    d, state = advance(state, w, tuned, ramps, 0.05, config)
    assert d.reason == "no-gain" and state.unclaimed == (0, tuned)  # searched: nothing more to claim
    w = _tail(_stack(w, window(100, seed=3)), 1200)
    d, state = advance(state, w, tuned, ramps, 0.05, config)
    assert d.reason == "searched-recently" and d.thresholds is None and state.unclaimed == (100, tuned)
    other = {"a": 0.95, "b": 0.97}
    d_other, _ = advance(state, w, other, ramps, 0.05, config)
    assert d_other.reason != "searched-recently"  # other thresholds in force: searched at once
    w = _tail(_stack(w, window(250, seed=4)), 1200)
    d, state = advance(state, w, tuned, ramps, 0.05, config)
    assert d.trigger == "savings" and state.unclaimed is None
