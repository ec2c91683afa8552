"""The rows a split worker holds: a frame in flight (`Pending`, answered when every row of it has
its answer) and each of its rows on its way through the split's fusion queues (`Row`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from exitplan.worker_image.wire import HopAnswer, HopItem, HopResult, ShadowRecord

NOT_FINITE = (
    "the model's scores for this input are not finite (NaN or infinity): its values are outside the range "
    "the model computes in; send values of the magnitude it was trained on"
)


class Pending:
    """One incoming frame: answered when every row has a result or an error."""

    __slots__ = (
        "items",
        "tensors",
        "results",
        "logits",
        "thresholds_version",
        "remaining",
        "future",
        "service_ms",
        "expected_ms",
        "compute_ms",
    )

    def __init__(self, items: Sequence[HopItem], n_labels: int, tensors: dict[str, np.ndarray] | None = None) -> None:
        self.items = items
        self.tensors = tensors or {}
        """The frame's input tensors, [len(items), ...] each: row i of each is item i's input."""
        self.results: list[HopResult | None] = [None] * len(items)
        self.logits = np.zeros((len(items), n_labels), dtype=np.float32)
        self.remaining = len(items)
        self.future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.service_ms = 0.0
        self.expected_ms = 0.0
        self.compute_ms = 0.0
        """The first batch's compute alone (service_ms may also hold a hand-off to the inference thread)."""
        self.thresholds_version = 0
        """The version of the thresholds the first batch's exits were decided with."""

    def answer(self, index: int, result: HopResult, logits: np.ndarray | None) -> None:
        if self.results[index] is not None:
            return  # a shadow row's second answer: the first one stands
        if logits is not None and result.error is None and not np.isfinite(logits).all():
            result, logits = HopResult.rejection(result.id, NOT_FINITE), None  # the input's own fault: 422
        self.results[index] = result
        if logits is not None:
            self.logits[index] = logits
        self.remaining -= 1
        if self.remaining == 0 and not self.future.done():
            self.future.set_result(None)

    def fail(self, index: int, reason: str) -> None:
        """Row `index` failed through no fault of its own (the pod's, or a pod's further down)."""
        self.answer(index, HopResult.failure(self.items[index].id, reason), None)

    def reject(self, index: int, reason: str) -> None:
        """Row `index` failed for its own input: the model cannot run it."""
        self.answer(index, HopResult.rejection(self.items[index].id, reason), None)

    def reply(self) -> HopAnswer:
        """The frame's answer (once every row has its result)."""
        results = [
            r if r is not None else HopResult.failure(item.id, "no answer") for r, item in zip(self.results, self.items)
        ]
        return HopAnswer(results, self.service_ms, self.expected_ms, self.compute_ms, self.thresholds_version)


@dataclass(slots=True)
class Row:
    pending: Pending
    index: int
    arrival: float
    deadline: float
    timeout: float
    item: HopItem
    enqueued: float = 0.0
    """When the row entered its current fusion queue."""
    state: dict[str, np.ndarray] | None = None
    """The row's own state (input of its next block) while it waits inside a rebatching split."""
    rec: ShadowRecord | None = None
    """A shadow-sampled row's feedback sample so far (the item's, plus what this split adds)."""

    @property
    def answered(self) -> bool:
        return self.pending.results[self.index] is not None


def batch_state(batch: list[Row], names: Sequence[str]) -> dict[str, np.ndarray]:
    """The batch's input state: a frame's own tensors when the batch is exactly that frame's rows in
    order (one request filling the batch: no copy), else the rows stacked."""
    first = batch[0].pending
    if len(batch) == len(first.items) and all(row.pending is first and row.index == i for i, row in enumerate(batch)):
        return {name: first.tensors[name] for name in names}
    return {name: np.stack([row.pending.tensors[name][row.index] for row in batch]) for name in names}


def carried_state(batch: list[Row]) -> dict[str, np.ndarray]:
    """The batch's state inside a rebatching split: the state each row carries (`Row.state`), stacked."""
    states = [row.state or {} for row in batch]
    return {name: np.stack([state[name] for state in states]) for name in states[0]}
