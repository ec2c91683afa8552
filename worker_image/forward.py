"""Sending a frame to the next hop, with retries on other pods and straggler tracking.

Used by the router (to split 0) and by every worker but the last (to the next split). A send picks
the least-loaded ready pod of the bucket (DensePipe), counts the inputs it carries as that pod's
running load until the answer arrives, feeds the pod's reported service time into the straggler
detector, and on a connection failure or a 5xx retries on another pod until the hard timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import numpy as np

from . import wire
from .discovery import Peer, PeerSet

log = logging.getLogger(__name__)


class NoPeer(RuntimeError):
    """No ready pod can take the frame (the message says which split and bucket)."""


class HopFailed(RuntimeError):
    """Every attempt failed before the timeout."""


async def send(
    session: aiohttp.ClientSession,
    peers: PeerSet,
    *,
    bucket: int,
    split: int | None,
    meta: dict,
    tensors: dict[str, np.ndarray],
    rows: int,
    timeout_at: float,
    attempts: int = 3,
) -> tuple[dict, dict[str, np.ndarray], Peer]:
    """POST the frame to /v1/run of a pod of (split, bucket); (meta, tensors, pod) of its answer."""
    body = wire.encode(meta, tensors)
    tried: list[str] = []
    last_error = ""
    for _ in range(attempts):
        peer = peers.choose(bucket, split, exclude=tried)
        if peer is None:
            break
        remaining = timeout_at - time.time()
        if remaining <= 0:
            raise HopFailed(f"timed out before reaching a pod of split {split} bucket {bucket}")
        tried.append(peer.address)
        peer.running += rows
        try:
            async with session.post(
                f"{peer.url}/v1/run",
                data=body,
                headers={"Content-Type": wire.CONTENT_TYPE},
                timeout=aiohttp.ClientTimeout(total=remaining),
            ) as resp:
                payload = await resp.read()
                if resp.status >= 500:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status, message=payload[:200].decode(errors="replace"))
                if resp.status != 200:
                    # A 4xx is our bug or a version skew: another pod would answer the same.
                    raise HopFailed(f"pod {peer.address} rejected the frame ({resp.status}): {payload[:300].decode(errors='replace')}")
            out_meta, out_tensors = wire.decode(payload)
            peer.failures = 0
            peers.observe_service(peer, float(out_meta.get("service_ms", 0.0)), float(out_meta.get("expected_ms", 0.0)))
            return out_meta, out_tensors, peer
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, wire.WireError) as err:
            peer.failures += 1
            peer.ready = peer.failures < 3 and peer.ready
            last_error = f"{peer.address}: {type(err).__name__}: {err}"
            log.warning("send to %s failed (%s); trying another pod", peer.address, last_error)
        finally:
            peer.running -= rows
    if not tried:
        raise NoPeer(f"no ready worker for split {split} bucket {bucket}")
    raise HopFailed(f"every pod tried for split {split} bucket {bucket} failed; last: {last_error}")
