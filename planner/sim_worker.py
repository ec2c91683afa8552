"""A simulated worker and its fusion queues (planner/simulator.py): what each replica of a cell holds."""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]


class FusionQueue:
    """A fusion queue: requests in the order they joined, when each joined, and the earliest deadline
    among them in O(1) (a monotone deque of candidates for the minimum)."""

    __slots__ = ("rows", "mins")

    def __init__(self) -> None:
        self.rows: deque[tuple[int, float]] = deque()
        self.mins: deque[tuple[float, int]] = deque()

    def __len__(self) -> int:
        return len(self.rows)

    def push(self, r: int, t: float, deadline: float) -> None:
        self.rows.append((r, t))
        mins = self.mins
        while mins and mins[-1][0] >= deadline:
            mins.pop()
        mins.append((deadline, r))

    def pop(self) -> int:
        r = self.rows.popleft()[0]
        if self.mins[0][1] == r:
            self.mins.popleft()
        return r

    def launch_at(self, max_wait: float, rest_s: float) -> float:
        """The oldest row's maximum wait, or the earliest deadline less the time to the end (20 % margin)."""
        return min(self.rows[0][1] + max_wait, self.mins[0][0] - rest_s * 1.2)


class SimWorker:
    __slots__ = (
        "split",
        "bucket",
        "length",
        "batch",
        "first",
        "last",
        "lat",
        "ramp_lat",
        "xfer",
        "queue",
        "running",
        "busy",
        "timer",
        "expect_ms",
        "mean_ms",
        "rest_ms",
        "batches",
        "rows",
        "stages",
        "stage_rest_ms",
        "held",
        "trim",
        "pool",
    )
    # Set by Simulation once the worker's cell is known:
    lat: FloatArray
    """[block of the split, rows]: a block's time at that many rows."""
    ramp_lat: FloatArray
    """The same for the enabled ramp after each block (0 where there is none)."""
    xfer: FloatArray
    """[rows]: the transfer of that many survivors to the next split."""
    expect_ms: float
    """A full batch through the split, transfer included."""
    mean_ms: float
    """Mean time the replica spends per full entering batch (exits counted)."""
    rest_ms: float
    """Expected time from this split to the end of the model (the deadline rule)."""

    def __init__(
        self,
        split: int,
        bucket: int,
        length: int,
        batch: int,
        first: int,
        last: int,
        rebatch: bool = False,
        pool: str = "",
    ) -> None:
        self.split, self.bucket, self.length, self.pool = split, bucket, length, pool
        self.batch, self.first, self.last = batch, first, last
        self.queue = FusionQueue()
        self.stages: list[FusionQueue] | None = (
            [self.queue] + [FusionQueue() for _ in range(last - first)] if rebatch else None
        )
        """With rebatching: one fusion queue per block (stages[0] is `queue`), rows enter the next on leaving one."""
        self.stage_rest_ms: list[float] = []
        self.held = 0
        """Rows in the worker's queues (all stages)."""
        self.running = 0
        self.busy = False
        self.timer = math.inf
        self.batches = 0
        self.rows = 0
        self.trim: list[tuple[int, FloatArray, FloatArray]] = []  # (length, lat, ramp_lat), shortest first
