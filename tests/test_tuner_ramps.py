"""Ramp management: utilities, upper bounds, the overhead budget, decisions."""

from __future__ import annotations

import numpy as np
import pytest

from exitplan.planner.tuning.ramps import manage_ramps, ramp_utilities
from exitplan.planner.tuning.synthetic_windows import synthetic_window
from exitplan.planner.tuning.thresholds import DISABLED, FeedbackWindow, WindowError, evaluate, tune


def _full_latency(w: FeedbackWindow) -> float:
    # synthetic_window: exiting at depth f saves latency * (1 - f); f_0 = 1 / (R + 1).
    return float(w.saving_ms[0]) * (w.n_ramps + 1) / w.n_ramps


@pytest.mark.parametrize("seed", range(5))
def test_utility_is_what_switching_the_ramp_off_loses(seed):
    rng = np.random.default_rng(seed)
    w = synthetic_window(rng, n=600, r=5)
    t = tune(w, 0.02).thresholds
    _, saving = evaluate(w, t)
    for u in ramp_utilities(w, t):
        if not u.active:
            assert u.utility_ms == 0.0 and u.exits == 0
            continue
        off = t.copy()
        off[u.ramp] = DISABLED
        agreement_off, saving_off = evaluate(w, off)
        assert u.utility_ms == pytest.approx(saving - saving_off, abs=1e-9)
        assert u.added_ms == pytest.approx(w.cost_ms[u.ramp] * (u.reached - u.exits) / w.n_inputs)
        assert u.agreement_delta == pytest.approx(evaluate(w, t)[0] - agreement_off)


def test_upper_bound_is_not_beaten_by_thresholds_that_exit_no_wrong_answer():
    rng = np.random.default_rng(9)
    w = synthetic_window(rng, n=600, r=4)
    t = tune(w, 0.0).thresholds  # budget 0: every exit agrees with the full model
    for u in ramp_utilities(w, t):
        if u.active:
            assert u.upper_bound_ms >= u.utility_ms - 1e-9


def test_a_negative_ramp_is_switched_off_with_its_reason():
    rng = np.random.default_rng(2)
    w = synthetic_window(rng, n=500, r=3)
    cost = w.cost_ms.copy()
    cost[1] = 0.2 * w.saving_ms[1]  # overhead paid by everyone reaching it, far above what it saves
    w = FeedbackWindow(w.conf, w.pred, w.final, w.saving_ms, cost)
    start = np.array([DISABLED, 0.95, DISABLED])
    assert ramp_utilities(w, start)[1].utility_ms < 0
    plan = manage_ramps(w, 0.01, _full_latency(w), start, overhead_frac=0.5)
    plan.verify(w, 0.01)
    assert not plan.active[1]
    first = plan.actions[0]
    assert first.ramp == 1 and first.action == "deactivate"


def test_overhead_budget_switches_off_the_least_useful_ramps():
    rng = np.random.default_rng(4)
    w = synthetic_window(rng, n=800, r=6)
    start = tune(w, 0.02).thresholds
    assert (start <= 1.0).sum() >= 2
    tight = 1.01 * float(w.cost_ms[start <= 1.0].min()) / _full_latency(w)  # room for about one ramp
    plan = manage_ramps(w, 0.02, _full_latency(w), start, overhead_frac=tight)
    plan.verify(w, 0.02)
    assert plan.overhead_ms <= plan.overhead_budget_ms
    assert any(a.action == "deactivate" and "overhead" in a.reason for a in plan.actions)


@pytest.mark.parametrize("seed", range(6))
def test_managed_plans_hold_every_budget(seed):
    rng = np.random.default_rng(50 + seed)
    w = synthetic_window(rng, n=700, r=int(rng.integers(2, 8)))
    budget = float(rng.choice([0.005, 0.01, 0.03]))
    plan = manage_ramps(w, budget, _full_latency(w), overhead_frac=float(rng.choice([0.02, 0.05])))
    plan.verify(w, budget)
    tried = [a for a in plan.actions if a.action in ("activate", "reject")]
    assert len({a.ramp for a in tried}) == len(tried)  # each candidate is tried once
    assert plan.saving_ms >= 0.0


def test_candidates_go_in_order_of_upper_bound():
    rng = np.random.default_rng(8)
    w = synthetic_window(rng, n=600, r=5)
    plan = manage_ramps(w, 0.02, _full_latency(w), overhead_frac=0.01)
    first = next(a for a in plan.actions if a.action in ("activate", "reject"))
    bounds = [u.upper_bound_ms for u in ramp_utilities(w, np.full(5, DISABLED))]
    assert first.ramp == int(np.argmax(bounds))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(worst_case_ms=0.0), "worst_case_ms"),
        (dict(worst_case_ms=float("nan")), "worst_case_ms"),
        (dict(worst_case_ms=100.0, overhead_frac=1.5), "overhead_frac"),
        (dict(worst_case_ms=100.0, budget=2.0), "budget"),
        (dict(worst_case_ms=100.0, thresholds=[0.5]), "thresholds"),
    ],
)
def test_bad_ramp_management_input(kwargs, field):
    w = synthetic_window(np.random.default_rng(0), n=100, r=3)
    args = dict(budget=0.01) | kwargs
    with pytest.raises(WindowError) as err:
        manage_ramps(w, **args)
    assert err.value.field == field
