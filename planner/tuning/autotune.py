"""Continual threshold tuning from a router's shadow-sampled feedback (Apparate): the policy.

Pure functions only (no I/O, no clock, no threads). The data plane only records and applies: the
router keeps the last shadow-sampled inputs (`GET /v1/window.npz`) and takes new thresholds
(`POST /v1/thresholds`, pushed down to every worker without a restart). The control loops that
read and push live elsewhere and call in here: `exitplan up`'s loop
(:class:`exitplan.localrun.autotune.AutoTuner`, which keeps a :class:`TunerState` and calls
:func:`advance` every period) and the operator's drift loop (the same, once a period per service,
the state in the service's memo). Given
one feedback window, :func:`decide`

- re-tunes at once when the thresholds in force break the accuracy budget on the newest samples
  (reason `accuracy`, trigger ``breach``, detail ``breach...``): a breach is called when the
  disagreements among the last 50, 100 or 200 samples are too many for the budget to hold (a
  one-sided binomial test) or exceed the budget on the last `recent`; the repair only raises thresholds;
- watches the kind of traffic: when the share of inputs that exit early (under the thresholds in
  force) moves in the newest 100 samples (a two-proportion z test, `drift_z`) and, with
  `drift_confirm` (:func:`advance`), again on the next 100 (an alarm is confirmed on samples it did
  not see), the traffic changed before enough disagreements could show it, and the thresholds are
  raised until none of those 100 samples disagrees (trigger ``drift``, detail ``drift...``);
- after a breach or a drift only the samples since count (``fresh``), and until there are
  `savings_samples` of them no disagreement is allowed among them (raises only);
- keeps a safety margin: thresholds are tuned to a fraction (``headroom``) of the budget less its
  sampling error (`sample_budget`), because thresholds placed at the edge of a sample's errors do
  worse on the next inputs (the tuner finds the sample's lucky spots) and a moderate shift must
  not break the budget before it is detected; thresholds that break the budget less its sampling
  error on the window are raised back to the target (trigger ``margin``, detail ``margin...``);
- otherwise re-tunes to claim savings (the tuner's full search, lowering) when it finds at least
  `min_gain_ms` more saving per input on at least `savings_samples` fresh samples (reason and
  trigger `savings`), unless the early-exit share is on the move (half the drift test's z: reason
  `hold`) or, with `savings_check`, the new thresholds break the budget on the newest 200 samples (`hold`);
  the live loop searches again only once `savings_every` samples arrived since a search that found
  nothing worth claiming (reason `searched-recently` meanwhile);
- keeps the last good thresholds when the window is short of samples.

Every knob is a field of :class:`TuneConfig`; :data:`LIVE` holds the settings bench/live_tuning.py
measured for the live loop (BENCHMARKS.md, "Threshold tuning").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np
import numpy.typing as npt

from exitplan.planner.tuning.feedback import DISABLED, FeedbackWindow, evaluate, outcome
from exitplan.planner.tuning.thresholds import tune

Thresholds = npt.NDArray[np.float64]
"""[R] exit thresholds in ramp order (> 1: the ramp is off)."""

Trigger = Literal["breach", "margin", "drift", "savings", ""]
"""Which test produced a decision's new thresholds ("" for a decision that keeps them)."""

DETECT_TAILS = (50, 100, 200)
"""Tail lengths (newest samples) the breach test looks at, besides `recent`."""


@dataclass(frozen=True)
class TuneConfig:
    """Every knob of the tuning policy (:func:`decide`, :func:`advance`) and of the live loop that
    runs it. The defaults are :func:`decide`'s for a single look at a window (tune to the edge of the
    window's errors: what one-time tuning does); :data:`LIVE` holds the live loops' (`exitplan up`'s and
    the operator's re-tune)."""

    min_samples: int = 200
    """Fewest samples (in the window; after a breach or drift, fresh ones outside probation) to act on."""
    recent: int = 300
    """Newest samples the breach test's point estimate is judged on, and the breach repair tunes on."""
    savings_samples: int = 1000
    """Fewest fresh samples to claim savings on (below it after a breach or drift: no disagreement allowed)."""
    min_gain_ms: float = 0.05
    """Smallest gain in mean saving per input (ms) worth a savings re-tune."""
    z: float = 1.645
    """Standard errors taken off the budget for the sample's own error (`sample_budget`; 1.645: ~95 %)."""
    headroom: float = 1.0
    """Share of the budget's safe part (the budget less its sampling error) that thresholds are tuned to."""
    tails: tuple[int, ...] = DETECT_TAILS
    """Newest-sample tail lengths the binomial breach test (:func:`breach`) looks at."""
    alpha: float = 0.01
    """Level of the binomial breach test: a tail breaches when its disagreements are this unlikely at the budget."""
    drift_z: float = 0.0
    """z the early-exit share must move by in the newest `drift_recent` samples to call a drift (0: no drift test)."""
    drift_recent: int = 100
    """Newest samples the drift test compares with the ones before them (0: no drift test)."""
    savings_check: int = 0
    """Newest samples on which new savings thresholds must also keep the budget (0: no check)."""
    savings_every: int = 0
    """The live loop (:func:`advance`): after a savings search that found nothing worth claiming, the next
    one waits until this many samples have arrived, while the thresholds in force stay (0: search at every
    look). A search on a window mostly the same as the last one finds mostly the same, at the tuner's
    dearest step."""
    period_s: float = 20.0
    """The live loop: seconds between two looks at the router's feedback."""
    window: int = 1500
    """The live loop: newest feedback samples fetched per look."""
    drift_confirm: bool = True
    """The live loop (:func:`advance`): act on a drift alarm only once `drift_recent` samples that
    arrived after it show the move again (savings are held meanwhile)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tails", tuple(int(t) for t in self.tails))
        checks: list[tuple[str, bool, str]] = [
            ("min_samples", self.min_samples >= 0, ">= 0"),
            ("recent", self.recent >= 1, ">= 1"),
            ("savings_samples", self.savings_samples >= 0, ">= 0"),
            ("min_gain_ms", self.min_gain_ms >= 0.0, ">= 0"),
            ("z", self.z >= 0.0 and math.isfinite(self.z), "finite and >= 0"),
            ("headroom", 0.0 <= self.headroom <= 1.0, "in [0, 1]"),
            ("tails", all(t >= 1 for t in self.tails), "tail lengths >= 1"),
            ("alpha", 0.0 < self.alpha < 1.0, "in (0, 1)"),
            ("drift_z", self.drift_z >= 0.0, ">= 0 (0: off)"),
            ("drift_recent", self.drift_recent >= 0, ">= 0 (0: off)"),
            ("savings_check", self.savings_check >= 0, ">= 0 (0: off)"),
            ("savings_every", self.savings_every >= 0, ">= 0 (0: every look)"),
            ("period_s", self.period_s > 0.0 and math.isfinite(self.period_s), "finite and > 0"),
            ("window", self.window >= 1, ">= 1"),
        ]
        for name, ok, expected in checks:  # `not ok` also rejects NaN
            if not ok:
                raise ValueError(f"TuneConfig.{name}: expected {expected}, got {getattr(self, name)!r}")


LIVE = TuneConfig(
    min_samples=100,
    recent=100,
    savings_samples=1000,
    headroom=0.25,
    alpha=0.05,
    drift_z=3.3,
    drift_recent=100,
    drift_confirm=True,
    savings_check=200,
    savings_every=300,
    window=1500,
    period_s=20.0,
)
"""The live loops' settings (`exitplan up`'s and the operator's re-tune), measured by bench/live_tuning.py
(BENCHMARKS.md, "Threshold tuning"): breach judged on the newest 100 samples, tune to a quarter of the
budget's safe part, watch the early-exit share (confirmed on new samples), claim savings on 1,000
fresh samples that also hold on the newest 200; after a search that found nothing worth claiming, search
again once 300 samples arrived (bench/retune_replay.py: the same held-out agreement and savings, ~20 %
fewer searches)."""


@dataclass(frozen=True)
class Decision:
    thresholds: dict[str, float] | None
    """New thresholds to apply, or None to keep the current ones."""
    reason: str
    samples: int
    agreement_before: float = 1.0
    agreement_after: float = 1.0
    saving_before_ms: float = 0.0
    saving_after_ms: float = 0.0
    detail: str = ""
    """Why, in words: which test fired (``breach in the last 100 samples: 4 disagree``, ``margin``...)."""
    exit_z: float = 0.0
    """The drift test's statistic on this window (0 when it did not run): the caller keeps an
    unconfirmed alarm (``abs(exit_z) > drift_z`` without ``drift_armed``) and confirms it later."""
    trigger: Trigger = ""
    """Which test produced `thresholds` (``breach``, ``margin``, ``drift``, ``savings``); "" when
    the thresholds are kept. Code branches on this, never on `detail`."""


def sample_budget(budget: float, n: int, z: float = 1.645) -> float:
    """The budget to tune to on a sample of n inputs so the traffic's own disagreement stays within
    `budget` with ~95 % confidence: budget minus z standard errors of a proportion at the budget."""
    if n <= 0:
        return 0.0
    return max(0.0, budget - z * math.sqrt(budget * (1.0 - budget) / n))


def binomial_tail(x: int, n: int, p: float) -> float:
    """P(X >= x) for X ~ Binomial(n, p)."""
    if x <= 0:
        return 1.0
    if x > n:
        return 0.0
    below = sum(math.comb(n, k) * p**k * (1.0 - p) ** (n - k) for k in range(x))
    return max(0.0, 1.0 - below)


def breach(
    window: FeedbackWindow, thresholds: Thresholds, budget: float, tails: tuple[int, ...], alpha: float
) -> tuple[int, int] | None:
    """(tail length, disagreements) of the shortest newest-samples tail on which ``thresholds`` break
    ``budget`` beyond chance: more disagreements than the budget allows there, and as many or more
    would happen with probability <= ``alpha`` if the true rate were the budget. None: no breach."""
    agrees = outcome(window, thresholds).agrees
    for m in sorted(t for t in tails if t <= window.n_inputs):
        x = int(m - agrees[-m:].sum())
        if x > budget * m and binomial_tail(x, m, budget) <= alpha:
            return m, x
    return None


def exit_shift(window: FeedbackWindow, thresholds: Thresholds, recent: int, min_before: int = 200) -> float:
    """z statistic of the change in the share of inputs that exit early (at any ramp, under
    ``thresholds``) between the last ``recent`` samples and the ones before them (0 when there are
    fewer than ``min_before`` of those). The share moves as soon as the kind of traffic does, long
    before enough disagreements have been seen to call a breach."""
    n = window.n_inputs
    if n - recent < min_before or recent <= 0:
        return 0.0
    exits = outcome(window, thresholds).exit_at < window.n_ramps
    a, b = float(exits[-recent:].mean()), float(exits[:-recent].mean())
    pooled = float(exits.mean())
    se = math.sqrt(max(pooled * (1.0 - pooled), 1e-12) * (1.0 / recent + 1.0 / (n - recent)))
    return (a - b) / se


def _tail(window: FeedbackWindow, k: int) -> FeedbackWindow:
    return window.tail(k)


def raise_to(window: FeedbackWindow, target: float, start: Thresholds) -> Thresholds:
    """The tuner's repair alone: ``start`` with thresholds raised until ``window`` is within ``target``
    (largest agreement gained per saving lost first); nothing is lowered."""
    result = tune(window, target, start=start, restart=False, refine_pass=False, max_rounds=0)
    raised: Thresholds = np.maximum(np.asarray(result.thresholds, dtype=np.float64), start)
    return raised


def _vector(thresholds: dict[str, float], ramps: list[str]) -> Thresholds:
    return np.array([float(thresholds.get(r, DISABLED)) for r in ramps], dtype=np.float64)


def _named(ramps: list[str], thresholds: Thresholds) -> dict[str, float]:
    return {r: float(t) for r, t in zip(ramps, thresholds)}


def decide(
    window: FeedbackWindow,
    ramps: list[str],
    current: dict[str, float],
    budget: float,
    config: TuneConfig = TuneConfig(),
    *,
    fresh: int | None = None,
    reference: dict[str, float] | None = None,
    drift_armed: bool = True,
    search_savings: bool = True,
) -> Decision:
    """What to do with the thresholds given one feedback window (samples oldest first; pure).

    Accuracy first, on the newest samples (a shift shows there long before it dominates the whole
    window): if the thresholds in force break the budget on the last `recent` samples (point
    estimate) or, beyond chance (:func:`breach`, level `alpha`), on a shorter tail of `tails`, they
    are raised until the last `recent` samples are within the tuning target (reason `accuracy`,
    trigger ``breach``). Everything else uses only the last `fresh` samples (those since the last
    breach; None: all of them). The tuning target is `headroom` x `sample_budget` on those samples
    (the budget less its sampling error, less a safety margin): thresholds that break the budget
    less its sampling error there are raised until they meet the target (reason `accuracy`, trigger
    ``margin``; the gap between the two keeps savings and margin raises from taking turns); a repair
    never lowers a threshold, because lowering on a few hundred samples overfits them. Savings (the
    tuner's full search, lowering) are claimed only on at least `savings_samples` fresh samples, when
    they gain at least `min_gain_ms` per input (reason `savings`). With `drift_z` > 0, a move of the
    early-exit share in the newest `drift_recent` fresh samples (under the thresholds in force, or
    under `reference` while every ramp is off) by more than `drift_z` standard errors raises the
    thresholds until none of those samples disagrees (trigger ``drift``; the caller then counts fresh
    samples from there) -- only when `drift_armed`: a caller that wants an alarm confirmed on samples
    the alarm did not see passes False on the first alarm (the decision then only holds savings and
    carries the statistic in ``exit_z``) and True once `drift_recent` new samples have arrived.
    With `savings_check` > 0, savings are claimed only if the new thresholds also keep the budget
    (point estimate) on the newest `savings_check` samples: a window of 1,000 fresh samples can end
    in the first ~100 of a shift, which the tuner, fitting the other 900, would ignore.
    With `search_savings` False the savings search is not run (reason ``searched-recently``: the caller
    searched a window mostly the same a moment ago and found nothing worth claiming); the tests above still run.
    The knobs are `config`'s; its live-loop fields (`period_s`, `window`, `drift_confirm`, `savings_every`)
    play no part here.
    """
    n = window.n_inputs
    if n < config.min_samples:
        return Decision(None, "short-of-samples", n)
    start = _vector(current, ramps)
    repaired = _breach_repair(window, ramps, start, budget, config)
    if repaired is not None:
        return repaired
    if fresh is not None and fresh < n:
        window = _tail(window, max(fresh, 1))
        n = window.n_inputs
    z_exit = 0.0
    if config.drift_z and config.drift_recent:
        # Under thresholds that let inputs exit: the ones in force, or `reference` while every ramp is off.
        probe_t = start
        if reference is not None and not (start <= 1.0).any():
            probe_t = _vector(reference, ramps)
        z_exit = exit_shift(window, probe_t, config.drift_recent)
        if (
            abs(z_exit) > config.drift_z and drift_armed
        ):  # the traffic changed: only the newest samples speak for it now
            return _drift_repair(window, ramps, start, z_exit, config.drift_recent)
    probation = fresh is not None and n < config.savings_samples
    if n < config.min_samples and not probation:
        return Decision(None, "short-of-samples", n, exit_z=z_exit)
    return _margin_or_savings(window, ramps, start, budget, config, probation, z_exit, search_savings)


def _breach_repair(
    window: FeedbackWindow, ramps: list[str], start: Thresholds, budget: float, config: TuneConfig
) -> Decision | None:
    """The breach test on the newest samples and, when it fires, the repair (raises only); None: no breach."""
    outcome(window, start)  # the thresholds in force on the whole window, kept: its tails' are read off it
    latest = _tail(window, min(config.recent, window.n_inputs))
    agree_recent, save_recent = evaluate(latest, start)
    fired = None if agree_recent < 1.0 - budget else breach(window, start, budget, config.tails, config.alpha)
    if agree_recent >= 1.0 - budget and fired is None:
        return None
    raised = raise_to(latest, config.headroom * sample_budget(budget, latest.n_inputs, config.z), start)
    agree_after, save_after = evaluate(latest, raised)
    detail = (
        f"breach in the last {fired[0]} samples: {fired[1]} disagree"
        if fired is not None
        else f"breach in the last {latest.n_inputs} samples: agreement {agree_recent:.4f}"
    )
    return Decision(
        _named(ramps, raised),
        "accuracy",
        latest.n_inputs,
        agree_recent,
        agree_after,
        save_recent,
        save_after,
        detail,
        trigger="breach",
    )


def _drift_repair(
    window: FeedbackWindow, ramps: list[str], start: Thresholds, z_exit: float, drift_recent: int
) -> Decision:
    """Thresholds raised until none of the newest `drift_recent` samples disagrees."""
    newest = _tail(window, drift_recent)
    raised = raise_to(newest, 0.0, start)
    agree_now, save_now = evaluate(newest, start)
    agree_after, save_after = evaluate(newest, raised)
    return Decision(
        _named(ramps, raised),
        "accuracy",
        drift_recent,
        agree_now,
        agree_after,
        save_now,
        save_after,
        f"drift: early-exit share moved by z = {z_exit:+.1f} in the last {drift_recent} samples",
        exit_z=z_exit,
        trigger="drift",
    )


def _margin_or_savings(
    window: FeedbackWindow,
    ramps: list[str],
    start: Thresholds,
    budget: float,
    config: TuneConfig,
    probation: bool,
    z_exit: float,
    search_savings: bool = True,
) -> Decision:
    """Back to the tuning target when past the statistically safe level (raises only), else savings."""
    n = window.n_inputs
    agree_now, save_now = evaluate(window, start)
    safe = 0.0 if probation else sample_budget(budget, n, config.z)
    target = 0.0 if probation else config.headroom * safe
    if n - round(agree_now * n) > math.floor(safe * n + 1e-9):  # past the statistically safe level: back to the target
        raised = raise_to(window, target, start)
        agree_after, save_after = evaluate(window, raised)
        return Decision(
            _named(ramps, raised),
            "accuracy",
            n,
            agree_now,
            agree_after,
            save_now,
            save_after,
            exit_z=z_exit,
            trigger="margin",
            detail=f"margin: agreement {agree_now:.4f} < target {1 - target:.4f}"
            + (" (since the last breach: no disagreement allowed)" if probation else ""),
        )
    if n < config.savings_samples:
        return Decision(None, "short-of-samples", n, agree_now, agree_now, save_now, save_now, exit_z=z_exit)
    if not search_savings:
        return Decision(None, "searched-recently", n, agree_now, agree_now, save_now, save_now, exit_z=z_exit)
    return _savings(window, ramps, start, budget, config, target, (agree_now, save_now), z_exit)


def _savings(
    window: FeedbackWindow,
    ramps: list[str],
    start: Thresholds,
    budget: float,
    config: TuneConfig,
    target: float,
    now: tuple[float, float],
    z_exit: float,
) -> Decision:
    """The tuner's full search (lowering) to `target`: claimed when it gains enough and nothing says hold
    (`now`: agreement and saving of `start` on `window`)."""
    n = window.n_inputs
    agree_now, save_now = now
    result = tune(window, target, start=start)
    kept = Decision(None, "no-gain", n, agree_now, result.agreement, save_now, result.saving_ms, exit_z=z_exit)
    if result.saving_ms < save_now + config.min_gain_ms:
        return kept
    if config.drift_z and abs(z_exit) > config.drift_z / 2:  # the traffic may be moving: claim nothing yet
        return replace(kept, reason="hold", detail=f"hold: early-exit share moving (z = {z_exit:+.1f})")
    new = np.asarray(result.thresholds, dtype=np.float64)
    if config.savings_check:  # the new thresholds must hold on the newest samples too (a shift may have begun there)
        tail = _tail(window, min(config.savings_check, n))
        agree_tail, _ = evaluate(tail, new)
        x = tail.n_inputs - round(agree_tail * tail.n_inputs)
        if x > math.floor(budget * tail.n_inputs + 1e-9):
            return replace(
                kept,
                reason="hold",
                detail=f"hold: the new thresholds break the budget on the newest {tail.n_inputs} "
                f"samples ({x} disagree)",
            )
    return replace(kept, thresholds=_named(ramps, new), reason="savings", trigger="savings")


def new_samples(previous: FeedbackWindow | None, window: FeedbackWindow) -> int:
    """How many of ``window``'s samples came after ``previous`` (both the newest samples of one
    router's feedback ring, oldest first): the newest samples of ``previous`` are found again in
    ``window``. All of them when ``previous`` is None or not found (more arrived than fit)."""
    if previous is None or previous.n_inputs == 0:
        return window.n_inputs
    k, n = min(NEWEST_KEPT, previous.n_inputs), window.n_inputs
    if window.conf.shape[1:] != previous.conf.shape[1:]:
        return n
    conf, final = previous.conf[-k:], previous.final[-k:]
    # rows equal to the previous window's newest one, newest first; each checked for the k rows before it too
    ends = np.flatnonzero((window.conf == conf[-1]).all(axis=1) & (window.final == final[-1])) + 1
    for end in ends[::-1]:
        if (
            end >= k
            and np.array_equal(window.conf[end - k : end], conf)
            and np.array_equal(window.final[end - k : end], final)
        ):
            return n - int(end)
    return n


Alarm = tuple[float, int]
"""An unconfirmed drift alarm: (sign of the early-exit share's move, samples arrived since it was raised)."""


@dataclass(frozen=True)
class TunerState:
    """What the live loop carries from one look at the feedback to the next (:func:`advance`)."""

    fresh: int | None = None
    """Samples that arrived since the last breach or drift repair (None: none yet; all samples count)."""
    alarm: Alarm | None = None
    """The drift alarm waiting for confirmation on new samples, if any."""
    alarm_log: list[str] = field(default_factory=list)
    """Drift alarms raised, acted on, superseded and dropped, in words, oldest first."""
    reference: dict[str, float] | None = None
    """The last thresholds in force that let inputs exit (the drift test's probe while every ramp is off)."""
    previous: FeedbackWindow | None = None
    """The newest samples of the last look's window (:data:`NEWEST_KEPT` of them, copied: the operator keeps
    a state per service): where they are found again in the next window, the samples after them are new."""
    unclaimed: tuple[int, dict[str, float]] | None = None
    """After a savings search that found nothing worth claiming: the samples arrived since, and the
    thresholds it searched from (None: no such search since the thresholds last changed)."""


def track_alarm(
    alarm: Alarm | None, decision: Decision, armed: bool, config: TuneConfig
) -> tuple[Alarm | None, list[str]]:
    """The drift alarm after `decision` (taken with `drift_armed=armed`), and what happened to it in
    words (for :attr:`TunerState.alarm_log`). An alarm is raised when the drift statistic passes
    `drift_z` and nothing acted on it; it is acted on (a ``drift`` decision), superseded by a breach,
    or dropped when `drift_recent` new samples do not show the move again in the same direction."""
    fired = bool(config.drift_z) and abs(decision.exit_z) > config.drift_z
    if decision.trigger == "drift" or not config.drift_confirm:
        return None, ([f"acted on: z = {decision.exit_z:+.1f}"] if decision.trigger == "drift" else [])
    if decision.trigger == "breach":  # repaired already; the samples since start afresh
        return None, (["superseded by a breach"] if alarm is not None else [])
    if alarm is None:
        if fired:
            return (math.copysign(1.0, decision.exit_z), 0), [
                f"alarm z = {decision.exit_z:+.1f} on {decision.samples} samples"
            ]
        return None, []
    if armed and not (fired and math.copysign(1.0, decision.exit_z) == alarm[0]):
        return None, [f"dropped: z = {decision.exit_z:+.1f} after {alarm[1]} new samples"]
    return alarm, []


def advance(
    state: TunerState,
    window: FeedbackWindow,
    current: dict[str, float],
    ramps: list[str],
    budget: float,
    config: TuneConfig,
) -> tuple[Decision, TunerState]:
    """One look of the live loop at the router's newest feedback `window` with `current` the
    thresholds in force (pure; `state` is not changed): the decision, and the state to carry to the
    next look. Counts the samples that arrived since the last look (fresh ones, and those since an
    unconfirmed drift alarm), arms the drift test once an alarm has `drift_recent` new samples
    (always, without `drift_confirm`: one look at 100 samples in ~1,000 sees z > 3.3 by chance),
    keeps the last thresholds that let inputs exit as the drift test's reference, skips the savings
    search while fewer than `savings_every` samples arrived since one that found nothing worth claiming
    from the same thresholds, decides, tracks the alarm, and after a breach or drift repair counts fresh samples from zero (the workload
    changed: older samples no longer speak for it). The caller applies the decision's thresholds and
    keeps the new state only once they are applied."""
    arrived = new_samples(state.previous, window)
    fresh = None if state.fresh is None else state.fresh + arrived
    alarm = None if state.alarm is None else (state.alarm[0], state.alarm[1] + arrived)
    armed = not config.drift_confirm or (alarm is not None and alarm[1] >= config.drift_recent)
    reference = state.reference
    if any(float(current.get(r, DISABLED)) <= 1.0 for r in ramps):
        reference = dict(current)
    unclaimed = state.unclaimed
    if unclaimed is not None:
        unclaimed = (unclaimed[0] + arrived, unclaimed[1])
    search = unclaimed is None or unclaimed[0] >= config.savings_every or unclaimed[1] != current
    decision = decide(
        window,
        ramps,
        current,
        budget,
        config,
        fresh=fresh,
        reference=reference,
        drift_armed=armed,
        search_savings=search,
    )
    alarm, words = track_alarm(alarm, decision, armed, config)
    if decision.thresholds is not None and decision.trigger in ("breach", "drift"):
        fresh = 0
    if decision.thresholds is not None:
        unclaimed = None
    elif decision.reason == "no-gain":  # searched: nothing worth claiming
        unclaimed = (0, dict(current))
    return decision, TunerState(fresh, alarm, [*state.alarm_log, *words], reference, _newest(window), unclaimed)


NEWEST_KEPT = 4
"""Samples of a look's window the state keeps to find them again in the next (`new_samples` matches 4)."""


def _newest(window: FeedbackWindow) -> FeedbackWindow:
    k = min(NEWEST_KEPT, window.n_inputs)
    return FeedbackWindow(
        conf=window.conf[window.n_inputs - k :].copy(),
        pred=window.pred[window.n_inputs - k :].copy(),
        final=window.final[window.n_inputs - k :].copy(),
        saving_ms=window.saving_ms,
        cost_ms=window.cost_ms,
    )
