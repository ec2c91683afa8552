"""What every exitplan HTTP server (routers, workers) holds its clients to, and its drain on SIGTERM.

aiohttp closes a kept-alive connection that stays idle (`keepalive_timeout`) and bounds the size of
a request's head (`max_line_size`, `max_field_size`), but it has no deadline for the head or for the
body and no limit on open connections: a client that opens connections and sends nothing, or drips
its headers or its body, would hold them (and a file descriptor each) for as long as it likes.
`serve.serve` runs every app behind the pieces of this module:

| limit | how | what the client sees |
|---|---|---|
| header timeout | `GuardedHandler`: a timer armed when a connection opens and at the first byte of each later request, cancelled when the request's head is complete | the connection is closed, no answer (as Go's `ReadHeaderTimeout`, nginx's `client_header_timeout`) |
| idle keep-alive | aiohttp's own `keepalive_timeout`, from the end of an answer to the first byte of the next request | the idle connection is closed |
| body timeout | `Guard.handle`: a request whose body is not all there when its head is, must deliver it within the timeout; at the deadline the handler (still reading it) is cancelled | 408, `Connection: close` |
| connection limit | `GuardedHandler.connection_made`: a connection past `max_connections` open ones is answered at once and closed, never read (held open a second for the answer to be read, unless `MAX_LINGERING` already are); a router's control port has its own guard and `control_max_connections` (auth.ControlPlane); both fit the process's file descriptors (server_limits.within_fd_limit) | 503 with `Retry-After: 1`, `Connection: close` |
| errors as JSON | `Guard.wrap` answers aiohttp's own 4xx (no such route, method not allowed, ...) as `{"error": ...}`; `GuardedHandler.handle_error` answers a request aiohttp cannot parse (400, 431, ...) the same way, logged as one rate-limited line (request_body.CLIENT_ERRORS) | a JSON 4xx, `Connection: close` where the request could not be parsed |
| compressed bodies | `GuardedRunner` turns aiohttp's decompression off; request_body.read_body inflates within the body limit | 413 / 400 / 415 (request_body.py) |
| drain | `Guard.begin_drain` (SIGTERM, see serve.py): readiness paths answer 503, every answer carries `Connection: close`, in-flight requests are counted until none is left | clients move to other replicas |

The header timer needs to know when the server waits for a head: it reads two attributes of
aiohttp's `RequestHandler` (`_waiter`, pending while the connection waits for its next request's
head; `_request_count`, the heads parsed so far), as aiohttp's own keep-alive check does. aiohttp
is pinned (pyproject.toml); tests/test_request_reading.py exercises each limit on a real router.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from exitplan.worker_image.protocol import error_response
from exitplan.worker_image.request_body import CLIENT_ERRORS, every_power_of_two, one_line
from exitplan.worker_image.server_limits import MAX_LINGERING, ServerLimits

log = logging.getLogger(__name__)

Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]
"""aiohttp's low-level request handler."""

REFUSED_LINGER_S = 1.0
"""How long a refused connection stays open after its 503 (so that the answer is read, not reset)."""
LIMITS: web.AppKey[ServerLimits] = web.AppKey("exitplan_server_limits", ServerLimits)
"""The limits the app is served with (serve.py sets it; a second listener, the control port, reads it)."""


async def as_json(handler: Handler, request: web.BaseRequest) -> web.StreamResponse:
    """`handler`'s answer, aiohttp's own 4xx (raised: no such route, method not allowed, body too
    large for request.read()) as a JSON `{"error": ...}` with their headers (Allow, ...)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if not 400 <= exc.status < 500:
            raise
        CLIENT_ERRORS.note(f"http_{exc.status}", f"{request.method} {request.path[:100]}: {exc.reason}")
        response = error_response(exc.status, f"{exc.reason}: {request.method} {request.path[:200]}")
        for key in ("Allow", "Retry-After"):
            if key in exc.headers:
                response.headers[key] = exc.headers[key]
        return response


class Guard:
    """The limits' state for one server: open connections, requests in flight, drain."""

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self.open_connections = 0
        self.inflight = 0
        self.draining = False
        self.lingering = 0
        """Refused connections still open for their 503 to be read (at most MAX_LINGERING)."""
        self.counts = {"refused": 0, "header_timeout": 0, "body_timeout": 0}
        self._idle = asyncio.Event()

    def count(self, what: str, message: str, *args: Any) -> None:
        self.counts[what] += 1
        if every_power_of_two(self.counts[what]):
            log.warning(message + " (%d so far)", *args, self.counts[what])

    def wrap(self, handler: Handler) -> Handler:
        """The app's request handler, with the body timeout, the in-flight count and the drain."""

        async def handle(request: web.BaseRequest) -> web.StreamResponse:
            self.inflight += 1
            try:
                if self.draining and request.path.endswith("/ready"):
                    response: web.StreamResponse = web.json_response(
                        {"ready": False, "reason": "draining: this process is shutting down"}, status=503
                    )
                elif request.content.is_eof():  # no body, or all of it came with the head
                    response = await as_json(handler, request)
                else:
                    response = await self._with_body_deadline(request, handler)
            finally:
                self.inflight -= 1
                if self.inflight == 0:
                    self._idle.set()
            if self.draining:
                response.force_close()
            return response

        return handle

    async def _with_body_deadline(self, request: web.BaseRequest, handler: Handler) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        expired = False

        def expire() -> None:
            nonlocal expired
            if not request.content.is_eof():
                expired = True
                task.cancel()

        timer = asyncio.get_running_loop().call_later(self.limits.body_timeout_s, expire)
        try:
            return await as_json(handler, request)
        except asyncio.CancelledError:
            if not expired:
                raise
            task.uncancel()
            self.count("body_timeout", "a request body took longer than %g s (408)", self.limits.body_timeout_s)
            response = web.json_response(
                {"error": f"the request body did not arrive within {self.limits.body_timeout_s:g} s"}, status=408
            )
            response.force_close()
            # Written here, then the connection closed: aiohttp would otherwise linger up to 10 s
            # reading the rest of a body that is not coming.
            await response.prepare(request)
            await response.write_eof()
            request.protocol.force_close()
            return response
        finally:
            timer.cancel()

    def begin_drain(self) -> None:
        self.draining = True
        if self.inflight == 0:
            self._idle.set()

    async def drained(self) -> bool:
        """After `begin_drain`: True once the drain delay has passed and no request is in flight,
        False when the drain timeout comes first."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.limits.drain_timeout_s
        await asyncio.sleep(self.limits.drain_delay_s)
        while self.inflight > 0:
            self._idle.clear()
            try:
                async with asyncio.timeout(max(0.0, end - loop.time())):
                    await self._idle.wait()
            except TimeoutError:
                return self.inflight == 0
        return True


class GuardedHandler(RequestHandler):
    """aiohttp's connection protocol with the header timeout and the connection limit (module docstring)."""

    def __init__(self, manager: GuardedServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.guard = manager.guard
        self.refused = False
        self.header_timer: asyncio.TimerHandle | None = None
        self.heads_before = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        guard = self.guard
        if guard.open_connections >= guard.limits.max_connections:
            self._refuse(transport)
            return
        guard.open_connections += 1
        super().connection_made(transport)
        self._arm_header_timer()

    def _refuse(self, transport: asyncio.BaseTransport) -> None:
        self.refused = True
        limit = self.guard.limits.max_connections
        self.guard.count("refused", "a connection past the limit of %d was refused (503)", limit)
        body = f'{{"error": "too many connections: this server holds {limit}; retry shortly"}}'.encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        transport = cast(asyncio.Transport, transport)
        transport.write(head + body)
        if self.guard.lingering >= MAX_LINGERING:  # a flood: its descriptors are not held a second each
            transport.close()  # (after the answer is written)
            return
        if transport.can_write_eof():
            transport.write_eof()  # the answer, then FIN; what the client sends is read and dropped
        self.guard.lingering += 1
        self._loop.call_later(REFUSED_LINGER_S, self._close_refused, transport)

    def _close_refused(self, transport: asyncio.Transport) -> None:
        self.guard.lingering -= 1
        transport.close()

    def _arm_header_timer(self) -> None:
        self.heads_before = self._request_count
        self.header_timer = self._loop.call_later(self.guard.limits.header_timeout_s, self._header_timeout)

    def _waiting_for_head(self) -> bool:
        return self._waiter is not None and not self._waiter.done()

    def _header_timeout(self) -> None:
        self.header_timer = None
        if self._request_count == self.heads_before and self.transport is not None and self._waiting_for_head():
            self.guard.count(
                "header_timeout",
                "a connection sent no complete request head within %g s; closed",
                self.guard.limits.header_timeout_s,
            )
            self.force_close()

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        if self.header_timer is None and self._waiting_for_head():
            self._arm_header_timer()  # the first byte of the next request on a kept-alive connection
        super().data_received(data)
        if self.header_timer is not None and self._request_count != self.heads_before:
            self.header_timer.cancel()
            self.header_timer = None

    def handle_error(
        self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        """aiohttp's answer to a request it could not parse (status < 500: one rate-limited log line, no
        traceback) or a handler that raised (500, logged with its traceback), as JSON; the connection closes."""
        if status >= 500:
            log.error("error handling a request to %s", request.path[:100], exc_info=exc)
            text = "internal error while handling this request"
        else:
            text = one_line(f"the request is malformed: {message or exc or 'bad request'}")
            CLIENT_ERRORS.note(f"http_{status}", text)
        if request.writer.output_size > 0:  # part of an answer went out: the connection is broken
            raise ConnectionError("an answer was being sent; cannot send another")
        response = error_response(status, text[:500])
        response.force_close()
        return response

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.refused:
            return
        self.guard.open_connections -= 1
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None
        super().connection_lost(exc)


class GuardedServer(web.Server):
    """aiohttp's low-level server, its connections `GuardedHandler`s, its requests through `Guard.wrap`."""

    def __init__(self, guard: Guard, inner: web.Server) -> None:
        super().__init__(
            guard.wrap(inner.request_handler),
            request_factory=inner.request_factory,
            handler_cancellation=inner.handler_cancellation,
            loop=inner._loop,
            **inner._kwargs,
        )
        self.guard = guard

    def __call__(self) -> GuardedHandler:
        return GuardedHandler(self, loop=self._loop, **self._kwargs)


class GuardedRunner(web.AppRunner):
    """`web.AppRunner` whose server is a `GuardedServer`."""

    def __init__(self, app: web.Application, guard: Guard, **kwargs: Any) -> None:
        kwargs.setdefault("auto_decompress", False)  # request_body.read_body inflates, within the limit
        super().__init__(app, **kwargs)
        self.guard = guard

    async def _make_server(self) -> web.Server:
        return GuardedServer(self.guard, await super()._make_server())
