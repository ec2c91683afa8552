"""The hop client: kept-alive HTTP/1.1 POSTs to pods, against a real aiohttp server and raw sockets.

Covers connection reuse, a pod that closes an idle kept connection (retried on a new one), a pod
that dies (typed error), chunked and close-delimited answers, a timeout, and `send` retrying a 5xx on
another pod with the straggler bookkeeping intact.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from aiohttp import web

from exitplan.worker_image import wire
from exitplan.worker_image.hop_client import HopClient, HopConnectionError, HopFailed, send
from exitplan.worker_image.peer_choice import Peer, PeerSet
from exitplan.worker_image.wire import HopItem


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"127.0.0.1:{port}"


def _echo_app(seen: list) -> web.Application:
    async def run(request: web.Request) -> web.Response:
        body = await request.read()
        seen.append((request.transport.get_extra_info("peername"), request.headers.get("Content-Type"), len(body)))
        return web.Response(body=body[::-1], content_type="application/octet-stream")

    app = web.Application(client_max_size=64 << 20)
    app.add_routes([web.post("/v1/run", run)])
    return app


async def test_posts_reuse_one_connection_and_carry_the_body():
    seen: list = []
    runner, address = await _serve(_echo_app(seen))
    client = HopClient()
    try:
        for k in range(5):
            body = bytes(range(k, k + 50))
            status, answer = await client.post(address, "/v1/run", body, "application/x-test", 5.0)
            assert status == 200 and answer == body[::-1]
        big = np.random.default_rng(0).bytes(1 << 20)  # above the single-write size: head and body apart
        status, answer = await client.post(address, "/v1/run", big, "application/x-test", 5.0)
        assert status == 200 and answer == big[::-1]
    finally:
        await client.close()
        await runner.cleanup()
    assert len({peer for peer, _, _ in seen}) == 1  # every request on the same kept connection
    assert all(ctype == "application/x-test" for _, ctype, _ in seen)
    assert seen[-1][2] == 1 << 20


async def test_concurrent_posts_open_more_connections_and_keep_them():
    seen: list = []
    gate = asyncio.Event()

    async def run(request: web.Request) -> web.Response:
        seen.append(request.transport.get_extra_info("peername"))
        if len(seen) >= 3:
            gate.set()
        await gate.wait()
        return web.Response(body=await request.read())

    app = web.Application()
    app.add_routes([web.post("/v1/run", run)])
    runner, address = await _serve(app)
    client = HopClient()
    try:
        answers = await asyncio.gather(*(client.post(address, "/v1/run", b"x%d" % i, "a/b", 5.0) for i in range(3)))
        assert sorted(a for _, a in answers) == [b"x0", b"x1", b"x2"]
        assert len(client.idle[address]) == 3
        await client.post(address, "/v1/run", b"again", "a/b", 5.0)
        assert seen[-1] in seen[:3]  # a kept connection served it
    finally:
        await client.close()
        await runner.cleanup()


async def test_a_kept_connection_the_pod_closed_is_replaced():
    seen: list = []
    runner, address = await _serve(_echo_app(seen))
    client = HopClient()
    try:
        await client.post(address, "/v1/run", b"one", "a/b", 5.0)
        (conn,) = client.idle[address]
        conn.transport.close()  # as a pod's keep-alive timeout would
        await asyncio.sleep(0.05)
        status, answer = await client.post(address, "/v1/run", b"two", "a/b", 5.0)
        assert (status, answer) == (200, b"owt")
    finally:
        await client.close()
        await runner.cleanup()


async def test_a_pod_that_closes_after_each_answer_unannounced_is_still_served():
    """The kept connection is dead by the next send (seen at once, or only when the write fails):
    either way the request goes out on a fresh connection and is answered."""
    server, address = await _raw_server(
        lambda request: (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n" + request[-2:], True)
    )
    client = HopClient()
    try:
        for k in range(6):
            assert await client.post(address, "/v1/run", b"r%d" % k, "a/b", 5.0) == (200, b"r%d" % k)
    finally:
        await client.close()
        server.close()
        await server.wait_closed()


async def _raw_server(respond) -> tuple[asyncio.Server, str]:
    """A TCP server that reads one request head + body and answers with `respond(request_bytes)`."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                body = await reader.readexactly(length)
                reply, close = respond(head + body)
                writer.write(reply)
                await writer.drain()
                if close:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def test_chunked_and_close_delimited_answers():
    replies = iter(
        [
            (
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6;x=1\r\n world\r\n0\r\nX-T: 1\r\n\r\n",
                False,
            ),
            (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\nConnection: close\r\n\r\nbusy", True),
            (b"HTTP/1.0 200 OK\r\n\r\nuntil the end", True),
        ]
    )
    server, address = await _raw_server(lambda _: next(replies))
    client = HopClient()
    try:
        assert await client.post(address, "/v1/run", b"a", "a/b", 5.0) == (200, b"hello world")
        assert len(client.idle[address]) == 1  # chunked and HTTP/1.1: kept
        assert await client.post(address, "/v1/run", b"b", "a/b", 5.0) == (503, b"busy")
        assert client.idle[address] == []  # Connection: close is honoured
        assert await client.post(address, "/v1/run", b"c", "a/b", 5.0) == (200, b"until the end")
    finally:
        await client.close()
        server.close()
        await server.wait_closed()


async def test_garbage_answer_and_dead_pod_raise_typed_errors():
    server, address = await _raw_server(lambda _: (b"SPDY/9 nonsense\r\n\r\n", False))
    client = HopClient()
    try:
        with pytest.raises(HopConnectionError, match="malformed HTTP"):
            await client.post(address, "/v1/run", b"a", "a/b", 5.0)
    finally:
        server.close()
        await server.wait_closed()
    with pytest.raises(HopConnectionError, match="cannot connect"):
        await client.post(address, "/v1/run", b"a", "a/b", 5.0)
    await client.close()


async def test_timeout_raises_and_drops_the_connection():
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.Response(body=b"late")

    app = web.Application()
    app.add_routes([web.post("/v1/run", slow)])
    runner, address = await _serve(app)
    client = HopClient()
    try:
        with pytest.raises(TimeoutError):
            await client.post(address, "/v1/run", b"a", "a/b", 0.2)
        assert not client.idle.get(address)  # a connection with an answer still due is never reused
    finally:
        await client.close()
        await runner.cleanup()


async def test_send_retries_a_5xx_on_another_pod_and_observes_service_time():
    calls: list[str] = []

    def app(name: str, status: int) -> web.Application:
        async def run(request: web.Request) -> web.Response:
            meta, tensors = wire.decode(await request.read())
            calls.append(name)
            if status != 200:
                return web.Response(status=status, text="worker is warming up")
            out = {
                "results": [{"id": i["id"], "ramp": "final", "final": True} for i in meta["items"]],
                "service_ms": 3.0,
                "expected_ms": 1.0,
            }
            return web.Response(body=wire.encode(out, {"logits": tensors["x"] * 2}), content_type=wire.CONTENT_TYPE)

        a = web.Application()
        a.add_routes([web.post("/v1/run", run)])
        return a

    bad, bad_address = await _serve(app("bad", 503))
    good, good_address = await _serve(app("good", 200))
    peers = PeerSet([])
    for address, running in ((bad_address, 0), (good_address, 4)):  # the bad pod is the least loaded: chosen first
        peers.peers[address] = Peer(address, split=0, bucket=16, batch_size=8, ready=True, running=running)
    client = HopClient()
    try:
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        answer, tensors, peer = await send(
            client,
            peers,
            bucket=16,
            split=0,
            items=[HopItem("a"), HopItem("b")],
            tensors={"x": x},
            timeout_at=time.time() + 5,
        )
        assert calls == ["bad", "good"] and peer.address == good_address
        np.testing.assert_array_equal(tensors["logits"], x * 2)
        assert [r.id for r in answer.results] == ["a", "b"]
        assert peers.peers[bad_address].failures == 1 and peers.peers[good_address].ratio_ewma > 1.0
        assert [peers.peers[a].running for a in (bad_address, good_address)] == [0, 4]  # each send's load released
        peers.peers[good_address].ready = False
        with pytest.raises(HopFailed, match="503"):
            await send(
                client,
                peers,
                bucket=16,
                split=0,
                items=[HopItem("c")],
                tensors={"x": x[:1]},
                timeout_at=time.time() + 5,
            )
    finally:
        await client.close()
        await bad.cleanup()
        await good.cleanup()
