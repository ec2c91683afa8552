"""What running a block range returns (`BundleRuntime.run_range`, on the host or with the batch kept on the
device): who exited where with which logits, and the state the next split needs."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(shifted)
    probs: np.ndarray = e / e.sum(axis=-1, keepdims=True)
    return probs


@dataclass(frozen=True)
class RampExit:
    """One input answered by a ramp: its row in the batch given to `run_range`."""

    row: int
    ramp: str
    logits: np.ndarray
    confidence: float
    """Max softmax probability of `logits`."""


@dataclass
class RangeResult:
    exits: list[RampExit]
    """Inputs answered inside the range (exit ramps and, when the range ends the model, the final head)."""
    rows: np.ndarray
    """Rows (of the batch given to `run_range`) still running, in the order of `state`'s rows."""
    state: dict[str, np.ndarray] = field(default_factory=dict)
    """What the next split needs (`manifest.live_after(last_block)`) for the surviving rows."""
