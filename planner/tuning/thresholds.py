"""Exit thresholds under an accuracy budget: Apparate's greedy hill-climb (pure numpy).

The window format and the exact semantics (exit rule, agreement, saving, which ramps an input
reaches, the budget test) are in :mod:`exitplan.planner.tuning.feedback`; this module re-exports them,
so ``from exitplan.planner.tuning.thresholds import FeedbackWindow, TuneResult, tune, evaluate, exit_index,
WindowError`` is the whole interface.

:func:`tune` starts from the current thresholds (default: every ramp disabled). If they break the
budget on the window it first *repairs*: it raises one ramp's threshold per round (largest agreement
gained per saving lost) until the window is within budget (``repaired``). Then the hill-climb
lowers ONE ramp's threshold per round, choosing the move with the largest extra saving per unit
of agreement lost (moves that lose no agreement first), and stops when no ramp can move without
breaking the budget. Two climbs (``method``):

- ``"steps"``: Apparate as published. Each ramp has a step; its move is its threshold minus the
  step (at least down to the next distinct confidence of the inputs going past it, so no move is
  empty); a move that overshoots the budget halves the ramp's step, a chosen move doubles it
  (steps within [min_step, max_step]); a ramp whose smallest move overshoots is done. Moves that
  save nothing are taken last; the best configuration visited is kept.
- ``"profile"`` (default): the same rule, but each ramp proposes its best move over every distinct
  confidence below its threshold -- every step size at once, read off one cumulative sum -- so a
  ramp whose first small step would not pay for its overhead can still make the big move that
  does. Proposals are refreshed lazily (the best is re-checked on the current state before it is
  taken); once the budget is spent, proposals that would lose agreement are dropped unchecked.

Ratio-first greedy spending can leave a knapsack gap (an efficient early move leaves too little
budget for the move that pays most), so (``restart=True``, default) a budget-indexed dynamic
programme over the ramps (:mod:`exitplan.planner.tuning.dp`) builds a configuration from
scratch and replaces the climb's if it saves more. Then (``refine_pass=True``, default) coordinate
ascent re-places one active ramp at a time at its exact best threshold given the others (raising,
lowering or disabling it, within budget) until R ramps in a row bring nothing. Thresholds placed
by the profile climb, the programme or the refinement sit midway between the last input that exits
and the next one that does not. bench/tuner_vs_grid.py compares the tuner (and each part) with an
exhaustive grid search; bench/tuner_speed.py times it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from exitplan.planner.tuning.dp import budget_dp
from exitplan.planner.tuning.feedback import (
    DISABLED,
    FeedbackWindow,
    InfeasibleBudget,
    Outcome,
    WindowError,
    allowed_disagreements,
    check_budget,
    check_thresholds,
    evaluate,
    exit_index,
    outcome,
    within_budget,
)
from exitplan.planner.tuning.search import Move, Search, climb_profiles, climb_steps, refine, repair

__all__ = [
    "DISABLED",
    "InfeasibleBudget",
    "Move",
    "Outcome",
    "TuneResult",
    "FeedbackWindow",
    "WindowError",
    "allowed_disagreements",
    "check_budget",
    "check_thresholds",
    "evaluate",
    "exit_index",
    "outcome",
    "tune",
    "within_budget",
]

Method = Literal["profile", "steps"]


@dataclass(frozen=True)
class TuneResult:
    thresholds: np.ndarray
    """[R] the tuned thresholds (:data:`DISABLED` for a disabled ramp)."""
    agreement: float
    saving_ms: float
    budget: float
    rounds: int
    """Work of the climb: rounds (``steps``: a round moves one ramp or shrinks steps) or ramp
    profiles computed (``profile``)."""
    moves: tuple[Move, ...]
    start_agreement: float
    start_saving_ms: float
    climb_saving_ms: float
    """Saving the climb alone reached (before the restart and the refinement)."""
    repaired: bool
    """The start thresholds broke the budget and were raised first."""
    restarted: bool = False
    """The budget programme's configuration (from scratch) beat the climb's and was refined instead."""

    @property
    def active(self) -> np.ndarray:
        return self.thresholds <= 1.0

    def changed(self, start: np.ndarray) -> list[int]:
        return [int(i) for i in np.flatnonzero(self.thresholds != np.asarray(start))]

    def verify(self, w: FeedbackWindow) -> None:
        """Re-evaluate on the window: the figures must match and the budget must hold."""
        out = outcome(w, self.thresholds)
        if abs(out.agreement - self.agreement) > 1e-12 or abs(out.saving_ms - self.saving_ms) > 1e-6:
            raise AssertionError(
                f"tuner figures {self.agreement}, {self.saving_ms} != evaluated {out.agreement}, {out.saving_ms}"
            )
        if w.n_inputs - out.agree_count > allowed_disagreements(w.n_inputs, self.budget):
            raise AssertionError(f"agreement {out.agreement} breaks the budget {self.budget}")

    def to_json(self) -> dict[str, object]:
        """The `exitplan tune --json` document: exactly thresholds, agreement, saving_ms."""
        return {
            "thresholds": [float(x) for x in self.thresholds],
            "agreement": float(self.agreement),
            "saving_ms": float(self.saving_ms),
        }


def tune(
    w: FeedbackWindow,
    budget: float,
    start: object | None = None,
    *,
    method: Method = "profile",
    restart: bool = True,
    refine_pass: bool = True,
    movable: object | None = None,
    beam: int = 1,
    min_step: float = 0.005,
    max_step: float = 0.2,
    init_step: float = 0.05,
    max_rounds: int = 100_000,
    max_sweeps: int = 1,
) -> TuneResult:
    """Tune the thresholds of ``w``'s ramps so that agreement >= 1 - budget and the saving is largest.

    ``start``: the current thresholds ([R]; default all disabled). ``movable``: [R] bool, the ramps
    the tuner may change (default all; the others keep their start value, e.g. ramps that ramp
    management switched off). ``method``, ``restart`` and ``refine_pass``: see the module docstring;
    ``beam``: states kept per budget level by the restart's programme; the steps apply to
    ``method="steps"``. The figures returned are evaluated afresh on the window. Raises :class:`WindowError` on bad input and
    :class:`InfeasibleBudget` when the ramps it may not move already break the budget.
    """
    budget = check_budget(budget)
    r = w.n_ramps
    start_t = np.full(r, DISABLED) if start is None else check_thresholds(start, r, "start")
    move_mask = _checked_options(r, movable, method, min_step, init_step, max_step)
    allowed = allowed_disagreements(w.n_inputs, budget)
    s = Search(w, start_t, allowed)
    start_agreement, start_saving = s.figures
    moves: list[Move] = []
    repaired = not s.feasible
    if repaired:
        _repair(s, start_t, move_mask, budget, init_step, moves)
    if method == "steps":
        best_t, _, rounds = climb_steps(s, move_mask, init_step, min_step, max_step, max_rounds, moves)
        s.set(best_t)
    else:
        rounds = climb_profiles(s, move_mask, max_rounds, moves)
    climb_saving = s.total / s.n
    restarted = _restart(s, start_t, move_mask, beam, moves) if restart else False
    if refine_pass:
        refine(s, move_mask, moves, max_sweeps)
    final = outcome(w, s.t)  # exactly what evaluate() says, not the search's running sums
    agreement, saving = final.agreement, final.saving_ms
    return TuneResult(
        s.t.copy(),
        agreement,
        saving,
        budget,
        rounds,
        tuple(moves),
        start_agreement,
        start_saving,
        climb_saving,
        repaired,
        restarted,
    )


def _checked_options(
    r: int, movable: object | None, method: str, min_step: float, init_step: float, max_step: float
) -> np.ndarray:
    """`tune`'s `movable` as [r] bool (default all), after checking it, `method` and the steps."""
    move_mask = np.ones(r, dtype=bool) if movable is None else np.asarray(movable, dtype=bool)
    if move_mask.shape != (r,):
        raise WindowError("movable", f"expected {r} booleans (one per ramp), got shape {move_mask.shape}")
    if method not in ("profile", "steps"):
        raise WindowError("method", f"expected 'profile' or 'steps', got {method!r}")
    if not (0.0 < min_step <= init_step <= max_step):
        raise WindowError(
            "steps", f"need 0 < min_step <= init_step <= max_step, got {min_step}, {init_step}, {max_step}"
        )
    return move_mask


def _repair(
    s: Search, start_t: np.ndarray, move_mask: np.ndarray, budget: float, init_step: float, moves: list[Move]
) -> None:
    """Raise the movable ramps' thresholds until the window is within budget; InfeasibleBudget when
    the ramps the tuner may not move break it on their own."""
    w = s.w
    floor_t = np.where(move_mask, DISABLED, start_t)
    if w.n_inputs - outcome(w, floor_t).agree_count > s.allowed:
        fixed = [w.ramps[i] for i in np.flatnonzero(~move_mask & (start_t <= 1.0))]
        raise InfeasibleBudget(
            "budget",
            f"the ramps the tuner may not move ({', '.join(fixed)}) already "
            f"break the budget {budget} on this window; let the tuner move them",
        )
    repair(s, move_mask, init_step, moves)


def _restart(s: Search, start_t: np.ndarray, move_mask: np.ndarray, beam: int, moves: list[Move]) -> bool:
    """The budget programme from scratch; the better of it and the climb goes on to refinement. When the
    programme's configuration is feasible and saves more, `s` takes it (a "restart" move per ramp it
    changes) and True is returned; otherwise `s` keeps the climb's."""
    alt, alt_total = budget_dp(
        s.w,
        s.allowed,
        beam=beam,
        movable=move_mask,
        fixed=start_t,
        orders=[s.order(q) for q in range(s.r)],
        ties=s.ties,
    )
    if alt_total > s.total + 1e-9 * max(1.0, abs(s.total)):
        old, old_total = s.t.copy(), s.total
        s.set(alt)
        if s.feasible and s.total > old_total:
            for q in np.flatnonzero(old != s.t):
                moves.append(Move("restart", int(q), float(old[q]), float(s.t[q]), *s.figures))
            return True
        s.set(old)
    return False
