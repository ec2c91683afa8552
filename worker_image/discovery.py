"""Finding the pods of the next hop and choosing among them.

A peer spec is a comma-separated list of `host:port`. Hostnames are re-resolved every refresh: when
the environment variable EXITPLAN_RESOLVE_FILE names a JSON file {"host": ["ip:port", ...]} the
mapping there wins (the local pod runner's stand-in for the cluster DNS of headless Services);
otherwise every DNS A record of the host is a peer (a headless Service resolves to its ready pods).

Each peer is asked for `/v1/info` (split, bucket, pool, batch size, readiness). Senders keep per-peer
load (inputs in flight) and service-time statistics; a peer whose service time stays well above
what its profile promises is marked a straggler (E3) and skipped for next hops until it recovers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import aiohttp

from exitplan.planner.dispatch import least_loaded

log = logging.getLogger(__name__)

RESOLVE_FILE_ENV = "EXITPLAN_RESOLVE_FILE"


def parse_peer_spec(spec: str | None) -> list[tuple[str, int]]:
    """[(host, port)] from "a:1,b:2"; raises ValueError naming the bad entry."""
    out: list[tuple[str, int]] = []
    for entry in (spec or "").split(","):
        entry = entry.strip()
        if not entry:
            continue
        host, sep, port = entry.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"peer {entry!r}: expected host:port")
        out.append((host, int(port)))
    return out


def _resolve_file() -> dict[str, list[str]]:
    path = os.environ.get(RESOLVE_FILE_ENV)
    if not path:
        return {}
    try:
        with open(path) as fh:
            data = json.load(fh)
        return {str(k): [str(v) for v in vs] for k, vs in data.items()}
    except (OSError, ValueError, AttributeError) as err:
        log.warning("cannot read %s=%s: %s", RESOLVE_FILE_ENV, path, err)
        return {}


async def resolve(spec: list[tuple[str, int]]) -> list[str]:
    """Every `ip:port` the spec names right now (duplicates removed, order kept)."""
    mapping = _resolve_file()
    loop = asyncio.get_running_loop()
    found: list[str] = []
    for host, port in spec:
        if host in mapping:
            found.extend(mapping[host])
            continue
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, family=socket.AF_INET)
        except OSError as err:
            log.debug("resolving %s: %s", host, err)
            continue
        found.extend(f"{info[4][0]}:{port}" for info in infos)
    return list(dict.fromkeys(found))


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

    @property
    def url(self) -> str:
        return f"http://{self.address}"


@dataclass
class StragglerPolicy:
    """Mark a peer a straggler after `streak` responses with the ratio EWMA above `mark`; clear below `clear`."""

    mark: float = 2.0
    clear: float = 1.3
    streak: int = 5
    ewma: float = 0.3
    probe_seconds: float = 2.0
    """A straggler still gets one send per this interval, so that its recovery can be seen."""


@dataclass
class PeerSet:
    """The pods of one hop, refreshed from a peer spec; chooses the least-loaded capable one."""

    spec: list[tuple[str, int]]
    refresh_seconds: float = 2.0
    info_timeout_s: float = 1.0
    """How long a /v1/info probe may take; a pod that misses two in a row leaves the hop."""
    policy: StragglerPolicy = field(default_factory=StragglerPolicy)
    peers: dict[str, Peer] = field(default_factory=dict)

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
                    info = await resp.json()
                peer.split, peer.bucket, peer.pool = int(info["split"]), int(info["bucket"]), str(info.get("pool", ""))
                peer.batch_size = int(info.get("batchSize", 1))
                peer.capacity = float(info.get("capacity", 0.0))
                peer.ready = bool(info.get("ready", False))
                peer.last_seen = time.monotonic()
                peer.info_timeouts = 0
            except TimeoutError:
                # A pod busy with a long batch can miss one probe; two in a row take it out of the hop.
                # (A pod that dies refuses the connection and leaves at once, below; sends to it fail over.)
                peer.info_timeouts += 1
                if peer.info_timeouts >= 2:
                    peer.ready = False
            except (aiohttp.ClientError, ValueError, KeyError, TypeError):
                peer.ready = False

        await asyncio.gather(*(probe(a) for a in addresses))

    async def run(self, session: aiohttp.ClientSession) -> None:
        while True:
            await self.refresh(session)
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
        now = time.monotonic()
        for p in cands:
            if p.straggler and now - p.last_probe >= self.policy.probe_seconds:
                p.last_probe = now
                return p  # a probe: the only way to see a straggler recover
        skip = [p.straggler for p in cands]
        if all(skip):
            skip = None
        i = least_loaded([p.running for p in cands], hop_capacities(cands), skip)
        return cands[i] if i >= 0 else None

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
        else:
            peer.slow_streak = 0
            if peer.straggler and peer.ratio_ewma < pol.clear:
                peer.straggler = False
                log.warning("peer %s recovered (service/expected %.2f)", peer.address, peer.ratio_ewma)

    def snapshot(self) -> list[dict]:
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
            }
            for p in sorted(self.peers.values(), key=lambda p: p.address)
        ]


class ReplyTargets:
    """Where a worker may post shadow feedback: the routers its plan names (`Plan.routers`, host:port
    entries resolved like peers, so a headless Service stands for its router pods). A frame whose
    reply_to is not among them is refused: a worker answers only to the service's own routers."""

    def __init__(self, entries: Iterable[str] = (), min_interval_s: float = 1.0) -> None:
        self.min_interval_s = min_interval_s
        self.set(entries)

    def set(self, entries: Iterable[str]) -> None:
        self.entries = [e for e in entries if e]
        self.spec = parse_peer_spec(",".join(self.entries))
        self.known: set[str] = set(self.entries)
        self.resolved_at = -float("inf")

    async def refresh(self) -> None:
        self.resolved_at = time.monotonic()
        self.known = set(self.entries) | set(await resolve(self.spec))

    async def allows(self, address: str) -> bool:
        """True when `address` is a router the plan names (re-resolved, at most once per
        min_interval_s, when it is not among the addresses resolved so far: a new router pod)."""
        if address in self.known:
            return True
        if self.spec and time.monotonic() - self.resolved_at >= self.min_interval_s:
            await self.refresh()
        return address in self.known
