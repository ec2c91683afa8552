"""The front of several local routers: what the router Service (kube-proxy) is in a cluster.

`exitplan up --routers N` runs N router processes, each on a port of its own, and this front on the
service's port. Like kube-proxy it balances connections, not requests: each client connection is
piped, both ways, to one router, the next ready one in turn. A router is ready while its
/v2/health/ready answers 200 (asked every `probe_s`, as the kubelet's readiness probe feeds the
Service's endpoints); a router that drains (SIGTERM) answers 503 and gets no new connections, though
the connections it holds stay with it until it closes them, as in a cluster. A router that refuses
the connection (it died, or closed its listener) is skipped for the next one: the client sent
nothing yet. When no router is ready, every one is tried.

The front runs its own event loop on a thread of the process that starts it.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import aiohttp

from exitplan.client.open_files import raise_open_files_limit

log = logging.getLogger(__name__)
CHUNK = 1 << 16


class Front:
    def __init__(self, port: int, backends: list[tuple[str, int]], *, host: str = "127.0.0.1", probe_s: float = 0.5):
        if not backends:
            raise ValueError("the front needs at least one router")
        self.host, self.port, self.backends, self.probe_s = host, port, list(backends), probe_s
        self.ready = [False] * len(backends)
        self.connections = [0] * len(backends)
        """Client connections piped to each router now."""
        self._next = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._pipes: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------ lifecycle (caller's thread)

    def start(self) -> None:
        """Listen on the port (OSError when it is taken) and start balancing."""
        raise_open_files_limit()  # two descriptors per piped connection, beside the process's own
        self._thread = threading.Thread(target=self._run, name=f"front-{self.port}", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join()

    def __enter__(self) -> Front:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ the front's thread

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as err:  # reported to start() when it failed to listen
            self._error = err
            self._started.set()
        finally:
            self._loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._client, self.host, self.port, reuse_address=True, backlog=1024)
        async with aiohttp.ClientSession() as session:
            await self._probe(session)
            prober = asyncio.create_task(self._probe_loop(session))
            self._started.set()
            await self._stop.wait()
            prober.cancel()
            server.close()
            for task in list(self._pipes):
                task.cancel()
            await asyncio.gather(prober, *self._pipes, return_exceptions=True)

    async def _probe(self, session: aiohttp.ClientSession) -> None:
        async def one(i: int, host: str, port: int) -> None:
            try:
                async with session.get(
                    f"http://{host}:{port}/v2/health/ready", timeout=aiohttp.ClientTimeout(total=1.0)
                ) as resp:
                    ready = resp.status == 200
            except (aiohttp.ClientError, OSError, TimeoutError):
                ready = False
            if ready != self.ready[i]:
                log.info("router %s:%d %s", host, port, "ready" if ready else "not ready")
            self.ready[i] = ready

        await asyncio.gather(*(one(i, h, p) for i, (h, p) in enumerate(self.backends)))

    async def _probe_loop(self, session: aiohttp.ClientSession) -> None:
        while True:
            await asyncio.sleep(self.probe_s)
            await self._probe(session)

    def order(self) -> list[int]:
        """The routers to try for a new connection: the ready ones from the next in turn, then the others."""
        n = len(self.backends)
        start = self._next
        self._next = (self._next + 1) % n
        turn = [(start + k) % n for k in range(n)]
        return [i for i in turn if self.ready[i]] + [i for i in turn if not self.ready[i]]

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._pipes.add(task)
        try:
            for i in self.order():
                host, port = self.backends[i]
                try:
                    up_reader, up_writer = await asyncio.open_connection(host, port)
                except OSError:
                    self.ready[i] = False  # refused: it died or stopped listening
                    continue
                self.connections[i] += 1
                try:
                    await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
                finally:
                    self.connections[i] -= 1
                    up_writer.close()
                return
        finally:
            writer.close()
            self._pipes.discard(task)


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    """Copy src to dst until src ends (then half-close dst) or either side fails (then reset dst)."""
    try:
        while data := await src.read(CHUNK):
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()
    except (ConnectionError, OSError):
        dst.transport.abort()
    except asyncio.CancelledError:
        dst.transport.abort()
        raise
