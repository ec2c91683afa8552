"""Continual threshold tuning from a router's shadow-sampled feedback (Apparate, issue 4).

The data plane only records and applies: the router keeps the last shadow-sampled inputs
(`GET /v1/window.npz`) and takes new thresholds (`POST /v1/thresholds`, pushed down to every
worker without a restart). This control loop sits outside it (in `exitplan up`; the operator's
drift loop can use `decide` the same way): every period it reads the window and

- re-tunes at once when the thresholds in force break the accuracy budget on the window
  (reason `accuracy`), starting from them (the tuner first repairs, then climbs);
- otherwise re-tunes to claim savings when the tuner finds at least `min_gain_ms` more saving per
  input (reason `savings`);
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

from exitplan.planner.thresholds import DISABLED, Window, WindowError, evaluate, tune

log = logging.getLogger(__name__)


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


def sample_budget(budget: float, n: int, z: float = 1.645) -> float:
    """The budget to tune to on a sample of n inputs so the traffic's own disagreement stays within
    `budget` with ~95 % confidence: budget minus z standard errors of a proportion at the budget."""
    if n <= 0:
        return 0.0
    return max(0.0, budget - z * math.sqrt(budget * (1.0 - budget) / n))


def _tail(window: Window, k: int) -> Window:
    return Window(conf=window.conf[-k:], pred=window.pred[-k:], final=window.final[-k:],
                  saving_ms=window.saving_ms, cost_ms=window.cost_ms)


def decide(window: Window, ramps: list[str], current: dict[str, float], budget: float, *,
           min_samples: int = 200, recent: int = 300, savings_samples: int = 1000, min_gain_ms: float = 0.05,
           z: float = 1.645) -> Decision:
    """What to do with the thresholds given one feedback window (samples oldest first; pure).

    Accuracy first, on the most recent `recent` samples (a shift shows there long before it
    dominates the whole window): if the thresholds in force break the budget there, re-tune on
    those samples and keep only the raises (reason `accuracy`): a repair never lowers a threshold,
    because lowering on a few hundred samples overfits them. Savings (lowering) are claimed only on
    a window of at least `savings_samples`. Thresholds are tuned to `sample_budget` (the budget
    less its sampling error on the samples used); the breach test uses the budget itself.
    """
    n = window.n_inputs
    if n < min_samples:
        return Decision(None, "short-of-samples", n)
    start = np.array([float(current.get(r, DISABLED)) for r in ramps])
    latest = _tail(window, min(recent, n))
    agree_recent, save_recent = evaluate(latest, start)
    if agree_recent < 1.0 - budget:
        result = tune(latest, sample_budget(budget, latest.n_inputs, z), start=start)
        raised = np.maximum(np.asarray(result.thresholds, dtype=float), start)
        agree_after, save_after = evaluate(latest, raised)
        return Decision({r: float(t) for r, t in zip(ramps, raised)}, "accuracy", latest.n_inputs,
                        agree_recent, agree_after, save_recent, save_after)
    agree_now, save_now = evaluate(window, start)
    if n < savings_samples and agree_now >= 1.0 - budget:
        return Decision(None, "short-of-samples", n, agree_now, agree_now, save_now, save_now)
    result = tune(window, sample_budget(budget, n, z), start=start)
    figures = dict(samples=n, agreement_before=agree_now, agreement_after=result.agreement,
                   saving_before_ms=save_now, saving_after_ms=result.saving_ms)
    if agree_now < 1.0 - budget:  # the recent samples were fine but the whole window is not
        return Decision({r: float(t) for r, t in zip(ramps, result.thresholds)}, "accuracy", **figures)
    if result.saving_ms >= save_now + min_gain_ms:
        return Decision({r: float(t) for r, t in zip(ramps, result.thresholds)}, "savings", **figures)
    return Decision(None, "no-gain", **figures)


def fetch_window(router_url: str, last: int) -> Window | None:
    """The router's newest `last` feedback samples, or None while it has none."""
    with urllib.request.urlopen(f"{router_url}/v1/window.npz?last={last}", timeout=10) as resp:
        data = np.load(io.BytesIO(resp.read()))
        if data["final"].size == 0:
            return None
        return Window(conf=data["conf"], pred=data["pred"], final=data["final"],
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
    """Runs `decide` every `period` seconds against one router, in a daemon thread."""

    def __init__(self, router_url: str, ramps: list[str], budget: float, *, period: float = 20.0,
                 window: int = 1024, min_samples: int = 200, recent: int = 300, savings_samples: int = 1000,
                 on_change=None) -> None:
        self.router_url, self.ramps, self.budget = router_url, ramps, budget
        self.period, self.window, self.min_samples, self.recent = period, window, min_samples, recent
        self.savings_samples = savings_samples
        self.on_change = on_change
        self.history: list[Decision] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autotune", daemon=True)

    def step(self) -> Decision:
        try:
            window = fetch_window(self.router_url, self.window)
            if window is None:
                return Decision(None, "short-of-samples", 0)
            decision = decide(window, self.ramps, current_thresholds(self.router_url), self.budget,
                              min_samples=self.min_samples, recent=self.recent, savings_samples=self.savings_samples)
        except WindowError as err:
            log.warning("feedback window rejected, keeping the last good thresholds: %s", err)
            return Decision(None, f"rejected: {err}", 0)
        if decision.thresholds is not None:
            push(self.router_url, decision.thresholds, f"tune-{decision.reason}")
            log.info("thresholds re-tuned (%s): agreement %.4f -> %.4f, saving %.2f -> %.2f ms on %d samples",
                     decision.reason, decision.agreement_before, decision.agreement_after,
                     decision.saving_before_ms, decision.saving_after_ms, decision.samples)
            if self.on_change:
                self.on_change(decision)
        self.history.append(decision)
        return decision

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
