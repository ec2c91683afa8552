"""A worker's expected time per batch: a + b x n, measured at warm-up, and for a trimming worker per length.

The expected time drives the worker's reported capacity (the router's admission starts its limits from
it), the deadline rule's reserve and the straggler marks (a pod is compared with its own expectation).
A worker that trims (trim.py) runs each batch at its longest row, often far below its bucket: it times a
short length at warm-up too, interpolates the fit in length between that and the bucket, expects each
batch at its own length, and reports its capacity at the mean length of its recent batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LENGTH_EWMA = 0.05
"""Weight of each batch in the running mean of the trimmed lengths (about the last 20 batches)."""


@dataclass
class Fit:
    a: float
    b: float

    def at(self, n: float) -> float:
        return self.a + self.b * n

    @staticmethod
    def of(small_ms: float, big_ms: float, big_n: int) -> Fit:
        """From a batch of 1 and a batch of big_n (>= 2): the slope between them, the intercept at 0."""
        slope = max((big_ms - small_ms) / (big_n - 1), 1e-3)
        return Fit(max(small_ms - slope, 0.0), slope)


@dataclass
class ServiceTime:
    bucket: int
    fits: dict[int, Fit] = field(default_factory=dict)
    """Length -> its fit (the bucket's always; a trimming worker's also one short length)."""
    mean_length: float = 0.0
    """Running mean of the lengths the batches ran at (the bucket until a batch ran)."""

    def __post_init__(self) -> None:
        self.fits.setdefault(self.bucket, Fit(1.0, 0.1))
        self.mean_length = self.mean_length or float(self.bucket)

    def expected_ms(self, n: float, length: float | None = None) -> float:
        """A batch of n at `length` (None: the bucket's), linear in length between the fitted lengths."""
        at = float(self.bucket if length is None else length)
        lengths = sorted(self.fits)
        if at >= lengths[-1] or len(lengths) == 1:
            return self.fits[lengths[-1]].at(n)
        if at <= lengths[0]:
            return self.fits[lengths[0]].at(n)
        hi = next(x for x in lengths if x >= at)
        lo = max(x for x in lengths if x < at)
        w = (at - lo) / (hi - lo)
        return (1 - w) * self.fits[lo].at(n) + w * self.fits[hi].at(n)

    def typical_ms(self, n: float) -> float:
        """A batch of n at the mean length of recent batches (the capacity's)."""
        return self.expected_ms(n, self.mean_length)

    def ran_at(self, length: int) -> None:
        self.mean_length += LENGTH_EWMA * (length - self.mean_length)

    def describe(self) -> dict[str, dict[str, float]]:
        return {str(k): {"a": f.a, "b": f.b} for k, f in sorted(self.fits.items())}
