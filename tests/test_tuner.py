"""Threshold tuning: window semantics, the tuner against exhaustive search, bad input."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from exitplan.planner.tuning.grid import grid_search, grid_values
from exitplan.planner.tuning.synthetic_windows import synthetic_window
from exitplan.planner.tuning.thresholds import (
    DISABLED,
    FeedbackWindow,
    InfeasibleBudget,
    WindowError,
    allowed_disagreements,
    evaluate,
    exit_index,
    outcome,
    tune,
)


def _by_hand(w: FeedbackWindow, t: np.ndarray) -> tuple[float, float]:
    """The issue's definitions, input by input, in plain Python."""
    agree, saving = 0, 0.0
    for i in range(w.n_inputs):
        paid, exit_at = 0.0, None
        for r in range(w.n_ramps):
            if t[r] > 1.0:
                continue  # disabled: costs nothing, lets nobody out
            paid += w.cost_ms[r]  # reached an active ramp
            if w.conf[i, r] >= t[r]:
                exit_at = r
                break
        if exit_at is None:
            agree += 1
            saving -= paid
        else:
            agree += int(w.pred[i, exit_at] == w.final[i])
            saving += w.saving_ms[exit_at] - paid
    return agree / w.n_inputs, saving / w.n_inputs


def _tiny() -> FeedbackWindow:
    conf = np.array([[0.9, 0.95], [0.5, 0.8], [0.2, 0.3]])
    pred = np.array([[1, 1], [0, 2], [0, 0]])
    final = np.array([1, 2, 1])
    return FeedbackWindow(conf, pred, final, saving_ms=np.array([10.0, 4.0]), cost_ms=np.array([1.0, 0.5]))


def test_exit_index_takes_the_earliest_active_ramp_and_r_for_never():
    conf = np.array([[0.9, 0.95], [0.5, 0.8], [0.2, 0.3]])
    assert exit_index(conf, [0.85, 0.7]).tolist() == [0, 1, 2]
    assert exit_index(conf, [DISABLED, 0.7]).tolist() == [1, 1, 2]
    assert exit_index(conf, [1.5, 1.0000001]).tolist() == [2, 2, 2]
    assert exit_index(conf, [0.9, 0.0]).tolist() == [0, 1, 1]  # >= at the threshold itself


def test_evaluate_tiny_window_by_the_definitions():
    w = _tiny()
    # t = [0.85, 0.7]: input 0 exits at ramp 0 (agrees, saves 10 - 1), input 1 at ramp 1 (agrees,
    # 4 - 1 - 0.5), input 2 never exits (agrees, pays both ramps: -1.5).
    agreement, saving = evaluate(w, [0.85, 0.7])
    assert agreement == 1.0
    assert saving == pytest.approx((9.0 + 2.5 - 1.5) / 3)
    # Ramp 0 disabled: input 0 now exits at ramp 1 and pays only ramp 1; input 2 pays only ramp 1.
    agreement, saving = evaluate(w, [DISABLED, 0.7])
    assert agreement == 1.0
    assert saving == pytest.approx((3.5 + 3.5 - 0.5) / 3)
    # Ramp 0 at 0.4: input 1 exits there with answer 0 != 2.
    agreement, saving = evaluate(w, [0.4, 0.7])
    assert agreement == pytest.approx(2 / 3)
    assert saving == pytest.approx((9.0 + 9.0 - 1.5) / 3)
    out = outcome(w, [0.4, 0.7])
    assert out.exits.tolist() == [2, 0, 1]
    assert out.reached.tolist() == [3, 1]
    assert out.exit_agree.tolist() == [1, 0]


@pytest.mark.parametrize("seed", range(6))
def test_evaluate_matches_the_definitions_input_by_input(seed):
    rng = np.random.default_rng(seed)
    w = synthetic_window(rng, n=150, r=int(rng.integers(1, 6)))
    for _ in range(20):
        t = rng.uniform(0.0, 1.0, size=w.n_ramps)
        t[rng.random(w.n_ramps) < 0.3] = DISABLED
        got = evaluate(w, t)
        want = _by_hand(w, t)
        assert got[0] == pytest.approx(want[0], abs=1e-12)
        assert got[1] == pytest.approx(want[1], abs=1e-9)


def test_budget_counts_disagreements_exactly():
    assert allowed_disagreements(100, 0.29) == 29  # 0.29 * 100 is 28.999999999999996 in floats
    assert allowed_disagreements(1024, 0.01) == 10
    assert allowed_disagreements(1024, 0.0) == 0


@pytest.mark.parametrize("method", ["profile", "steps"])
@pytest.mark.parametrize("seed", range(10))
def test_tune_holds_the_budget_and_reports_what_evaluate_says(method, seed):
    rng = np.random.default_rng(100 + seed)
    w = synthetic_window(rng, n=int(rng.integers(50, 600)), r=int(rng.integers(1, 9)))
    budget = float(rng.choice([0.0, 0.005, 0.01, 0.03, 0.1]))
    res = tune(w, budget, method=method)
    res.verify(w)  # figures re-evaluated, budget on integer counts
    agreement, saving = evaluate(w, res.thresholds)
    assert agreement >= 1.0 - budget - 1e-12
    assert res.agreement == agreement and res.saving_ms == saving  # evaluated afresh, exactly
    assert res.saving_ms >= 0.0  # all disabled (saving 0) is always within budget
    assert res.saving_ms >= res.climb_saving_ms - 1e-9  # the refinement never loses


def test_tune_handles_tied_confidences():
    rng = np.random.default_rng(7)
    w = synthetic_window(rng, n=400, r=4)
    w = FeedbackWindow(np.round(w.conf, 1), w.pred, w.final, w.saving_ms, w.cost_ms)
    for method in ("profile", "steps"):
        res = tune(w, 0.02, method=method)
        res.verify(w)
    grid = grid_search(w, 0.02, 0.1)  # with confidences on a 0.1 grid, this grid is exhaustive
    assert res.saving_ms == pytest.approx(grid.saving_ms, rel=0.03) or res.saving_ms > grid.saving_ms


@pytest.mark.parametrize("r", [1, 2, 3])
def test_grid_search_is_exhaustive(r):
    rng = np.random.default_rng(r)
    w = synthetic_window(rng, n=200, r=r)
    budget = 0.03
    got = grid_search(w, budget, 0.25)
    values = list(grid_values(0.25)) + [DISABLED]
    allowed = allowed_disagreements(w.n_inputs, budget)
    best = max(
        outcome(w, np.array(cfg)).saving_ms
        for cfg in itertools.product(values, repeat=r)
        if w.n_inputs - outcome(w, np.array(cfg)).agree_count <= allowed
    )
    assert got.saving_ms == pytest.approx(best)
    assert got.configs == len(values) ** r


def test_tune_is_close_to_the_grid_optimum_on_small_windows():
    rng = np.random.default_rng(42)
    ratios = []
    for i in range(24):
        w = synthetic_window(rng, n=512, r=2 + i % 2)
        budget = float(rng.choice([0.005, 0.01, 0.02, 0.05]))
        grid = grid_search(w, budget, 0.01)
        res = tune(w, budget)
        if grid.saving_ms > 1e-9:
            ratios.append(res.saving_ms / grid.saving_ms)
        else:
            assert res.saving_ms >= grid.saving_ms - 1e-9
    assert len(ratios) >= 15
    assert np.median(ratios) >= 0.995
    assert min(ratios) >= 0.97


def test_steps_method_doubles_a_chosen_step():
    # One ramp, every answer right, confidences dense: nothing overshoots, so each move doubles the step.
    conf = np.linspace(0.0, 1.0, 2001)[:, None]
    w = FeedbackWindow(conf, np.zeros((2001, 1), int), np.zeros(2001, int), np.array([10.0]), np.array([0.0]))
    res = tune(w, 0.0, method="steps", refine_pass=False, init_step=0.05, max_step=0.2)
    news = [1.0] + [m.new for m in res.moves if m.phase == "climb"]
    drops = np.round(-np.diff(news), 6).tolist()
    assert drops[:4] == [0.05, 0.1, 0.2, 0.2]  # doubled, then bounded by max_step
    assert res.thresholds[0] == 0.0 and res.agreement == 1.0


def test_steps_method_halves_on_overshoot_and_stops_at_the_budget_edge():
    # Answers are wrong below 0.8 and the budget allows no disagreement: the climb must end exactly
    # at the lowest confidence >= 0.8.
    conf = np.linspace(0.0, 1.0, 1001)[:, None]
    pred = np.where(conf[:, 0] >= 0.8, 0, 1)[:, None]
    w = FeedbackWindow(conf, pred, np.zeros(1001, int), np.array([10.0]), np.array([0.1]))
    res = tune(w, 0.0, method="steps", refine_pass=False)
    assert res.thresholds[0] == pytest.approx(conf[conf[:, 0] >= 0.8, 0].min())
    assert res.agreement == 1.0


def test_infeasible_start_is_repaired_first():
    rng = np.random.default_rng(3)
    w = synthetic_window(rng, n=500, r=4, gamma=3.0)
    start = np.zeros(4)  # everyone exits at ramp 0: far below any budget
    assert evaluate(w, start)[0] < 0.9
    res = tune(w, 0.01, start)
    assert res.repaired
    assert res.moves[0].phase == "repair"
    res.verify(w)


def test_movable_keeps_the_other_ramps_and_fixed_ramps_can_break_the_budget():
    rng = np.random.default_rng(4)
    w = synthetic_window(rng, n=500, r=3)
    start = np.array([DISABLED, 0.99, DISABLED])
    assert evaluate(w, start)[0] >= 0.98
    res = tune(w, 0.02, start, movable=[True, False, True])
    assert res.thresholds[1] == 0.99
    res.verify(w)
    with pytest.raises(InfeasibleBudget) as err:
        tune(w, 0.01, [0.0, DISABLED, DISABLED], movable=[False, True, True])
    assert err.value.field == "budget"


def test_budget_zero_loses_nothing():
    rng = np.random.default_rng(5)
    w = synthetic_window(rng, n=400, r=3)
    res = tune(w, 0.0)
    assert res.agreement == 1.0


def _arrays(n=20, r=3):
    rng = np.random.default_rng(0)
    return dict(
        conf=rng.random((n, r)),
        pred=rng.integers(0, 3, (n, r)),
        final=rng.integers(0, 3, n),
        saving_ms=np.array([3.0, 2.0, 1.0][:r]),
        cost_ms=np.full(r, 0.1),
    )


@pytest.mark.parametrize(
    "field, bad",
    [
        ("conf", lambda a: a["conf"].__setitem__((3, 1), np.nan)),
        ("conf", lambda a: a.update(conf=a["conf"] * 2)),
        ("conf", lambda a: a.update(conf=a["conf"][:0], pred=a["pred"][:0], final=a["final"][:0])),
        ("pred", lambda a: a.update(pred=a["pred"][:, :2])),
        ("pred", lambda a: a.update(pred=a["pred"] + 0.5)),
        ("final", lambda a: a.update(final=a["final"][:5])),
        ("saving_ms", lambda a: a.update(saving_ms=np.array([1.0, 2.0]))),
        ("cost_ms", lambda a: a.update(cost_ms=np.array([0.1, -0.1, 0.1]))),
        ("cost_ms", lambda a: a["cost_ms"].__setitem__(0, np.nan)),
    ],
)
def test_bad_windows_name_the_field(field, bad):
    arrays = _arrays()
    bad(arrays)
    with pytest.raises(WindowError) as err:
        FeedbackWindow(**arrays)
    assert err.value.field == field
    assert str(err.value).startswith(field)


@pytest.mark.parametrize("budget", [-0.01, 1.0, 1.5, float("nan")])
def test_bad_budgets_are_refused(budget):
    w = FeedbackWindow(**_arrays())
    with pytest.raises(WindowError) as err:
        tune(w, budget)
    assert err.value.field == "budget"


def test_thresholds_for_a_ramp_that_no_longer_exists_are_refused():
    w = FeedbackWindow(**_arrays())
    with pytest.raises(WindowError) as err:
        tune(w, 0.01, start=[0.9, 0.9, 0.9, 0.9])
    assert err.value.field == "start"
    with pytest.raises(WindowError) as err:
        evaluate(w, [0.9, np.nan, 0.9])
    assert err.value.field == "thresholds"


def test_window_roundtrip_and_missing_arrays(tmp_path):
    w = FeedbackWindow(**_arrays(), ramps=("a", "b", "c"))
    w.save(tmp_path / "w.npz")
    back = FeedbackWindow.load(tmp_path / "w.npz")
    assert back.ramps == ("a", "b", "c")
    for name in ("conf", "pred", "final", "saving_ms", "cost_ms"):
        assert np.array_equal(getattr(back, name), getattr(w, name))
    arrays = _arrays()
    del arrays["cost_ms"]
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(WindowError) as err:
        FeedbackWindow.load(tmp_path / "bad.npz")
    assert err.value.field == "cost_ms"
    with pytest.raises(WindowError) as err:
        FeedbackWindow.load(tmp_path / "missing.npz")
    assert err.value.field == "window"


def test_float32_confidences_a_hair_past_one_are_accepted():
    arrays = _arrays()
    arrays["conf"] = arrays["conf"].astype(np.float32)
    arrays["conf"][0, 0] = np.float32(1.0000001)
    w = FeedbackWindow(**arrays)
    assert w.conf.max() == 1.0


def _all_thresholds(w: FeedbackWindow, r: int) -> list[float]:
    return sorted(set(w.conf[:, r].tolist())) + [DISABLED]


@pytest.mark.parametrize("seed", range(4))
def test_budget_programme_is_exact_for_one_and_two_ramps(seed):
    # Exhaustive over every distinct confidence of every ramp (savings shrink with depth).
    from exitplan.planner.tuning.dp import budget_dp

    rng = np.random.default_rng(200 + seed)
    for r in (1, 2):
        w = synthetic_window(rng, n=60, r=r)
        budget = float(rng.choice([0.0, 0.05, 0.1]))
        allowed = allowed_disagreements(w.n_inputs, budget)
        best = max(
            outcome(w, np.array(cfg)).saving_ms
            for cfg in itertools.product(*[_all_thresholds(w, q) for q in range(r)])
            if w.n_inputs - outcome(w, np.array(cfg)).agree_count <= allowed
        )
        t, total = budget_dp(w, allowed, beam=1)
        got = outcome(w, t)
        assert total / w.n_inputs == pytest.approx(got.saving_ms)
        assert w.n_inputs - got.agree_count <= allowed
        assert got.saving_ms == pytest.approx(best)
        assert tune(w, budget).saving_ms >= best - 1e-9


def test_budget_programme_respects_fixed_ramps():
    from exitplan.planner.tuning.dp import budget_dp

    rng = np.random.default_rng(12)
    w = synthetic_window(rng, n=300, r=4)
    fixed = np.array([DISABLED, 0.97, DISABLED, DISABLED])
    t, _ = budget_dp(w, allowed_disagreements(300, 0.05), movable=np.array([True, False, True, True]), fixed=fixed)
    assert t[1] == 0.97
    assert w.n_inputs - outcome(w, t).agree_count <= allowed_disagreements(300, 0.05)


def test_repair_when_no_single_ramp_helps():
    # Both ramps let out the same wrong answers: switching off either one alone changes nothing,
    # so the repair must switch off both.
    n = 100
    conf = np.full((n, 2), 0.9)
    pred = np.zeros((n, 2), int)
    pred[:20] = 1  # 20 % wrong at both ramps
    w = FeedbackWindow(conf, pred, np.zeros(n, int), np.array([10.0, 5.0]), np.array([0.1, 0.1]))
    res = tune(w, 0.05, start=[0.5, 0.5], restart=False, refine_pass=False)
    assert res.repaired
    res.verify(w)
