"""The router: the cluster entry point, speaking the Open Inference Protocol (KServe v2).

It owns every request until it answers it: a result (label, scores, the ramp that answered) or an
explicit error. Per input: tokenize (text) or take token ids, pick the length-bucket runtime with
Arlo's multi-level queue, admit it only if its bucket can answer within the SLO (else 429 with
Retry-After), send it to the least-loaded split-0 pod of that bucket, and wait for the answer that
comes back through the chain of splits. A shadow-sampled fraction of inputs keeps running to the
final head after it exits; the last split posts their complete per-ramp outputs to /v1/feedback.

Endpoints: POST /v2/models/{name}/infer, GET /v2/models/{name}, GET /v2/models/{name}/ready,
GET /v2, GET /v2/health/live|ready, GET /metrics, GET /v1/observations, GET /v1/window.npz,
GET/POST /v1/thresholds, GET /v1/peers, POST /v1/feedback (workers only).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import os
import random
import time
from pathlib import Path

import aiohttp
import numpy as np
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from exitplan.api.bundle import read_manifest
from exitplan.api.plan import Plan
from exitplan.planner.dispatch import QueueParams, choose_bucket, ideal_bucket

from exitplan.worker.classify.admission import BucketLimiter
from exitplan.worker.bundle_runtime import softmax
from exitplan.worker.discovery import PeerSet, parse_peer_spec
from exitplan.worker.hop_client import HopClient, HopFailed, NoPeer, send
from exitplan.worker.metrics import Children, RouterMetrics
from exitplan.worker.classify.observe import FeedbackRing, WindowStats
from exitplan.worker.planfile import read_plan, watch_plan
from exitplan.worker.classify.decode import BadRequest, decode_inputs

log = logging.getLogger(__name__)


class Router:
    def __init__(
        self,
        bundle: str | Path,
        plan_path: str | Path,
        *,
        peers: str,
        slo_ms: float,
        accuracy_budget: float = 0.01,
        shadow_fraction: float = 0.05,
        queue: QueueParams = QueueParams(),
        max_body_bytes: int = 1 << 20,
        max_inflight: int = 4096,
        truncate: bool = False,
        timeout_ms: float | None = None,
        window_seconds: float = 30.0,
        advertise: str | None = None,
        seed: int | None = None,
    ) -> None:
        self.bundle_dir = Path(bundle)
        self.manifest = read_manifest(self.bundle_dir)
        self.plan_path = Path(plan_path)
        self.plan = read_plan(self.plan_path)
        self.model = self.plan.model
        self.peers = PeerSet(parse_peer_spec(peers))
        if not self.peers.spec:
            raise ValueError("--peers must name the split-0 workers (host:port, comma-separated)")
        self.slo_s = slo_ms / 1000.0
        self.timeout_s = (timeout_ms / 1000.0) if timeout_ms else max(5 * self.slo_s, 2.0)
        self.accuracy_budget = accuracy_budget
        self.shadow_fraction = shadow_fraction
        self.queue_params = queue
        self.max_body_bytes = max_body_bytes
        self.max_inflight = max_inflight
        self.truncate_default = truncate
        self.window_seconds = window_seconds
        self.advertise = advertise
        self.rng = random.Random(seed)
        self.exit_ramps = [r.name for r in self.manifest.exit_ramps()]
        self.ramp_index = {name: i for i, name in enumerate(self.exit_ramps)}
        self.final_name = self.manifest.final_ramp().name
        self.thresholds = dict(self.plan.thresholds)
        self.tokenizer = self._load_tokenizer()
        self.buckets = list(self.plan.buckets)
        self.outstanding = [0] * len(self.buckets)
        self.limiters = [BucketLimiter(target_s=0.8 * self.slo_s) for _ in self.buckets]
        self.inflight = 0
        self.ids = itertools.count()
        self.prefix = f"{os.getpid():x}{int(time.time()) % 100000:x}"
        self.metrics = RouterMetrics(self.plan.service)
        self._child = Children(self.plan.service)
        self.metrics.slo.labels(self.plan.service).set(self.slo_s)
        self.metrics.accuracy_budget.labels(self.plan.service).set(accuracy_budget)
        self.window = self._new_window()
        self.last_window = None
        self.feedback = FeedbackRing(len(self.exit_ramps))
        self.pending_records: dict[str, str] = {}  # id of a shadow-sampled input -> ramp that answered it
        self.saving_ms, self.cost_ms = self._ramp_costs()
        self.session: aiohttp.ClientSession | None = None
        self.hop = HopClient()
        """Frames to the next hop's /v1/run (the session serves probes, thresholds and feedback)."""
        self.tasks: list[asyncio.Task] = []
        self._publish_thresholds()

    # ------------------------------------------------------------------ setup helpers

    def _load_tokenizer(self):
        if not self.manifest.tokenizer:
            return None
        from tokenizers import Tokenizer

        # A request carries a few texts: tokenizing them on this thread is cheaper than waking the
        # tokenizers thread pool for each request (measured: 0.65 vs 0.85 ms for 8 texts between
        # 30 ms idle gaps on a 2-core VM). Requests run concurrently on the event loop, and router
        # replicas scale out. An explicit TOKENIZERS_PARALLELISM in the environment wins.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        tok = Tokenizer.from_file(str(self.bundle_dir / self.manifest.tokenizer))
        tok.no_padding()
        tok.no_truncation()
        return tok

    def _ramp_costs(self) -> tuple[np.ndarray, np.ndarray]:
        """Per exit ramp: latency saved by exiting there and its overhead (from the bundle's calibration window)."""
        path = self.bundle_dir / "data" / "window.npz"
        n = len(self.exit_ramps)
        if path.is_file():
            with np.load(path) as data:
                if data["saving_ms"].shape == (n,):
                    return data["saving_ms"].astype(np.float64), data["cost_ms"].astype(np.float64)
        return np.zeros(n), np.zeros(n)

    def _new_window(self) -> WindowStats:
        return WindowStats(self.plan.service, self.model, self.exit_ramps, self.buckets)

    def _publish_thresholds(self) -> None:
        for name in self.exit_ramps:
            self.metrics.threshold.labels(self.plan.service, name).set(self.thresholds.get(name, 2.0))

    def apply_plan(self, plan: Plan) -> None:
        if plan.buckets != self.buckets:
            log.warning("the new plan changes buckets %s -> %s; the router takes them on restart", self.buckets, plan.buckets)
        self.plan = plan
        if plan.thresholds != self.thresholds:
            self.thresholds = dict(plan.thresholds)
            self.metrics.threshold_updates.labels(plan.service, "plan-update").inc()
            self._publish_thresholds()

    # ------------------------------------------------------------------ admission and dispatch

    def _capacity(self, b: int) -> float:
        """Inputs/s bucket b's split-0 pods report for their pipelines (0 when none is ready)."""
        return sum(p.capacity for p in self.peers.candidates(self.buckets[b], 0))

    def _loads(self) -> list[float]:
        """Per bucket: inputs in flight over its admission limit (inf when it has no ready pod)."""
        loads = []
        for b, limiter in enumerate(self.limiters):
            cap = self._capacity(b)
            if cap <= 0:
                loads.append(math.inf)
                continue
            limiter.ensure(cap, self.slo_s)
            loads.append(limiter.load(self.outstanding[b]))
        return loads

    async def _gauge_loop(self, tick: float = 1.0) -> None:
        while True:
            await asyncio.sleep(tick)
            for b, load in enumerate(self._loads()):
                self.metrics.bucket_load.labels(self.plan.service, str(self.buckets[b])).set(load if math.isfinite(load) else -1.0)

    async def _window_loop(self) -> None:
        while True:
            await asyncio.sleep(self.window_seconds)
            self._roll_window()

    def _roll_window(self) -> None:
        now = time.time()
        obs = self._snapshot(now)
        self.last_window = obs
        self.metrics.agreement.labels(self.plan.service).set(obs.agreement_overall)
        self.window = self._new_window()

    def _snapshot(self, now: float):
        loads = self._loads()
        return self.window.observations(
            now, {str(b): (l if math.isfinite(l) else -1.0) for b, l in zip(self.buckets, loads)}, self.thresholds,
            self.plan.content_hash(), self.saving_ms, self.cost_ms,
        )

    # ------------------------------------------------------------------ inference

    async def handle_infer(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name != self.model:
            return _error(404, f"unknown model {name!r}; this router serves {self.model!r}")
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            return _error(413, f"request body of {request.content_length} bytes is over the limit of {self.max_body_bytes}")
        try:
            raw = await request.content.read(self.max_body_bytes + 1)
            if len(raw) > self.max_body_bytes:
                return _error(413, f"request body is over the limit of {self.max_body_bytes} bytes")
            body = orjson.loads(raw)
            batch = decode_inputs(body, self.manifest, self.tokenizer, self.buckets, self.truncate_default)
        except BadRequest as err:
            self.window.record_error("bad_request")
            self.metrics.requests.labels(self.plan.service, "400").inc()
            return _error(400, str(err))
        except (ValueError, UnicodeDecodeError) as err:
            self.window.record_error("bad_request")
            self.metrics.requests.labels(self.plan.service, "400").inc()
            return _error(400, f"body is not valid JSON: {err}")
        n = batch.n
        if self.inflight + n > self.max_inflight:
            self.window.record_error("overload", n)
            self.metrics.errors.labels(self.plan.service, "overload").inc(n)
            self.metrics.requests.labels(self.plan.service, "503").inc()
            return _error(503, f"router is at its limit of {self.max_inflight} inputs in flight; retry later", retry_after=1)
        loads = self._loads()
        lengths = batch.lengths.tolist()
        per_ideal: dict[int, int] = {}
        for length in lengths:
            ideal = ideal_bucket(length, self.buckets)
            self.window.record_length(ideal)
            if ideal >= 0:
                per_ideal[ideal] = per_ideal.get(ideal, 0) + 1
        for ideal, count in per_ideal.items():
            self._child(self.metrics.length_inputs, str(self.buckets[ideal])).inc(count)
        chosen = []
        for length in lengths:
            b = choose_bucket(length, self.buckets, loads, self.queue_params)
            # An idle bucket takes a request whatever its size (else a batch above the limit would starve).
            if b < 0 or (loads[b] >= 1.0 and self.outstanding[b] > 0):
                wait = self.limiters[b].retry_after_s(self.outstanding[b]) if b >= 0 else 1
                self.window.record_error("overload", n)
                self.metrics.errors.labels(self.plan.service, "overload").inc(n)
                self.metrics.requests.labels(self.plan.service, "429").inc()
                what = f"bucket {self.buckets[b]}" if b >= 0 else "every bucket"
                return _error(429, f"{what} cannot answer within the SLO of {self.slo_s * 1000:.0f} ms at the current load", retry_after=max(1, math.ceil(wait)))
            loads[b] += 1.0 / self.limiters[b].limit
            chosen.append(b)
        for b in chosen:  # counted before any await, so concurrent admissions see each other
            self.outstanding[b] += 1
        started = time.time()
        deadline = started + self.slo_s
        timeout_at = started + self.timeout_s
        self.inflight += n
        inflight = self._child(self.metrics.inflight)
        inflight.set(self.inflight)
        try:
            groups: dict[int, list[int]] = {}
            for i, b in enumerate(chosen):
                groups.setdefault(b, []).append(i)
            results: list[dict | None] = [None] * n
            scores = np.zeros((n, len(self.manifest.labels)), dtype=np.float32)
            compute_ms: list[float] = []
            if len(groups) == 1:  # the common case: no task to schedule
                (b, rows), = groups.items()
                await self._dispatch(b, rows, batch, deadline, timeout_at, results, scores, compute_ms)
            else:
                await asyncio.gather(*(self._dispatch(b, rows, batch, deadline, timeout_at, results, scores, compute_ms)
                                       for b, rows in groups.items()))
        finally:
            self.inflight -= n
            inflight.set(self.inflight)
        return self._respond(results, scores, started, chosen, request, compute_ms)

    async def _dispatch(self, b, rows, batch, deadline, timeout_at, results, scores, compute_ms) -> None:
        bucket = self.buckets[b]
        ids = [f"{self.prefix}-{next(self.ids)}" for _ in rows]
        frac = self.shadow_fraction
        if self.window.samples.sum() < 50 * max(len(self.exit_ramps), 1):
            frac = min(4 * frac, 0.5)  # short of feedback in this window: sample more
        items = []
        for k, _ in enumerate(rows):
            record = frac > 0 and self.rng.random() < frac
            item = {"id": ids[k], "deadline": deadline, "timeout": timeout_at, "record": record}
            if record and self.advertise:
                item["reply_to"] = self.advertise
            items.append(item)
        tensors = batch.state_for(rows, bucket)
        try:
            meta, out, _ = await send(self.hop, self.peers, bucket=bucket, split=0, meta={"items": items, "bucket": bucket},
                                      tensors=tensors, rows=len(rows), timeout_at=timeout_at)
        except NoPeer as err:
            for i in rows:
                results[i] = {"error": str(err), "reason": "worker", "status": 503}
            return
        except HopFailed as err:
            for i in rows:
                results[i] = {"error": str(err), "reason": "deadline" if time.time() >= timeout_at else "worker", "status": 504 if time.time() >= timeout_at else 502}
            return
        finally:
            latency, now = time.time() - (deadline - self.slo_s), time.time()
            for _ in rows:
                self.limiters[b].on_answer(latency, self.outstanding[b], now)
            self.outstanding[b] -= len(rows)
        compute_ms.append(float(meta.get("compute_ms") or 0.0))
        logits = out.get("logits")
        by_id = {item["id"]: (i, item) for item, i in zip(items, rows)}
        answered_k, answered_i = [], []
        for k, res in enumerate(meta.get("results") or []):
            i, item = by_id.pop(res.get("id"), (None, None)) if res else (None, None)
            if i is None:
                continue
            if "error" in res:
                results[i] = {"error": res["error"], "reason": "worker", "status": 502}
                continue
            results[i] = {"ramp": res["ramp"], "final": bool(res.get("final"))}
            answered_k.append(k)
            answered_i.append(i)
            if item.get("record"):
                self.pending_records[item["id"]] = res["ramp"]
                if len(self.pending_records) > 8192:  # feedback that never came (a lost post): forget the oldest
                    self.pending_records.pop(next(iter(self.pending_records)))
        if logits is not None and answered_k:
            scores[answered_i] = softmax(logits[answered_k])
        for i, _ in by_id.values():
            results[i] = {"error": "the worker returned no answer for this input", "reason": "worker", "status": 502}

    def _respond(self, results, scores, started, chosen, request, compute_ms) -> web.Response:
        latency = time.time() - started
        within = latency <= self.slo_s
        errors = [r for r in results if r is None or "error" in r]
        per_exit: dict[str, int] = {}
        per_bucket: dict[int, int] = {}
        for r, b in zip(results, chosen):
            if r is None or "error" in r:
                reason = (r or {}).get("reason", "worker")
                self.window.record_error(reason)
                self._child(self.metrics.errors, reason).inc()
                continue
            ramp = r["ramp"]
            index = len(self.exit_ramps) if r["final"] else self.ramp_index.get(ramp, len(self.exit_ramps))
            self.window.record_answer(index, latency, within)
            label = "final" if r["final"] else ramp
            per_exit[label] = per_exit.get(label, 0) + 1
            per_bucket[b] = per_bucket.get(b, 0) + 1
        # Metrics once per label set rather than per input (the labels() lookups were most of the cost).
        for label, count in per_exit.items():
            self._child(self.metrics.exits, label).inc(count)
        for b, count in per_bucket.items():
            histogram = self._child(self.metrics.latency, str(self.buckets[b]))
            for _ in range(count):
                histogram.observe(latency)
            self._child(self.metrics.inputs, str(self.buckets[b])).inc(count)
        if within and per_bucket:
            self._child(self.metrics.within_slo).inc(sum(per_bucket.values()))
        if errors:
            first = errors[0] or {"error": "no answer", "status": 502}
            status = first.get("status", 502)
            self._child(self.metrics.requests, str(status)).inc()
            return _error(status, f"{len(errors)} of {len(results)} inputs failed: {first['error']}")
        names = self.manifest.labels
        labels = [names[k] for k in scores.argmax(axis=1).tolist()]
        ramps = [r["ramp"] for r in results]
        self._child(self.metrics.requests, "200").inc()
        n = len(results)
        # Server-Timing (W3C): the router's own latency and the split-0 pod's compute for the batch
        # that carried these inputs (the slowest, when they went to several buckets); what the path
        # adds over the model is the client's latency minus split0.
        timing = f"router;dur={latency * 1000:.3f}, split0;dur={max(compute_ms, default=0.0):.3f}"
        return _json({
            "model_name": self.model,
            "id": request.headers.get("X-Request-Id", ""),
            "outputs": [
                {"name": "label", "datatype": "BYTES", "shape": [n], "data": labels},
                {"name": "scores", "datatype": "FP32", "shape": [n, scores.shape[1]], "data": scores.ravel().round(6).tolist()},
                {"name": "exit_ramp", "datatype": "BYTES", "shape": [n], "data": ramps},
            ],
            "parameters": {"latency_ms": round(latency * 1000, 3)},
        }, headers={"Server-Timing": timing})

    # ------------------------------------------------------------------ feedback and control

    async def handle_feedback(self, request: web.Request) -> web.Response:
        try:
            samples = (await request.json())["samples"]
            for s in samples:
                answered_by = self.pending_records.pop(s["id"], None)
                final = int(s["final"])
                if not self.feedback.add(s["conf"], s["pred"], final):
                    continue
                if answered_by in self.ramp_index:
                    r = self.ramp_index[answered_by]
                    self.window.record_feedback(r, int(s["pred"][r]) == final)
        except (ValueError, KeyError, TypeError, IndexError) as err:
            return _error(400, f"bad feedback: {err}")
        return web.json_response({"accepted": len(samples)})

    async def handle_thresholds_get(self, _: web.Request) -> web.Response:
        return web.json_response({"thresholds": self.thresholds})

    async def handle_thresholds_post(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            new = {str(k): float(v) for k, v in body["thresholds"].items()}
            reason = str(body.get("reason", "api"))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            return _error(400, f"bad thresholds: {err}; send {{\"thresholds\": {{ramp: value}}, \"reason\": ...}}")
        unknown = sorted(set(new) - {r.name for r in self.manifest.ramps})
        if unknown or any(not math.isfinite(v) for v in new.values()):
            return _error(400, f"thresholds must be finite numbers for the bundle's ramps {self.exit_ramps}; got unknown {unknown}")
        await self.push_thresholds(new, reason)
        return web.json_response({"thresholds": self.thresholds})

    async def push_thresholds(self, new: dict[str, float], reason: str) -> None:
        """Apply new thresholds here and on every split-0 pod (which forward them down the chain)."""
        assert self.session is not None
        body = {"thresholds": new, "reason": reason}

        async def push(url: str) -> None:
            async with self.session.post(f"{url}/v1/thresholds", json=body, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                resp.raise_for_status()

        results = await asyncio.gather(*(push(p.url) for p in self.peers.peers.values() if p.ready), return_exceptions=True)
        for r in results:
            if isinstance(r, Exception):
                log.warning("threshold push failed: %s", r)
        if new != self.thresholds:
            log.info("thresholds %s -> %s (%s)", self.thresholds, new, reason)
            self.thresholds = dict(new)
            self.metrics.threshold_updates.labels(self.plan.service, reason).inc()
            self._publish_thresholds()

    async def handle_observations(self, request: web.Request) -> web.Response:
        current = request.query.get("window") == "current"
        obs = self._snapshot(time.time()) if current or self.last_window is None else self.last_window
        return web.json_response(obs.dump())

    async def handle_window(self, request: web.Request) -> web.Response:
        try:
            last = int(request.query.get("last", 0))
            if last < 0:
                raise ValueError
        except ValueError:
            return _error(400, "last must be a non-negative integer (0 = every stored sample)")
        body = self.feedback.to_npz(self.saving_ms, self.cost_ms, last=last or None)
        return web.Response(body=body, content_type="application/octet-stream")

    async def handle_model(self, request: web.Request) -> web.Response:
        if request.match_info["name"] != self.model:
            return _error(404, f"unknown model {request.match_info['name']!r}; this router serves {self.model!r}")
        m = self.manifest
        inputs = (
            [{"name": "text", "datatype": "BYTES", "shape": [-1]}, {"name": "input_ids", "datatype": "INT64", "shape": [-1, -1]}]
            if m.tokenizer else [{"name": t.name, "datatype": _kserve_dtype(t.dtype), "shape": [-1 if isinstance(d, str) else d for d in t.shape]} for t in m.inputs]
        )
        return web.json_response({
            "name": self.model, "versions": [self.plan.content_hash()], "platform": "exitplan-early-exit-onnx",
            "inputs": inputs,
            "outputs": [
                {"name": "label", "datatype": "BYTES", "shape": [-1]},
                {"name": "scores", "datatype": "FP32", "shape": [-1, len(m.labels)]},
                {"name": "exit_ramp", "datatype": "BYTES", "shape": [-1]},
            ],
            "parameters": {"labels": m.labels, "buckets": self.buckets, "ramps": self.exit_ramps, "thresholds": self.thresholds},
        })

    async def handle_model_ready(self, request: web.Request) -> web.Response:
        if request.match_info["name"] != self.model:
            return _error(404, f"unknown model {request.match_info['name']!r}")
        return await self.handle_ready(request)

    async def handle_server(self, _: web.Request) -> web.Response:
        return web.json_response({"name": "exitplan-router", "version": "0.1.0", "extensions": ["observations", "thresholds"]})

    async def handle_live(self, _: web.Request) -> web.Response:
        return web.json_response({"live": True})

    def is_ready(self) -> bool:
        """Ready when every bucket has a ready split-0 pod."""
        return all(self.peers.candidates(b, 0) for b in self.buckets)

    async def handle_ready(self, _: web.Request) -> web.Response:
        ok = self.is_ready()
        return web.json_response({"ready": ok}, status=200 if ok else 503)

    async def handle_metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def handle_peers(self, _: web.Request) -> web.Response:
        return web.json_response(self.peers.snapshot())

    # ------------------------------------------------------------------ lifecycle

    async def _startup(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        await self.peers.refresh(self.session)
        self.tasks += [
            asyncio.create_task(self.peers.run(self.session)),
            asyncio.create_task(self._gauge_loop()),
            asyncio.create_task(self._window_loop()),
            asyncio.create_task(watch_plan(self.plan_path, self.apply_plan)),
        ]

    async def _cleanup(self, app: web.Application) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.hop.close()
        if self.session:
            await self.session.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes + 1024)
        app.add_routes([
            web.post("/v2/models/{name}/infer", self.handle_infer),
            web.get("/v2/models/{name}", self.handle_model),
            web.get("/v2/models/{name}/ready", self.handle_model_ready),
            web.get("/v2", self.handle_server),
            web.get("/v2/health/live", self.handle_live),
            web.get("/v2/health/ready", self.handle_ready),
            web.get("/metrics", self.handle_metrics),
            web.get("/v1/observations", self.handle_observations),
            web.get("/v1/window.npz", self.handle_window),
            web.get("/v1/thresholds", self.handle_thresholds_get),
            web.post("/v1/thresholds", self.handle_thresholds_post),
            web.get("/v1/peers", self.handle_peers),
            web.post("/v1/feedback", self.handle_feedback),
        ])
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app


def _json(body: dict, headers: dict[str, str] | None = None) -> web.Response:
    """A JSON answer via orjson (numpy scalars and arrays serialize as their values)."""
    return web.Response(body=orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), content_type="application/json", headers=headers)


def _error(status: int, message: str, retry_after: int | None = None) -> web.Response:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return web.json_response({"error": message}, status=status, headers=headers)


def _kserve_dtype(dtype: str) -> str:
    return {"float32": "FP32", "float16": "FP16", "int64": "INT64", "int32": "INT32", "uint8": "UINT8"}[dtype]
