"""A tail's outcome read off its window's (planner/tuning/feedback.py `outcome`): the same figures, counts and
per-input arrays as computed from the tail's own samples, for tails of every length, tails of tails, disabled
and fixed ramps; and read off only when the window keeps the outcome of the same thresholds."""

from __future__ import annotations

import numpy as np
import pytest

from exitplan.planner.tuning.feedback import DISABLED, FeedbackWindow, _outcome, outcome
from exitplan.planner.tuning.synthetic_windows import synthetic_window


def fresh_copy(w: FeedbackWindow) -> FeedbackWindow:
    """The same samples as a window of its own (no parent to read outcomes off)."""
    return FeedbackWindow(w.conf.copy(), w.pred.copy(), w.final.copy(), w.saving_ms, w.cost_ms)


def same(a, b) -> None:
    assert a.agree_count == b.agree_count and a.agreement == b.agreement
    assert a.saving_ms == pytest.approx(b.saving_ms, rel=1e-12, abs=1e-12)
    for name in ("thresholds", "exit_at", "exits", "exit_agree", "reached", "per_input_ms", "agrees"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


@pytest.mark.parametrize("seed", range(4))
def test_a_tails_outcome_read_off_its_windows_is_the_one_computed_from_its_samples(seed: int) -> None:
    rng = np.random.default_rng(seed)
    w = synthetic_window(rng, 700, 6)
    t = rng.uniform(0.3, 1.0, 6)
    t[rng.integers(0, 6)] = DISABLED  # a ramp switched off
    whole = outcome(w, t)  # kept with the window
    for k in (1, 2, 99, 100, 350, 699, 700):
        tail = w.tail(k)
        derived = outcome(tail, t)
        same(derived, _outcome(fresh_copy(tail), t.copy()))
        if k < w.n_inputs:
            assert derived.exit_at.base is not None  # read off the window's, not computed again
        else:
            assert derived is whole  # the whole window is its own tail
        inner = tail.tail(max(1, k // 3))  # a tail of a tail: read off the tail's, kept now
        same(outcome(inner, t), _outcome(fresh_copy(inner), t.copy()))
    assert outcome(w, t) is whole


def test_other_thresholds_on_a_tail_are_computed_from_its_samples() -> None:
    w = synthetic_window(np.random.default_rng(7), 400, 4)
    kept_t, other_t = np.full(4, 0.8), np.array([0.9, DISABLED, 0.6, 0.95])
    outcome(w, kept_t)
    tail = w.tail(120)
    got = outcome(tail, other_t)
    same(got, _outcome(fresh_copy(tail), other_t.copy()))
    assert got.exit_at.base is None  # the window kept no outcome of these thresholds
