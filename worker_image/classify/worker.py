"""The split worker: one (split, length bucket, pool) cell of a plan, as an aiohttp app.

POST /v1/run takes a frame of inputs (rows of the split's input state, padded to the bucket),
puts the rows in the fusion queue and answers when every row has its answer: rows that exit in this
split are answered from here; survivors go, as one frame per batch, to the least-loaded pod of the
next split (same bucket) and their answers come back through here. A batch launches when it holds
the planned batch size, or when the oldest deadline needs it to run now (deadline minus the
expected time to finish the model from this split), or — when `max_wait_ms` is set, which suits
processors whose batch latency grows with the batch (CPUs) — when its oldest row has waited that long.
When the plan's split rebatches, every block of the split has such a queue of its own (`fusion.py`):
a batch runs one block and its survivors wait for the next block with the survivors of other batches.
A batch that fails in ONNX Runtime is split until only the inputs the model cannot run fail, each
answered with an input error (a 422 at the router), the others as usual (`isolate.py`).

Also: GET /v1/info (what this pod is), /v1/peers (next-split pods with their straggler marks),
/v2/health/live, /v2/health/ready, /metrics; POST /v1/thresholds (hot update, forwarded to the
next split). The plan file is re-read when it changes. The frames and rows in flight are in `rows.py`.

Every /v1 route answers only requests that carry the service's control token (`exitplan.worker.auth`),
and a frame is refused (403) when an input's reply_to is not a router the plan names (`Plan.routers`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import numpy as np
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from exitplan.api.bundle import read_manifest
from exitplan.api.dtypes import by_onnx
from exitplan.api.plan import Plan
from exitplan.worker import wire
from exitplan.worker.auth import bearer, guarded, json_body
from exitplan.worker.bundle_runtime import BundleRuntime, StateError
from exitplan.worker.classify.control import MAX_THRESHOLDS_BODY, BadControl, parse_thresholds
from exitplan.worker.classify.executor import BatchOutcome, execute
from exitplan.worker.classify.feedback import send_feedback
from exitplan.worker.classify.fusion import FusionQueues
from exitplan.worker.classify.isolate import execute_isolated, known_input_check
from exitplan.worker.classify.rows import Pending, Row, batch_state
from exitplan.worker.classify.service_time import Fit, ServiceTime
from exitplan.worker.classify.trim import TRIM_STEP, cut_to, mask_input, seq_axes, trim_length, trimmed, trims
from exitplan.worker.control_client import ControlClient
from exitplan.worker.discovery import PeerSet, ReplyTargets, parse_peer_spec
from exitplan.worker.hop_client import HopClient, HopFailed, NoPeer, send
from exitplan.worker.metrics import Children, WorkerMetrics, reason_label
from exitplan.worker.planfile import read_plan, watch_plan
from exitplan.worker.wire import HopAnswer, HopItem, HopRequest, HopResult, ShadowRecord

log = logging.getLogger(__name__)

_NO_RECORD = ShadowRecord({}, {})

FAULTS_ENV = "EXITPLAN_ENABLE_FAULTS"
"""Set to 1 to enable POST /v1/faults (slow-down injection for straggler tests and chaos drills)."""

INLINE_BATCH_MS = 1.0
"""Batches expected to compute within this many ms run on the event loop itself: the round trip to the
inference thread and back (two wake-ups, ~0.3-0.5 ms on a 2-core VM) would cost more than the batch,
and blocking the loop for under a millisecond delays nothing that matters. Longer batches, up to
INLINE_IDLE_MAX_MS, run on the loop too when the worker has nothing else to do (no row queued, no
frame out to the next split): nothing waits on the loop then, and the hand-off is pure latency."""

INLINE_IDLE_MAX_MS = 150.0
"""The longest batch an idle worker runs on its event loop: health and /v1/info probes (1 s
timeouts, the kubelet's default included) and arriving frames wait at most this long behind it."""


class SplitWorker:
    alone: Callable[[int], bool] = staticmethod(lambda n: True)
    """Whether nothing but a batch's n inputs is in flight in this process (a router that co-locates
    split 0 sets it for its requests and its other buckets): a batch runs on the event loop only then."""

    def __init__(
        self,
        bundle: str | Path,
        plan_path: str | Path,
        *,
        split: int,
        bucket: int,
        pool: str = "",
        next_peers: str | None = None,
        max_wait_ms: float | None = None,
        threads: int = 1,
        providers: Sequence[str] = ("CPUExecutionProvider",),
        control_token: str | None = None,
        trim: bool | None = None,
    ) -> None:
        """`control_token`: the service's control token (None: every /v1 request is refused)."""
        self.plan_path = Path(plan_path)
        self.plan = read_plan(self.plan_path)
        if not 0 <= split < len(self.plan.splits):
            raise ValueError(f"--split {split}: the plan has splits 0..{len(self.plan.splits) - 1}")
        if bucket not in self.plan.buckets:
            raise ValueError(f"--bucket {bucket}: the plan's buckets are {self.plan.buckets}")
        self.split, self.bucket, self.pool = split, bucket, pool
        sp = self.plan.splits[split]
        manifest = read_manifest(bundle)
        self.trim_mask = mask_input(manifest)
        trim = trims(manifest, sp, providers, trim)  # trim.py: pad each batch only to its longest row's bucket
        self.runtime = BundleRuntime(
            bundle,
            first_block=sp.first_block,
            last_block=sp.last_block,
            buckets=[bucket],
            providers=providers,
            threads=threads,
            free_length=trim,
        )
        manifest = self.runtime.manifest
        self.trim_axes = seq_axes({i.name: i.shape for i in self._first_block_inputs()}) if trim else {}
        if self.trim_mask not in self.trim_axes:
            self.trim_axes = {}
        self.n_labels = len(manifest.labels)
        self.exit_ramps = [r.name for r in manifest.exit_ramps()]
        self.input_names = (
            [t.name for t in manifest.inputs] if sp.first_block == 0 else manifest.live_after(sp.first_block - 1)
        )
        self.is_last = self.runtime.ends_model
        if not self.is_last and not next_peers:
            raise ValueError(
                f"split {split} is not the last split of the plan: give --next host:port of split {split + 1}"
            )
        self.next = PeerSet(parse_peer_spec(next_peers)) if not self.is_last else None
        self.batch_size = self._planned_batch(self.plan)
        self.thresholds = dict(self.plan.thresholds)
        self.max_wait = None if max_wait_ms is None or max_wait_ms < 0 else max_wait_ms / 1000.0
        self.n_blocks = len(manifest.blocks)
        self.stages = FusionQueues(sp.first_block, sp.last_block, sp.rebatch)
        self.queue: deque[Row] = self.stages.entry
        self.wakeup = asyncio.Event()
        self.pool_exec = ThreadPoolExecutor(1, thread_name_prefix="infer")
        self.metrics = WorkerMetrics(self.plan.service, split, bucket, pool)
        self._child = Children(*self.metrics.labels.values())
        self.metrics.zero([r.name for r in manifest.ramps_in(sp.first_block, sp.last_block)])
        self.metrics.planned_batch.set(self.batch_size)
        self.times = ServiceTime(bucket)  # expected ms per batch (service_time.py), fitted at warm-up
        self.warm_input: dict[str, np.ndarray] | None = None
        """One row the model ran at warm-up: tells a batch it cannot run from a model that runs nothing."""
        self.slowdown = 1.0
        self.ready = False
        self.draining = False
        """Set when the process drains (SIGTERM): /v1/info says not ready, so senders stop choosing this pod."""
        self.served = 0
        self.session: aiohttp.ClientSession | None = None
        self.control_token = control_token
        self.replies = ReplyTargets(self.plan.routers)
        self.hop = HopClient(token=control_token)
        """Frames to the next hop's /v1/run (the session serves probes, thresholds and feedback)."""
        self.tasks: list[asyncio.Task] = []
        self.forwarding = 0
        """Frames out to the next split, not yet answered."""

    # ------------------------------------------------------------------ plan

    def _planned_batch(self, plan: Plan) -> int:
        cells = [c for c in plan.cells if c.split == self.split and c.bucket == self.bucket]
        mine = [c for c in cells if c.pool == self.pool] or cells
        return max((c.batch_size for c in mine), default=1)

    def apply_plan(self, plan: Plan) -> None:
        sp = plan.splits[self.split] if self.split < len(plan.splits) else None
        if sp is None or (sp.first_block, sp.last_block) != (self.runtime.first_block, self.runtime.last_block):
            log.warning("the new plan moves this split's blocks; this pod keeps serving its range until it is replaced")
        elif sp.rebatch != self.stages.rebatch:
            log.info("rebatching %s (plan update)", "on" if sp.rebatch else "off")
            self.stages.set_rebatch(sp.rebatch)
        self.plan = plan
        if plan.routers != self.replies.entries:
            self.replies.set(plan.routers)
        self.batch_size = self._planned_batch(plan)
        self.metrics.planned_batch.set(self.batch_size)
        self.set_thresholds(plan.thresholds, "plan-update")

    def set_thresholds(self, thresholds: dict[str, float], reason: str) -> None:
        known = {r.name for r in self.runtime.manifest.ramps}
        unknown = sorted(set(thresholds) - known)
        if unknown:
            raise ValueError(
                f"thresholds name ramps the bundle does not have: {unknown}; its ramps are {sorted(known)}"
            )
        if dict(thresholds) != self.thresholds:
            log.info("thresholds %s -> %s (%r)", self.thresholds, dict(thresholds), reason)
            self.thresholds = {k: float(v) for k, v in thresholds.items()}
            self.metrics.threshold_updates.labels(self.plan.service, reason_label(reason)).inc()

    # ------------------------------------------------------------------ warm-up and expected service time

    def _first_block_inputs(self) -> list:
        """The input specs (name, shape with its named dimensions, type) of the split's first block's ONNX file."""
        import onnxruntime as ort

        first = self.runtime.manifest.blocks[self.runtime.first_block]
        session = ort.InferenceSession(str(self.runtime.directory / first.file), providers=["CPUExecutionProvider"])
        return list(session.get_inputs())

    def _dummy_state(self, n: int) -> dict[str, np.ndarray]:
        """Inputs of the split's first block, shaped for batch n and this bucket (read from the ONNX file)."""
        state = {}
        for spec in self._first_block_inputs():
            dims = [
                n if d == "batch" else self.bucket if d == "seq" else (d if isinstance(d, int) else 1)
                for d in spec.shape
            ]
            dtype = np.dtype(by_onnx(spec.type).numpy)  # the runtime checked these types at load
            state[spec.name] = (np.ones if "mask" in spec.name else np.zeros)(dims, dtype=dtype)
        return state

    def _time_batch(self, n: int, template: dict[str, np.ndarray]) -> float:
        state = {k: np.repeat(v[:1], n, axis=0) for k, v in template.items()}
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            execute(self.runtime, state, self.bucket, {}, np.zeros(n, bool), np.zeros(n, bool))
            best = min(best, (time.perf_counter() - t0) * 1000)
        return best

    def warm_up(self) -> None:
        template = self._dummy_state(1)
        small = self._time_batch(1, template)
        self.warm_input = template
        big_n = max(2, self.batch_size)
        big = self._time_batch(big_n, template)
        self.times.fits[self.bucket] = Fit.of(small, big, big_n)
        if self.trim_axes and self.bucket > 2 * TRIM_STEP:  # a trimming worker: its fit at a short length too
            cut = cut_to(template, self.trim_axes, 2 * TRIM_STEP)
            self.times.fits[2 * TRIM_STEP] = Fit.of(self._time_batch(1, cut), self._time_batch(big_n, cut), big_n)
        log.info("warm-up: %.2f ms at batch 1, %.2f ms at batch %d; fits %s", small, big, big_n, self.times.describe())

    def expected_ms(self, n: int) -> float:  # a batch of n at the bucket's length (the longest it can take)
        return self.times.expected_ms(n)

    @property
    def survival(self) -> float:
        """Estimated fraction of the inputs entering this split that go on to the next split."""
        return self.stages.survival()

    def capacity(self) -> float:
        """Inputs/s this pod and the splits after it can take: its own rate at full batches (with
        rebatching, each block only for the share of inputs that reach it), capped by the next
        split's reported capacity divided by the share of inputs that survive this split."""
        per_batch = self.times.typical_ms(self.batch_size) * self.slowdown * self.stages.work_fraction()
        own = self.batch_size / max(per_batch, 1e-3) * 1000.0
        if self.next is None:
            return own
        downstream = sum(p.capacity for p in self.next.candidates(self.bucket, self.split + 1))
        return min(own, downstream / max(self.survival, 0.05))

    # ------------------------------------------------------------------ HTTP

    async def handle_run(self, request: web.Request) -> web.Response:
        if not self.ready:
            return web.Response(status=503, text="worker is warming up", headers={"Retry-After": "1"})
        body = await request.read()
        try:
            meta, tensors = wire.decode(body)
            items = HopRequest.from_meta(meta).items
            self._check_tensors(tensors, len(items))
        except (wire.WireError, KeyError, TypeError, ValueError) as err:
            return web.Response(status=400, text=f"bad frame: {err}")
        for target in {item.reply_to for item in items if item.reply_to}:
            if not await self.replies.allows(target):
                return web.Response(
                    status=403,
                    text=f"reply_to {target[:100]!r} is not a router of this service's plan "
                    f"(its routers: {self.replies.entries}); a worker posts feedback only to them",
                )
        pending = self._enqueue(items, tensors)
        await pending.future
        return web.Response(
            body=wire.encode(pending.reply().to_meta(), {"logits": pending.logits}), content_type=wire.CONTENT_TYPE
        )

    async def run_local(self, items: list[HopItem], tensors: dict[str, np.ndarray]) -> tuple[HopAnswer, np.ndarray]:
        """A frame from a router in this very process (co-located): the answer and the logits (a row per
        item), through the same queue and batches as /v1/run, without the encoding, HTTP and sender checks."""
        if not self.ready or self.draining:
            raise NoPeer(f"the co-located split-0 runtime of bucket {self.bucket} is not ready")
        pending = self._enqueue(items, tensors)
        await pending.future
        return pending.reply(), pending.logits

    def _enqueue(self, items: list[HopItem], tensors: dict[str, np.ndarray]) -> Pending:
        """A frame's rows into the fusion queue; its Pending is answered when every row is."""
        pending = Pending(items, self.n_labels, {k: tensors[k] for k in self.input_names})
        now = time.time()
        for i, item in enumerate(items):
            deadline = now + 1.0 if item.deadline is None else float(item.deadline)
            timeout = deadline if item.timeout is None else float(item.timeout)
            row = Row(pending, i, now, deadline, timeout, item, now, rec=item.rec)
            if item.answered:
                pending.answer(i, HopResult.shadow_of(item.id), None)
            self.queue.append(row)
        self.metrics.queued.set(self.stages.held())
        self.wakeup.set()
        return pending

    def _check_tensors(self, tensors: dict[str, np.ndarray], n: int) -> None:
        """Raise ValueError unless the frame holds this split's inputs, n rows each, padded to this bucket."""
        for name in self.input_names:
            if name not in tensors:
                raise ValueError(f"tensor {name!r} missing; this split reads {self.input_names}")
            t = tensors[name]
            if t.shape[0] != n:
                raise ValueError(f"tensor {name!r} has {t.shape[0]} rows for {n} items")
            if self.runtime.is_sequence_model and (t.ndim < 2 or t.shape[1] != self.bucket):
                raise ValueError(
                    f"tensor {name!r} shape {list(t.shape)}: axis 1 must be this bucket's length {self.bucket}"
                )

    async def handle_info(self, _: web.Request) -> web.Response:
        return web.json_response(
            {
                "service": self.plan.service,
                "model": self.plan.model,
                "split": self.split,
                "bucket": self.bucket,
                "pool": self.pool,
                "batchSize": self.batch_size,
                "ready": self.ready and not self.draining,
                "firstBlock": self.runtime.first_block,
                "lastBlock": self.runtime.last_block,
                "queued": self.stages.held(),
                "served": self.served,
                "thresholds": self.thresholds,
                "rebatch": self.stages.rebatch,
                "stages": self.stages.snapshot(),
                "capacity": round(self.capacity(), 3),
                "survival": round(self.survival, 4),
                "planHash": self.plan.content_hash(),
                "expectedMs": self.times.describe(),
                "meanLength": round(self.times.mean_length, 2),
            }
        )

    async def handle_peers(self, _: web.Request) -> web.Response:
        return web.json_response(self.next.snapshot() if self.next else [])

    async def handle_live(self, _: web.Request) -> web.Response:
        return web.json_response({"live": True})

    async def handle_ready(self, _: web.Request) -> web.Response:
        ok = self.ready and (self.next is None or bool(self.next.candidates(self.bucket, self.split + 1)))
        return web.json_response({"ready": ok}, status=200 if ok else 503)

    async def handle_metrics(self, _: web.Request) -> web.Response:
        self.metrics.stragglers.set(sum(p.straggler for p in self.next.peers.values()) if self.next else 0)
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def handle_thresholds(self, request: web.Request) -> web.Response:
        body = await json_body(request, MAX_THRESHOLDS_BODY)
        if isinstance(body, web.Response):
            return body
        try:
            manifest = self.runtime.manifest
            thresholds, reason = parse_thresholds(body, self.exit_ramps, manifest.final_ramp().name)
            await self.push_thresholds(thresholds, reason)
        except (BadControl, ValueError) as err:
            return web.Response(status=400, text=f"bad thresholds: {err}")
        return web.json_response({"thresholds": self.thresholds})

    async def push_thresholds(self, thresholds: dict[str, float], reason: str) -> None:
        """Apply thresholds here and pass them on down the chain (ValueError: a ramp the bundle lacks)."""
        self.set_thresholds(thresholds, reason)
        if self.next and self.session:
            clients = [
                ControlClient(p.url, session=self.session, timeout_s=2.0) for p in self.next.peers.values() if p.ready
            ]
            await asyncio.gather(*(c.push_thresholds(thresholds, reason) for c in clients), return_exceptions=True)

    async def handle_faults(self, request: web.Request) -> web.Response:
        body = await json_body(request, 1024)
        if isinstance(body, web.Response):
            return body
        slowdown = body.get("slowdown", 1.0) if isinstance(body, dict) else None
        if isinstance(slowdown, bool) or not isinstance(slowdown, (int, float)) or not 1.0 <= slowdown <= 100.0:
            return web.Response(status=400, text='send {"slowdown": x} with x in [1, 100]')
        self.slowdown = float(slowdown)
        log.warning("fault injection: slowdown x%.1f", self.slowdown)
        return web.json_response({"slowdown": self.slowdown})

    # ------------------------------------------------------------------ batching

    def _reserve_s(self, j: int) -> float:
        """Time to keep for finishing the model from block first + j (the deadline rule), x 1.2."""
        span = self.runtime.last_block - self.runtime.first_block + 1
        remaining = (self.n_blocks - self.runtime.first_block - j) / span
        return self.expected_ms(self.batch_size) * remaining * 1.2 / 1000.0

    async def batch_loop(self) -> None:
        while True:
            j, at = self.stages.choose(self.batch_size, time.time(), self._reserve_s, self.max_wait)
            if j < 0:
                self.wakeup.clear()
                try:
                    await asyncio.wait_for(
                        self.wakeup.wait(), None if at == float("inf") else max(at - time.time(), 0.0)
                    )
                except TimeoutError:
                    pass
                continue
            batch = self.stages.take(j, self.batch_size)
            self.metrics.queued.set(self.stages.held())
            try:
                await self.run_batch(batch, j)
            except Exception as err:  # keep the loop alive; every row of the batch gets an explicit error
                log.exception("batch failed")
                for row in batch:
                    row.pending.fail(row.index, f"worker error in split {self.split}: {err}")

    async def run_batch(self, batch: list[Row], stage: int = 0) -> None:
        """Run fusion queue `stage`'s batch over its blocks (the whole split, or one block when the
        split rebatches); answer the exits; pass the survivors on to the next block's queue or split."""
        now = time.time()
        first, last = self.stages.span(stage)
        if stage == 0:
            for row in batch:
                self.metrics.queue_seconds.observe(now - row.arrival)
            state = batch_state(batch, self.input_names)
        else:
            state = {name: np.stack([row.state[name] for row in batch]) for name in batch[0].state}
        answered = np.array([row.answered for row in batch], dtype=bool)
        recorded = np.array([row.item.record for row in batch], dtype=bool)
        args = (state, self.thresholds, answered, recorded, first, last)
        fraction = (last - first + 1) / (self.runtime.last_block - self.runtime.first_block + 1)
        trims = bool(self.trim_axes) and self.trim_mask in state  # the length _execute cuts the batch to:
        length = trim_length(state, self.trim_mask, self.trim_axes, self.bucket) if trims else self.bucket
        self.times.ran_at(length)
        expected = self.times.expected_ms(len(batch), length) * fraction
        t0 = time.perf_counter()
        try:
            if expected <= INLINE_BATCH_MS or (
                expected <= INLINE_IDLE_MAX_MS
                and self.stages.held() == 0
                and self.forwarding == 0
                and self.alone(len(batch))
            ):
                outcome = self._execute(*args)
            else:
                outcome = await asyncio.get_running_loop().run_in_executor(self.pool_exec, self._execute, *args)
        except StateError as err:
            for row in batch:
                row.pending.fail(row.index, f"split {self.split} cannot run this input: {err}")
            return
        service_ms = (time.perf_counter() - t0) * 1000
        if self.slowdown > 1.0:
            extra = service_ms * (self.slowdown - 1.0)
            await asyncio.sleep(extra / 1000)
            service_ms += extra
        if stage == 0:
            self.served += len(batch)
            self.metrics.inputs.inc(len(batch))
        self.metrics.batch_size.observe(len(batch))
        self.metrics.batch_seconds.observe(service_ms / 1000)
        for row in batch:
            p = row.pending
            if p.service_ms == 0.0:
                p.service_ms, p.expected_ms, p.compute_ms = service_ms, expected, outcome.compute_ms
        for i, rec in outcome.records.items():
            row = batch[i]
            row.rec = (row.rec or _NO_RECORD).merged(rec.conf, rec.pred, rec.final_pred)
        per_ramp: dict[str, int] = {}
        for ans in outcome.answers:
            row = batch[ans.row]
            per_ramp[ans.ramp] = per_ramp.get(ans.ramp, 0) + 1
            row.pending.answer(row.index, HopResult.answer(row.item.id, ans.ramp, ans.final), ans.logits)
        for ramp, count in per_ramp.items():
            self._child(self.metrics.exits, ramp).inc(count)
        for i, why in outcome.rejected.items():  # inputs the model cannot run: the client's fault (isolate.py)
            batch[i].pending.reject(batch[i].index, why)
        self.metrics.rejected.inc(len(outcome.rejected))
        self.stages.record(stage, len(batch), len(outcome.survivors))
        if last < self.runtime.last_block:  # on to the next block's queue, each row with its slice of the state
            now = time.time()
            queue = self.stages.queues[stage + last - first + 1]
            for pos, i in enumerate(outcome.survivors):
                row = batch[i]
                row.state = {name: value[pos] for name, value in outcome.state.items()}
                row.enqueued = now
                queue.append(row)
            self.metrics.queued.set(self.stages.held())
        elif self.is_last and self.session is not None:
            send_feedback(self.session, [batch[i] for i in outcome.records], self.exit_ramps)
        elif len(outcome.survivors):
            rows = [batch[i] for i in outcome.survivors]
            self.forwarding += 1
            asyncio.create_task(self.forward(rows, outcome.state))

    def _execute(self, state, thresholds, answered, recorded, first: int, last: int) -> BatchOutcome:
        """A batch through blocks first..last; an input the model cannot run fails alone (isolate.py)."""
        known = known_input_check(self.runtime, self.warm_input, self.bucket, first, last)
        if self.trim_axes and self.trim_mask in state:  # cut to its longest row; the session has a free length
            state, _ = trimmed(state, self.trim_mask, self.trim_axes, self.bucket)
        return execute_isolated(self.runtime, state, self.bucket, thresholds, answered, recorded, first, last, known)

    async def forward(self, rows: list[Row], state: dict[str, np.ndarray]) -> None:
        try:
            await self._forward(rows, state)
        finally:
            self.forwarding -= 1

    async def _forward(self, rows: list[Row], state: dict[str, np.ndarray]) -> None:
        assert self.next is not None and self.session is not None
        items = [row.item.onward(row.rec, row.answered) for row in rows]
        self.metrics.forward_bytes.inc(sum(v.nbytes for v in state.values()))
        try:
            answer, tensors, _ = await send(
                self.hop,
                self.next,
                bucket=self.bucket,
                split=self.split + 1,
                items=items,
                tensors=state,
                timeout_at=max(r.timeout for r in rows),
            )
        except (NoPeer, HopFailed) as err:
            self.metrics.forward_errors.inc()
            for row in rows:
                row.pending.fail(row.index, str(err))
            return
        logits = tensors.get("logits")
        by_id = {row.item.id: row for row in rows}
        for k, result in enumerate(answer.results):
            row = by_id.pop(result.id, None)
            if row is None or result.shadow:
                continue
            if result.error is not None:  # the pod's failure or the input's own (result.input_error), kept as is
                row.pending.answer(row.index, result, None)
            else:
                row.pending.answer(row.index, result, logits[k] if logits is not None else None)
        for row in by_id.values():
            if not row.answered:
                row.pending.fail(row.index, f"split {self.split + 1} returned no answer for this input")

    # ------------------------------------------------------------------ lifecycle

    async def _startup(self, app: web.Application) -> None:
        await self.start()

    async def start(self) -> None:
        """Warm up and start batching (the app's startup; a router that co-locates split 0 calls it)."""
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), headers=bearer(self.control_token)
        )  # probes of the next split, threshold pushes and feedback posts carry the control token
        await self.replies.refresh()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self.pool_exec, self.warm_up)
        self.ready = True
        self.tasks.append(asyncio.create_task(self.batch_loop()))
        self.tasks.append(asyncio.create_task(watch_plan(self.plan_path, self.apply_plan)))
        if self.next:
            await self.next.refresh(self.session)
            self.tasks.append(asyncio.create_task(self.next.run(self.session)))

    async def _cleanup(self, app: web.Application) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Fail what is queued, stop the loops, close the connections."""
        self.ready = False
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for queue in self.stages.queues:
            for row in queue:
                row.pending.fail(row.index, "worker shutting down")
        await self.hop.close()
        if self.session:
            await self.session.close()
        self.pool_exec.shutdown(wait=False)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 << 20)
        token = self.control_token
        app.add_routes(
            [
                web.post("/v1/run", guarded(token, self.handle_run)),
                web.get("/v1/info", guarded(token, self.handle_info)),
                web.get("/v1/peers", guarded(token, self.handle_peers)),
                web.get("/v2/health/live", self.handle_live),
                web.get("/v2/health/ready", self.handle_ready),
                web.get("/metrics", self.handle_metrics),
                web.post("/v1/thresholds", guarded(token, self.handle_thresholds)),
            ]
        )
        if os.environ.get(FAULTS_ENV) == "1":
            app.router.add_post("/v1/faults", guarded(token, self.handle_faults))
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app
