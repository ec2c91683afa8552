"""What a bundle's exits will buy, in compute (FLOPs from the graph, not timings, so the figures and the
choice of ramps do not swing with other jobs on the machine): this module owns the compute window the
ramp placement decides on and the build report's summary of the exits.

In the compute window an input exiting at a ramp saves the fraction of the model's compute after the
ramp's cut, and every ramp an input reaches costs its own FLOPs as a fraction of the model's. The
summary tunes thresholds at the accuracy budget on the held-out rows and gives, per ramp, its place
(the fraction of the compute before it), its agreement with the final answer, its exit share, and the
expected compute saved, beside the per-input oracle over the same ramps: each input exits at the first
ramp that already gives the final answer, the most any thresholds on these ramps could save.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from exitplan.planner.tuning.feedback import FeedbackWindow, outcome
from exitplan.planner.tuning.thresholds import tune

__all__ = ["compute_window", "exit_summary", "oracle_saving"]


def compute_window(
    conf: np.ndarray, pred: np.ndarray, final: np.ndarray, places: Sequence[float], costs: Sequence[float]
) -> FeedbackWindow:
    """The feedback window with savings and costs as fractions of the model's compute: an exit at ramp r
    saves 1 - places[r]; reaching ramp r costs costs[r]."""
    saving = 1.0 - np.asarray(places, dtype=np.float64)
    return FeedbackWindow(conf=conf, pred=pred, final=final, saving_ms=saving, cost_ms=np.asarray(costs, float))


def oracle_saving(window: FeedbackWindow) -> float:
    """Mean compute saved when each input exits at the first ramp whose answer is the final one (paying
    the ramps it reached), and runs to the end (paying them all) where none is."""
    if window.n_ramps == 0:
        return 0.0
    right = window.pred == window.final[:, None]
    first = np.where(right.any(axis=1), np.argmax(right, axis=1), window.n_ramps)
    paid = np.concatenate([np.cumsum(window.cost_ms), [window.cost_ms.sum()]])
    saved = np.concatenate([window.saving_ms, [0.0]])
    return float((saved[first] - paid[np.minimum(first, window.n_ramps)]).mean())


def exit_summary(
    names: Sequence[str], window: FeedbackWindow | None, places: Sequence[float], budget: float
) -> dict[str, Any]:
    """The build report's `exits`: thresholds tuned at `budget` on the compute window of the bundle's ramps
    `names` (block order; None: the bundle has none), and per ramp its place, agreement, exit share and
    cost; the expected compute saved and the oracle's (fractions of the model's compute per input)."""
    if window is None or window.n_ramps == 0:
        return {
            "budget": budget,
            "agreement": 1.0,
            "compute_saved": 0.0,
            "oracle_compute_saved": 0.0,
            "ramps": [],
        }
    n = window.n_inputs
    tuned = tune(window, budget)
    result = outcome(window, tuned.thresholds)
    ramps = []
    for r, name in enumerate(names):
        ramps.append(
            {
                "name": name,
                "place": float(places[r]),
                "agreement": float((window.pred[:, r] == window.final).mean()),
                "threshold": float(result.thresholds[r]),
                "exit_share": float(result.exits[r] / n),
                "cost": float(window.cost_ms[r]),
            }
        )
    return {
        "budget": budget,
        "agreement": result.agreement,
        "compute_saved": result.saving_ms,
        "oracle_compute_saved": oracle_saving(window),
        "ramps": ramps,
    }
