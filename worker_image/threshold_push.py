"""Handing a versioned threshold set (`threshold_set.py`) on to the pods of the next hop.

A router pushes the set in force to every ready split-0 pod when it changes, and each pod pushes it
down its chain; a pod that missed a push (it was restarting, or stalled) reports an older version in
its next /v1/info, and the sender pushes it again then (`catch_up`): every pod that decides exits
converges on the sender's set within one probe period.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import aiohttp

from exitplan.worker_image.control_client import ControlClient
from exitplan.worker_image.peer_choice import Peer, PeerSet
from exitplan.worker_image.threshold_set import ThresholdHolder, ThresholdSet

log = logging.getLogger(__name__)


async def push_to_peers(session: aiohttp.ClientSession, peers: Iterable[Peer], new: ThresholdSet, reason: str) -> None:
    """POST `new` (replacing, at its version) to every ready pod among `peers`; a failure is logged
    (the pod gets it again at its next probe)."""
    targets = [p for p in peers if p.ready]
    results = await asyncio.gather(
        *(ControlClient(p.url, session=session, timeout_s=2.0).push_set(new, reason) for p in targets),
        return_exceptions=True,
    )
    for peer, result in zip(targets, results):
        if isinstance(result, BaseException):
            log.warning("threshold push to %s failed: %s", peer.address, result)
        else:
            peer.thresholds_key = result.key()


async def catch_up(session: aiohttp.ClientSession, peers: PeerSet, holder: ThresholdHolder) -> None:
    """Push the set in force to every ready pod whose last probe reported an older set, under the reason
    it was made for (the pod counts the change it missed, not the way it reached it)."""
    current = holder.current
    behind = [p for p in peers.peers.values() if p.ready and p.thresholds_key < current.key()]
    if behind:
        await push_to_peers(session, behind, current, holder.reason)
