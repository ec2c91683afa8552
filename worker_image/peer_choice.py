"""The pods of one hop, and the choice of the pod that takes the next frame.

`PeerSet` holds a hop's pods: their addresses from the peer spec (`discovery.py`), each one asked for
`/v1/info` (`control_bodies.WorkerInfo`: split, bucket, pool, batch size, capacity, readiness) every
refresh. Senders keep per-peer load (inputs in flight) and service-time statistics; `choose` is
DensePipe's hop (least running / capacity); a peer whose service time stays well above what its
profile promises is marked a straggler (E3) and skipped for next hops until it recovers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from exitplan.planner.dispatch import least_loaded
from exitplan.worker_image.control_bodies import WorkerInfo
from exitplan.worker_image.discovery import resolve

log = logging.getLogger(__name__)


def hop_capacities(peers: list[Peer]) -> list[float]:
    """The denominators of "least running / capacity": each pod's reported inputs/s, so that a faster
    pod (a faster GPU type in a mixed split) takes proportionally more; its batch size while any of
    them has not reported a rate yet (equal for the replicas of one cell)."""
    if all(p.capacity > 0 for p in peers):
        return [p.capacity for p in peers]
    return [float(p.batch_size) for p in peers]


@dataclass
class Peer:
    address: str
    split: int = -1
    bucket: int = -1
    pool: str = ""
    batch_size: int = 1
    capacity: float = 0.0
    """Inputs per second the pod (with the splits after it) can take, as it reports."""
    ready: bool = False
    running: int = 0
    """Inputs sent to this peer and not yet answered."""
    ratio_ewma: float = 1.0
    """EWMA of (observed service time / expected service time)."""
    slow_streak: int = 0
    straggler: bool = False
    last_probe: float = 0.0
    failures: int = 0
    info_timeouts: int = 0
    """Consecutive /v1/info probes that timed out."""
    last_seen: float = 0.0
    thresholds_key: tuple[int, str] = (0, "")
    """(version, digest) of the thresholds the pod last said it holds (`threshold_set.ThresholdSet.key`)."""
    full_batch_ms: float = 0.0
    """The pod's profiled service time for a full batch (the longest of its fitted lengths)."""
    ejections: int = 0
    ejected: bool = False
    """Taken out of rotation: a frame sent to it made no progress within the hedge bound; back when it
    answers its next /v1/info probe (outlier ejection)."""

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def take(self, info: WorkerInfo) -> None:
        """What a /v1/info probe of the peer said."""
        self.split, self.bucket, self.pool = info.split, info.bucket, info.pool
        self.batch_size, self.capacity, self.ready = info.batch_size, info.capacity, info.ready
        self.last_seen = time.monotonic()
        self.info_timeouts = 0
        self.thresholds_key = (info.thresholds_version, info.thresholds_digest)
        fits = info.expected_ms.values()
        self.full_batch_ms = max((f.get("a", 0.0) + f.get("b", 0.0) * self.batch_size for f in fits), default=0.0)
        if self.ejected:
            log.warning("peer %s answers its health check again: back in rotation", self.address)
            self.ejected = False


@dataclass
class StragglerPolicy:
    """Mark a peer a straggler after `streak` responses with the ratio EWMA above `mark`; clear below `clear`."""

    mark: float = 2.0
    clear: float = 1.3
    streak: int = 5
    ewma: float = 0.3
    probe_seconds: float = 2.0
    """A straggler still gets one send per this interval, so that its recovery can be seen."""
    hedge_floor_s: float = 0.25
    """A frame is not hedged before this (a pod's batch, the splits after it and a busy host's jitter)."""
    hedge_profile_factor: float = 4.0
    hedge_observed_factor: float = 2.0


@dataclass
class PeerSet:
    """The pods of one hop, refreshed from a peer spec; chooses the least-loaded capable one."""

    spec: list[tuple[str, int]]
    refresh_seconds: float = 2.0
    info_timeout_s: float = 1.0
    """How long a /v1/info probe may take; a pod that misses two in a row leaves the hop."""
    policy: StragglerPolicy = field(default_factory=StragglerPolicy)
    peers: dict[str, Peer] = field(default_factory=dict)
    on_straggler: Callable[[Peer], None] | None = None
    """Called when a peer is marked a straggler (the router counts it: exitplan_router_stragglers_marked_total)."""
    round_trips: deque[float] = field(default_factory=lambda: deque(maxlen=512))
    """The newest answered frames' round trips (s)."""
    _p99: float | None = field(default=None, repr=False)

    async def refresh(self, session: aiohttp.ClientSession) -> None:
        addresses = await resolve(self.spec)
        for gone in set(self.peers) - set(addresses):
            if self.peers[gone].running == 0:
                del self.peers[gone]
            else:
                self.peers[gone].ready = False

        async def probe(address: str) -> None:
            peer = self.peers.setdefault(address, Peer(address))
            try:
                async with session.get(
                    f"http://{address}/v1/info", timeout=aiohttp.ClientTimeout(total=self.info_timeout_s)
                ) as resp:
                    resp.raise_for_status()
                    peer.take(WorkerInfo.parse(await resp.read()))
            except TimeoutError:
                # A pod busy with a long batch can miss one probe; two in a row take it out of the hop.
                # (A pod that dies refuses the connection and leaves at once, below; sends to it fail over.)
                peer.info_timeouts += 1
                if peer.info_timeouts >= 2:
                    peer.ready = False
            except (aiohttp.ClientError, ValueError):  # refused, an error status, or not a WorkerInfo
                peer.ready = False

        await asyncio.gather(*(probe(a) for a in addresses))

    async def run(self, session: aiohttp.ClientSession, after: Callable[[], Awaitable[None]] | None = None) -> None:
        """Refresh every `refresh_seconds`; `after` runs after each refresh (a failure is logged)."""
        while True:
            await self.refresh(session)
            if after is not None:
                try:
                    await after()
                except Exception:
                    log.exception("after the refresh of the hop's pods")
            await asyncio.sleep(self.refresh_seconds)

    def candidates(self, bucket: int, split: int | None = None) -> list[Peer]:
        return [
            p for p in self.peers.values() if p.ready and p.bucket == bucket and (split is None or p.split == split)
        ]

    def choose(self, bucket: int, split: int | None = None, exclude: Iterable[str] = ()) -> Peer | None:
        """DensePipe's hop: least running/capacity among ready peers of the bucket, stragglers skipped
        unless every peer is a straggler."""
        excluded = set(exclude)
        cands = [p for p in self.candidates(bucket, split) if p.address not in excluded]
        if not cands:
            return None
        in_rotation = [p for p in cands if not p.ejected]
        cands = in_rotation or cands  # every one ejected: the least bad still beats no answer
        now = time.monotonic()
        for p in cands:
            if p.straggler and now - p.last_probe >= self.policy.probe_seconds:
                p.last_probe = now
                return p  # a probe: the only way to see a straggler recover
        skip: list[bool] | None = [p.straggler for p in cands]
        if skip is not None and all(skip):
            skip = None
        i = least_loaded([p.running for p in cands], hop_capacities(cands), skip)
        return cands[i] if i >= 0 else None

    def observe_round_trip(self, seconds: float) -> None:
        """One answered frame's round trip (send to answer, the splits after this hop included)."""
        self.round_trips.append(seconds)
        self._p99 = None

    def hedge_after_s(self, out: Iterable[Peer]) -> float:
        """How long a frame out to the pods `out` may go without an answer before it is sent to another
        pod too: the largest of the floor, `policy.hedge_profile_factor` x the pods' profiled time for a
        full batch (their /v1/info fits), and `policy.hedge_observed_factor` x the hop's observed p99
        round trip."""
        pol = self.policy
        profile_s = max((p.full_batch_ms for p in out), default=0.0) / 1000.0
        if self._p99 is None:
            self._p99 = float(np.percentile(self.round_trips, 99)) if len(self.round_trips) >= 20 else 0.0
        return max(pol.hedge_floor_s, pol.hedge_profile_factor * profile_s, pol.hedge_observed_factor * self._p99)

    def eject(self, peer: Peer, waited_s: float) -> None:
        """Take a pod that made no progress out of rotation until it answers its next /v1/info probe."""
        if not peer.ejected:
            peer.ejected = True
            peer.ejections += 1
            log.warning(
                "peer %s gave no answer within %.0f ms: out of rotation until it answers", peer.address, waited_s * 1000
            )

    def observe_service(self, peer: Peer, service_ms: float, expected_ms: float) -> None:
        """Feed one response's service time; updates the straggler mark."""
        if expected_ms <= 0:
            return
        pol = self.policy
        peer.ratio_ewma = (1 - pol.ewma) * peer.ratio_ewma + pol.ewma * (service_ms / expected_ms)
        if peer.ratio_ewma > pol.mark:
            peer.slow_streak += 1
            if peer.slow_streak >= pol.streak and not peer.straggler:
                peer.straggler = True
                peer.last_probe = time.monotonic()
                log.warning("peer %s marked straggler (service/expected %.2f)", peer.address, peer.ratio_ewma)
                if self.on_straggler is not None:
                    self.on_straggler(peer)
        else:
            peer.slow_streak = 0
            if peer.straggler and peer.ratio_ewma < pol.clear:
                peer.straggler = False
                log.warning("peer %s recovered (service/expected %.2f)", peer.address, peer.ratio_ewma)

    def snapshot(self) -> list[dict[str, Any]]:
        """The pods as GET /v1/peers shows them."""
        return [
            {
                "address": p.address,
                "split": p.split,
                "bucket": p.bucket,
                "pool": p.pool,
                "ready": p.ready,
                "running": p.running,
                "batchSize": p.batch_size,
                "capacity": round(p.capacity, 3),
                "serviceRatio": round(p.ratio_ewma, 3),
                "straggler": p.straggler,
                "failures": p.failures,
                "ejected": p.ejected,
                "ejections": p.ejections,
            }
            for p in sorted(self.peers.values(), key=lambda p: p.address)
        ]
