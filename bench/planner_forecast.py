"""Survival-curve forecast error on a workload that switches 80:20 -> 50:50 -> 20:80 easy:hard.

    python bench/planner_forecast.py

Windows: 20 per phase; each window's survival curve is the 12-block easy:hard mapping of
planner/synthetic.py (easy inputs exit after 2-5 blocks, hard after 10-12) measured on 500
requests (binomial sampling noise, as a router window of 500 answers would show). One-step-ahead
forecasts from the windows before each (after 3 warm-up windows) by the registry's predictors;
error = mean absolute difference over the 11 ramps. Reported overall, in steady windows, and in
the 3 windows after each switch.
"""

from __future__ import annotations

import numpy as np

from exitplan.planner.forecast import backtest
from exitplan.planner.simulator import depths_from_survival


def series(per_phase: int = 20, requests: int = 500, seed: int = 0):
    from exitplan.planner.synthetic import easy_hard_survival

    rng = np.random.default_rng(seed)
    rows, phase = [], []
    for p, easy in enumerate((0.8, 0.5, 0.2)):
        truth = easy_hard_survival(12, easy)
        for _ in range(per_phase):
            d = depths_from_survival(rng, requests, 12, list(range(11)), truth, [True] * 11)
            rows.append([float(np.mean(d > k + 1)) for k in range(11)])
            phase.append(p)
    return np.asarray(rows), np.asarray(phase)


def main() -> None:
    s, phase = series()
    warm = 3
    after_switch = np.zeros(len(s), dtype=bool)
    for i in range(1, len(s)):
        if phase[i] != phase[i - 1]:
            after_switch[i : i + 3] = True
    mask = after_switch[warm:]
    print(
        f"{len(s)} windows, 3 phases (80:20, 50:50, 20:80), 11 ramps; one-step-ahead mean absolute error of the survival curve"
    )
    for b in backtest(s, ("constant", "ewma", "arima"), warmup=warm):
        print(
            f"  {b.predictor:<9} overall {b.mae:.4f}  steady {b.errors[~mask].mean():.4f}  3 windows after a switch {b.errors[mask].mean():.4f}  "
            f"worst {b.max_error:.4f}"
        )
    jump = np.abs(s[phase == 1].mean(0) - s[phase == 0].mean(0)).mean()
    print(
        f"  (the curve moves by {jump:.4f} on average at each switch; the drift limit survivalError defaults to 0.1 max-abs)"
    )


if __name__ == "__main__":
    main()
