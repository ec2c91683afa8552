"""The continual tuning decision (pure) and one live step against a real router."""

import numpy as np

from exitplan.autotune import decide
from exitplan.planner.thresholds import Window, evaluate


def window(n=1000, seed=0):
    """Two ramps; an input's ramp answer is right more often the more confident the ramp is."""
    rng = np.random.default_rng(seed)
    final = rng.integers(0, 3, n)
    conf = rng.uniform(0.34, 1.0, (n, 2))
    conf[:, 1] = np.clip(conf[:, 1] + 0.1, 0, 1)
    right = rng.uniform(0, 1, (n, 2)) < conf ** 2
    pred = np.where(right, final[:, None], (final[:, None] + 1) % 3)
    return Window(conf=conf, pred=pred, final=final, saving_ms=np.array([20.0, 10.0]), cost_ms=np.array([0.1, 0.1]))


def test_short_window_keeps_the_thresholds():
    d = decide(window(50), ["a", "b"], {"a": 2.0, "b": 2.0}, 0.01, min_samples=200)
    assert d.thresholds is None and d.reason == "short-of-samples"


def test_thresholds_breaking_the_budget_are_repaired():
    w = window()
    d = decide(w, ["a", "b"], {"a": 0.4, "b": 0.4}, 0.01)
    assert d.reason == "accuracy" and d.agreement_before < 0.99
    agreement, _ = evaluate(w, np.array([d.thresholds["a"], d.thresholds["b"]]))
    assert agreement >= 0.99 and d.agreement_after >= 0.99  # repaired on the recent samples, holds on all


def test_disabled_ramps_are_lowered_to_claim_savings():
    d = decide(window(), ["a", "b"], {"a": 2.0, "b": 2.0}, 0.05)
    assert d.reason == "savings" and d.saving_after_ms > d.saving_before_ms > -1e-9
    assert min(d.thresholds.values()) <= 1.0


def test_no_gain_keeps_the_thresholds():
    w = window()
    first = decide(w, ["a", "b"], {"a": 2.0, "b": 2.0}, 0.05)
    again = decide(w, ["a", "b"], first.thresholds, 0.05)
    assert again.thresholds is None and again.reason == "no-gain"


def test_sample_budget_is_below_the_budget_and_approaches_it_with_more_samples():
    from exitplan.autotune import sample_budget

    values = [sample_budget(0.01, n) for n in (100, 600, 2000, 100000)]
    assert values[0] == 0.0  # 100 samples cannot vouch for 1 %
    assert all(a < b for a, b in zip(values[1:], values[2:]))
    assert 0.0 < values[1] < values[2] < values[3] < 0.01
    assert sample_budget(0.01, 0) == 0.0


def test_a_breach_in_the_recent_samples_is_repaired_on_them():
    """Old samples are easy, the newest are hard: the whole window looks fine, the recent part does not."""
    easy, hard = window(2000, seed=1), window(300, seed=2)
    hard_pred = (hard.final + 1) % 3  # the hard inputs' early answers are all wrong...
    hard_conf = np.full_like(hard.conf, 0.99)  # ...and confident
    w = Window(conf=np.vstack([easy.conf, hard_conf]), pred=np.vstack([easy.pred, np.stack([hard_pred] * 2, 1)]),
               final=np.concatenate([easy.final, hard.final]), saving_ms=easy.saving_ms, cost_ms=easy.cost_ms)
    current = decide(easy, ["a", "b"], {"a": 2.0, "b": 2.0}, 0.05).thresholds
    d = decide(w, ["a", "b"], current, 0.05, recent=300)
    assert d.reason == "accuracy" and d.samples == 300 and d.agreement_before < 0.95
    assert all(t > 0.99 for t in d.thresholds.values())  # those confident wrong exits are shut
