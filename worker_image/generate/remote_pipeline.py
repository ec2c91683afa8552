"""The pipeline-based mode across split worker processes: stage servers and the coordinator engine.

A stage server (`exitplan generate-stage`) holds blocks [first, last] of a generative bundle, their
heads, and its slice of every sequence's KV cache. Work reaches it as `POST /v1/generation/run`
(a wire frame: meta {seq, start, decide, threshold}, tensor `x` = token ids for block 0, hidden states
after) and is computed strictly in arrival order by one worker task. The answer is a stream of JSON
lines: `{"queued": true}` as soon as the work is in the queue, then, for work that still needs a
decision, `{"decision": {...}}` (from this stage's head, or relayed from a later stage).

A stage forwards its output to the next stage and waits only for the next stage's `queued` line
before taking its own next work item, so every stage sees a sequence's positions in order. When a
head decides inside a stage, the decision goes back at once, and the coordinator sends the next
token to the first stage while this and the later stages finish the exited token's forward (EE-LLM's
pipeline-based mode): every block's cache stays complete, nothing is recomputed.

A stage that holds every block can run KV recomputation instead (`RecomputeStageServer`, `exitplan
generate-stage --mode recompute`): the same protocol, one stage, and a token that exits early leaves its
later blocks' cache entries to be recomputed with the next token (EE-LLM's KV recomputation).

`--next` names the next stage as a URL or `host:port`; a host is resolved at first use (and again after
a failed hop) the way the data plane resolves peers (the dev-cluster's resolve file, else DNS: a
headless Service of the next split). Every stage runs one replica: a sequence's cache lives there.

`RemotePipelineEngine` is the coordinator (the router side): an `EngineBase` whose steps post to the
first stage. `POST /v1/generation/release` drops a sequence's cache on every stage (after its queued
work), `GET /v1/generation/cache` returns a stage's cache of one sequence once its earlier work is done
(tests), `GET /v1/generation/stats` the number of sequences holding a cache.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time
import uuid
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NotRequired, TypedDict, TypeVar

import aiohttp
import numpy as np
from aiohttp import web

from exitplan.worker_image import wire
from exitplan.worker_image.discovery import parse_peer_spec, resolve
from exitplan.worker_image.generate.decoder import (
    NEVER_EXIT,
    DecoderModel,
    EngineBase,
    GenerationError,
    GenerationHandle,
    RecomputeEngine,
    TokenEvent,
    check_request,
    forward_stage,
)

log = logging.getLogger(__name__)
INLINE_SECONDS = 0.001
"""Work items expected to compute in less than this run on the stage's event loop, not in a thread."""
RUN, RELEASE, CACHE, STATS = (
    "/v1/generation/run",
    "/v1/generation/release",
    "/v1/generation/cache",
    "/v1/generation/stats",
)


T = TypeVar("T")


class Decision(TypedDict):
    """The token a head chose for a sequence's position (the `decision` line of a run's answer)."""

    token: int
    block: int
    head: str
    confidence: float
    final: bool
    recomputed: NotRequired[int]
    """Positions whose missing KV entries were recomputed with this token (KV recomputation only)."""


@dataclass
class _Item:
    kind: str  # "run" | "release" | "barrier"
    seq: str
    done: asyncio.Future[Decision | None]
    start: int = 0
    x: np.ndarray | None = None
    decide: bool = False
    threshold: float = NEVER_EXIT
    extra: dict[str, Any] = field(default_factory=dict)


class StageServer:
    """One split of the pipeline as an HTTP server (see the module docstring)."""

    mode = "pipeline"

    def __init__(self, model: DecoderModel, next_url: str | None = None) -> None:
        self.model = model
        self.next_spec = next_url.rstrip("/") if next_url else None
        self.next_url: str | None = None
        """The next stage's resolved base URL (resolved at first use; None for the last stage)."""
        self.caches: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        self.cancelled: set[str] = set()
        self._queue: asyncio.Queue[_Item] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._worker: asyncio.Task[None] | None = None
        self._relays: set[asyncio.Task[None]] = set()
        self._compute_ewma = 0.0
        """Recent time of one work item's compute; below INLINE_SECONDS it runs on the event loop."""

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post(RUN, self.handle_run)
        app.router.add_post(RELEASE, self.handle_release)
        app.router.add_get(CACHE, self.handle_cache)
        app.router.add_get(STATS, self.handle_stats)
        app.router.add_get("/v2/health/ready", self.handle_ready)
        app.router.add_get("/v2/health/live", self.handle_live)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, _: web.Application) -> None:
        self._queue = asyncio.Queue()
        self._session = aiohttp.ClientSession()
        self._worker = asyncio.create_task(self._loop())

    async def _next(self, again: bool = False) -> str | None:
        """The next stage's base URL: a URL as given, or `host:port` resolved (resolve file, else DNS)."""
        if self.next_spec is None:
            return None
        if self.next_url is None or again:
            if self.next_spec.startswith(("http://", "https://")):
                self.next_url = self.next_spec
            else:
                found = await resolve(parse_peer_spec(self.next_spec))
                if not found:
                    raise GenerationError(f"the next stage {self.next_spec!r} does not resolve to any address yet")
                self.next_url = f"http://{found[0]}"
        return self.next_url

    async def _cleanup(self, _: web.Application) -> None:
        if self._worker:
            self._worker.cancel()
        if self._session:
            await self._session.close()

    # ------------------------------------------------------------------ handlers

    async def handle_live(self, _: web.Request) -> web.Response:
        return web.json_response({"live": True})

    async def handle_ready(self, _: web.Request) -> web.Response:
        """Ready when the stages from here to the last one are (each asks the next)."""
        body = {"ready": True, "blocks": [self.model.first_block, self.model.last_block], "mode": self.mode}
        if self.next_spec is not None:
            assert self._session is not None
            try:
                url = await self._next(again=True)
                async with self._session.get(f"{url}/v2/health/ready", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    ok = r.status == 200
            except (TimeoutError, aiohttp.ClientError, GenerationError) as err:
                ok, body["reason"] = False, f"next stage {self.next_spec}: {err or type(err).__name__}"
            if not ok:
                body["ready"] = False
                body.setdefault("reason", f"next stage {self.next_spec} is not ready")
                return web.json_response(body, status=503)
        return web.json_response(body)

    async def handle_stats(self, _: web.Request) -> web.Response:
        return web.json_response({"active_caches": len(self.caches)})

    def _drop(self, seq: str) -> None:
        self.caches.pop(seq, None)

    async def handle_run(self, request: web.Request) -> web.StreamResponse:
        try:
            meta, tensors = wire.decode(await request.read())
            item = _Item(
                "run",
                str(meta["seq"]),
                asyncio.get_running_loop().create_future(),
                int(meta["start"]),
                tensors["x"],
                bool(meta["decide"]),
                float(meta["threshold"]),
            )
        except (wire.WireError, KeyError, TypeError, ValueError) as err:
            return web.json_response({"error": f"bad run frame: {err}"}, status=400)
        assert self._queue is not None
        if meta.get("reply") == "answer":  # the coordinator: one body with the decision (no queued line to wait for)
            await self._queue.put(item)
            try:
                return web.Response(
                    body=json.dumps({"decision": await item.done}).encode() + b"\n", content_type="application/x-ndjson"
                )
            except Exception as err:
                return web.Response(
                    body=json.dumps({"error": str(err)}).encode() + b"\n", content_type="application/x-ndjson"
                )
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        assert self._queue is not None
        await self._queue.put(item)
        await response.write(b'{"queued": true}\n')
        try:
            decision = await item.done
            if decision is not None:
                await response.write(json.dumps({"decision": decision}).encode() + b"\n")
        except Exception as err:  # the computation failed: say so on the stream
            await response.write(json.dumps({"error": str(err)}).encode() + b"\n")
        await response.write_eof()
        return response

    async def handle_release(self, request: web.Request) -> web.Response:
        seq = str((await request.json())["seq"])
        self.cancelled.add(seq)  # queued work for it is skipped
        item = _Item("release", seq, asyncio.get_running_loop().create_future())
        assert self._queue is not None
        await self._queue.put(item)
        await item.done
        return web.json_response({"released": seq})

    async def handle_cache(self, request: web.Request) -> web.Response:
        seq = request.query.get("seq", "")
        item = _Item("barrier", seq, asyncio.get_running_loop().create_future())
        assert self._queue is not None
        await self._queue.put(item)
        await item.done
        if seq not in self.caches:
            return web.json_response({"error": f"no cache for sequence {seq!r}"}, status=404)
        keys, values = self.caches[seq]
        tensors = {f"key{i}": k for i, k in enumerate(keys)} | {f"value{i}": v for i, v in enumerate(values)}
        return web.Response(body=wire.encode({"blocks": len(keys)}, tensors), content_type=wire.CONTENT_TYPE)

    # ------------------------------------------------------------------ the worker

    async def _loop(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            item = await self._queue.get()
            try:
                if item.kind == "barrier":
                    item.done.set_result(None)
                elif item.kind == "release":
                    self._drop(item.seq)
                    nxt = await self._next()
                    if nxt:
                        assert self._session is not None
                        async with self._session.post(nxt + RELEASE, json={"seq": item.seq}) as r:
                            await r.read()
                    self.cancelled.discard(item.seq)
                    item.done.set_result(None)
                elif item.seq in self.cancelled:
                    item.done.set_result(None)
                else:
                    if self._compute_ewma < INLINE_SECONDS:  # short work: the thread round trip would cost more
                        started = time.perf_counter()
                        decision, x, decide = self._compute(item)
                        self._compute_ewma = 0.8 * self._compute_ewma + 0.2 * (time.perf_counter() - started)
                    else:
                        started = time.perf_counter()
                        decision, x, decide = await loop.run_in_executor(None, self._compute, item)
                        self._compute_ewma = 0.8 * self._compute_ewma + 0.2 * (time.perf_counter() - started)
                    if decision is not None:
                        item.done.set_result(decision)
                    await self._forward(item, x, decide)
                    if not item.done.done() and not (decide and self.next_spec):  # else the relay answers
                        item.done.set_result(None)
            except Exception as err:
                self.cancelled.add(item.seq)
                if not item.done.done():
                    item.done.set_exception(err)

    def _compute(self, item: _Item) -> tuple[Decision | None, np.ndarray, bool]:
        model, first = self.model, self.model.first_block
        n = model.last_block - first + 1
        if item.seq not in self.caches:
            if item.start != 0:
                raise GenerationError(
                    f"sequence {item.seq!r} has no cache on blocks {first}-{model.last_block} (released?)"
                )
            self.caches[item.seq] = ([model.empty_cache()] * n, [model.empty_cache()] * n)
        keys, values = self.caches[item.seq]
        assert item.x is not None
        x, decided = forward_stage(
            model, keys, values, item.x, item.start, item.threshold, item.decide, f"sequence {item.seq!r}"
        )
        if decided is None:
            return None, x, item.decide
        token, block, head, conf, final = decided
        decision: Decision = {"token": token, "block": block, "head": head, "confidence": conf, "final": final}
        return decision, x, False

    async def _forward(self, item: _Item, x: np.ndarray, decide: bool) -> None:
        nxt = await self._next()
        if nxt is None:
            return
        assert self._session is not None
        frame = wire.encode(
            {"seq": item.seq, "start": item.start, "decide": decide, "threshold": item.threshold}, {"x": x}
        )
        try:
            response = await self._session.post(nxt + RUN, data=frame, headers={"Content-Type": wire.CONTENT_TYPE})
        except aiohttp.ClientError as err:
            await self._next(again=True)  # the next stage may have moved: resolve again for the next item
            raise GenerationError(f"next stage {self.next_spec} unreachable: {err}") from err
        if response.status != 200:
            raise GenerationError(f"next stage {nxt} refused the work: {response.status} {await response.text()}")
        await response.content.readline()  # queued there: order kept, take the next item
        task = asyncio.create_task(self._relay(response, item.done if decide else None))
        self._relays.add(task)
        task.add_done_callback(self._relays.discard)

    @staticmethod
    async def _relay(response: aiohttp.ClientResponse, done: asyncio.Future[Decision | None] | None) -> None:
        """Pass the later stage's decision (or error) back to whoever waits for this item."""
        try:
            async for line in response.content:
                message = json.loads(line)
                if done is not None and not done.done():
                    if "decision" in message:
                        done.set_result(message["decision"])
                    elif "error" in message:
                        done.set_exception(GenerationError(message["error"]))
        finally:
            response.release()
            if done is not None and not done.done():
                done.set_exception(GenerationError("the next stage closed the stream without a decision"))


class RecomputeStageServer(StageServer):
    """The whole model in one stage with EE-LLM's KV recomputation (see the module docstring)."""

    mode = "recompute"

    def __init__(self, model: DecoderModel, *, max_pending: int = 8) -> None:
        super().__init__(model, None)
        self.engine = RecomputeEngine(model, max_pending=max_pending)
        self.handles: dict[str, GenerationHandle] = {}

    def _drop(self, seq: str) -> None:
        super()._drop(seq)
        handle = self.handles.pop(seq, None)
        if handle is not None:
            self.engine.release(handle)

    def _compute(self, item: _Item) -> tuple[Decision | None, np.ndarray, bool]:
        assert item.x is not None
        ids = [int(t) for t in item.x[0]]
        handle = self.handles.get(item.seq)
        if handle is None:
            if item.start != 0:
                raise GenerationError(f"sequence {item.seq!r} has no cache here (released?)")
            handle = self.engine.open_ids(ids, self.model.spec.max_context - len(ids), item.threshold, ignore_eos=True)
            self.handles[item.seq] = handle
            self.caches[item.seq] = self.engine.cache_lists(handle)
        elif item.start != len(handle.ids) - 1 or ids != handle.ids[-1:]:
            raise GenerationError(
                f"sequence {item.seq!r}: expected the token at position {len(handle.ids) - 1}, "
                f"got {len(ids)} at {item.start}"
            )
        handle.threshold = item.threshold
        event = self.engine.step(handle)
        decision: Decision = {
            "token": event.token_id,
            "block": event.block,
            "head": event.exit,
            "confidence": event.confidence,
            "final": event.full_pass,
            "recomputed": event.recomputed,
        }
        return decision, item.x, False


class RemotePipelineEngine(EngineBase):
    """The coordinator of split stage servers (the first URL holds block 0); steps block the calling thread."""

    mode = "pipeline-remote"

    def __init__(self, directory: str | Path, urls: Sequence[str]) -> None:
        if not urls:
            raise GenerationError("give the URL of at least one stage server")
        super().__init__(DecoderModel(directory, first_block=0, last_block=0))  # the tokenizer and the limits
        self.urls = [u.rstrip("/") for u in urls]
        self._prefix = uuid.uuid4().hex[:8]
        self._open: set[int] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="generation-remote", daemon=True)
        self._thread.start()
        self._session: aiohttp.ClientSession = self._call(self._make_session())
        self._asession: aiohttp.ClientSession | None = None
        self._counter = itertools.count()

    async def _make_session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _seq(self, handle: GenerationHandle) -> str:
        return f"{self._prefix}-{handle.id}"

    @property
    def active_caches(self) -> int:
        return len(self._open)

    def stage_caches(self) -> list[int]:
        """Sequences holding a cache on each stage server."""

        async def stats() -> list[int]:
            out = []
            for url in self.urls:
                async with self._session.get(url + STATS) as r:
                    out.append(int((await r.json())["active_caches"]))
            return out

        return self._call(stats())

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        self._call(self._session.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()

    def open(self, prompt: str, max_tokens: int, threshold: float, ignore_eos: bool = False) -> GenerationHandle:
        ids = check_request(self.model, prompt, max_tokens, threshold)
        handle = GenerationHandle(ids, max_tokens, threshold, ignore_eos)
        handle.decoder = self.model.codec.stream()
        with self._lock:
            self._open.add(handle.id)
        return handle

    def release(self, handle: GenerationHandle) -> None:
        with self._lock:
            if handle.id not in self._open:
                return
            self._open.discard(handle.id)

        async def release() -> None:
            async with self._session.post(self.urls[0] + RELEASE, json={"seq": self._seq(handle)}) as r:
                await r.read()

        try:
            self._call(release())
        except (TimeoutError, aiohttp.ClientError) as err:  # the stage is gone: so is its cache
            log.warning("releasing sequence %s on %s failed: %s", self._seq(handle), self.urls[0], err)

    def snapshot(self, handle: GenerationHandle) -> tuple[list[np.ndarray], list[np.ndarray]]:
        async def caches() -> tuple[list[np.ndarray], list[np.ndarray]]:
            keys: list[np.ndarray] = []
            values: list[np.ndarray] = []
            for url in self.urls:  # in stage order: each barrier runs after the earlier stages forwarded
                async with self._session.get(url + CACHE, params={"seq": self._seq(handle)}) as r:
                    meta, tensors = wire.decode(await r.read())
                keys += [tensors[f"key{i}"] for i in range(meta["blocks"])]
                values += [tensors[f"value{i}"] for i in range(meta["blocks"])]
            return keys, values

        return self._call(caches())

    def step(self, handle: GenerationHandle) -> TokenEvent:
        """One token, from any thread (the engine's own event loop posts to the first stage)."""
        meta, x, started = self._next_work(handle)
        try:
            decision = self._call(self._run(meta, x))
        except (TimeoutError, aiohttp.ClientError) as err:
            raise GenerationError(f"the first stage {self.urls[0]} is unreachable: {err}") from err
        return self._event(handle, decision, started)

    async def astep(self, handle: GenerationHandle) -> TokenEvent:
        """One token, awaited on the caller's event loop (a router: no thread hand-offs per token)."""
        meta, x, started = self._next_work(handle)
        if self._asession is None or self._asession.closed:
            self._asession = aiohttp.ClientSession()
        try:
            decision = await self._run(meta, x, self._asession)
        except (TimeoutError, aiohttp.ClientError) as err:
            raise GenerationError(f"the first stage {self.urls[0]} is unreachable: {err}") from err
        return self._event(handle, decision, started)

    async def aclose(self) -> None:
        """Close the session `astep` opened on the caller's loop (call it on that loop)."""
        if self._asession is not None:
            await self._asession.close()

    def _next_work(self, handle: GenerationHandle) -> tuple[dict[str, Any], np.ndarray, float]:
        if handle.finished:
            raise GenerationError("this sequence has finished")
        if handle.id not in self._open:
            raise GenerationError("this sequence's cache was released")
        started = time.perf_counter()
        prompt = not handle.generated
        new = handle.ids if prompt else handle.ids[-1:]
        meta = {
            "seq": self._seq(handle),
            "start": len(handle.ids) - len(new),
            "decide": True,
            "threshold": NEVER_EXIT if prompt else handle.threshold,
            "reply": "answer",
        }
        return meta, np.asarray([new], dtype=np.int64), started

    def _event(self, handle: GenerationHandle, decision: Decision, started: float) -> TokenEvent:
        token = int(decision["token"])
        self._finish(handle, token)
        assert handle.decoder is not None
        return TokenEvent(
            index=len(handle.generated) - 1,
            token_id=token,
            text=handle.decoder.feed(token),
            exit=decision["head"],
            block=int(decision["block"]),
            confidence=float(decision["confidence"]),
            recomputed=int(decision.get("recomputed", 0)),
            full_pass=bool(decision["final"]),
            seconds=time.perf_counter() - started,
        )

    async def _run(self, meta: dict[str, Any], x: np.ndarray, session: aiohttp.ClientSession | None = None) -> Decision:
        frame = wire.encode(meta, {"x": x})
        async with (session or self._session).post(
            self.urls[0] + RUN, data=frame, headers={"Content-Type": wire.CONTENT_TYPE}
        ) as r:
            if r.status != 200:
                raise GenerationError(f"stage {self.urls[0]} refused the work: {r.status} {await r.text()}")
            decision: Decision | None = None
            for line in (await r.read()).splitlines():  # one line: the decision (or the error)
                message = json.loads(line)
                if "decision" in message:
                    decision = message["decision"]
                if "error" in message:
                    raise GenerationError(f"stage failed: {message['error']}")
        if decision is None:
            raise GenerationError("the first stage closed the stream without a decision")
        return decision
