"""HTTP routes for early-exit generation (Open Inference Protocol style) and their metrics.

`add_generate_routes(app, engine, model_name)` adds to an aiohttp application:

- `POST /v2/models/{name}/generate`: `{"text_input": "...", "parameters": {"max_tokens": N,
  "threshold": x, "ignore_eos": false}}` -> `{"model_name", "text_output", "token_ids", "exits",
  "finish_reason", "time_per_token_seconds", ...}`;
- `POST /v2/models/{name}/generate_stream`: the same request, answered with server-sent events, one
  `data: {...}` per token and a last one with `"done": true`.

Bad input is answered 400 with `{"error": ...}` naming what to change; an unknown model 404. A client
that goes away mid-stream stops the generation at the next token and releases the sequence's cache.
Token steps run in the default executor (ONNX Runtime releases the GIL), so the event loop stays free.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from exitplan.worker_image import protocol
from exitplan.worker_image.generate.decoder import EngineBase, GenerationError, GenerationHandle, TokenEvent
from exitplan.worker_image.metrics import GenerationMetrics

DEFAULT_MAX_TOKENS = 32


class _BadRequest(Exception):
    pass


def _parse(body: object, default_threshold: float) -> tuple[str, int, float, bool]:
    if not isinstance(body, dict):
        raise _BadRequest('the body must be a JSON object like {"text_input": "...", "parameters": {"max_tokens": 16}}')
    unknown = set(body) - {"text_input", "parameters", "id"}
    if unknown:
        raise _BadRequest(f"unknown fields {sorted(unknown)}; use text_input and parameters")
    text = body.get("text_input")
    if not isinstance(text, str):
        raise _BadRequest("text_input must be a string (the prompt)")
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise _BadRequest("parameters must be an object")
    unknown = set(params) - {"max_tokens", "threshold", "ignore_eos"}
    if unknown:
        raise _BadRequest(f"unknown parameters {sorted(unknown)}; known: max_tokens, threshold, ignore_eos")
    ignore_eos = params.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise _BadRequest("ignore_eos must be true or false")
    return text, params.get("max_tokens", DEFAULT_MAX_TOKENS), params.get("threshold", default_threshold), ignore_eos


def _summary(
    model_name: str, handle: GenerationHandle, events: list[TokenEvent], started: float
) -> protocol.GenerateResponse:
    return protocol.generate_response(
        model_name,
        events,
        finish_reason=handle.finish_reason or "stopped",
        threshold=handle.threshold,
        prompt_tokens=handle.prompt_len,
        total_seconds=time.perf_counter() - started,
    )


class GenerateRoutes:
    """The generate and generate_stream handlers of one served model (registered by add_generate_routes).

    `threshold()`: the exit threshold in force; `unavailable()`: why the engine cannot take a request
    now (answered 503), or None."""

    def __init__(
        self,
        engine: EngineBase,
        model_name: str,
        metrics: GenerationMetrics,
        threshold: Callable[[], float],
        unavailable: Callable[[], str | None] | None = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.threshold = threshold
        self.unavailable = unavailable
        self.astep: Callable[[GenerationHandle], Awaitable[TokenEvent]] | None = getattr(engine, "astep", None)
        """The engine's step on this event loop (an engine that awaits remote stages has one)."""

    def error(self, code: int, message: str) -> web.Response:
        self.metrics.answered(code)
        return protocol.error_response(code, message)

    async def opened(self, request: web.Request) -> GenerationHandle | web.Response:
        """The request's sequence, opened on the engine; or the answer that refuses it (404, 400, 503)."""
        if request.match_info["name"] != self.model_name:
            return self.error(
                404, f"model {request.match_info['name']!r} is not served here; this server serves {self.model_name!r}"
            )
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return self.error(400, "the body is not valid JSON")
        try:
            text, max_tokens, chosen, ignore_eos = _parse(body, self.threshold())
            handle = self.engine.open(text, max_tokens, chosen, ignore_eos)
        except (_BadRequest, GenerationError) as err:
            return self.error(400, str(err))
        reason = self.unavailable() if self.unavailable is not None else None
        if reason:
            self.engine.release(handle)
            return self.error(503, reason)
        return handle

    def start_step(self, handle: GenerationHandle) -> asyncio.Future[TokenEvent]:
        """The next token: on this loop when the engine awaits remote stages, else in a thread (ONNX Runtime)."""
        if self.astep is not None:
            return asyncio.ensure_future(self.astep(handle))
        return asyncio.get_running_loop().run_in_executor(None, self.engine.step, handle)

    async def generate(self, request: web.Request) -> web.Response:
        """POST /v2/models/{name}/generate: the whole generation in one answer."""
        started = time.perf_counter()
        handle = await self.opened(request)
        if isinstance(handle, web.Response):
            return handle
        loop = asyncio.get_running_loop()
        events: list[TokenEvent] = []
        try:
            while not handle.finished:
                step = self.start_step(handle)
                try:
                    event = await asyncio.shield(step)
                except asyncio.CancelledError:  # let the step in flight finish before its cache goes
                    await asyncio.wait([step])
                    raise
                self.metrics.token(event)
                events.append(event)
        except GenerationError as err:
            return self.error(500, f"generation failed: {err}")
        finally:
            await loop.run_in_executor(None, self.engine.release, handle)
        self.metrics.answered(200)
        return web.json_response(_summary(self.model_name, handle, events, started))

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        """POST /v2/models/{name}/generate_stream: one server-sent event per token, then the summary."""
        started = time.perf_counter()
        handle = await self.opened(request)
        if isinstance(handle, web.Response):
            return handle
        loop = asyncio.get_running_loop()
        metrics = self.metrics
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        events: list[TokenEvent] = []
        step: asyncio.Future[TokenEvent] | None = None
        try:
            await response.prepare(request)
            while not handle.finished:
                step = self.start_step(handle)
                event = await asyncio.shield(step)
                step = None
                metrics.token(event)
                events.append(event)
                await response.write(protocol.sse_event({"model_name": self.model_name, **asdict(event)}))
            await loop.run_in_executor(None, self.engine.release, handle)  # before the client hears "done"
            await response.write(
                protocol.sse_event({"done": True, **_summary(self.model_name, handle, events, started)})
            )
            await response.write_eof()
            metrics.answered(200)
        except ConnectionResetError:  # the client went away: stop here
            metrics.disconnects.inc()
            metrics.answered(499)
        except asyncio.CancelledError:  # the server cancelled the handler (client gone, or shutdown)
            metrics.disconnects.inc()
            metrics.answered(499)
            if step is not None:  # let the step in flight finish before its cache goes
                await asyncio.wait([step])
            raise
        except GenerationError as err:
            metrics.answered(500)
            await response.write(protocol.sse_event(protocol.error_body(str(err)), event="error"))
        finally:
            await loop.run_in_executor(None, self.engine.release, handle)
        return response


def add_generate_routes(
    app: web.Application,
    engine: EngineBase,
    model_name: str,
    *,
    service: str | None = None,
    threshold: float | Callable[[], float] = 1.0,
    metrics: GenerationMetrics | None = None,
    unavailable: Callable[[], str | None] | None = None,
) -> GenerationMetrics:
    """Add the generate and generate_stream routes for `model_name`; returns the metrics (merge its registry).

    `threshold`: the service's threshold, or a function giving the one in force (hot-updated thresholds);
    `unavailable`: a function giving why the engine cannot take a request now (answered 503), or None."""
    metrics = metrics or GenerationMetrics(service or model_name, engine.mode)
    manifest = engine.model.manifest
    metrics.zero([*(r.name for r in manifest.exit_ramps()), manifest.final_ramp().name])
    metrics.sequences.set_function(lambda: engine.active_caches)
    current_threshold = threshold if callable(threshold) else (lambda: threshold)
    routes = GenerateRoutes(engine, model_name, metrics, current_threshold, unavailable)
    app.router.add_post("/v2/models/{name}/generate", routes.generate)
    app.router.add_post("/v2/models/{name}/generate_stream", routes.generate_stream)
    return metrics


def generation_app(engine: EngineBase, model_name: str, *, threshold: float = 1.0) -> web.Application:
    """The standalone generation server: the generate routes, GET /metrics and /v2/health/ready."""
    app = web.Application()
    metrics = add_generate_routes(app, engine, model_name, threshold=threshold)

    async def handle_metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def handle_ready(_: web.Request) -> web.Response:
        return protocol.ready_response(True)

    async def close_engine(_: web.Application) -> None:
        close = getattr(engine, "close", None)
        if close is not None:
            close()

    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get("/v2/health/ready", handle_ready)
    app.on_cleanup.append(close_engine)
    return app
