"""The split worker: one (split, length bucket, pool) cell of a plan, and its batching/execution loop.

`SplitWorker` owns the cell's runtime (the split's blocks for one bucket), its thresholds and plan
(re-read when the plan file changes), and the rows in flight: `enqueue` puts a frame's rows in the
fusion queue (`fusion.py`; the rows and frames are `rows.py`'s) and `batch_loop` runs them. A batch
launches when it holds the planned batch size, or when the oldest deadline needs it to run now
(deadline minus the expected time to finish the model from this split), or — when `max_wait_ms` is
set, which suits processors whose batch latency grows with the batch (CPUs) — when its oldest row has
waited that long. `run_batch` executes it (`batch_bisect.execute_isolated`: a batch that fails in ONNX
Runtime is split until only the inputs the model cannot run fail, each answered with an input error, a
422 at the router), answers the rows that exit here, and sends the survivors, as one frame per batch, to
the least-loaded pod of the next split (same bucket), whose answers come back through here. When the
plan's split rebatches, every block of the split has a queue of its own: a batch runs one block and
its survivors wait for the next block with the survivors of other batches.

The HTTP surface (/v1/run, /v1/info, health, metrics, thresholds) is `worker_routes.py`; the warm-up that
fits the expected service time is `warmup.py`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import numpy as np
from aiohttp import web

from exitplan.api.bundle import read_manifest
from exitplan.api.plan import Plan
from exitplan.worker_image.auth import bearer
from exitplan.worker_image.bundle_runtime import BundleRuntime, StateError
from exitplan.worker_image.classify.batch_bisect import execute_isolated, known_input_check
from exitplan.worker_image.classify.executor import BatchOutcome
from exitplan.worker_image.classify.feedback import send_feedback
from exitplan.worker_image.classify.fusion import FusionQueues
from exitplan.worker_image.classify.rows import Pending, Row, batch_state, carried_state
from exitplan.worker_image.classify.service_time import ServiceTime
from exitplan.worker_image.classify.trim import mask_input, seq_axes, trim_length, trimmed, trims
from exitplan.worker_image.classify.warmup import first_block_inputs, warm_up
from exitplan.worker_image.classify.worker_routes import worker_app
from exitplan.worker_image.control_bodies import WorkerInfo
from exitplan.worker_image.discovery import ReplyTargets, parse_peer_spec
from exitplan.worker_image.hop_client import HopClient, HopFailed, NoPeer, send
from exitplan.worker_image.metrics import Children, WorkerMetrics, reason_label
from exitplan.worker_image.peer_choice import PeerSet
from exitplan.worker_image.planfile import read_plan, watch_plan
from exitplan.worker_image.threshold_push import catch_up, push_to_peers
from exitplan.worker_image.threshold_set import PLAN_UPDATE, ThresholdHolder, ThresholdSet
from exitplan.worker_image.wire import HopAnswer, HopItem, HopResult, ShadowRecord

log = logging.getLogger(__name__)

_NO_RECORD = ShadowRecord({}, {})

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
        self.trim_axes = seq_axes({i.name: i.shape for i in first_block_inputs(self.runtime)}) if trim else {}
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
        self.threshold_set = ThresholdHolder(ThresholdSet(dict(self.plan.thresholds), self.plan.thresholds_version))
        self.max_wait = None if max_wait_ms is None or max_wait_ms < 0 else max_wait_ms / 1000.0
        self.n_blocks = len(manifest.blocks)
        self.stages: FusionQueues[Row] = FusionQueues(sp.first_block, sp.last_block, sp.rebatch)
        self.queue: deque[Row] = self.stages.entry
        self.wakeup = asyncio.Event()
        self.pool_exec = ThreadPoolExecutor(1, thread_name_prefix="infer")
        self.metrics = WorkerMetrics(self.plan.service, split, bucket, pool)
        self._child = Children(*self.metrics.labels.values())
        self.metrics.zero([r.name for r in manifest.ramps_in(sp.first_block, sp.last_block)])
        self.metrics.planned_batch.set(self.batch_size)
        self.metrics.runtime_info(self.runtime.active_providers, manifest.dtype)
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
        self.tasks: list[asyncio.Task[None]] = []
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
        before = self.threshold_set.current
        if self.threshold_set.adopt_plan(plan.thresholds, plan.thresholds_version):
            self._took(before, PLAN_UPDATE)

    @property
    def thresholds(self) -> dict[str, float]:
        """The thresholds in force (the values of `threshold_set`)."""
        return self.threshold_set.values

    def _took(self, before: ThresholdSet, reason: str) -> None:
        now = self.threshold_set.current
        log.info("thresholds %s %s -> %s %s (%r)", before.label, before.values, now.label, now.values, reason)
        self.metrics.threshold_updates.labels(self.plan.service, reason_label(reason)).inc()

    def set_thresholds(self, new: ThresholdSet, reason: str) -> bool:
        """Take `new` when it is newer than the set in force (ValueError: a ramp the bundle lacks)."""
        known = {r.name for r in self.runtime.manifest.ramps}
        unknown = sorted(set(new.values) - known)
        if unknown:
            raise ValueError(
                f"thresholds name ramps the bundle does not have: {unknown}; its ramps are {sorted(known)}"
            )
        before = self.threshold_set.current
        if not self.threshold_set.adopt(new, reason):
            return False
        self._took(before, reason)
        return True

    # ------------------------------------------------------------------ warm-up and expected service time

    def warm_up(self) -> None:
        """Run and time the split (`warmup.py`): the expected service time's fits, and a known-good input."""
        self.warm_input = warm_up(self.runtime, self.bucket, self.batch_size, self.trim_axes, self.times)

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

    # ------------------------------------------------------------------ what comes in, what it reports

    async def run_local(self, items: list[HopItem], tensors: dict[str, np.ndarray]) -> tuple[HopAnswer, np.ndarray]:
        """A frame from a router in this very process (co-located): the answer and the logits (a row per
        item), through the same queue and batches as /v1/run, without the encoding, HTTP and sender checks."""
        if not self.ready or self.draining:
            raise NoPeer(f"the co-located split-0 runtime of bucket {self.bucket} is not ready")
        pending = self.enqueue(items, tensors)
        await pending.future
        return pending.reply(), pending.logits

    def enqueue(self, items: Sequence[HopItem], tensors: dict[str, np.ndarray]) -> Pending:
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

    async def push_thresholds(self, new: ThresholdSet, reason: str) -> None:
        """Take `new` here when it is newer and pass it on down the chain (ValueError: a ramp the bundle
        lacks); a pod of the next split that missed it gets it at its next probe (`catch_up`)."""
        if self.set_thresholds(new, reason) and self.next and self.session:
            await push_to_peers(self.session, self.next.peers.values(), self.threshold_set.current, reason)

    def inject_slowdown(self, slowdown: float) -> None:
        """Every batch takes `slowdown` times its time from now on (fault injection, POST /v1/faults)."""
        self.slowdown = slowdown
        log.warning("fault injection: slowdown x%.1f", self.slowdown)

    def info(self) -> WorkerInfo:
        """What this pod is and how it is doing (GET /v1/info)."""
        return WorkerInfo(
            service=self.plan.service,
            model=self.plan.model,
            split=self.split,
            bucket=self.bucket,
            pool=self.pool,
            batch_size=self.batch_size,
            ready=self.ready and not self.draining,
            first_block=self.runtime.first_block,
            last_block=self.runtime.last_block,
            queued=self.stages.held(),
            served=self.served,
            thresholds=self.thresholds,
            thresholds_version=self.threshold_set.current.version,
            thresholds_digest=self.threshold_set.current.digest,
            rebatch=self.stages.rebatch,
            stages=self.stages.snapshot(),
            capacity=round(self.capacity(), 3),
            survival=round(self.survival, 4),
            plan_hash=self.plan.content_hash(),
            expected_ms=self.times.describe(),
            mean_length=round(self.times.mean_length, 2),
        )

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
        first, last = self.stages.span(stage)
        if stage == 0:
            now = time.time()
            for row in batch:
                self.metrics.queue_seconds.observe(now - row.arrival)
            state = batch_state(batch, self.input_names)
        else:
            state = carried_state(batch)
        try:
            outcome, service_ms, expected = await self._compute(batch, state, first, last)
        except StateError as err:
            for row in batch:
                row.pending.fail(row.index, f"split {self.split} cannot run this input: {err}")
            return
        if stage == 0:
            self.served += len(batch)
            self.metrics.inputs.inc(len(batch))
        self.metrics.batch_size.observe(len(batch))
        self.metrics.batch_seconds.observe(service_ms / 1000)
        for row in batch:
            p = row.pending
            if p.service_ms == 0.0:
                p.service_ms, p.expected_ms, p.compute_ms = service_ms, expected, outcome.compute_ms
                p.thresholds_version = self.threshold_set.current.version
        self._answer(batch, outcome)
        self.stages.record(stage, len(batch), len(outcome.survivors))
        self._pass_on(batch, outcome, stage + last - first + 1, last)

    async def _compute(
        self, batch: list[Row], state: dict[str, np.ndarray], first: int, last: int
    ) -> tuple[BatchOutcome, float, float]:
        """(outcome, service ms, expected ms) of the batch through blocks first..last: on the event loop
        when it is short or the worker has nothing else to do, else on the inference thread."""
        answered = np.array([row.answered for row in batch], dtype=bool)
        recorded = np.array([row.item.record for row in batch], dtype=bool)
        fraction = (last - first + 1) / (self.runtime.last_block - self.runtime.first_block + 1)
        mask = self.trim_mask  # the length _execute cuts the batch to:
        trims = bool(self.trim_axes) and mask is not None and mask in state
        length = trim_length(state, mask, self.trim_axes, self.bucket) if trims and mask is not None else self.bucket
        self.times.ran_at(length)
        expected = self.times.expected_ms(len(batch), length) * fraction
        args = (state, self.thresholds, answered, recorded, first, last)
        t0 = time.perf_counter()
        if expected <= INLINE_BATCH_MS or (
            expected <= INLINE_IDLE_MAX_MS
            and self.stages.held() == 0
            and self.forwarding == 0
            and self.alone(len(batch))
        ):
            outcome = self._execute(*args)
        else:
            outcome = await asyncio.get_running_loop().run_in_executor(self.pool_exec, self._execute, *args)
        service_ms = (time.perf_counter() - t0) * 1000
        if self.slowdown > 1.0:
            extra = service_ms * (self.slowdown - 1.0)
            await asyncio.sleep(extra / 1000)
            service_ms += extra
        return outcome, service_ms, expected

    def _execute(
        self,
        state: dict[str, np.ndarray],
        thresholds: dict[str, float],
        answered: np.ndarray,
        recorded: np.ndarray,
        first: int,
        last: int,
    ) -> BatchOutcome:
        """A batch through blocks first..last; an input the model cannot run fails alone (batch_bisect.py)."""
        known = known_input_check(self.runtime, self.warm_input, self.bucket, first, last)
        mask = self.trim_mask
        if self.trim_axes and mask is not None and mask in state:  # cut to its longest row (a free-length session)
            state, _ = trimmed(state, mask, self.trim_axes, self.bucket)
        return execute_isolated(self.runtime, state, self.bucket, thresholds, answered, recorded, first, last, known)

    def _answer(self, batch: list[Row], outcome: BatchOutcome) -> None:
        """The rows that exited, and those the model cannot run; the shadow records of the recorded ones."""
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
        for i, why in outcome.rejected.items():  # inputs the model cannot run: the client's fault (batch_bisect.py)
            batch[i].pending.reject(batch[i].index, why)
        self.metrics.rejected.inc(len(outcome.rejected))

    def _pass_on(self, batch: list[Row], outcome: BatchOutcome, next_queue: int, last: int) -> None:
        """The survivors to the next block's queue (`next_queue`, inside a rebatching split) or to the
        next split; the last split posts the shadow records' feedback instead."""
        if last < self.runtime.last_block:  # each row with its slice of the state
            now = time.time()
            queue = self.stages.queues[next_queue]
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
            sent = by_id.pop(result.id) if result.id in by_id else None
            if sent is None or result.shadow:
                continue
            if result.error is not None:  # the pod's failure or the input's own (result.input_error), kept as is
                sent.pending.answer(sent.index, result, None)
            else:
                sent.pending.answer(sent.index, result, logits[k] if logits is not None else None)
        for row in by_id.values():
            if not row.answered:
                row.pending.fail(row.index, f"split {self.split + 1} returned no answer for this input")

    # ------------------------------------------------------------------ lifecycle

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
            self.tasks.append(asyncio.create_task(self.next.run(self.session, self._catch_up)))

    async def _catch_up(self) -> None:
        """After each probe of the next split: push the thresholds to a pod that reported older ones."""
        if self.next and self.session:
            await catch_up(self.session, self.next, self.threshold_set)

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
        """The worker's aiohttp app (`worker_routes.py`), which starts and stops it."""
        return worker_app(self)
