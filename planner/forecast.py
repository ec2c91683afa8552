"""Batch-profile forecasting: the survival curve (fraction of inputs left after each ramp) of the next
window, predicted per ramp from the observation windows, behind a small predictor registry.

Predictors (`PREDICTORS`): `constant` (last value), `ewma` (exponentially weighted mean), `ar1` (the
default: an AR(1) around the window's mean in closed form -- the mean, and the lag-1 least-squares slope
of the deviations, kept stationary -- on the last 12 windows, every ramp at once: microseconds), and
`arima`, its reference (statsmodels' ARIMA(1,0,0) maximum-likelihood fit per ramp, ~0.1 s a ramp; the
tests check that the two agree on AR(1) series). Both fall back to EWMA when a series is too short or
constant for the fit. `forecast_survival` also clips the forecast to [0, 1] and keeps it non-increasing
along the ramps. `backtest` replays a series one window at a time and reports the mean absolute error
of each predictor's one-step-ahead forecasts.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from exitplan.planner.errors import SpecError

Predictor = Callable[[np.ndarray], float]
"""history (1-D, oldest first, >= 1 value) -> forecast of the next value."""


def predict_constant(history: np.ndarray) -> float:
    return float(history[-1])


def predict_ewma(history: np.ndarray, alpha: float = 0.5) -> float:
    level = float(history[0])
    for x in history[1:]:
        level = alpha * float(x) + (1 - alpha) * level
    return level


def predict_arima(
    history: np.ndarray, order: tuple[int, int, int] = (1, 0, 0), min_points: int = 6, window: int = 12
) -> float:
    """ARIMA fitted on the last `window` points (statsmodels); EWMA when they are too few or flat to fit.

    The window keeps an old regime from pulling the forecast back after the workload switches."""
    history = np.asarray(history)[-window:]
    if len(history) < min_points or float(np.ptp(history)) < 1e-9:
        return predict_ewma(history)
    from statsmodels.tsa.arima.model import ARIMA

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            fit = ARIMA(np.asarray(history, dtype=np.float64), order=order).fit()
            value = float(fit.forecast(1)[0])
        except (ValueError, np.linalg.LinAlgError):
            return predict_ewma(history)
    return value if np.isfinite(value) else predict_ewma(history)


AR1_WINDOW = 12
"""The AR(1) fit reads the last this many windows (as the ARIMA reference): an old regime does not pull the
forecast back after the workload switches."""
AR1_MIN_POINTS = 6
PHI_MAX = 0.99
"""The AR(1) coefficient is kept within +-PHI_MAX (a stationary fit, as the reference enforces)."""


def predict_ar1_all(histories: np.ndarray) -> np.ndarray:
    """AR(1) forecasts of every column of `histories` (T, R), oldest first, in closed form: on the last
    AR1_WINDOW points, mu = their mean, phi = sum d_t d_t+1 / sum d_t^2 over the deviations d = x - mu
    (least squares of each deviation on the one before, clipped to +-PHI_MAX), forecast mu + phi d_T. A
    column too short (< AR1_MIN_POINTS) or flat is forecast by EWMA, as `predict_arima` does."""
    h = np.atleast_2d(np.asarray(histories, dtype=np.float64))[-AR1_WINDOW:]
    mu = h.mean(axis=0)
    d = h - mu
    den = (d[:-1] ** 2).sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        phi = np.clip(np.where(den > 0, (d[:-1] * d[1:]).sum(axis=0) / den, 0.0), -PHI_MAX, PHI_MAX)
    out: np.ndarray = mu + phi * d[-1]
    flat = np.ptp(h, axis=0) < 1e-9
    if len(h) < AR1_MIN_POINTS or flat.any():
        for r in np.flatnonzero(flat) if len(h) >= AR1_MIN_POINTS else range(h.shape[1]):
            out[r] = predict_ewma(h[:, r])
    return out


def predict_ar1(history: np.ndarray) -> float:
    """`predict_ar1_all` of one series."""
    return float(predict_ar1_all(np.asarray(history, dtype=np.float64)[:, None])[0])


PREDICTORS: dict[str, Predictor] = {
    "constant": predict_constant,
    "ewma": predict_ewma,
    "ar1": predict_ar1,
    "arima": predict_arima,
}
BATCHED: dict[str, Callable[[np.ndarray], np.ndarray]] = {"ar1": predict_ar1_all}
"""Predictors that forecast every ramp in one call (`forecast_survival` uses them)."""
DEFAULT_PREDICTOR = "ar1"


def get_predictor(name: str) -> Predictor:
    try:
        return PREDICTORS[name]
    except KeyError:
        raise SpecError(f"unknown predictor {name!r}; choose one of {sorted(PREDICTORS)}", field="forecaster") from None


def register_predictor(name: str, fn: Predictor) -> None:
    PREDICTORS[name] = fn


def forecast_survival(series: np.ndarray, predictor: str = DEFAULT_PREDICTOR) -> np.ndarray:
    """series[t, r] = survival after ramp r in window t -> forecast for window t+1 (shape R)."""
    series = np.atleast_2d(np.asarray(series, dtype=np.float64))
    fn = get_predictor(predictor)
    if predictor in BATCHED and PREDICTORS[predictor] is fn:
        raw = BATCHED[predictor](series)
    else:
        raw = np.asarray([fn(series[:, r]) for r in range(series.shape[1])])
    return np.minimum.accumulate(np.clip(raw, 0.0, 1.0))


@dataclass
class Backtest:
    predictor: str
    mae: float
    """Mean absolute error of one-step forecasts over every ramp and window after warm-up."""
    max_error: float
    errors: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))
    """Per forecast window: mean absolute error over the ramps."""


def backtest(
    series: np.ndarray, predictors: Sequence[str] = ("constant", "ewma", "ar1", "arima"), warmup: int = 3
) -> list[Backtest]:
    """One-step-ahead forecasts of windows warmup..T-1 from the windows before each."""
    series = np.atleast_2d(np.asarray(series, dtype=np.float64))
    out = []
    for name in predictors:
        errs = []
        for t in range(warmup, len(series)):
            pred = forecast_survival(series[:t], name)
            errs.append(float(np.mean(np.abs(pred - series[t]))))
        arr = np.asarray(errs)
        out.append(Backtest(name, float(arr.mean()) if len(arr) else 0.0, float(arr.max()) if len(arr) else 0.0, arr))
    return out
