"""Split 0 inside the router's process (`exitplan router --colocate`, `Plan.colocate`).

The router holds one split-0 worker per bucket of the plan and hands each request's inputs to that
bucket's fusion queue directly: no frame, no HTTP, no second process between the router and split 0.
The workers batch, exit and forward survivors to split 1's pods exactly as a split-0 pod does; a batch
runs on the event loop only while nothing else is in flight in the process (`SplitWorker.alone`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from exitplan.worker_image.discovery import parse_peer_spec
from exitplan.worker_image.hop_client import HopFailed
from exitplan.worker_image.wire import HopAnswer, HopItem

if TYPE_CHECKING:
    from exitplan.worker_image.classify.router import Router
    from exitplan.worker_image.classify.worker import SplitWorker


@dataclass(frozen=True, slots=True)
class Colocation:
    """The split-0 runtime's settings, as `exitplan worker` takes them."""

    pool: str = ""
    threads: int = 1
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    max_wait_ms: float | None = None
    trim: bool | None = None


def split0_workers(router: Router, co: Colocation, peers: str, token: str | None) -> dict[int, SplitWorker]:
    """bucket -> a split-0 worker of that bucket, run by the router's event loop; ValueError when a
    multi-split plan names no split-1 peers."""
    from exitplan.worker_image.classify.worker import SplitWorker

    plan = router.plan
    if len(plan.splits) > 1 and not parse_peer_spec(peers):
        raise ValueError(
            f"--colocate runs split 0 here; the plan has {len(plan.splits)} splits, so --peers must name "
            "split 1's workers (host:port, comma-separated)"
        )
    workers = {
        b: SplitWorker(
            router.bundle_dir,
            router.plan_path,
            split=0,
            bucket=b,
            pool=co.pool,
            next_peers=peers or None,
            max_wait_ms=co.max_wait_ms,
            threads=co.threads,
            providers=co.providers,
            control_token=token,
            trim=co.trim,
        )
        for b in plan.buckets
    }
    for worker in workers.values():  # a batch blocks the event loop only when no other request waits on it
        worker.alone = lambda n: router.admission.inflight <= n
    return workers


async def run_local(
    worker: SplitWorker, items: list[HopItem], tensors: dict[str, np.ndarray], timeout_at: float
) -> tuple[HopAnswer, np.ndarray]:
    """Split 0 in this process; HopFailed past the request's timeout (its rows still run, unanswered)."""
    try:  # a timeout scope, not wait_for's extra task per request
        async with asyncio.timeout(max(timeout_at - time.time(), 0.0)):
            return await worker.run_local(items, tensors)
    except TimeoutError:
        raise HopFailed(f"split 0 (bucket {worker.bucket}) gave no answer before the request's timeout") from None
