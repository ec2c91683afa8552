"""What the exits buy, in compute (exitplan.prepare.exit_report): the compute window, the per-input oracle and
the build report's summary at the budget, on windows small enough to check by hand."""

from __future__ import annotations

import numpy as np
import pytest

from exitplan.prepare.exit_report import compute_window, exit_summary, oracle_saving

PLACES, COSTS = [0.25, 0.5], [0.01, 0.02]


def _window(conf, pred, final):
    return compute_window(np.asarray(conf, float), np.asarray(pred), np.asarray(final), PLACES, COSTS)


def test_the_oracle_exits_each_input_at_the_first_ramp_with_the_final_answer():
    # input 0: ramp 0 right; input 1: ramp 1 right; input 2: neither (runs to the end, pays both ramps)
    w = _window([[0.9, 0.9]] * 3, [[1, 0], [0, 1], [0, 0]], [1, 1, 1])
    expected = ((0.75 - 0.01) + (0.5 - 0.03) + (0.0 - 0.03)) / 3
    assert oracle_saving(w) == pytest.approx(expected)


def test_the_summary_at_the_budget_names_each_ramps_place_agreement_and_share():
    rng = np.random.default_rng(0)
    final = rng.integers(0, 3, 400)
    right0 = rng.random(400) < 0.6
    pred = np.stack([np.where(right0, final, (final + 1) % 3), final], axis=1)
    conf = np.stack([np.where(right0, 0.95, 0.5), np.full(400, 0.99)], axis=1)
    summary = exit_summary(["ramp0", "ramp1"], _window(conf, pred, final), PLACES, budget=0.0)
    first, second = summary["ramps"]
    assert summary["agreement"] == 1.0  # no wrong exit allowed at budget 0
    assert first["place"] == 0.25 and first["agreement"] == pytest.approx(right0.mean())
    assert first["exit_share"] == pytest.approx(right0.mean()) and second["exit_share"] == pytest.approx(
        1 - right0.mean()
    )
    want = right0.mean() * (0.75 - 0.01) + (1 - right0.mean()) * (0.5 - 0.03)
    assert summary["compute_saved"] == pytest.approx(want)
    assert summary["oracle_compute_saved"] == pytest.approx(want)  # here the thresholds find the oracle's exits


def test_a_bundle_without_ramps_saves_nothing():
    assert exit_summary([], None, [], 0.01) == {
        "budget": 0.01,
        "agreement": 1.0,
        "compute_saved": 0.0,
        "oracle_compute_saved": 0.0,
        "ramps": [],
    }
