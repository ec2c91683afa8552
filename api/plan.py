"""The Plan: what the planner decides and what routers and workers run.

It travels as JSON (the plan ConfigMap's `plan.json`, or a file for `exitplan up`). The planner
produces it; the operator turns it into manifests; routers and workers read it at start and on
change (thresholds are hot-updated).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

from pydantic import Field, model_validator

from exitplan.api.resources import Model


def even_ranges(n_blocks: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous (first, last) block ranges of near-equal size covering blocks 0..n_blocks-1 (the
    first ranges take the extra blocks). The even split both the planner and a worker fall back on."""
    if not 1 <= parts <= n_blocks:
        raise ValueError(f"parts must be within 1..{n_blocks} (the model's blocks), got {parts}")
    sizes = [n_blocks // parts + (1 if i < n_blocks % parts else 0) for i in range(parts)]
    out, start = [], 0
    for size in sizes:
        out.append((start, start + size - 1))
        start += size
    return out


class SplitPlan(Model):
    index: Annotated[int, Field(ge=0)]
    first_block: Annotated[int, Field(ge=0)]
    last_block: Annotated[int, Field(ge=0)]
    """Inclusive: the split runs blocks first_block..last_block and the ramps after them."""
    rebatch: bool = False
    """Regroup rows at every block inside the split: each block has its own fusion queue and runs
    on a batch of the rows that reached it (from several entering batches), instead of on what is
    left of one entering batch after its exits."""


class Cell(Model):
    """One worker Deployment: a split, for one length bucket, on one pool."""

    split: Annotated[int, Field(ge=0)]
    bucket: Annotated[int, Field(ge=1)]
    """The bucket's max length (1 for models without a sequence axis)."""
    pool: str
    replicas: Annotated[int, Field(ge=0)]
    batch_size: Annotated[int, Field(ge=1)]
    """Target batch size of the split's fusion queue."""


class Prediction(Model):
    goodput_rps: Annotated[float, Field(ge=0.0)] = 0.0
    p99_ms: Annotated[float, Field(ge=0.0)] = 0.0
    cost_per_hour: Annotated[float, Field(ge=0.0)] = 0.0


def colocated_routers(cells: Sequence[Cell], routers: int) -> int:
    """Routers of a plan that runs split 0 in them (`Plan.colocate`): each holds split 0 of every bucket, so
    as many as the most split-0 replicas of a bucket, at least `routers` (spec.router.replicas)."""
    per_bucket: dict[int, int] = {}
    for c in cells:
        if c.split == 0:
            per_bucket[c.bucket] = per_bucket.get(c.bucket, 0) + c.replicas
    return max(routers, *per_bucket.values())


class Plan(Model):
    service: str
    model: str
    splits: Annotated[list[SplitPlan], Field(min_length=1)]
    buckets: Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=1)]
    cells: Annotated[list[Cell], Field(min_length=1)]
    thresholds: dict[str, float] = Field(default_factory=dict)
    """Exit threshold per ramp name; a ramp exits an input whose confidence is >= its threshold.
    A threshold above 1 disables the ramp. Ramps not named here do not exit."""
    thresholds_version: int = Field(default=0, ge=0)
    """The version of `thresholds` (`worker_image/threshold_set.py`): the tuner and the operator write the
    live thresholds into the plan with theirs; 0: a plan's own thresholds (a new plan). Not part of the
    plan's hash (the values are)."""
    survival: list[float] = Field(default_factory=list)
    """The survival curve (per exit ramp) the plan was sized for."""
    length_histogram: list[float] = Field(default_factory=list)
    """Share of requests per bucket the plan was sized for."""
    prediction: Prediction = Field(default_factory=Prediction)
    reason: str = "initial"
    """Why this plan was made (initial, spec-change, length-drift, survival-drift, slo-risk, ...)."""
    colocate: bool = False
    """Split 0 runs inside the router processes (`exitplan router --colocate`): no split-0 worker pods,
    as many routers as the most split-0 replicas of a bucket, each holding split 0 of every bucket, on
    split 0's pool; the router's peers are split 1's pods. The planner sets it where the hop from the
    router to split 0 costs more than keeping them apart gains (planner/serving_path.py)."""
    routers: list[str] = Field(default_factory=list)
    """host:port of the routers' control endpoints, the only places a worker posts shadow feedback to
    (a /v1/run frame whose reply_to is not one of them is refused). A hostname stands for every
    address it resolves to (a headless Service of the router pods). Wiring, not part of the plan's
    hash: the operator and `exitplan up` fill it in."""

    @model_validator(mode="after")
    def _consistent(self) -> Plan:
        if any(b >= c for b, c in zip(self.buckets, self.buckets[1:])):
            raise ValueError(f"buckets must increase strictly, got {self.buckets}")
        for prev, nxt in zip(self.splits, self.splits[1:]):
            if nxt.first_block != prev.last_block + 1 or nxt.index != prev.index + 1:
                raise ValueError("splits must be contiguous and indexed in order")
        known = {s.index for s in self.splits}
        for cell in self.cells:
            if cell.split not in known:
                raise ValueError(f"cell names split {cell.split}, which the plan does not have")
            if cell.bucket not in self.buckets:
                raise ValueError(f"cell names bucket {cell.bucket}, which is not one of {self.buckets}")
        return self

    def content_hash(self) -> str:
        """Stable short hash of what the data plane runs: status.plan.hash, the plan ConfigMap's annotation
        exitplan.io/plan-hash, and the plan hash the routers report."""
        return self._hash({"prediction", "reason", "routers", "thresholds_version"})

    def layout_hash(self) -> str:
        """The hash of the plan less its exit thresholds: the annotation exitplan.io/plan-hash of every child
        but the plan ConfigMap. Thresholds live in plan.json alone (a re-tune writes only the ConfigMap),
        so a child's annotation changes only when the child itself does."""
        return self._hash({"prediction", "reason", "routers", "thresholds_version", "thresholds"})

    def _hash(self, exclude: set[str]) -> str:
        body = self.model_dump(by_alias=True, mode="json", exclude=exclude)
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]

    def to_json(self) -> str:
        return json.dumps(self.dump(), indent=2, sort_keys=True)

    @classmethod
    def from_file(cls, path: str | Path) -> Plan:
        return cls.model_validate_json(Path(path).read_text())
