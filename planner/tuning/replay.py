"""A threshold tuning policy replayed offline on a stream of feedback samples (pure numpy; for tests and
benchmarks): does it keep the accuracy budget on the inputs that follow each decision?

The stream is a service's shadow-sampled feedback in arrival order. Thresholds are first tuned once on its
first `start` samples (to half the budget less its sampling error); then each period `per` new samples
arrive, the policy (`step`) looks at the newest `window` with the thresholds in force, and the period's new
samples -- which no decision saw -- are served under whatever it decided.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from exitplan.planner.tuning.autotune import sample_budget
from exitplan.planner.tuning.feedback import FeedbackWindow, evaluate
from exitplan.planner.tuning.thresholds import tune

Step = Callable[[FeedbackWindow, dict[str, float]], dict[str, float] | None]
"""One look of a policy: (the newest samples, the thresholds in force) -> new thresholds, or None to keep them.
A policy with a state keeps it between its looks (a closure)."""


@dataclass(frozen=True)
class Replayed:
    agreement: float
    """Agreement with the full model on the held-out samples (the budget is kept when >= 1 - budget)."""
    saving_ms: float
    """Mean latency saved per held-out input."""
    changes: int
    """Looks that changed the thresholds."""
    looks: int


def rows(stream: FeedbackWindow, start: int, end: int) -> FeedbackWindow:
    """Samples [start, end) of the stream."""
    return FeedbackWindow(
        stream.conf[start:end], stream.pred[start:end], stream.final[start:end], stream.saving_ms, stream.cost_ms
    )


def stream_length(periods: int, per: int = 200, window: int = 1024, start: int = 1024) -> int:
    """Samples a replay of `periods` periods reads."""
    return start + window + per * (periods + 1)


def replay(
    stream: FeedbackWindow,
    step: Step,
    budget: float,
    *,
    periods: int = 60,
    per: int = 200,
    window: int = 1024,
    start: int = 1024,
) -> Replayed:
    """`step` replayed on `stream` (at least `stream_length(periods, per, window, start)` samples)."""
    if stream.n_inputs < stream_length(periods, per, window, start):
        raise ValueError(
            f"the stream holds {stream.n_inputs} samples; the replay reads {stream_length(periods, per, window, start)}"
        )
    names = [f"ramp{i}" for i in range(stream.n_ramps)]
    first = tune(rows(stream, 0, start), 0.5 * sample_budget(budget, start))
    current = {r: float(t) for r, t in zip(names, first.thresholds)}
    end, changes, disagree, saved = start + window, 0, 0, 0.0
    for _ in range(periods):
        new = step(rows(stream, end - window, end), current)
        if new is not None:
            changes += any(abs(new[r] - current[r]) > 1e-9 for r in names)
            current = new
        agree, saving = evaluate(rows(stream, end, end + per), np.array([current[r] for r in names]))
        disagree += round((1.0 - agree) * per)
        saved += saving * per
        end += per
    served = periods * per
    return Replayed(1.0 - disagree / served, saved / served, changes, periods)
