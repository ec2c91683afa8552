"""The operator's threshold re-tune keeps the accuracy budget on the inputs that follow its decisions.

A stationary stream of shadow feedback (synthetic windows: confidence rising with depth, ramps more or less
over-confident; no built-in model) is replayed (planner/tuning/replay.py) through the operator's tuning step
(live_thresholds._tune, its state carried from look to look as retune carries it in the service's memo):
each period 200 new samples arrive, the tuner looks at the newest 1,024 with the thresholds in force, and the
next period's samples -- which no decision saw -- are served under what it decided. The budget holds on them.
On the same streams, one look at decide's defaults (tune to the edge of the window's errors, no memory: what
the operator ran before) breaks it, which is what makes these streams a test of the policy
(bench/retune_replay.py prints both on more streams).
"""

from __future__ import annotations

import numpy as np
import pytest

from exitplan.operator import live_thresholds
from exitplan.planner.tuning import autotune
from exitplan.planner.tuning.feedback import FeedbackWindow
from exitplan.planner.tuning.replay import Step, replay, stream_length
from exitplan.planner.tuning.synthetic_windows import synthetic_window
from exitplan.worker_image.control_bodies import FeedbackArrays

BUDGET, PERIODS, RAMPS = 0.01, 60, 10


def operator_step() -> Step:
    state = autotune.TunerState()

    def step(look: FeedbackWindow, current: dict[str, float]) -> dict[str, float] | None:
        nonlocal state
        arrays = FeedbackArrays(look.conf, look.pred, look.final, look.saving_ms, look.cost_ms)
        decision, state = live_thresholds._tune(arrays, list(current), current, BUDGET, state)
        return decision.thresholds

    return step


def single_look(look: FeedbackWindow, current: dict[str, float]) -> dict[str, float] | None:
    return autotune.decide(look, list(current), current, BUDGET, autotune.TuneConfig()).thresholds


@pytest.mark.parametrize("seed", [1, 3])
def test_the_operator_retune_keeps_the_budget_on_inputs_no_decision_saw(seed):
    s = synthetic_window(np.random.default_rng(seed), stream_length(PERIODS), RAMPS)
    assert replay(s, operator_step(), BUDGET, periods=PERIODS).agreement >= 1.0 - BUDGET
    # tuned to the edge: these streams tell the two policies apart
    assert replay(s, single_look, BUDGET, periods=PERIODS).agreement < 1.0 - BUDGET
