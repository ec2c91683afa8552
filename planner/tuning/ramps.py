"""Ramp management (Apparate): which exit ramps to keep active, by their utility (pure numpy).

Definitions, on a feedback window (:class:`~exitplan.planner.tuning.feedback.FeedbackWindow`) under thresholds t:

- **utility** of an active ramp r = latency saved by the inputs that exit there minus latency it
  added to the inputs that reached it and went on. *Saved*: for each input exiting at r, its
  latency without the ramp (t with r disabled: it exits at a later ramp or runs to the end) minus
  its latency with it (including r's own overhead, which it paid to exit). *Added*: r's overhead
  for every input that reached r and did not exit there. utility = saved - added is exactly what
  the window's saving loses if r is switched off with the other thresholds kept (tested). Figures
  are in ms per window input (sums / N), like ``saving_ms``.
- **upper bound** of a ramp (Apparate's optimistic utility, used to rank candidates): with the
  others as they are, an oracle lets out at r every input reaching it whose answer there is right
  and for which exiting saves latency; everyone else reaching r goes on and pays its overhead. No
  threshold can do better without exiting wrong answers.
- **overhead** of a configuration: the sum of ``cost_ms`` of the active ramps (what an input that
  runs to the end pays); it must stay within ``overhead_frac`` (default 2 %) of ``worst_case_ms``,
  the latency of an input that runs the whole model.

:func:`manage_ramps` (1) re-tunes the thresholds with :func:`~exitplan.planner.tuning.thresholds.tune`
over the active ramps, (2) switches off ramps whose utility is negative, worst first, re-tuning
after each, (3) switches off the least useful ramps while the overhead exceeds its budget, and
(4) tries the inactive ramps by decreasing upper bound: a candidate that fits in the overhead
budget is switched on and the thresholds re-tuned; it stays if the window's saving grows and its
utility is positive. Every decision is recorded with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from exitplan.planner.tuning.feedback import (
    DISABLED,
    FeedbackWindow,
    WindowError,
    allowed_disagreements,
    check_budget,
    check_thresholds,
    outcome,
)
from exitplan.planner.tuning.thresholds import tune

_EPS_MS = 1e-9


@dataclass(frozen=True)
class RampUtility:
    ramp: int
    name: str
    active: bool
    reached: int
    exits: int
    saved_ms: float
    added_ms: float
    utility_ms: float
    """saved_ms - added_ms (0 for an inactive ramp)."""
    upper_bound_ms: float
    agreement_delta: float
    """Agreement with the ramp minus agreement without it (0 for an inactive ramp)."""


@dataclass(frozen=True)
class RampAction:
    ramp: int
    name: str
    action: str
    """"deactivate", "activate" or "reject" (a candidate tried and left off)."""
    reason: str


@dataclass(frozen=True)
class RampPlan:
    thresholds: np.ndarray
    active: np.ndarray
    agreement: float
    saving_ms: float
    overhead_ms: float
    overhead_budget_ms: float
    utilities: tuple[RampUtility, ...]
    actions: tuple[RampAction, ...] = field(default=())

    def verify(self, w: FeedbackWindow, budget: float) -> None:
        """The plan's figures re-evaluated; the budgets hold; no active ramp has negative utility."""
        out = outcome(w, self.thresholds)
        if abs(out.agreement - self.agreement) > 1e-12 or abs(out.saving_ms - self.saving_ms) > 1e-6:
            raise AssertionError("plan figures do not match the window")
        if w.n_inputs - out.agree_count > allowed_disagreements(w.n_inputs, budget):
            raise AssertionError(f"agreement {out.agreement} breaks the budget {budget}")
        if self.overhead_ms > self.overhead_budget_ms + 1e-9:
            raise AssertionError(f"overhead {self.overhead_ms} ms over its budget {self.overhead_budget_ms} ms")
        if any(u.active and u.utility_ms < -_EPS_MS for u in self.utilities):
            raise AssertionError("an active ramp has negative utility")


def ramp_utilities(w: FeedbackWindow, thresholds: object) -> list[RampUtility]:
    """Utility and upper bound of every ramp under ``thresholds`` (see the module docstring)."""
    t = check_thresholds(thresholds, w.n_ramps)
    base = outcome(w, t)
    result = []
    for r in range(w.n_ramps):
        off_t = t.copy()
        off_t[r] = DISABLED
        off = base if t[r] > 1.0 else outcome(w, off_t)
        # Upper bound, relative to the ramp switched off: who reaches r then, and what exiting would give.
        reach = off.exit_at > r
        before = float(w.cost_ms[:r][off_t[:r] <= 1.0].sum())
        exit_ms = float(w.saving_ms[r]) - before - float(w.cost_ms[r])
        gain = np.where(w.agree[:, r], np.maximum(exit_ms - off.per_input_ms, -w.cost_ms[r]), -w.cost_ms[r])
        upper = float(gain[reach].sum()) / w.n_inputs
        if t[r] > 1.0:
            result.append(RampUtility(r, w.ramps[r], False, 0, 0, 0.0, 0.0, 0.0, upper, 0.0))
            continue
        exiting = base.exit_at == r
        saved = float((base.per_input_ms[exiting] - off.per_input_ms[exiting]).sum()) / w.n_inputs
        exits, reached = int(base.exits[r]), int(base.reached[r])
        added = float(w.cost_ms[r]) * (reached - exits) / w.n_inputs
        result.append(
            RampUtility(
                r, w.ramps[r], True, reached, exits, saved, added, saved - added, upper, base.agreement - off.agreement
            )
        )
    return result


def manage_ramps(
    w: FeedbackWindow,
    budget: float,
    worst_case_ms: float,
    thresholds: object | None = None,
    *,
    overhead_frac: float = 0.02,
    max_candidates: int | None = None,
) -> RampPlan:
    """Choose the active ramps and their thresholds (see the module docstring).

    ``thresholds``: the current ones ([R]; default all disabled, so every ramp is a candidate).
    ``worst_case_ms``: latency of an input that runs the whole model (the overhead budget is
    ``overhead_frac`` of it). ``max_candidates``: try at most this many inactive ramps.
    """
    budget = check_budget(budget)
    if not (np.isfinite(worst_case_ms) and worst_case_ms > 0):
        raise WindowError("worst_case_ms", f"expected a latency > 0 ms, got {worst_case_ms!r}")
    if not (0.0 <= overhead_frac < 1.0):
        raise WindowError("overhead_frac", f"expected a fraction in [0, 1), got {overhead_frac!r}")
    r_all = w.n_ramps
    t = np.full(r_all, DISABLED) if thresholds is None else check_thresholds(thresholds, r_all).copy()
    cap_ms = overhead_frac * worst_case_ms
    manager = _RampManager(w, budget, cap_ms)
    active = t <= 1.0
    if active.any():  # (1)
        t = manager.retune(t, active)
    t = manager.drop_negative(t)
    t = manager.fit_overhead(t)
    t = manager.try_candidates(t, max_candidates)
    out = outcome(w, t)
    return RampPlan(
        t,
        t <= 1.0,
        out.agreement,
        out.saving_ms,
        float(w.cost_ms[t <= 1.0].sum()),
        cap_ms,
        tuple(ramp_utilities(w, t)),
        tuple(manager.actions),
    )


class _RampManager:
    """The steps of :func:`manage_ramps` on one window, recording every decision in ``actions``."""

    def __init__(self, w: FeedbackWindow, budget: float, cap_ms: float) -> None:
        self.w, self.budget, self.cap_ms = w, budget, cap_ms
        self.allowed = allowed_disagreements(w.n_inputs, budget)
        self.actions: list[RampAction] = []

    def tuned(self, current: np.ndarray, active: np.ndarray) -> np.ndarray:
        """Thresholds tuned from scratch over the ``active`` ramps (the others stay off), so a new set of
        ramps can claim budget that the current thresholds hand to others; the current thresholds
        re-tuned instead if they do better (the tuner is a heuristic)."""
        w, budget = self.w, self.budget
        fresh = tune(w, budget, None, movable=active).thresholds
        kept = np.where(active, current, DISABLED)
        if (current[active] <= 1.0).all() and w.n_inputs - outcome(w, kept).agree_count <= self.allowed:
            kept = tune(w, budget, kept, movable=active).thresholds
            if outcome(w, kept).saving_ms > outcome(w, fresh).saving_ms:
                return kept
        return fresh

    def retune(self, current: np.ndarray, active: np.ndarray) -> np.ndarray:
        """:meth:`tuned`, recording the ramps that re-tuning switches off."""
        new = self.tuned(current, active)
        for r in np.flatnonzero(active & (new > 1.0)):
            self.actions.append(
                RampAction(
                    int(r),
                    self.w.ramps[r],
                    "deactivate",
                    "re-tuning the thresholds switched it off (the others use the budget better)",
                )
            )
        return new

    def drop_negative(self, t: np.ndarray) -> np.ndarray:
        """(2) Switch off the ramps of negative utility, worst first, re-tuning after each."""
        while True:
            utils = ramp_utilities(self.w, t)
            worst = min((u for u in utils if u.active), key=lambda u: u.utility_ms, default=None)
            if worst is None or worst.utility_ms >= -_EPS_MS:
                return t
            self.actions.append(
                RampAction(
                    worst.ramp,
                    worst.name,
                    "deactivate",
                    f"utility {worst.utility_ms:.4f} ms/input < 0 (saved {worst.saved_ms:.4f}, "
                    f"added {worst.added_ms:.4f})",
                )
            )
            t[worst.ramp] = DISABLED
            t = self.retune(t, t <= 1.0)

    def fit_overhead(self, t: np.ndarray) -> np.ndarray:
        """(3) While the overhead is over its budget, switch off the least useful ramp and re-tune."""
        w, cap_ms = self.w, self.cap_ms
        while float(w.cost_ms[t <= 1.0].sum()) > cap_ms + _EPS_MS:
            utils = ramp_utilities(w, t)
            least = min((u for u in utils if u.active), key=lambda u: u.utility_ms)
            self.actions.append(
                RampAction(
                    least.ramp,
                    least.name,
                    "deactivate",
                    f"ramp overhead {w.cost_ms[t <= 1.0].sum():.4f} ms over its budget {cap_ms:.4f} ms; "
                    f"lowest utility {least.utility_ms:.4f} ms/input",
                )
            )
            t[least.ramp] = DISABLED
            t = self.retune(t, t <= 1.0)
        return t

    def try_candidates(self, t: np.ndarray, max_candidates: int | None) -> np.ndarray:
        """(4) Try the inactive ramps by decreasing upper bound (re-ranked after every change): one that
        fits the overhead budget stays on if the re-tuned window saves more and its utility is positive."""
        w, cap_ms, actions = self.w, self.cap_ms, self.actions
        saving = outcome(w, t).saving_ms
        tried: set[int] = set()
        while max_candidates is None or len(tried) < max_candidates:
            pool = [
                u for u in ramp_utilities(w, t) if not u.active and u.ramp not in tried and u.upper_bound_ms > _EPS_MS
            ]
            if not pool:
                break
            u = max(pool, key=lambda c: c.upper_bound_ms)
            tried.add(u.ramp)
            overhead = float(w.cost_ms[t <= 1.0].sum()) + float(w.cost_ms[u.ramp])
            if overhead > cap_ms + _EPS_MS:
                actions.append(
                    RampAction(
                        u.ramp,
                        u.name,
                        "reject",
                        f"would bring the ramp overhead to {overhead:.4f} ms, over its budget {cap_ms:.4f} ms",
                    )
                )
                continue
            trial_active = t <= 1.0
            trial_active[u.ramp] = True
            trial = self.tuned(t, trial_active)
            trial_saving = outcome(w, trial).saving_ms
            trial_util = ramp_utilities(w, trial)[u.ramp]
            if trial[u.ramp] <= 1.0 and trial_saving > saving + _EPS_MS and trial_util.utility_ms > _EPS_MS:
                for r in np.flatnonzero((t <= 1.0) & (trial > 1.0)):
                    actions.append(
                        RampAction(
                            int(r), w.ramps[r], "deactivate", f"re-tuned with {u.name} on, the thresholds switch it off"
                        )
                    )
                actions.append(
                    RampAction(
                        u.ramp,
                        u.name,
                        "activate",
                        f"upper bound {u.upper_bound_ms:.4f} ms/input; saving {saving:.4f} -> "
                        f"{trial_saving:.4f} ms, utility {trial_util.utility_ms:.4f}",
                    )
                )
                t, saving = trial, trial_saving
            else:
                actions.append(
                    RampAction(
                        u.ramp,
                        u.name,
                        "reject",
                        f"upper bound {u.upper_bound_ms:.4f} ms/input, but the tuned window saves "
                        f"{trial_saving:.4f} ms (now {saving:.4f})",
                    )
                )
        return t
