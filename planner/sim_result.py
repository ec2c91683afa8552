"""What one simulated run reports (planner/simulator.py): offered, answered, within the SLO, dropped, latencies,
and the same over the requests that arrived in the last third of the run."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class SimResult:
    name: str
    offered: int
    answered: int
    within_slo: int
    dropped: int
    duration_s: float
    """From the first arrival to the last answer (or arrival): `goodput` counts the drain after the last arrival."""
    latencies_ms: np.ndarray = field(repr=False)
    cost_per_hour: float = 0.0
    mean_batch: float = 0.0
    tail_offered: int = 0
    """Requests that arrived in the last third of the arrival span."""
    tail_within_slo: int = 0
    """Of those, answered within the SLO: a queue that is still building shows here first."""
    block_rows: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    """Rows run through each block, over all workers."""
    block_runs: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    """Batches that ran each block."""
    answers: int = 0
    """Answer events (a request answered twice would count twice here, once in `answered`)."""
    busy_ms: float = 0.0
    """Time the workers spent running batches (blocks), summed over the workers."""

    @property
    def goodput(self) -> float:
        return self.within_slo / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def attainment(self) -> float:
        return self.within_slo / self.offered if self.offered else 1.0

    @property
    def block_batch(self) -> np.ndarray:
        """Mean rows per run of each block (nan for a block never run)."""
        return np.where(self.block_runs > 0, self.block_rows / np.maximum(self.block_runs, 1), np.nan)

    @property
    def tail_attainment(self) -> float:
        """Attainment over the requests that arrived in the last third of the run."""
        return self.tail_within_slo / self.tail_offered if self.tail_offered else self.attainment

    @property
    def violations(self) -> int:
        return self.answered - self.within_slo

    def pct(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if len(self.latencies_ms) else float("nan")

    def summary(self) -> dict[str, object]:
        return {
            "config": self.name,
            "offered": self.offered,
            "answered": self.answered,
            "within_slo": self.within_slo,
            "dropped": self.dropped,
            "violations": self.violations,
            "goodput_rps": self.goodput,
            "attainment": self.attainment,
            "p50_ms": self.pct(50),
            "p98_ms": self.pct(98),
            "p99_ms": self.pct(99),
            "mean_ms": float(np.mean(self.latencies_ms)) if len(self.latencies_ms) else float("nan"),
            "cost_per_hour": self.cost_per_hour,
            "mean_batch": self.mean_batch,
        }
