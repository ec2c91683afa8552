"""Forecasting: the predictor registry, clipping/monotone survival, the closed-form AR(1) against its statsmodels ARIMA
reference, and backtests on a switching mix."""

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


def ar1_series(phi: float, n: int, rng: np.random.Generator, mean: float = 0.6, sd: float = 0.01) -> np.ndarray:
    x = np.empty(n)
    x[0] = mean + rng.normal(0, sd / np.sqrt(1 - phi**2))
    for t in range(1, n):
        x[t] = mean + phi * (x[t - 1] - mean) + rng.normal(0, sd)
    return x


@pytest.mark.parametrize("phi", [0.0, 0.5, 0.8, -0.3])
def test_closed_form_ar1_agrees_with_the_statsmodels_fit(phi):
    """On stationary AR(1) series of the window's length (12 points, noise sd 0.01), the closed form's
    one-step forecast is the maximum-likelihood ARIMA(1,0,0)'s to within a small part of the noise (median
    at most 0.1 sd, never 1 sd), and forecasts the next point as well (mean error within 10 %)."""
    rng = np.random.default_rng(int(10 * phi) + 50)
    sd, gaps, err_ar1, err_ref = 0.01, [], [], []
    for _ in range(25):
        x = ar1_series(phi, 13, rng, sd=sd)
        ar1, ref = PREDICTORS["ar1"](x[:12]), PREDICTORS["arima"](x[:12])
        gaps.append(abs(ar1 - ref) / sd)
        err_ar1.append(abs(ar1 - x[12]))
        err_ref.append(abs(ref - x[12]))
    assert np.median(gaps) <= 0.1 and max(gaps) < 1.0
    assert np.mean(err_ar1) <= 1.1 * np.mean(err_ref)


def test_closed_form_forecasts_every_ramp_at_once_as_one_by_one():
    rng = np.random.default_rng(3)
    series = np.column_stack([ar1_series(0.5, 14, rng, mean=m) for m in (0.9, 0.7, 0.5, 0.3)])
    series[:, 3] = 0.3  # a flat ramp: EWMA, as the reference falls back
    batched = forecast_survival(series, "ar1")
    one_by_one = np.minimum.accumulate(np.clip([PREDICTORS["ar1"](series[:, r]) for r in range(4)], 0, 1))
    assert batched == pytest.approx(one_by_one, abs=1e-15)
    assert forecast_survival(series[:4], "ar1") == pytest.approx(forecast_survival(series[:4], "ewma"))  # too short


def test_closed_form_backtest_is_as_good_as_the_reference_on_a_switching_mix():
    series = switching_series(windows_per_phase=7)[:, :3]
    ar1, ref = backtest(series, ("ar1", "arima"))
    assert ar1.mae <= 1.1 * ref.mae and ar1.max_error <= 1.1 * ref.max_error
