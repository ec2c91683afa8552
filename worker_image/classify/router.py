"""The router of a classification service: the cluster entry point, speaking the Open Inference
Protocol (KServe v2). (A generation service's router is `generate/router.py`; `exitplan router` starts
the one the bundle calls for. Both serve `protocol.v2_routes`.)

It owns every request until it answers it: a result (label, scores, the ramp that answered) or an
explicit error. Per input: tokenize (text) or take token ids, pick the length-bucket runtime with
Arlo's multi-level queue, admit it only if its bucket can answer within the SLO (else 429 with
Retry-After), send it to the least-loaded split-0 pod of that bucket, and wait for the answer that
comes back through the chain of splits. A shadow-sampled fraction of inputs keeps running to the
final head after it exits; the last split posts their complete per-ramp outputs to /v1/feedback.

Endpoints: POST /v2/models/{name}/infer, GET /v2/models/{name}, GET /v2/models/{name}/ready,
GET /v2, GET /v2/health/live|ready, GET /metrics; behind the service's control token, on the control
port when there is one (control.py): GET /v1/observations, GET /v1/window.npz, GET/POST /v1/thresholds,
GET /v1/peers, POST /v1/feedback (workers only).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import numpy as np
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from exitplan.api.bundle import read_manifest
from exitplan.api.observations import Observations
from exitplan.api.plan import Plan
from exitplan.planner.dispatch import QueueParams
from exitplan.worker_image import protocol
from exitplan.worker_image.auth import ControlPlane, bearer
from exitplan.worker_image.bundle_runtime import softmax
from exitplan.worker_image.classify.admission import Admission, Admitted, Refusal
from exitplan.worker_image.classify.colocated import Colocation, run_local, split0_workers
from exitplan.worker_image.classify.control import RouterControl
from exitplan.worker_image.classify.decode import BadRequest, DecodedBatch, decode_inputs, parse_request
from exitplan.worker_image.classify.observe import FeedbackRing, WindowStats
from exitplan.worker_image.classify.router_thresholds import RouterThresholds
from exitplan.worker_image.discovery import parse_peer_spec
from exitplan.worker_image.hop_client import HopClient, HopFailed, NoPeer, send
from exitplan.worker_image.metrics import Children, RouterMetrics, merged
from exitplan.worker_image.peer_choice import PeerSet
from exitplan.worker_image.planfile import read_plan, watch_plan
from exitplan.worker_image.protocol import error_response as _error
from exitplan.worker_image.request_body import BodyError, body_error_response, read_body
from exitplan.worker_image.vocabulary import vocabulary_size
from exitplan.worker_image.wire import HopAnswer, HopItem

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from exitplan.worker_image.classify.worker import SplitWorker

log = logging.getLogger(__name__)

SHADOW_RECORDS_KEPT = 8192
"""Shadow-sampled inputs whose feedback is awaited; beyond this the oldest is forgotten (a lost post)."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """What became of one input of a request: the ramp that answered it, or why it failed."""

    ramp: str = ""
    final: bool = False
    error: str | None = None
    reason: str = "worker"
    """The error counter's label (worker, deadline, bad_input)."""
    status: int = 502
    """The HTTP status of a request failed by this input (422: the model cannot run the input itself)."""


NO_ANSWER = Outcome(error="no answer")


@dataclass(slots=True)
class InferCall:
    """One admitted request while its inputs are out to split 0."""

    batch: DecodedBatch
    started: float
    deadline: float
    timeout_at: float
    outcomes: list[Outcome]
    scores: np.ndarray
    """[inputs, classes]: the answers' softmax scores."""
    compute_ms: list[float]
    """Per bucket the request went to: split 0's compute for the batch that carried its inputs."""
    thresholds_version: int = 0
    """The newest thresholds version split 0 decided the request's exits with."""


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
        control_token: str | None = None,
        control_port: int | None = None,
        control_host: str = "0.0.0.0",
        colocate: Colocation | None = None,
    ) -> None:
        """`control_token`: the service's control token (None: every control request is refused);
        `control_port`: serve the control routes there instead of on the inference port; `advertise`:
        host:port of the control endpoints that workers post shadow feedback to; `colocate`: run split 0
        in this process (then `peers` names split 1's pods, none when the plan has one split)."""
        self.bundle_dir = Path(bundle)
        self.manifest = read_manifest(self.bundle_dir)
        self.plan_path = Path(plan_path)
        self.plan = read_plan(self.plan_path)
        self.model = self.plan.model
        self.peers = PeerSet(parse_peer_spec(peers))
        self.local: dict[int, SplitWorker] = {}
        """bucket -> split 0 of that bucket in this process (co-located), else empty."""
        if colocate is not None:
            self.local = split0_workers(self, colocate, peers, control_token)
            self.peers = PeerSet([])  # split 1's pods are the local workers' to probe and choose
        elif not self.peers.spec:
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
        self.tokenizer = self._load_tokenizer()
        self.vocab_size = vocabulary_size(self.bundle_dir, self.manifest, self.tokenizer)
        self.buckets = list(self.plan.buckets)
        self.admission = Admission(
            self.buckets, self.slo_s, self._capacity, queue=queue, max_inflight=max_inflight, timeout_s=self.timeout_s
        )
        self.ids = itertools.count()
        self.prefix = f"{os.getpid():x}{int(time.time()) % 100000:x}"
        self.metrics = RouterMetrics(self.plan.service)
        self._child = Children(self.plan.service)
        self._count_stragglers()
        self.metrics.slo.labels(self.plan.service).set(self.slo_s)
        self.metrics.accuracy_budget.labels(self.plan.service).set(accuracy_budget)
        self.window = self._new_window()
        self.last_window: Observations | None = None
        self.feedback = FeedbackRing(len(self.exit_ramps))
        self.pending_records: dict[str, str] = {}  # id of a shadow-sampled input -> ramp that answered it
        self.saving_ms, self.cost_ms = self._ramp_costs()
        self.session: aiohttp.ClientSession | None = None
        self.control_token = control_token
        self.control = ControlPlane(control_token, control_port, control_host)
        self.hop = HopClient(token=control_token)
        """Frames to the next hop's /v1/run (the session serves probes, thresholds and feedback)."""
        self.tasks: list[asyncio.Task[None]] = []
        self.threshold_set = RouterThresholds(self)
        """The versioned thresholds, the same on every router (router_thresholds.py)."""
        self.threshold_set.publish()

    # ------------------------------------------------------------------ setup helpers

    def _count_stragglers(self) -> None:
        """Every label set the router counts at 0, and the peer sets' stragglers counted as they are marked."""
        hops = {(c.split, c.pool) for c in self.plan.cells if c.split == (1 if self.local else 0)}
        self.metrics.zero(self.buckets, [*self.exit_ramps, self.final_name], sorted(hops))
        for peer_set in (self.peers, *(w.next for w in self.local.values() if w.next is not None)):
            peer_set.on_straggler = self.metrics.straggler_marked

    def _load_tokenizer(self) -> Tokenizer | None:
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

    @property
    def thresholds(self) -> dict[str, float]:
        """The thresholds in force (the values of `threshold_set`)."""
        return self.threshold_set.current.values

    def apply_plan(self, plan: Plan) -> None:
        if plan.buckets != self.buckets:
            log.warning(
                "the new plan changes buckets %s -> %s; the router takes them on restart", self.buckets, plan.buckets
            )
        if plan.colocate != bool(self.local):
            log.warning(
                "the new plan %s split 0 in the routers; this router keeps %s until it is replaced",
                "runs" if plan.colocate else "does not run",
                "its own split 0" if self.local else "sending to split-0 pods",
            )
        self.plan = plan
        self.threshold_set.adopt_plan(plan.thresholds, plan.thresholds_version)

    # ------------------------------------------------------------------ admission and dispatch

    def _capacity(self, b: int) -> float:
        """Inputs/s bucket b's split-0 pods report for their pipelines (0 when none is ready)."""
        if self.local:
            worker = self.local[self.buckets[b]]
            return worker.capacity() if worker.ready else 0.0
        return sum(p.capacity for p in self.peers.candidates(self.buckets[b], 0))

    async def _gauge_loop(self, tick: float = 1.0) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            loads = self.admission.loads()
            for b, load in enumerate(loads):
                self.metrics.set_bucket_load(self.buckets[b], load)
            self.window.record_load(loads, now - last)  # the window's capacity in use, per bucket
            last = now

    async def _window_loop(self) -> None:
        while True:
            await asyncio.sleep(self.window_seconds)
            self._roll_window()

    def _roll_window(self) -> None:
        now = time.time()
        obs = self.snapshot(now)
        self.last_window = obs
        if obs.requests:  # a window without answers tells nothing new: the last estimate stands
            samples = int(self.window.samples.sum())
            # Evidence: shadow samples, or answers that all came from the final head (the full model itself).
            evidence = samples > 0 or int(self.window.exit_counts[:-1].sum()) == 0
            self.metrics.set_agreement(
                samples, obs.agreement_overall, obs.agreement_ci_low, obs.agreement_ci_high, evidence
            )
        self.window = self._new_window()

    def snapshot(self, now: float) -> Observations:
        """The observation window in progress (GET /v1/observations?window=current)."""
        loads = self.admission.loads()
        return self.window.observations(
            now,
            {str(b): (load if math.isfinite(load) else -1.0) for b, load in zip(self.buckets, loads)},
            self.thresholds,
            self.plan.content_hash(),
            self.saving_ms,
            self.cost_ms,
            self.threshold_set.current.version,
        )

    # ------------------------------------------------------------------ inference

    async def handle_infer(self, request: web.Request) -> web.Response:
        batch = await self._decode(request)
        if isinstance(batch, web.Response):
            return batch
        verdict = self.admission.admit(batch.lengths.tolist())
        self._observe_lengths(verdict.ideal)
        if isinstance(verdict, Refusal):
            return self._refuse(verdict, batch.n)
        started = time.time()
        call = InferCall(
            batch,
            started,
            started + self.slo_s,
            started + self.timeout_s,
            [NO_ANSWER] * batch.n,
            np.zeros((batch.n, len(self.manifest.labels)), dtype=np.float32),
            [],
        )
        inflight = self._child(self.metrics.inflight)
        inflight.set(self.admission.inflight)
        try:
            await self._dispatch_all(call, verdict)
        finally:
            self.admission.release(batch.n)
            inflight.set(self.admission.inflight)
        return self._respond(call, verdict.buckets, request)

    async def _decode(self, request: web.Request) -> DecodedBatch | web.Response:
        """The request's inputs, or the answer that refuses it (404, 413, 400)."""
        name = request.match_info["name"]
        if name != self.model:
            return _error(404, f"unknown model {name!r}; this router serves {self.model!r}")
        try:  # the whole body: one `read(n)` returns only what has arrived so far
            raw = await read_body(request, self.max_body_bytes)
        except BodyError as err:  # 413, 415, 400 (a corrupt stream, a malformed chunk): the connection closes
            return self._bad_request(err) if err.status == 400 else body_error_response(err)
        try:
            body = parse_request(raw, request.headers.get(protocol.BINARY_HEADER))
            return decode_inputs(
                body, self.manifest, self.tokenizer, self.buckets, self.truncate_default, self.vocab_size
            )
        except BadRequest as err:
            return self._bad_request(str(err))
        except (ValueError, UnicodeDecodeError) as err:
            return self._bad_request(f"body is not valid JSON: {err}")

    def _bad_request(self, why: str | BodyError) -> web.Response:
        self.window.record_error("bad_request")
        self.metrics.requests.labels(self.plan.service, "400").inc()
        return body_error_response(why) if isinstance(why, BodyError) else _error(400, why)

    def _observe_lengths(self, ideal: list[int] | tuple[int, ...]) -> None:
        """Count the inputs per ideal bucket (the length histogram the planner sizes buckets from)."""
        per_ideal: dict[int, int] = {}
        for b in ideal:
            self.window.record_length(b)
            if b >= 0:
                per_ideal[b] = per_ideal.get(b, 0) + 1
        for b, count in per_ideal.items():
            self._child(self.metrics.length_inputs, str(self.buckets[b])).inc(count)

    def _refuse(self, refusal: Refusal, n: int) -> web.Response:
        """429/503 (overload, Retry-After) or 413 (a request that can never be admitted, no Retry-After)."""
        reason = "overload" if refusal.retry_after_s > 0 else "too_large"
        self.window.record_error(reason, n)
        if reason == "overload":
            self.window.record_refused(refusal.ideal)  # per ideal bucket (a 429; a 503 names none)
        self.metrics.errors.labels(self.plan.service, reason).inc(n)
        self.metrics.requests.labels(self.plan.service, str(refusal.status)).inc()
        retry = math.ceil(refusal.retry_after_s) if refusal.retry_after_s > 0 else None
        return _error(refusal.status, refusal.reason, retry_after=retry)

    async def _dispatch_all(self, call: InferCall, admitted: Admitted) -> None:
        groups = admitted.groups()
        if len(groups) == 1:  # the common case: no task to schedule
            ((b, rows),) = groups.items()
            await self._dispatch(call, b, rows)
        else:
            await asyncio.gather(*(self._dispatch(call, b, rows) for b, rows in groups.items()))

    def _items(self, call: InferCall, n: int) -> list[HopItem]:
        """The hop items of n inputs, a shadow-sampled share of them recorded for feedback."""
        frac = self.shadow_fraction if self.exit_ramps else 0.0  # no ramp: every answer is the full model's
        if frac and self.window.samples.sum() < 50 * max(len(self.exit_ramps), 1):
            frac = min(4 * frac, 0.5)  # short of feedback in this window: sample more
        items = []
        for _ in range(n):
            record = frac > 0 and self.rng.random() < frac
            reply_to = self.advertise if record and self.advertise else None
            item = HopItem(f"{self.prefix}-{next(self.ids)}", call.deadline, call.timeout_at, record, reply_to)
            if reply_to:  # its feedback sample is awaited (and only such samples count, see control.py)
                self.pending_records[item.id] = ""
                if len(self.pending_records) > SHADOW_RECORDS_KEPT:
                    self.pending_records.pop(next(iter(self.pending_records)))
            items.append(item)
        return items

    async def _dispatch(self, call: InferCall, b: int, rows: list[int]) -> None:
        """Send the inputs `rows` of the request to a split-0 pod of bucket b; fill in their outcomes."""
        bucket = self.buckets[b]
        items = self._items(call, len(rows))
        tensors = call.batch.state_for(rows, bucket)
        logits: np.ndarray | None
        try:
            if self.local:
                answer, logits = await run_local(self.local[bucket], items, tensors, call.timeout_at)
            else:
                answer, out, _ = await send(
                    self.hop,
                    self.peers,
                    bucket=bucket,
                    split=0,
                    items=items,
                    tensors=tensors,
                    timeout_at=call.timeout_at,
                )
                logits = out.get("logits")
        except NoPeer as err:
            for i in rows:
                call.outcomes[i] = Outcome(error=str(err), reason="worker", status=503)
            return
        except HopFailed as err:
            late = time.time() >= call.timeout_at
            for i in rows:
                call.outcomes[i] = Outcome(
                    error=str(err), reason="deadline" if late else "worker", status=504 if late else 502
                )
            return
        finally:
            self.admission.answered(b, len(rows), time.time() - call.started, time.time())
        self._take_answer(call, rows, items, answer, logits)

    def _take_answer(
        self, call: InferCall, rows: list[int], items: list[HopItem], answer: HopAnswer, logits: np.ndarray | None
    ) -> None:
        call.compute_ms.append(answer.compute_ms)
        call.thresholds_version = max(call.thresholds_version, answer.thresholds_version)
        by_id = {item.id: (i, item) for item, i in zip(items, rows)}
        answered_k, answered_i = [], []
        for k, res in enumerate(answer.results):
            i, item = by_id.pop(res.id, (None, None))
            if i is None or item is None:
                continue
            if res.input_error:  # the model cannot run this input: the client's, retried nowhere
                call.outcomes[i] = Outcome(error=res.error, reason="bad_input", status=422)
                continue
            if res.error is not None or res.ramp is None:
                call.outcomes[i] = Outcome(error=res.error or "the worker answered no ramp for this input")
                continue
            call.outcomes[i] = Outcome(res.ramp, res.final)
            answered_k.append(k)
            answered_i.append(i)
            if item.record and item.id in self.pending_records:  # (its feedback may have come first)
                self.pending_records[item.id] = res.ramp
        if logits is not None and answered_k:
            call.scores[answered_i] = softmax(logits[answered_k])
        for i, _ in by_id.values():
            call.outcomes[i] = Outcome(error="the worker returned no answer for this input")

    def _account(self, outcomes: list[Outcome], chosen: list[int], latency: float) -> None:
        """The request's answers and errors into the window and the metrics."""
        within = latency <= self.slo_s
        per_exit: dict[str, int] = {}
        per_bucket: dict[int, int] = {}
        for r, b in zip(outcomes, chosen):
            if r.error is not None:
                self.window.record_error(r.reason)
                self._child(self.metrics.errors, r.reason).inc()
                continue
            index = len(self.exit_ramps) if r.final else self.ramp_index.get(r.ramp, len(self.exit_ramps))
            self.window.record_answer(index, latency, within, b)
            label = self.final_name if r.final else r.ramp
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

    def _respond(self, call: InferCall, chosen: list[int], request: web.Request) -> web.Response:
        latency = time.time() - call.started
        self._account(call.outcomes, chosen, latency)
        errors = [(i, r) for i, r in enumerate(call.outcomes) if r.error is not None]
        if errors:  # an input's own fault (4xx) first: the request fails for it whatever else happened
            i, first = min(errors, key=lambda e: (e[1].status >= 500, e[0]))
            self._child(self.metrics.requests, str(first.status)).inc()
            return _error(
                first.status, f"{len(errors)} of {len(call.outcomes)} inputs failed; input {i}: {first.error}"
            )
        names = self.manifest.labels
        labels = [names[k] for k in call.scores.argmax(axis=1).tolist()]
        self._child(self.metrics.requests, "200").inc()
        # Server-Timing (W3C): the router's own latency and the split-0 pod's compute for the batch
        # that carried these inputs (the slowest, when they went to several buckets); what the path
        # adds over the model is the client's latency minus split0.
        timing = f"router;dur={latency * 1000:.3f}, split0;dur={max(call.compute_ms, default=0.0):.3f}"
        body = protocol.infer_response(
            self.model,
            call.batch.request_id or request.headers.get("X-Request-Id", ""),
            labels,
            call.scores,
            [r.ramp for r in call.outcomes],
            latency,
        )
        body["parameters"]["thresholds_version"] = call.thresholds_version
        return protocol.infer_http_response(body, call.batch.binary_outputs, headers={"Server-Timing": timing})

    # ------------------------------------------------------------------ feedback and control

    async def handle_model(self, request: web.Request) -> web.Response:
        if request.match_info["name"] != self.model:
            return _error(404, f"unknown model {request.match_info['name']!r}; this router serves {self.model!r}")
        parameters = {
            "labels": self.manifest.labels,
            "buckets": self.buckets,
            "ramps": self.exit_ramps,
            "thresholds": self.thresholds,
            "thresholds_version": self.threshold_set.current.version,
            "thresholds_digest": self.threshold_set.current.digest,
            "exits": "early exits" if self.exit_ramps else "no exits",
        }
        return web.json_response(
            protocol.classifier_metadata(self.manifest, self.model, self.plan.content_hash(), parameters)
        )

    async def handle_model_ready(self, request: web.Request) -> web.Response:
        if request.match_info["name"] != self.model:
            return _error(404, f"unknown model {request.match_info['name']!r}")
        return await self.handle_ready(request)

    async def handle_server(self, _: web.Request) -> web.Response:
        return web.json_response(protocol.server_metadata(["observations", "thresholds"]))

    async def handle_live(self, _: web.Request) -> web.Response:
        return protocol.live_response()

    def is_ready(self) -> bool:
        """Ready when every bucket has a ready split-0 pod that reports capacity (a pod probed before the
        splits after it were ready reports none, and admission would refuse every request until the next probe)."""
        if self.local:
            return all(self._capacity(i) > 0 for i in range(len(self.buckets)))
        return all(self.peers.candidates(b, 0) for b in self.buckets) and all(
            self._capacity(i) > 0 for i in range(len(self.buckets))
        )

    async def handle_ready(self, _: web.Request) -> web.Response:
        return protocol.ready_response(self.is_ready())

    async def handle_metrics(self, _: web.Request) -> web.Response:
        registry = merged([self.metrics.registry, *(w.metrics.registry for w in self.local.values())])
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ------------------------------------------------------------------ lifecycle

    async def _startup(self, app: web.Application) -> None:
        if not self.exit_ramps:  # said once: no shadow samples, no feedback, nothing to tune
            log.info("bundle %r has no exit ramp: serving the plain model (no exits)", self.manifest.name)
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), headers=bearer(self.control_token)
        )  # probes of split-0 pods and threshold pushes carry the control token
        for worker in self.local.values():  # co-located split 0: warm up before the first probe
            await worker.start()
        if not self.local:
            await self.peers.refresh(self.session)
            self.tasks.append(asyncio.create_task(self.peers.run(self.session)))
        await self.threshold_set.sync_once()  # a router that (re)starts takes the newest set of the others
        self.tasks += [
            asyncio.create_task(self.threshold_set.run(self.session)),
            asyncio.create_task(self._gauge_loop()),
            asyncio.create_task(self._window_loop()),
            asyncio.create_task(watch_plan(self.plan_path, self.apply_plan)),
        ]

    async def _cleanup(self, app: web.Application) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for worker in self.local.values():
            await worker.stop()
        await self.hop.close()
        if self.session:
            await self.session.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes + 1024)
        app.add_routes(protocol.v2_routes(self))
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        self.control.mount(app, RouterControl(self).routes())
        return app
