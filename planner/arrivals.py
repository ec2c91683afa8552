"""Arrival processes for the simulator: Poisson at a rate, or a trace's own pattern looped and scaled.

Both cover a stated number of seconds at a stated mean rate, whatever the trace's own length: a
trace of 58 minutes replayed at 80,000 req/s covers its seconds in a fraction of one, so a replay of
"S seconds" loops the trace's pattern (its gaps scaled to the rate) until S seconds are covered.

`depths_from_survival`: what each arrival runs, the blocks before its exit drawn from a survival curve.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from exitplan.planner.traces import looped_trace

__all__ = ["depths_from_survival", "looped_trace", "poisson_arrivals", "poisson_for"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


def poisson_arrivals(rng: np.random.Generator, rate: float, n: int) -> FloatArray:
    """`n` Poisson arrival times at `rate` per second, from 0."""
    out: FloatArray = np.cumsum(rng.exponential(1.0 / rate, n))
    return out


def poisson_for(rng: np.random.Generator, rate: float, duration_s: float) -> FloatArray:
    """Poisson arrival times at `rate` per second over [0, duration_s)."""
    expected = rate * duration_s
    n = int(expected + 6.0 * np.sqrt(expected) + 16)
    times = poisson_arrivals(rng, rate, n)
    while times[-1] < duration_s:  # (practically never: six standard deviations)
        times = np.concatenate([times, times[-1] + poisson_arrivals(rng, rate, n)])
    out: FloatArray = times[times < duration_s]
    return out


def depths_from_survival(
    rng: np.random.Generator,
    n: int,
    n_blocks: int,
    ramp_after: Sequence[int],
    survival: Sequence[float],
    enabled: Sequence[bool],
) -> np.ndarray:
    """Blocks each input runs: it exits at the first enabled ramp at or after its natural exit ramp."""
    surv = (
        np.concatenate([[1.0], np.minimum.accumulate(np.asarray(survival, dtype=np.float64))])
        if len(survival)
        else np.ones(1)
    )
    u = rng.random(n)
    # natural exit ramp index r: s[r] >= u > s[r+1]  (r = len(ramps) -> no exit before the end)
    natural = np.searchsorted(-surv[1:], -u, side="left")  # first r with surv[r+1] < u
    exit_at = np.full(len(ramp_after) + 1, n_blocks, dtype=np.int64)
    nxt = n_blocks
    for r in range(len(ramp_after) - 1, -1, -1):
        if enabled[r]:
            nxt = ramp_after[r] + 1
        exit_at[r] = nxt
    return exit_at[np.minimum(natural, len(ramp_after))]
