"""Where to put exit ramps: Apparate's choice among candidate cut vertices (pure numpy).

The window holds every candidate ramp (trained at every candidate cut). A placement is a subset of
them with thresholds tuned under the accuracy budget on the subset alone (the others off: inputs
never reach them, nothing pays their cost); its value is the window's saving per input (latency
saved by exits minus the overhead of the ramps the inputs pass), as :func:`tune` reports it.

- :func:`place_ramps` grows the subset greedily, each time adding the candidate that raises the
  saving most, while it gains and fits the overhead budget, up to `max_ramps`; then switches off
  any chosen ramp whose utility (:func:`ramp_utilities`) is negative.
- :func:`best_placement` tries every subset of up to `max_ramps` candidates (the reference).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from exitplan.planner.tuning.feedback import DISABLED, FeedbackWindow
from exitplan.planner.tuning.ramps import ramp_utilities
from exitplan.planner.tuning.thresholds import tune

_GAIN_MS = 1e-9


@dataclass(frozen=True)
class Placement:
    ramps: tuple[int, ...]
    """Chosen candidates (window columns), in block order."""
    thresholds: npt.NDArray[np.float64]
    """[R] over every candidate; DISABLED for those not chosen."""
    saving_ms: float
    """Saving per input on the window, net of ramp overheads."""
    agreement: float
    evaluated: int
    """Subsets tuned to find it."""


def _tuned(w: FeedbackWindow, subset: tuple[int, ...], budget: float) -> tuple[npt.NDArray[np.float64], float, float]:
    movable = np.zeros(w.n_ramps, dtype=bool)
    movable[list(subset)] = True
    start = np.full(w.n_ramps, DISABLED)
    result = tune(w, budget, start=start, movable=movable)
    return np.asarray(result.thresholds, dtype=np.float64), float(result.saving_ms), float(result.agreement)


def _fits(w: FeedbackWindow, subset: tuple[int, ...], overhead_ms: float) -> bool:
    return float(w.cost_ms[list(subset)].sum()) <= overhead_ms + 1e-12


def place_ramps(w: FeedbackWindow, budget: float, max_ramps: int, *, overhead_ms: float = float("inf")) -> Placement:
    """Greedy placement of at most `max_ramps` ramps (see the module docstring); `overhead_ms`: the
    most the chosen ramps may cost together an input that passes them all."""
    if max_ramps < 0:
        raise ValueError(f"max_ramps must be >= 0, got {max_ramps}")
    chosen: tuple[int, ...] = ()
    thresholds, saving, agreement = np.full(w.n_ramps, DISABLED), 0.0, 1.0
    evaluated = 0
    while len(chosen) < max_ramps:
        best: tuple[float, tuple[int, ...], npt.NDArray[np.float64], float] | None = None
        for r in range(w.n_ramps):
            subset = tuple(sorted((*chosen, r)))
            if r in chosen or not _fits(w, subset, overhead_ms):
                continue
            t, s, a = _tuned(w, subset, budget)
            evaluated += 1
            if best is None or s > best[0]:
                best = (s, subset, t, a)
        if best is None or best[0] <= saving + _GAIN_MS:
            break
        saving, chosen, thresholds, agreement = best
    chosen, thresholds, saving, agreement = _drop_negative(w, chosen, thresholds, saving, agreement, budget)
    return Placement(chosen, thresholds, saving, agreement, evaluated)


def _drop_negative(
    w: FeedbackWindow,
    chosen: tuple[int, ...],
    thresholds: npt.NDArray[np.float64],
    saving: float,
    agreement: float,
    budget: float,
) -> tuple[tuple[int, ...], npt.NDArray[np.float64], float, float]:
    """Switch off the chosen ramp of most negative utility and re-tune, until none is negative."""
    while chosen:
        worst = min(
            (u for u in ramp_utilities(w, thresholds) if u.active and u.ramp in chosen), key=lambda u: u.utility_ms
        )
        if worst.utility_ms >= 0.0:
            break
        chosen = tuple(r for r in chosen if r != worst.ramp)
        thresholds, saving, agreement = (
            _tuned(w, chosen, budget) if chosen else (np.full(w.n_ramps, DISABLED), 0.0, 1.0)
        )
    return chosen, thresholds, saving, agreement


def best_placement(w: FeedbackWindow, budget: float, max_ramps: int, *, overhead_ms: float = float("inf")) -> Placement:
    """The best subset of up to `max_ramps` candidates by exhaustive search (tuned per subset)."""
    best = Placement((), np.full(w.n_ramps, DISABLED), 0.0, 1.0, 0)
    evaluated = 0
    for k in range(1, max_ramps + 1):
        for subset in itertools.combinations(range(w.n_ramps), k):
            if not _fits(w, subset, overhead_ms):
                continue
            t, s, a = _tuned(w, subset, budget)
            evaluated += 1
            if s > best.saving_ms + _GAIN_MS:
                best = Placement(subset, t, s, a, 0)
    return Placement(best.ramps, best.thresholds, best.saving_ms, best.agreement, evaluated)
