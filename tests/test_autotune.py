"""The continual tuning decision (pure) and one live step against a real router."""

import numpy as np

from exitplan.planner.tuning.autotune import decide
from exitplan.planner.tuning.thresholds import FeedbackWindow, evaluate


def window(n=1000, seed=0):
    """Two ramps; an input's ramp answer is right more often the more confident the ramp is."""
    rng = np.random.default_rng(seed)
    final = rng.integers(0, 3, n)
    conf = rng.uniform(0.34, 1.0, (n, 2))
    conf[:, 1] = np.clip(conf[:, 1] + 0.1, 0, 1)
    right = rng.uniform(0, 1, (n, 2)) < conf ** 2
    pred = np.where(right, final[:, None], (final[:, None] + 1) % 3)
    return FeedbackWindow(conf=conf, pred=pred, final=final, saving_ms=np.array([20.0, 10.0]), cost_ms=np.array([0.1, 0.1]))


def test_short_window_keeps_the_thresholds():
    d = decide(window(50), ["a", "b"], {"a": 2.0, "b": 2.0}, 0.01, min_samples=200)
    assert d.thresholds is None and d.reason == "short-of-samples"


def test_thresholds_breaking_the_budget_are_repaired():
    w = window()
    d = decide(w, ["a", "b"], {"a": 0.4, "b": 0.4}, 0.01)
    assert d.reason == "accuracy" and d.agreement_before < 0.99
    agreement, _ = evaluate(w, np.array([d.thresholds["a"], d.thresholds["b"]]))
    assert agreement >= 0.99 and d.agreement_after >= 0.99  # repaired on the recent samples, holds on all


def test_disabled_ramps_are_lowered_to_claim_savings():
    d = decide(window(), ["a", "b"], {"a": 2.0, "b": 2.0}, 0.05)
    assert d.reason == "savings" and d.saving_after_ms > d.saving_before_ms > -1e-9
    assert min(d.thresholds.values()) <= 1.0


def test_no_gain_keeps_the_thresholds():
    w = window()
    first = decide(w, ["a", "b"], {"a": 2.0, "b": 2.0}, 0.05)
    again = decide(w, ["a", "b"], first.thresholds, 0.05)
    assert again.thresholds is None and again.reason == "no-gain"


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
    w = FeedbackWindow(conf=np.vstack([easy.conf, hard_conf]), pred=np.vstack([easy.pred, np.stack([hard_pred] * 2, 1)]),
               final=np.concatenate([easy.final, hard.final]), saving_ms=easy.saving_ms, cost_ms=easy.cost_ms)
    current = decide(easy, ["a", "b"], {"a": 2.0, "b": 2.0}, 0.05).thresholds
    d = decide(w, ["a", "b"], current, 0.05, recent=300)
    assert d.reason == "accuracy" and d.samples == 300 and d.agreement_before < 0.95
    assert all(t > 0.99 for t in d.thresholds.values())  # those confident wrong exits are shut


def _stack(*windows):
    return FeedbackWindow(conf=np.vstack([w.conf for w in windows]), pred=np.vstack([w.pred for w in windows]),
                  final=np.concatenate([w.final for w in windows]), saving_ms=windows[0].saving_ms,
                  cost_ms=windows[0].cost_ms)


def test_new_samples_finds_the_previous_fetch_in_the_next():
    from exitplan.planner.tuning.autotune import _tail, new_samples

    w = window(300, seed=3)
    first = FeedbackWindow(conf=w.conf[:200], pred=w.pred[:200], final=w.final[:200], saving_ms=w.saving_ms, cost_ms=w.cost_ms)
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
    bad = _stack(w, FeedbackWindow(conf=np.full((50, 2), 0.99), pred=np.stack([(w.final[:50] + 1) % 3] * 2, 1),
                           final=w.final[:50], saving_ms=w.saving_ms, cost_ms=w.cost_ms))
    fired = breach(bad, np.array([0.9, 0.9]), 0.01, (50, 100, 200), 0.01)
    assert fired is not None and fired[0] == 50 and fired[1] >= 45


def test_a_shift_in_the_early_exit_share_is_caught_before_the_disagreements_add_up():
    """The newest 100 samples are confident at ramp a (most exit there), the 600 before were not:
    one disagreement among them is no breach, but the exit share moved; the drift test resets and
    shuts the confident wrong exit."""
    rng = np.random.default_rng(5)
    old = window(600, seed=6)
    old = FeedbackWindow(conf=np.minimum(old.conf, 0.5), pred=old.pred, final=old.final, saving_ms=old.saving_ms, cost_ms=old.cost_ms)
    final = rng.integers(0, 3, 100)
    pred = np.stack([final, final], 1)
    pred[-1, 0] = (final[-1] + 1) % 3  # one wrong, confident early answer
    new = FeedbackWindow(conf=np.full((100, 2), 0.95), pred=pred, final=final, saving_ms=old.saving_ms, cost_ms=old.cost_ms)
    w = _stack(old, new)
    current = {"a": 0.9, "b": 2.0}
    quiet = decide(w, ["a", "b"], current, 0.01, recent=200, min_samples=100)
    assert not quiet.detail.startswith(("breach", "drift"))  # 1 disagreement in 200: not a breach
    d = decide(w, ["a", "b"], current, 0.01, recent=200, min_samples=100, drift_z=3.3, drift_recent=100)
    assert d.reason == "accuracy" and d.detail.startswith("drift")
    assert d.thresholds["a"] > 0.95  # the confident wrong exit is shut
    assert evaluate(new, np.array([d.thresholds["a"], d.thresholds["b"]]))[0] == 1.0


def test_since_a_breach_no_disagreement_is_allowed_until_enough_fresh_samples():
    w = window(1000, seed=7)
    current = {"a": 0.5, "b": 2.0}
    agreement_tail, _ = evaluate(FeedbackWindow(conf=w.conf[-80:], pred=w.pred[-80:], final=w.final[-80:],
                                        saving_ms=w.saving_ms, cost_ms=w.cost_ms), np.array([0.5, 2.0]))
    assert agreement_tail < 1.0  # some fresh sample disagrees at these thresholds
    d = decide(w, ["a", "b"], current, 0.5, fresh=80, min_samples=50, savings_samples=500)  # budget 50 %: no breach
    assert d.reason == "accuracy" and "since the last breach" in d.detail and d.samples == 80
    assert d.thresholds["a"] > 0.5 and d.agreement_after == 1.0


def test_headroom_keeps_a_safety_margin_below_the_budget():
    from exitplan.planner.tuning.autotune import sample_budget

    w = window(2000, seed=8)
    full = decide(w, ["a", "b"], {"a": 2.0, "b": 2.0}, 0.05, headroom=1.0)
    half = decide(w, ["a", "b"], {"a": 2.0, "b": 2.0}, 0.05, headroom=0.5)
    assert full.reason == half.reason == "savings"
    assert half.agreement_after > full.agreement_after
    assert 1 - half.agreement_after <= 0.5 * sample_budget(0.05, 2000) + 1e-12
    assert half.saving_after_ms < full.saving_after_ms


def _drifted():
    """600 old samples that rarely exit at ramp a, then 100 confident ones (one wrong): the exit share moved."""
    rng = np.random.default_rng(5)
    old = window(600, seed=6)
    old = FeedbackWindow(conf=np.minimum(old.conf, 0.5), pred=old.pred, final=old.final, saving_ms=old.saving_ms, cost_ms=old.cost_ms)
    final = rng.integers(0, 3, 100)
    pred = np.stack([final, final], 1)
    pred[-1, 0] = (final[-1] + 1) % 3
    new = FeedbackWindow(conf=np.full((100, 2), 0.95), pred=pred, final=final, saving_ms=old.saving_ms, cost_ms=old.cost_ms)
    return _stack(old, new)


def test_an_unconfirmed_drift_alarm_changes_nothing_but_reports_the_statistic():
    w = _drifted()
    current = {"a": 0.9, "b": 2.0}
    d = decide(w, ["a", "b"], current, 0.01, recent=200, min_samples=100, drift_z=3.3, drift_recent=100, drift_armed=False)
    assert not d.detail.startswith("drift") and d.reason != "savings"
    assert d.exit_z > 3.3  # the caller sees the alarm and confirms it on later samples
    armed = decide(w, ["a", "b"], current, 0.01, recent=200, min_samples=100, drift_z=3.3, drift_recent=100, drift_armed=True)
    assert armed.detail.startswith("drift") and armed.exit_z == d.exit_z


def test_autotuner_acts_on_a_drift_alarm_only_once_new_samples_confirm_it():
    from exitplan.planner.tuning.autotune import AutoTuner, Decision

    t = AutoTuner("http://127.0.0.1:9", ["a", "b"], 0.01, drift_z=3.3, drift_recent=100)
    alarm = Decision(None, "short-of-samples", 500, exit_z=3.6)
    quiet = Decision(None, "no-gain", 500, exit_z=0.4)
    t._track_alarm(alarm, armed=False)
    assert t.alarm == (1.0, 0)  # raised, not acted on
    t.alarm = (1.0, 60)
    t._track_alarm(quiet, armed=False)
    assert t.alarm is not None  # 60 new samples: too few to judge it yet
    t.alarm = (1.0, 120)
    t._track_alarm(quiet, armed=True)
    assert t.alarm is None  # the next 100 samples did not show the move: a false alarm, dropped
    t._track_alarm(alarm, armed=False)
    t.alarm = (1.0, 120)
    t._track_alarm(Decision(None, "no-gain", 500, exit_z=-3.6), armed=True)
    assert t.alarm is None  # a move the other way does not confirm it
    t._track_alarm(alarm, armed=False)
    t._track_alarm(Decision({"a": 2.0, "b": 2.0}, "accuracy", 100, detail="drift: early-exit share moved", exit_z=3.9), armed=True)
    assert t.alarm is None  # confirmed and acted on


def test_savings_are_held_when_the_new_thresholds_break_the_budget_on_the_newest_samples():
    """1,000 fresh samples whose newest 100 are a new kind of traffic: confident, wrong early answers."""
    w = window(1000, seed=10)
    final = w.final[-100:]
    bad_pred = np.stack([(final + 1) % 3, (final + 1) % 3], 1)
    shifted = _stack(FeedbackWindow(conf=w.conf[:-100], pred=w.pred[:-100], final=w.final[:-100], saving_ms=w.saving_ms,
                            cost_ms=w.cost_ms),
                     FeedbackWindow(conf=np.full((100, 2), 0.97), pred=bad_pred, final=final, saving_ms=w.saving_ms,
                            cost_ms=w.cost_ms))
    start = {"a": 2.0, "b": 2.0}
    plain = decide(shifted, ["a", "b"], start, 0.2, recent=50, tails=(), min_samples=100)
    assert plain.reason == "savings"  # fitted to the 900 older samples, the move looks good on the window
    held = decide(shifted, ["a", "b"], start, 0.2, recent=50, tails=(), min_samples=100, savings_check=200)
    assert held.thresholds is None and "newest 200 samples" in held.detail
    calm = decide(w, ["a", "b"], start, 0.2, recent=50, tails=(), min_samples=100, savings_check=200)
    assert calm.reason == "savings"  # without the shift the check lets the savings through
