"""Synthetic feedback windows for tests and benchmarks (pure numpy).

The generator, per window (its knobs drawn from ``rng`` unless given):

- R ramps at depths f_r = (r + 1) / (R + 1) of the model; exiting at ramp r saves
  ``latency_ms * (1 - f_r)``; each ramp costs ``latency_ms * u_r`` with u_r ~ U(0.2 %, 2 %).
- Each input has a difficulty d ~ Beta(a, b). Its confidence at ramp r rises with depth:
  z = sharpness * (f_r - d) + N(0, noise), conf = 1/K + (1 - 1/K) * sigmoid(z), stored as float32
  (as a softmax maximum would be).
- Ramp r's answer agrees with the full model with probability conf ** gamma (agreement correlated
  with confidence; gamma > 1 makes ramps over-confident), otherwise it is another class.
"""

from __future__ import annotations

import numpy as np

from exitplan.planner.tuning.feedback import FeedbackWindow


def synthetic_window(
    rng: np.random.Generator,
    n: int = 1024,
    r: int = 4,
    *,
    classes: int | None = None,
    latency_ms: float | None = None,
    sharpness: float | None = None,
    noise: float | None = None,
    gamma: float | None = None,
) -> FeedbackWindow:
    k = int(classes if classes is not None else rng.integers(2, 11))
    latency = float(latency_ms if latency_ms is not None else rng.uniform(20.0, 200.0))
    sharp = float(sharpness if sharpness is not None else rng.uniform(3.0, 10.0))
    sigma = float(noise if noise is not None else rng.uniform(0.3, 1.5))
    gam = float(gamma if gamma is not None else rng.uniform(0.5, 3.0))
    depth = (np.arange(r) + 1.0) / (r + 1.0)
    difficulty = rng.beta(rng.uniform(0.8, 3.0), rng.uniform(0.8, 3.0), size=n)
    z = sharp * (depth[None, :] - difficulty[:, None]) + rng.normal(0.0, sigma, size=(n, r))
    conf = (1.0 / k + (1.0 - 1.0 / k) / (1.0 + np.exp(-z))).astype(np.float32).astype(np.float64)
    final = rng.integers(0, k, size=n)
    agrees = rng.random((n, r)) < conf**gam
    other = (final[:, None] + rng.integers(1, k, size=(n, r))) % k
    pred = np.where(agrees, final[:, None], other)
    saving = latency * (1.0 - depth)
    cost = latency * rng.uniform(0.002, 0.02, size=r)
    return FeedbackWindow(conf, pred, final, saving, cost)
