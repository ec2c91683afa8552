"""Sending a frame to the next hop, with retries on other pods and straggler tracking.

Used by the router (to split 0) and by every worker but the last (to the next split). A send picks
the least-loaded ready pod of the bucket (DensePipe), counts the inputs it carries as that pod's
running load until the answer arrives, feeds the pod's reported service time into the straggler
detector, and on a connection failure or a 5xx retries on another pod until the hard timeout.

Frames travel as HTTP/1.1 POSTs to the pod's /v1/run over kept-alive connections (`HopClient`): a
request is written in one piece and its answer parsed as it arrives by httptools (llhttp, the
parser uvicorn uses), without a general-purpose client's per-request machinery (URL parsing, cookie
jar, header multidicts, a writer task), which cost ~0.35 ms of the ~1 ms a frame round trip takes
on a 2-core VM after an idle gap.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import httptools
import numpy as np

from exitplan.worker_image import wire
from exitplan.worker_image.peer_choice import Peer, PeerSet
from exitplan.worker_image.wire import HopAnswer, HopItem, HopRequest

log = logging.getLogger(__name__)


class NoPeer(RuntimeError):
    """No ready pod can take the frame (the message says which split and bucket)."""


class HopFailed(RuntimeError):
    """Every attempt failed before the timeout."""


class HopConnectionError(ConnectionError):
    """A connection to a pod failed, closed early or answered something that is not HTTP/1.1."""


class PodError(ConnectionError):
    """A pod answered 5xx (another pod may succeed)."""


_SINGLE_WRITE_MAX = 256 << 10
"""Bodies up to this size are sent with the request head in one write (one segment, one wake-up of the
pod); larger ones are written after the head rather than copied."""


class _Connection(asyncio.Protocol):
    """One kept-alive connection to a pod; carries one request at a time."""

    def __init__(self, client: HopClient, address: str) -> None:
        self.client = client
        self.address = address
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reusable = True
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.reset()

    def reset(self) -> None:
        """A fresh response parser (httptools, llhttp) for the next exchange."""
        self.parser = httptools.HttpResponseParser(self)
        self.body: list[bytes] = []
        self.headers_done = False
        self.complete = False
        self.delimited = False  # Content-Length or chunked (else the body ends when the pod closes)
        self.got_data = False

    # asyncio.Protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        waiter = self.waiter
        if waiter is None or waiter.done():
            self.reusable = False  # bytes nobody asked for: this connection is out of step
            self.abort()
            return
        self.got_data = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as err:
            self.reusable = False
            waiter.set_exception(HopConnectionError(f"{self.address} answered malformed HTTP: {err}"))
            self.abort()
            return
        if self.complete and not waiter.done():
            waiter.set_result((self.parser.get_status_code(), b"".join(self.body)))

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.client._forget(self)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            if self.headers_done and not self.delimited:
                waiter.set_result((self.parser.get_status_code(), b"".join(self.body)))  # body delimited by close
            else:
                waiter.set_exception(
                    HopConnectionError(
                        f"connection to {self.address} closed before the answer{f': {exc}' if exc else ''}"
                    )
                )

    # httptools callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:  # a second answer to one request
            raise httptools.HttpParserError("bytes after the answer's body")

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self.delimited = True

    def on_headers_complete(self) -> None:
        self.headers_done = True
        self.reusable = self.reusable and self.parser.should_keep_alive()  # HTTP/1.1 without Connection: close
        if not self.delimited and self.parser.get_status_code() not in (204, 304):
            self.reusable = False  # the body ends when the pod closes the connection

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True

    # use ------------------------------------------------------------------------------------

    def abort(self) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.abort()


class HopClient:
    """POSTs frames to pods over kept-alive HTTP/1.1 connections, pooled per pod address.

    A connection carries one request at a time; concurrent sends to one pod open more connections
    (up to `max_idle` are kept per pod afterwards). A kept connection that the pod closed while idle
    is detected before use, or retried once on a fresh connection when it fails before any answer
    byte arrives (the usual keep-alive race). `token`: the service's control token, sent with every
    request (a pod's /v1/run answers only requests that carry it).
    """

    def __init__(self, max_idle: int = 64, token: str | None = None) -> None:
        self.max_idle = max_idle
        self._auth = f"Authorization: Bearer {token}\r\n" if token else ""
        self.idle: dict[str, list[_Connection]] = {}
        self.closed = False

    def _forget(self, conn: _Connection) -> None:
        pool = self.idle.get(conn.address)
        if pool and conn in pool:
            pool.remove(conn)

    async def _connect(self, address: str) -> _Connection:
        host, _, port = address.rpartition(":")
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(lambda: _Connection(self, address), host.strip("[]"), int(port))
        except OSError as err:
            raise HopConnectionError(f"cannot connect to {address}: {err}") from err
        return conn

    async def post(self, address: str, path: str, body: bytes, content_type: str, timeout: float) -> tuple[int, bytes]:
        """(status, body) of one POST; raises HopConnectionError or TimeoutError."""
        if self.closed:
            raise HopConnectionError("the hop client is closed")
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: {content_type}\r\n{self._auth}"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode("latin-1")
        async with asyncio.timeout(timeout):
            pool = self.idle.get(address)
            reused = bool(pool)
            conn = pool.pop() if pool else await self._connect(address)
            try:
                return await self._exchange(conn, head, body)
            except HopConnectionError:
                if not (reused and not conn.got_data):
                    raise
            # The pod closed the kept connection as we wrote: once more on a new one.
            return await self._exchange(await self._connect(address), head, body)

    async def _exchange(self, conn: _Connection, head: bytes, body: bytes) -> tuple[int, bytes]:
        assert conn.transport is not None
        conn.reset()
        conn.waiter = asyncio.get_running_loop().create_future()
        try:
            if len(body) <= _SINGLE_WRITE_MAX:
                conn.transport.write(head + body)
            else:
                conn.transport.write(head)
                conn.transport.write(body)
            result = await conn.waiter
        except BaseException:
            conn.abort()  # cancelled or failed mid-request: the connection is out of step
            raise
        finally:
            conn.waiter = None
        self._release(conn)
        return result

    def _release(self, conn: _Connection) -> None:
        if conn.closed:
            return
        pool = self.idle.setdefault(conn.address, [])
        if not conn.reusable or self.closed or len(pool) >= self.max_idle:
            assert conn.transport is not None
            conn.transport.close()
            return
        pool.append(conn)

    async def close(self) -> None:
        self.closed = True
        for pool in self.idle.values():
            for conn in list(pool):
                if conn.transport is not None:
                    conn.transport.close()
        self.idle.clear()


async def _attempt(
    client: HopClient, peers: PeerSet, peer: Peer, body: bytes, rows: int, timeout_at: float
) -> tuple[HopAnswer, dict[str, np.ndarray], Peer]:
    """One POST of the frame to `peer`; its rows count as the peer's load while it is out."""
    peer.running += rows
    sent = time.monotonic()
    try:
        status, payload = await client.post(peer.address, "/v1/run", body, wire.CONTENT_TYPE, timeout_at - time.time())
        if status >= 500:
            raise PodError(f"HTTP {status}: {payload[:200].decode(errors='replace')}")
        if status != 200:
            # A 4xx is our bug or a version skew: another pod would answer the same.
            raise HopFailed(
                f"pod {peer.address} rejected the frame ({status}): {payload[:300].decode(errors='replace')}"
            )
        out_meta, out_tensors = wire.decode(payload)
        answer = HopAnswer.from_meta(out_meta)
        peer.failures = 0
        peers.observe_service(peer, answer.service_ms, answer.expected_ms)
        peers.observe_round_trip(time.monotonic() - sent)
        return answer, out_tensors, peer
    finally:
        peer.running -= rows


async def send(
    client: HopClient,
    peers: PeerSet,
    *,
    bucket: int,
    split: int | None,
    items: Sequence[HopItem],
    tensors: dict[str, np.ndarray],
    timeout_at: float,
    attempts: int = 3,
) -> tuple[HopAnswer, dict[str, np.ndarray], Peer]:
    """POST a frame of `items` (row i of `tensors` is item i) to /v1/run of a pod of (split, bucket);
    (answer, tensors, pod) of the first answer.

    A pod that fails (connection, 5xx) is followed by another; a pod that makes no progress within
    the hedge bound (`PeerSet.hedge_after_s`: derived from its profile and the hop's observed round
    trips, with a floor) is taken out of rotation (`PeerSet.eject`, until it answers its health check)
    and the frame is also sent to another ready pod: the first answer wins, the other is cancelled.
    At most `attempts` pods are tried."""
    body = wire.encode(HopRequest(items, bucket).to_meta(), tensors)
    rows = len(items)
    tried: list[str] = []
    out: dict[asyncio.Task[tuple[HopAnswer, dict[str, np.ndarray], Peer]], Peer] = {}
    last_error = ""

    def launch() -> bool:
        if len(tried) >= attempts:
            return False
        peer = peers.choose(bucket, split, exclude=tried)
        if peer is None:
            return False
        tried.append(peer.address)
        out[asyncio.ensure_future(_attempt(client, peers, peer, body, rows, timeout_at))] = peer
        return True

    try:
        if time.time() >= timeout_at:
            raise HopFailed(f"timed out before reaching a pod of split {split} bucket {bucket}")
        if not launch():
            raise NoPeer(f"no ready worker for split {split} bucket {bucket}")
        hedge = True
        while out:
            remaining = timeout_at - time.time()
            if remaining <= 0:
                break
            # (never later than half the time left: a hedge must have time to answer)
            wait = min(remaining / 2, peers.hedge_after_s(out.values())) if hedge else remaining
            done, _ = await asyncio.wait(out, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            if not done:  # no progress within the bound: eject the stalled pods, hedge on another one
                for peer in out.values():
                    peers.eject(peer, wait)
                hedge = launch()
                if not hedge:
                    log.warning(
                        "no other pod of split %s bucket %s to hedge on (%d tried, ready: %s)",
                        split,
                        bucket,
                        len(tried),
                        [p.address for p in peers.candidates(bucket, split)],
                    )
                continue
            for task in done:
                peer = out.pop(task)
                try:
                    return task.result()
                except (ConnectionError, TimeoutError, wire.WireError) as err:
                    peer.failures += 1
                    peer.ready = peer.failures < 3 and peer.ready
                    last_error = f"{peer.address}: {type(err).__name__}: {err}"
                    log.warning("send to %s failed (%s); trying another pod", peer.address, last_error)
            if not out:
                launch()
        if last_error:
            raise HopFailed(f"every pod tried for split {split} bucket {bucket} failed; last: {last_error}")
        raise HopFailed(f"no pod of split {split} bucket {bucket} answered before the request's timeout")
    finally:
        for task in out:
            task.cancel()
