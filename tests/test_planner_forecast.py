"""Forecasting: the predictor registry, clipping/monotone survival, ARIMA and backtests on a switching mix."""

from __future__ import annotations

import numpy as np
import pytest

from exitplan.planner.errors import SpecError
from exitplan.planner.forecast import PREDICTORS, backtest, forecast_survival, register_predictor
from exitplan.planner.synthetic import easy_hard_survival


def switching_series(windows_per_phase=12, noise=0.01, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for easy in (0.8, 0.5, 0.2):
        base = np.asarray(easy_hard_survival(12, easy))
        for _ in range(windows_per_phase):
            rows.append(np.clip(base + rng.normal(0, noise, base.shape), 0, 1))
    return np.asarray(rows)


def test_registry_and_unknown_name():
    assert {"constant", "ewma", "arima"} <= set(PREDICTORS)
    register_predictor("half", lambda h: 0.5)
    assert forecast_survival(np.ones((3, 2)), "half").tolist() == [0.5, 0.5]
    with pytest.raises(SpecError, match="unknown predictor"):
        forecast_survival(np.ones((3, 2)), "prophet")


def test_forecast_is_clipped_and_non_increasing():
    series = np.array([[0.9, 0.95, 1.2], [0.9, 0.97, 1.3]])
    out = forecast_survival(series, "constant")
    assert np.all(out <= 1.0) and np.all(np.diff(out) <= 0)


def test_arima_tracks_a_stationary_series():
    rng = np.random.default_rng(4)
    series = 0.6 + rng.normal(0, 0.01, (30, 1))
    pred = forecast_survival(series, "arima")
    assert pred[0] == pytest.approx(0.6, abs=0.02)


def test_backtest_on_switching_mix_reports_errors_per_predictor():
    series = switching_series()
    results = {b.predictor: b for b in backtest(series, ("constant", "ewma"))}
    # ARIMA fits cost ~50 ms each: backtest it on three ramps of a shorter run
    results["arima"] = backtest(switching_series(windows_per_phase=7)[:, :3], ("arima",))[0]
    for b in results.values():
        assert 0 < b.mae < 0.1 and b.max_error >= b.mae
    # right after a switch every predictor is off by about the jump; within a phase all are close
    jump = np.mean(np.abs(np.asarray(easy_hard_survival(12, 0.5)) - np.asarray(easy_hard_survival(12, 0.8))))
    assert results["constant"].max_error == pytest.approx(jump, abs=0.02)
