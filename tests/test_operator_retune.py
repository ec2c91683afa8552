"""The operator's threshold re-tune keeps the accuracy budget on the inputs that follow its decisions.

A stationary stream of shadow feedback (synthetic windows: confidence rising with depth, ramps more or less
over-confident; no built-in model) is replayed through the operator's tuning step (live_thresholds._tune, its
state carried from look to look as retune carries it in the service's memo): each period 200 new samples
arrive, the tuner looks at the newest 1,024 with the thresholds in force, and the next period's samples --
which no decision saw -- are served under what it decided. The budget holds on them. On the same streams,
one look at decide's defaults (tune to the edge of the window's errors, no memory: what the operator ran
before) breaks it, which is what makes these streams a test of the policy (bench/retune_replay.py prints
both on more streams).
"""

from __future__ import annotations

import numpy as np
import pytest

from exitplan.operator import live_thresholds
from exitplan.planner.tuning import autotune
from exitplan.planner.tuning.feedback import FeedbackWindow, evaluate
from exitplan.planner.tuning.synthetic_windows import synthetic_window
from exitplan.planner.tuning.thresholds import tune
from exitplan.worker_image.control_bodies import FeedbackArrays

BUDGET, PER, WINDOW, PERIODS, RAMPS = 0.01, 200, 1024, 60, 10


def rows(s: FeedbackWindow, start: int, end: int) -> FeedbackWindow:
    return FeedbackWindow(s.conf[start:end], s.pred[start:end], s.final[start:end], s.saving_ms, s.cost_ms)


def held_out_agreement(s: FeedbackWindow, operator: bool) -> float:
    names = [f"ramp{i}" for i in range(RAMPS)]
    first = tune(rows(s, 0, 1024), 0.5 * autotune.sample_budget(BUDGET, 1024))
    current = {r: float(t) for r, t in zip(names, first.thresholds)}
    state, end, disagree = autotune.TunerState(), 1024 + WINDOW, 0
    for _ in range(PERIODS):
        look = rows(s, end - WINDOW, end)
        if operator:
            arrays = FeedbackArrays(look.conf, look.pred, look.final, look.saving_ms, look.cost_ms)
            decision, state = live_thresholds._tune(arrays, names, current, BUDGET, state)
        else:
            decision = autotune.decide(look, names, current, BUDGET, autotune.TuneConfig())
        current = decision.thresholds or current
        agree, _ = evaluate(rows(s, end, end + PER), np.array([current[r] for r in names]))
        disagree += round((1.0 - agree) * PER)
        end += PER
    return 1.0 - disagree / (PERIODS * PER)


@pytest.mark.parametrize("seed", [1, 3])
def test_the_operator_retune_keeps_the_budget_on_inputs_no_decision_saw(seed):
    s = synthetic_window(np.random.default_rng(seed), 1024 + WINDOW + PER * (PERIODS + 1), RAMPS)
    assert held_out_agreement(s, operator=True) >= 1.0 - BUDGET
    assert held_out_agreement(s, operator=False) < 1.0 - BUDGET  # tuned to the edge: these streams tell them apart
