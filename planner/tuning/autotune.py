"""Continual threshold tuning from a router's shadow-sampled feedback (Apparate, issue 4).

The data plane only records and applies: the router keeps the last shadow-sampled inputs
(`GET /v1/window.npz`) and takes new thresholds (`POST /v1/thresholds`, pushed down to every
worker without a restart). This control loop sits outside it (in `exitplan up`; the operator's
drift loop can use `decide` the same way): every period it reads the window and

- re-tunes at once when the thresholds in force break the accuracy budget on the newest samples
  (reason `accuracy`, detail ``breach...``): a breach is called when the disagreements among the
  last 50, 100 or 200 samples are too many for the budget to hold (a one-sided binomial test) or
  exceed the budget on the last `recent`; the repair only raises thresholds;
- watches the kind of traffic: when the share of inputs that exit early (under the thresholds in
  force) moves in the newest 100 samples (a two-proportion z test, `drift_z`) and, in `AutoTuner`, again on the next 100
  (an alarm is confirmed on samples it did not see), the traffic changed
  before enough disagreements could show it, and the thresholds are raised until none of those
  100 samples disagrees (detail ``drift...``);
- after a breach or a drift only the samples since count (``fresh``), and until there are
  `savings_samples` of them no disagreement is allowed among them (raises only);
- keeps a safety margin: thresholds are tuned to a fraction (``headroom``) of the budget less its
  sampling error (`sample_budget`), because thresholds placed at the edge of a sample's errors do
  worse on the next inputs (the tuner finds the sample's lucky spots) and a moderate shift must
  not break the budget before it is detected; thresholds that break the budget less its sampling
  error on the window are raised back to the target (detail ``margin...``);
- otherwise re-tunes to claim savings (the tuner's full search, lowering) when it finds at least
  `min_gain_ms` more saving per input on at least `savings_samples` fresh samples (reason
  `savings`), unless the early-exit share is on the move (half the drift test's z: hold) or, in
  `AutoTuner`, the new thresholds break the budget on the newest 200 samples (hold);
- keeps the last good thresholds when the window is short of samples or the tuner rejects it.
"""

from __future__ import annotations

import io
import json
import logging
import math
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass

import numpy as np

from exitplan.planner.tuning.thresholds import DISABLED, FeedbackWindow, WindowError, evaluate, outcome, tune

log = logging.getLogger(__name__)

DETECT_TAILS = (50, 100, 200)
"""Tail lengths (newest samples) the breach test looks at, besides `recent`."""


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


def breach(window: FeedbackWindow, thresholds: np.ndarray, budget: float, tails: tuple[int, ...], alpha: float) -> tuple[int, int] | None:
    """(tail length, disagreements) of the shortest newest-samples tail on which ``thresholds`` break
    ``budget`` beyond chance: more disagreements than the budget allows there, and as many or more
    would happen with probability <= ``alpha`` if the true rate were the budget. None: no breach."""
    agrees = outcome(window, thresholds).agrees
    for m in sorted(t for t in tails if t <= window.n_inputs):
        x = int(m - agrees[-m:].sum())
        if x > budget * m and binomial_tail(x, m, budget) <= alpha:
            return m, x
    return None


def exit_shift(window: FeedbackWindow, thresholds: np.ndarray, recent: int, min_before: int = 200) -> float:
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
    return FeedbackWindow(conf=window.conf[-k:], pred=window.pred[-k:], final=window.final[-k:],
                  saving_ms=window.saving_ms, cost_ms=window.cost_ms)


def raise_to(window: FeedbackWindow, target: float, start: np.ndarray) -> np.ndarray:
    """The tuner's repair alone: ``start`` with thresholds raised until ``window`` is within ``target``
    (largest agreement gained per saving lost first); nothing is lowered."""
    result = tune(window, target, start=start, restart=False, refine_pass=False, max_rounds=0)
    return np.maximum(np.asarray(result.thresholds, dtype=float), start)


def decide(window: FeedbackWindow, ramps: list[str], current: dict[str, float], budget: float, *,
           min_samples: int = 200, recent: int = 300, savings_samples: int = 1000, min_gain_ms: float = 0.05,
           z: float = 1.645, headroom: float = 1.0, fresh: int | None = None,
           tails: tuple[int, ...] = DETECT_TAILS, alpha: float = 0.01, drift_z: float = 0.0,
           drift_recent: int = 100, reference: dict[str, float] | None = None,
           drift_armed: bool = True, savings_check: int = 0) -> Decision:
    """What to do with the thresholds given one feedback window (samples oldest first; pure).

    Accuracy first, on the newest samples (a shift shows there long before it dominates the whole
    window): if the thresholds in force break the budget on the last `recent` samples (point
    estimate) or, beyond chance (:func:`breach`, level `alpha`), on a shorter tail of `tails`, they
    are raised until the last `recent` samples are within the tuning target (reason `accuracy`,
    detail ``breach...``). Everything else uses only the last `fresh` samples (those since the last
    breach; None: all of them). The tuning target is `headroom` x `sample_budget` on those samples
    (the budget less its sampling error, less a safety margin): thresholds that break the budget
    less its sampling error there are raised until they meet the target (reason `accuracy`, detail
    ``margin...``; the gap between the two keeps savings and margin raises from taking turns); a repair never lowers a
    threshold, because lowering on a few hundred samples overfits them. Savings (the tuner's full
    search, lowering) are claimed only on at least `savings_samples` fresh samples, when they gain
    at least `min_gain_ms` per input (reason `savings`). With `drift_z` > 0, a move of the early-exit
    share in the newest `drift_recent` fresh samples (under the thresholds in force, or under
    `reference` while every ramp is off) by more than `drift_z` standard errors raises the thresholds
    until none of those samples disagrees (detail ``drift...``; the caller then counts fresh samples
    from there) -- only when `drift_armed`: a caller that wants an alarm confirmed on samples the
    alarm did not see passes False on the first alarm (the decision then only holds savings and
    carries the statistic in ``exit_z``) and True once `drift_recent` new samples have arrived.
    With `savings_check` > 0, savings are claimed only if the new thresholds also keep the budget
    (point estimate) on the newest `savings_check` samples: a window of 1,000 fresh samples can end
    in the first ~100 of a shift, which the tuner, fitting the other 900, would ignore.
    """
    n = window.n_inputs
    if n < min_samples:
        return Decision(None, "short-of-samples", n)
    start = np.array([float(current.get(r, DISABLED)) for r in ramps])
    latest = _tail(window, min(recent, n))
    agree_recent, save_recent = evaluate(latest, start)
    fired = None if agree_recent < 1.0 - budget else breach(window, start, budget, tails, alpha)
    if agree_recent < 1.0 - budget or fired is not None:
        raised = raise_to(latest, headroom * sample_budget(budget, latest.n_inputs, z), start)
        agree_after, save_after = evaluate(latest, raised)
        detail = (f"breach in the last {fired[0]} samples: {fired[1]} disagree" if fired is not None
                  else f"breach in the last {latest.n_inputs} samples: agreement {agree_recent:.4f}")
        return Decision({r: float(t) for r, t in zip(ramps, raised)}, "accuracy", latest.n_inputs,
                        agree_recent, agree_after, save_recent, save_after, detail)
    if fresh is not None and fresh < n:
        window = _tail(window, max(fresh, 1))
        n = window.n_inputs
    z_exit = 0.0
    if drift_z and drift_recent:
        # Under thresholds that let inputs exit: the ones in force, or `reference` while every ramp is off.
        probe_t = start
        if reference is not None and not (start <= 1.0).any():
            probe_t = np.array([float(reference.get(r, DISABLED)) for r in ramps])
        z_exit = exit_shift(window, probe_t, drift_recent)
        if abs(z_exit) > drift_z and drift_armed:  # the traffic changed: only the newest samples speak for it now
            raised = raise_to(_tail(window, drift_recent), 0.0, start)
            agree_now, save_now = evaluate(_tail(window, drift_recent), start)
            agree_after, save_after = evaluate(_tail(window, drift_recent), raised)
            return Decision({r: float(t) for r, t in zip(ramps, raised)}, "accuracy", drift_recent, agree_now,
                            agree_after, save_now, save_after,
                            f"drift: early-exit share moved by z = {z_exit:+.1f} in the last {drift_recent} samples",
                            exit_z=z_exit)
    probation = fresh is not None and n < savings_samples
    if n < min_samples and not probation:
        return Decision(None, "short-of-samples", n, exit_z=z_exit)
    agree_now, save_now = evaluate(window, start)
    safe = 0.0 if probation else sample_budget(budget, n, z)
    target = 0.0 if probation else headroom * safe
    if n - round(agree_now * n) > math.floor(safe * n + 1e-9):  # past the statistically safe level: back to the target
        raised = raise_to(window, target, start)
        agree_after, save_after = evaluate(window, raised)
        return Decision({r: float(t) for r, t in zip(ramps, raised)}, "accuracy", n, agree_now, agree_after,
                        save_now, save_after, exit_z=z_exit, detail=f"margin: agreement {agree_now:.4f} < target {1 - target:.4f}"
                        + (" (since the last breach: no disagreement allowed)" if probation else ""))
    if n < savings_samples:
        return Decision(None, "short-of-samples", n, agree_now, agree_now, save_now, save_now, exit_z=z_exit)
    result = tune(window, target, start=start)
    figures = dict(samples=n, agreement_before=agree_now, agreement_after=result.agreement,
                   saving_before_ms=save_now, saving_after_ms=result.saving_ms, exit_z=z_exit)
    if result.saving_ms >= save_now + min_gain_ms:
        if drift_z and abs(z_exit) > drift_z / 2:  # the traffic may be moving: claim nothing yet
            return Decision(None, "no-gain", **figures, detail=f"hold: early-exit share moving (z = {z_exit:+.1f})")
        if savings_check:  # the new thresholds must hold on the newest samples too (a shift may have begun there)
            tail = _tail(window, min(savings_check, n))
            agree_tail, _ = evaluate(tail, np.asarray(result.thresholds, dtype=float))
            x = tail.n_inputs - round(agree_tail * tail.n_inputs)
            if x > math.floor(budget * tail.n_inputs + 1e-9):
                return Decision(None, "no-gain", **figures,
                                detail=f"hold: the new thresholds break the budget on the newest {tail.n_inputs} samples ({x} disagree)")
        return Decision({r: float(t) for r, t in zip(ramps, result.thresholds)}, "savings", **figures)
    return Decision(None, "no-gain", **figures)


def new_samples(previous: FeedbackWindow | None, window: FeedbackWindow) -> int:
    """How many of ``window``'s samples came after ``previous`` (both the newest samples of one
    router's feedback ring, oldest first): the newest samples of ``previous`` are found again in
    ``window``. All of them when ``previous`` is None or not found (more arrived than fit)."""
    if previous is None or previous.n_inputs == 0:
        return window.n_inputs
    k = min(4, previous.n_inputs)
    key = np.concatenate([previous.conf[-k:].ravel(), previous.final[-k:].astype(np.float64)])
    n = window.n_inputs
    for end in range(n, k - 1, -1):
        if np.array_equal(np.concatenate([window.conf[end - k:end].ravel(), window.final[end - k:end].astype(np.float64)]), key):
            return n - end
    return n


def fetch_window(router_url: str, last: int) -> FeedbackWindow | None:
    """The router's newest `last` feedback samples, or None while it has none."""
    with urllib.request.urlopen(f"{router_url}/v1/window.npz?last={last}", timeout=10) as resp:
        data = np.load(io.BytesIO(resp.read()))
        if data["final"].size == 0:
            return None
        return FeedbackWindow(conf=data["conf"], pred=data["pred"], final=data["final"],
                      saving_ms=data["saving_ms"], cost_ms=data["cost_ms"])


def current_thresholds(router_url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{router_url}/v1/thresholds", timeout=10) as resp:
        return json.loads(resp.read())["thresholds"]


def push(router_url: str, thresholds: dict[str, float], reason: str) -> None:
    body = json.dumps({"thresholds": thresholds, "reason": reason}).encode()
    req = urllib.request.Request(f"{router_url}/v1/thresholds", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        resp.read()


class AutoTuner:
    """Runs `decide` every `period` seconds against one router, in a daemon thread.

    Keeps count of the samples that arrived since the last breach or drift (``fresh``), so that
    savings are claimed only on samples of the workload as it is now. With ``drift_confirm`` a drift
    alarm is acted on only when it shows again on ``drift_recent`` samples that arrived after it
    (savings are held meanwhile; breaches are acted on at once as always). The defaults are the settings
    bench/live_tuning.py measured (BENCHMARKS.md, "Threshold tuning (issue 4)"): breach judged on the
    newest 100 samples, tune to a quarter of the budget's safe part (``headroom``), watch the
    early-exit share (``drift_z``), claim savings on 1,000 fresh samples."""

    def __init__(self, router_url: str, ramps: list[str], budget: float, *, period: float = 20.0,
                 window: int = 1500, min_samples: int = 100, recent: int = 100, savings_samples: int = 1000,
                 headroom: float = 0.25, alpha: float = 0.05, drift_z: float = 3.3, drift_recent: int = 100,
                 drift_confirm: bool = True, savings_check: int = 200, on_change=None) -> None:
        self.router_url, self.ramps, self.budget = router_url, ramps, budget
        self.period, self.window, self.min_samples, self.recent = period, window, min_samples, recent
        self.savings_samples, self.headroom, self.alpha = savings_samples, headroom, alpha
        self.drift_z, self.drift_recent, self.drift_confirm = drift_z, drift_recent, drift_confirm
        self.savings_check = savings_check
        self.alarm: tuple[float, int] | None = None  # unconfirmed drift alarm: (sign of z, samples since)
        self.alarm_log: list[str] = []  # drift alarms raised and dropped, in words
        self.on_change = on_change
        self.history: list[Decision] = []
        self.fresh: int | None = None  # samples since the last breach (None: no breach yet)
        self.reference: dict[str, float] | None = None
        self._previous: FeedbackWindow | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autotune", daemon=True)

    def step(self) -> Decision:
        try:
            window = fetch_window(self.router_url, self.window)
            if window is None:
                return Decision(None, "short-of-samples", 0)
            arrived = new_samples(self._previous, window)
            if self.fresh is not None:
                self.fresh += arrived
            if self.alarm is not None:
                self.alarm = (self.alarm[0], self.alarm[1] + arrived)
            self._previous = window
            # An alarm is acted on only when the newest drift_recent samples, none of which the first
            # alarm saw, show the move again (one look at 100 samples in ~1,000 sees z > 3.3 by chance).
            armed = not self.drift_confirm or (self.alarm is not None and self.alarm[1] >= self.drift_recent)
            current = current_thresholds(self.router_url)
            if any(float(current.get(r, DISABLED)) <= 1.0 for r in self.ramps):
                self.reference = dict(current)  # the last thresholds in force that let inputs exit
            decision = decide(window, self.ramps, current, self.budget,
                              min_samples=self.min_samples, recent=self.recent, savings_samples=self.savings_samples,
                              headroom=self.headroom, alpha=self.alpha, fresh=self.fresh, drift_z=self.drift_z,
                              drift_recent=self.drift_recent, reference=self.reference, drift_armed=armed,
                              savings_check=self.savings_check)
            self._track_alarm(decision, armed)
        except WindowError as err:
            log.warning("feedback window rejected, keeping the last good thresholds: %s", err)
            return Decision(None, f"rejected: {err}", 0)
        if decision.thresholds is not None:
            push(self.router_url, decision.thresholds, f"tune-{decision.reason}")
            log.info("thresholds re-tuned (%s%s): agreement %.4f -> %.4f, saving %.2f -> %.2f ms on %d samples",
                     decision.reason, f", {decision.detail}" if decision.detail else "", decision.agreement_before,
                     decision.agreement_after, decision.saving_before_ms, decision.saving_after_ms, decision.samples)
            if decision.detail.startswith(("breach in the last", "drift")):
                self.fresh = 0  # the workload changed: older samples no longer speak for it
            if self.on_change:
                self.on_change(decision)
        self.history.append(decision)
        return decision

    def _track_alarm(self, decision: Decision, armed: bool) -> None:
        fired = bool(self.drift_z) and abs(decision.exit_z) > self.drift_z
        if decision.detail.startswith("drift") or not self.drift_confirm:
            if decision.detail.startswith("drift"):
                self.alarm_log.append(f"acted on: z = {decision.exit_z:+.1f}")
            self.alarm = None
        elif decision.detail.startswith("breach"):  # repaired already; the samples since start afresh
            if self.alarm is not None:
                self.alarm_log.append("superseded by a breach")
            self.alarm = None
        elif self.alarm is None:
            if fired:
                self.alarm = (math.copysign(1.0, decision.exit_z), 0)
                self.alarm_log.append(f"alarm z = {decision.exit_z:+.1f} on {decision.samples} samples")
                log.info("early-exit share moved (z = %+.1f): drift alarm, to be confirmed on the next %d samples",
                         decision.exit_z, self.drift_recent)
        elif armed and not (fired and math.copysign(1.0, decision.exit_z) == self.alarm[0]):
            log.info("drift alarm not confirmed on %d new samples (z = %+.1f): dropped", self.alarm[1], decision.exit_z)
            self.alarm_log.append(f"dropped: z = {decision.exit_z:+.1f} after {self.alarm[1]} new samples")
            self.alarm = None

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.step()
            except (urllib.error.URLError, OSError, ValueError) as err:
                log.warning("autotune step failed: %s", err)

    def start(self) -> AutoTuner:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
