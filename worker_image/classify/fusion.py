"""The fusion queues of a split worker: one for the whole split, or one per block when it rebatches.

Without rebatching a batch enters the split and runs every block of it; rows that exit leave, so
later blocks run on what is left of the batch (on a GPU, nearly the cost of a full one). With
rebatching (the plan's `SplitPlan.rebatch`, after DREX's dynamic rebatching) queue j holds the rows
waiting for block first + j: a batch runs one block, its survivors join the next block's queue,
where they are batched with survivors of other batches. The rows in queue j > 0 carry their own
slice of the state (the input of their next block).

Which queue runs next is `exitplan.planner.dispatch.choose_queue`, the policy the simulator uses:
of the queues whose launch time has come (its earliest deadline minus the expected time from its
block to the end of the model, x 1.2; or its oldest row's maximum wait), the one whose time came
first; else the deepest full queue.

Queues exist for every block in both modes: a plan update that turns rebatching off leaves rows in
inner queues, which then run from their block to the end of the split.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from exitplan.planner.dispatch import choose_queue
from exitplan.worker_image.control_bodies import StageInfo

SURVIVAL_EWMA = 0.1


class Queued(Protocol):
    enqueued: float
    deadline: float


Q = TypeVar("Q", bound=Queued)


@dataclass
class QueueStats:
    batches: int = 0
    rows: int = 0
    survival: float = 1.0
    """EWMA of the fraction of a batch of this queue that goes on past its last block."""


class FusionQueues(Generic[Q]):
    def __init__(self, first_block: int, last_block: int, rebatch: bool) -> None:
        self.first, self.last = first_block, last_block
        self.queues: list[deque[Q]] = [deque() for _ in range(last_block - first_block + 1)]
        self.stats = [QueueStats() for _ in self.queues]
        self.rebatch = rebatch

    @property
    def entry(self) -> deque[Q]:
        """The queue of rows entering the split."""
        return self.queues[0]

    def held(self) -> int:
        return sum(len(q) for q in self.queues)

    def set_rebatch(self, on: bool) -> None:
        if on != self.rebatch:
            self.rebatch = on
            for st in self.stats:
                st.survival = 1.0

    def span(self, j: int) -> tuple[int, int]:
        """Blocks a batch of queue j runs."""
        block = self.first + j
        return (block, block) if self.rebatch else (block, self.last)

    def choose(
        self, batch: int, now: float, reserve_s: Callable[[int], float], max_wait: float | None
    ) -> tuple[int, float]:
        """(queue to run, now) or (-1, when to look again; inf when all are empty)."""

        def launch_at(j: int) -> float:
            q = self.queues[j]
            by_deadline = min(r.deadline for r in q) - reserve_s(j)
            return by_deadline if max_wait is None else min(q[0].enqueued + max_wait, by_deadline)

        return choose_queue([len(q) for q in self.queues], batch, launch_at, now)

    def take(self, j: int, batch: int) -> list[Q]:
        q = self.queues[j]
        return [q.popleft() for _ in range(min(batch, len(q)))]

    def record(self, j: int, rows_in: int, rows_on: int) -> None:
        st = self.stats[j]
        st.batches += 1
        st.rows += rows_in
        st.survival += SURVIVAL_EWMA * (rows_on / rows_in - st.survival)

    def survival(self) -> float:
        """Estimated fraction of the rows entering the split that leave it for the next split."""
        if not self.rebatch:
            return self.stats[0].survival
        out = 1.0
        for st in self.stats:
            out *= st.survival
        return out

    def work_fraction(self) -> float:
        """Mean compute per entering row relative to one full pass of the split at the same batch:
        1 without rebatching (a batch holds its replica for the whole split, the model's estimate of
        time does not count exits); with rebatching, each block only for the share of rows that
        reach it."""
        if not self.rebatch:
            return 1.0
        reach, total = 1.0, 0.0
        for st in self.stats:
            total += reach
            reach *= st.survival
        return total / len(self.stats)

    def snapshot(self) -> list[StageInfo]:
        return [
            StageInfo(
                first_block=self.first + j,
                queued=len(q),
                batches=st.batches,
                rows=st.rows,
                mean_batch=round(st.rows / st.batches, 3) if st.batches else 0.0,
                survival=round(st.survival, 4),
            )
            for j, (q, st) in enumerate(zip(self.queues, self.stats))
        ]
