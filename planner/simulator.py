"""Discrete-event simulator: replay arrivals through a Plan with the data plane's policies.

What it models (the same rules as worker_image/router_app.py and worker_app.py):
- Router: each request picks its bucket runtime with Arlo's Algorithm 1 (`dispatch.choose_bucket`)
  over loads = outstanding requests / the bucket's admission limit (`dispatch.BucketLimiter`, the
  router's own: it starts at the bucket's capacity x the SLO and follows the answers' latency); a request
  whose bucket is at load >= 1 (or that fits no bucket) is refused at once (a drop, counted), so past
  capacity the excess is refused and the rest still meets the SLO. A bucket's capacity is the slowest
  split's rate at full batches with the mean batch time given its exits (at the trimmed length where the
  workers trim). The routers' CPU and the cores the processes share: `path` (planner/sim_path.py).
  Split 0 replica: least loaded.
- Worker (one per replica of a cell): a fusion queue that launches a batch when it holds the
  planned batch size, when its oldest row has waited `max_wait_ms`, or when the earliest deadline
  needs it to run now (deadline minus the expected time to finish the model from this split).
  One batch at a time; batch time from the cost model at the real batch, which shrinks block by
  block as rows exit at enabled ramps; survivors go, after the transfer, to the least loaded
  replica (`dispatch.least_loaded`, queued+running over the replica's rate: DensePipe's "least
  running / capacity"; the data plane divides by the batch size, the same for replicas of one
  GPU type) of the next split, same bucket.
  The transfer does not hold the replica (the worker forwards in a task of its own and starts
  its next batch): it delays the survivors only.
  With `trim` (lengths; the data plane's CPU workers cut a batch to its longest input rounded up to 8
  tokens, worker_image/classify/trim.py), a worker that ends the model without rebatching runs each
  batch at the shortest of those below its bucket that holds the batch's longest input (else its bucket).
- Rebatching worker (a split with SplitPlan.rebatch, as the data plane's rebatching worker): one
  fusion queue (stage) per block of the split; a row that survives block k joins stage k + 1 of
  the same worker, where it is batched with rows from other entering batches, and leaves the
  worker after the split's last block (then transferred as above). The worker runs one block at a
  time, chosen by the data plane's own policy (`dispatch.choose_queue`): of the stages whose
  launch time has come (the earliest deadline minus the expected time from its block to the end
  of the model, 20 % margin, or its oldest row past `max_wait_ms`), the one whose time came first;
  else the deepest stage holding a full batch (it drains rows already part-way through before
  taking new ones in); else it sleeps until the first launch time. A block's time is the cost
  model's at the rows it runs (up to the batch size). Its mean time per entering batch is each
  block at a full batch weighted by the share of rows that reach it (the planner's rebatching
  table); the admission rate and the next-hop choice use it, and a worker's load counts the rows
  held in all its stages.
- Exits: each request draws its exit depth from the survival curve; a ramp that is off lets its
  inputs ride on to the next enabled ramp (the planner assumes the same). An exited row leaves
  its batch: later blocks run at the remaining size (E3's account of early exits: exits shrink
  the batch and leave the GPU under-used). With compact_exits=False, exited rows keep their
  slots until every row of the batch has exited (an implementation that cannot shrink a batch
  mid-model); the batch still ends early when all its rows are done.

Reports goodput (answers within the SLO per second, from the first arrival to the last answer, so
the drain after the last arrival counts against it), latency percentiles, SLO violations, drops,
cost, the mean rows per launched batch (per block with rebatching) and the attainment over the
requests that arrived in the last third of the run (a queue still building shows there). Arrivals:
planner/arrivals.py; the fluid upper bound (`oracle_goodput`): planner/oracle.py.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from exitplan.api.plan import Plan
from exitplan.planner.arrivals import depths_from_survival, poisson_arrivals
from exitplan.planner.costmodel import CostModel, survival_before_blocks, survivor_pmf
from exitplan.planner.dispatch import QueueParams, choose_bucket, choose_queue, least_loaded
from exitplan.planner.oracle import oracle_goodput
from exitplan.planner.sim_cores import SharedCores
from exitplan.planner.sim_path import RouterState, ServingPath
from exitplan.planner.sim_result import SimResult
from exitplan.planner.sim_worker import FusionQueue, SimWorker
from exitplan.planner.trimming import length_support, trimmed_length

__all__ = ["ServingPath", "SimResult", "Simulation", "depths_from_survival", "oracle_goodput", "poisson_arrivals"]

FloatArray = npt.NDArray[np.float64]


class Simulation:
    """One plan, one cost model per pool; call `run(arrivals, lengths)`."""

    def __init__(
        self,
        plan: Plan,
        models: dict[str, CostModel],
        slo_ms: float,
        *,
        enabled: Sequence[bool] | None = None,
        survival: Sequence[float] | None = None,
        pool_costs: dict[str, float] | None = None,
        queue: QueueParams = QueueParams(),
        max_wait_ms: float = 2.0,
        seed: int = 0,
        name: str = "",
        compact_exits: bool = True,
        trim: Sequence[int] | None = None,  # lengths a batch may be trimmed to (module doc); None: never
        path: ServingPath = ServingPath(),  # the routers and shared cores (planner/sim_path.py)
    ) -> None:
        self.plan, self.models, self.slo_s = plan, models, slo_ms / 1e3
        self.path = path
        ref = next(iter(models.values()))
        self.n_blocks = ref.n_blocks
        self.ramp_after = list(ref.ramp_after)
        names = [r.name for r in ref.profile.ramps]
        self.enabled = list(enabled) if enabled is not None else [plan.thresholds.get(n, 2.0) <= 1.0 for n in names]
        self.survival = list(survival) if survival is not None else (list(ref.profile.survival) or [1.0] * len(names))
        self.queue_params, self.max_wait = queue, max_wait_ms / 1e3
        self.compact_exits = compact_exits
        self.rng = np.random.default_rng(seed)
        self.name = name
        self.cost = sum(c.replicas * (pool_costs or {}).get(c.pool, 1.0) for c in plan.cells)
        self.buckets = list(plan.buckets)
        # fraction of requests that reach block k (k = 0..n_blocks) with the ramps in force
        self._reach = survival_before_blocks(self.n_blocks, self.ramp_after, self.survival, self.enabled)
        layout = {s.index: (s.first_block, s.last_block) for s in plan.splits}
        rebatch = {s.index for s in plan.splits if s.rebatch}
        self.n_splits = len(plan.splits)
        self.workers: list[list[list[SimWorker]]] = [[[] for _ in range(self.n_splits)] for _ in self.buckets]
        all_on = [on or after == self.n_blocks - 1 for on, after in zip(self.enabled, self.ramp_after)]
        for cell in plan.cells:
            k = self.buckets.index(cell.bucket)
            a, b = layout[cell.split]
            model = models[cell.pool]
            top = max(cell.batch_size, 1)
            sizes = np.arange(top + 1, dtype=np.float64)
            lat, ramp_lat = self._tables(model, a, b, cell.bucket, sizes, all_on)
            trims = b == self.n_blocks - 1 and cell.split not in rebatch  # ends the model, one batch
            shorter = sorted({int(x) for x in trim or () if x < cell.bucket and trims})
            trimmed = [(x, *self._tables(model, a, b, x, sizes, all_on)) for x in shorter]
            xfer = np.asarray([model.transfer_ms(b, x, cell.bucket) if b < self.n_blocks - 1 else 0.0 for x in sizes])
            full = float(lat[:, top].sum() + ramp_lat[:, top].sum() + xfer[top])
            for _ in range(cell.replicas):
                w = SimWorker(
                    cell.split, k, cell.bucket, cell.batch_size, a, b, rebatch=cell.split in rebatch, pool=cell.pool
                )
                w.lat, w.ramp_lat, w.xfer, w.expect_ms = lat, ramp_lat, xfer, full
                w.trim = trimmed
                w.mean_ms = self._mean_batch_ms(lat, ramp_lat, a, top, w.stages is not None)
                self.workers[k][cell.split].append(w)
        self._set_rest()
        self._set_admission()

    def _tables(
        self, model: CostModel, a: int, b: int, length: int, sizes: FloatArray, all_on: Sequence[bool]
    ) -> tuple[FloatArray, FloatArray]:
        """(lat, ramp_lat) of blocks a..b at `length` for each number of rows in `sizes`."""
        lat = np.stack([[model.block_ms(blk, x, length) for x in sizes] for blk in range(a, b + 1)])
        if a > 0 or not self.path.colocated:  # the worker's own work per batch, once per split
            lat[0, 1:] += model.hop_ms
        ramp_lat = np.zeros_like(lat)
        for r, after in enumerate(self.ramp_after):
            if a <= after <= b and all_on[r]:
                ramp_lat[after - a] = [model.ramp_ms(r, x, length) for x in sizes]
        return lat, ramp_lat

    def _set_rest(self) -> None:
        """Expected time to finish the model from each split (for the deadline rule), per bucket; from each
        block of a rebatching split."""
        for k in range(len(self.buckets)):
            rest = 0.0
            for s in range(self.n_splits - 1, -1, -1):
                ws = self.workers[k][s]
                here = max((w.expect_ms for w in ws), default=0.0)
                for w in ws:
                    w.rest_ms = rest + here
                    per_block = w.lat[:, w.batch] + w.ramp_lat[:, w.batch]
                    w.stage_rest_ms = [
                        rest + float(per_block[j:].sum()) + float(w.xfer[w.batch]) for j in range(len(per_block))
                    ]
                rest += here

    def _set_admission(self) -> None:
        """Per bucket, the requests/s its pods report to the router's admission: the slowest split's rate at
        full batches (mean batch time with the exits inside it) over the share of inputs reaching it."""
        self.capacity: list[float] = []
        for k in range(len(self.buckets)):
            rates = []
            for ws in self.workers[k]:
                if ws:
                    reach = max(float(self._reach[ws[0].first]), 1e-9)
                    rates.append(sum(w.batch / max(w.mean_ms, 1e-6) * 1e3 for w in ws) / reach)
            self.capacity.append(min(rates) if rates else 0.0)

    def _at_trimmed_lengths(self, lengths: np.ndarray) -> None:
        """A trimming worker reports its capacity at the lengths its batches run at (a full batch of the
        bucket's inputs cut to its longest, planner/trimming.py), not at its bucket's: its mean batch time
        from the table of the shortest trimmed length holding that."""
        for k, per in enumerate(self.workers):
            lo = self.buckets[k - 1] if k else 0
            values, probs = length_support([], np.zeros(0), lengths, lo, self.buckets[k])
            for ws in per:
                for w in ws:
                    if w.trim:
                        need = trimmed_length(values, probs, w.length, w.batch)
                        lat, ramp = next(((la, ra) for x, la, ra in w.trim if need <= x), (w.lat, w.ramp_lat))
                        w.mean_ms = self._mean_batch_ms(lat, ramp, w.first, max(w.batch, 1), False)
        self._set_admission()

    def _mean_batch_ms(self, lat: np.ndarray, ramp_lat: np.ndarray, a: int, top: int, rebatch: bool) -> float:
        """Mean time a replica of blocks a.. spends per `top` entering rows: each block over the
        number of rows still in it (binomial from the survival curve; a block no row reaches is not
        run), or with rebatching each block at full batches of the share of rows that reach it.
        The transfer of the survivors runs beside the next batch."""
        m = lat.shape[0]
        frac = self._reach[a : a + m] / max(float(self._reach[a]), 1e-12)
        per_block = lat + ramp_lat  # (m, top + 1)
        if rebatch:
            return float(np.sum(frac * per_block[:, top]))
        pmf = survivor_pmf(top, frac)  # (m, top + 1)
        return float(np.sum(pmf * per_block))

    # ------------------------------------------------------------------ the event loop

    def run(self, arrivals: np.ndarray, lengths: np.ndarray, depths: np.ndarray | None = None) -> SimResult:
        if depths is None:
            depths = depths_from_survival(
                self.rng, len(arrivals), self.n_blocks, self.ramp_after, self.survival, self.enabled
            )
        if any(w.trim for per in self.workers for ws in per for w in ws):
            self._at_trimmed_lengths(np.asarray(lengths))
        events = _EventLoop(self, arrivals, lengths, depths)
        events.run()
        return events.result()


# Events, in the order of (time, sequence number); each names what happened.
class _Arrival(NamedTuple):
    """Request `i` reaches the router."""

    i: int


class _BatchDone(NamedTuple):
    """A batch of a worker without rebatching finished; its survivors reach the next split after `xfer_ms`."""

    worker: SimWorker
    rows: list[int]
    surv: list[int]
    xfer_ms: float


class _BlockDone(NamedTuple):
    """Block `stage` (of its split) of a rebatching worker finished."""

    worker: SimWorker
    stage: int
    rows: list[int]
    surv: list[int]


class _Hop(NamedTuple):
    """Survivors arrive at the next split of their bucket."""

    bucket: int
    split: int
    rows: list[int]


class _Timer(NamedTuple):
    """A worker's fusion-queue timer fires."""

    worker: SimWorker


class _Served(NamedTuple):
    """The sender or a router (`process`, planner/sim_path.py RouterState) finished its work on request `i`."""

    process: int
    i: int


class _CoresDue(NamedTuple):
    """The next job on the shared cores (`pool` None) or on a pool's shared devices finishes, if nothing
    started or ended there since (`version`)."""

    version: int
    pool: str | None = None


_Event = _Arrival | _BatchDone | _BlockDone | _Hop | _Timer | _Served | _CoresDue


class _EventLoop:
    """One `Simulation.run`: the event queue, every request's state, and a handler per event."""

    def __init__(self, sim: Simulation, arrivals: np.ndarray, lengths: np.ndarray, depths: np.ndarray) -> None:
        n = len(arrivals)
        self.sim, self.arrivals, self.lengths, self.depths = sim, arrivals, lengths, depths
        self.deadline = arrivals + sim.slo_s
        self.done_at = np.full(n, np.nan)
        self.outstanding = [0] * len(sim.buckets)
        """Per bucket: admitted requests not yet answered."""
        self.bucket_of = np.full(n, -1, dtype=np.int64)
        self.events: list[tuple[float, int, _Event]] = [(float(arrivals[i]), i, _Arrival(i)) for i in range(n)]
        heapq.heapify(self.events)
        self.seq = n
        self.dropped = 0
        self.answers = 0
        """Answer events (a request answered twice would count twice)."""
        self.busy_ms = 0.0
        self.blk_rows = np.zeros(sim.n_blocks)
        self.blk_runs = np.zeros(sim.n_blocks)
        self.routers = RouterState(sim.path, sim.capacity, sim.slo_s)
        path = sim.path
        self.shared: dict[str | None, SharedCores[_Event]] = {pool: SharedCores(n) for pool, n in path.devices}
        """The shared cores (key None) and each pool's shared devices."""
        if path.cores is not None:
            self.shared[None] = SharedCores(path.cores, path.background)
        self.versions: dict[str | None, int] = dict.fromkeys(self.shared, 0)

    def run(self) -> None:
        events = self.events
        while events:
            now, _, event = heapq.heappop(events)
            self.dispatch(event, now)

    def dispatch(self, event: _Event, now: float) -> None:
        if isinstance(event, _Arrival):
            self.arrive(event.i, now)
        elif isinstance(event, _BatchDone):
            self.batch_done(event, now)
        elif isinstance(event, _BlockDone):
            self.block_done(event, now)
        elif isinstance(event, _Hop):
            self.enqueue(self.pick(self.sim.workers[event.bucket][event.split]), event.rows, now)
        elif isinstance(event, _Served):
            self.served(event.process, event.i, now)
        elif isinstance(event, _CoresDue):
            if event.version == self.versions.get(event.pool):
                for done in self.shared[event.pool].finished(now):
                    self.dispatch(done, now)
                self.reschedule(event.pool)
        else:  # a fusion-queue timer
            w = event.worker
            if w.timer <= now:
                w.timer = math.inf
            self.kick(w, now)

    def push(self, t: float, event: _Event) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, event))

    # ------------------------------------------------------------------ events

    def run_job(self, now: float, work_ms: float, threads: float, event: _Event, pool: str | None = None) -> None:
        """Work of `work_ms` (its time alone) keeping `threads` threads busy starts now; `event` when it ends
        (on shared cores, or on `pool`'s shared devices, one thread per batch: processor sharing,
        planner/sim_cores.py)."""
        key = pool if pool in self.shared else None
        if key is None and None not in self.shared:
            self.push(now + work_ms / 1e3, event)
            return
        self.shared[key].start(now, work_ms, 1 if key is not None else threads, event)
        self.reschedule(key)

    def reschedule(self, key: str | None = None) -> None:
        """The next finish on the shared cores (`key` None) or a pool's devices moved: an event for it, the
        earlier one made stale."""
        self.versions[key] += 1
        due = self.shared[key].due()
        if due < math.inf:
            self.push(due, _CoresDue(self.versions[key], key))

    def arrive(self, i: int, now: float) -> None:
        """A request goes to the sender, then its router (each one request at a time, in order), then is
        admitted; where neither costs anything, at once."""
        first = self.routers.first_stop()
        if first is None:
            self.admit(i, now)
        elif self.routers.join(first, i):
            self.run_job(now, self.routers.work_ms(first), 1, _Served(first, i))

    def served(self, process: int, i: int, now: float) -> None:
        routers = self.routers
        following = routers.done(process)
        if following is not None:
            self.run_job(now, routers.work_ms(process), 1, _Served(process, following))
        router = routers.next_stop() if process == routers.sender else None
        if router is None:
            self.admit(i, now)
        elif routers.join(router, i):
            self.run_job(now, routers.work_ms(router), 1, _Served(router, i))

    def admit(self, i: int, now: float) -> None:
        """The router admits the request to a bucket's runtime (Arlo's Algorithm 1) under the bucket's limit,
        or refuses it (having done its work on it: a refused request costs its sender and router too)."""
        sim, outstanding = self.sim, self.outstanding
        loads = self.routers.loads(outstanding)
        k = choose_bucket(int(self.lengths[i]), sim.buckets, loads, sim.queue_params)
        if k < 0 or loads[k] >= 1.0:
            self.dropped += 1
            return
        self.bucket_of[i] = k
        outstanding[k] += 1
        self.enqueue(self.pick(sim.workers[k][0]), [i], now)

    def batch_done(self, event: _BatchDone, now: float) -> None:
        w, rows, surv, xfer_ms = event
        self.answers += self.finish(w, rows, surv, now)
        if surv:
            self.push(now + xfer_ms / 1e3, _Hop(w.bucket, w.split + 1, surv))
        self.kick(w, now)

    def block_done(self, event: _BlockDone, now: float) -> None:
        """Survivors of an inner block join the worker's next stage; those of its last block go on to the next split."""
        w, j, rows, surv = event
        self.answers += self.finish(w, rows, surv, now)
        stages = w.stages
        assert stages is not None  # only rebatching workers run single blocks
        if surv and j + 1 < len(stages):
            deadline, q = self.deadline, stages[j + 1]
            for r in surv:
                q.push(r, now, deadline[r])
            w.held += len(surv)
        elif surv:
            self.push(now + float(w.xfer[len(surv)]) / 1e3, _Hop(w.bucket, w.split + 1, surv))
        self.kick(w, now)

    # ------------------------------------------------------------------ workers

    def pick(self, ws: list[SimWorker]) -> SimWorker:
        # DensePipe's hop: least (queued + running) / capacity, capacity = the replica's rate
        # (a batch over its mean time), so a slow GPU beside fast ones gets its share, not more
        i = least_loaded([w.held + w.running for w in ws], [w.batch / max(w.mean_ms, 1e-6) for w in ws])
        if i < 0:
            raise ValueError("no replica serves this split and bucket")  # a verified plan has one for every pair
        return ws[i]

    def enqueue(self, w: SimWorker, rows: list[int], now: float) -> None:
        deadline, q = self.deadline, w.queue
        for r in rows:
            q.push(r, now, deadline[r])
        w.held += len(rows)
        self.kick(w, now)

    def finish(self, w: SimWorker, rows: list[int], surv: list[int], now: float) -> int:
        """A batch or block of `w` finished: the rows that did not survive are answered now.
        Returns how many."""
        w.busy, w.running = False, 0
        alive = set(surv)
        done = [r for r in rows if r not in alive]
        for r in done:
            self.done_at[r] = now
            k = int(self.bucket_of[r])
            self.outstanding[k] -= 1
            self.routers.answered(k, now - float(self.arrivals[r]), self.outstanding[k], now)
        return len(done)

    def kick(self, w: SimWorker, now: float) -> None:
        """Launch the worker's next batch if it is idle and one is due, else set its timer."""
        if w.busy or not w.held:
            return
        if w.stages is not None:
            self.kick_stages(w, w.stages, now)
            return
        at = self.launch_at(w)
        if len(w.queue.rows) >= w.batch or at <= now:
            q = w.queue
            rows = [q.pop() for _ in range(min(w.batch, len(q.rows)))]
            w.held -= len(rows)
            d = self.depths[rows]
            m = len(rows)
            ks = np.arange(w.first, w.last + 1)
            counts = (d[:, None] > ks[None, :]).sum(axis=0)  # rows running each block
            if not self.sim.compact_exits:  # exited rows keep their slots until the whole batch is done
                counts = np.where(counts > 0, m, 0)
            idx = np.arange(len(ks))
            self.blk_rows[w.first : w.last + 1] += counts
            self.blk_runs[w.first : w.last + 1] += counts > 0
            need = int(self.lengths[rows].max()) if w.trim else 0  # trimming: the shortest length holding it
            lat, ramp_lat = next(((la, ra) for x, la, ra in w.trim if need <= x), (w.lat, w.ramp_lat))
            t = float(lat[idx, counts].sum() + ramp_lat[idx, counts].sum())
            self.busy_ms += t
            surv = [r for r, dd in zip(rows, d) if dd > w.last + 1]
            w.busy, w.running = True, m
            w.batches += 1
            w.rows += m
            # the survivors' transfer runs beside the next batch (the worker forwards in a
            # task of its own): it delays them, not the replica
            self.run_job(now, t, self.sim.path.threads, _BatchDone(w, rows, surv, float(w.xfer[len(surv)])), w.pool)
        elif at < w.timer:
            w.timer = at
            self.push(at, _Timer(w))

    def launch_at(self, w: SimWorker) -> float:
        """When the queue of a worker without rebatching must launch: its oldest row's maximum wait,
        or the earliest deadline minus the expected time to the end of the model (20 % margin)."""
        return w.queue.launch_at(self.sim.max_wait, w.rest_ms / 1e3)

    def kick_stages(self, w: SimWorker, stages: list[FusionQueue], now: float) -> None:
        # The data plane's policy (dispatch.choose_queue): of the stages whose launch time has
        # come (the oldest row's maximum wait, or the earliest deadline minus the expected time
        # from the stage's block to the end of the model with the same 20 % margin), the one
        # whose time came first; else the deepest stage holding a full batch; else sleep until
        # the first launch time.
        max_wait, rest = self.sim.max_wait, w.stage_rest_ms

        def launch(j: int) -> float:
            return stages[j].launch_at(max_wait, rest[j] / 1e3)

        chosen, soonest = choose_queue([len(q.rows) for q in stages], w.batch, launch, now)
        if chosen < 0:
            if soonest < w.timer:
                w.timer = soonest
                self.push(soonest, _Timer(w))
            return
        q = stages[chosen]
        rows = [q.pop() for _ in range(min(w.batch, len(q.rows)))]
        m = len(rows)
        w.held -= m
        blk = w.first + chosen
        self.blk_rows[blk] += m
        self.blk_runs[blk] += 1
        t = float(w.lat[chosen, m] + w.ramp_lat[chosen, m])
        self.busy_ms += t
        w.busy, w.running = True, m
        w.batches += 1
        w.rows += m
        self.run_job(
            now,
            t,
            self.sim.path.threads,
            _BlockDone(w, chosen, rows, [r for r in rows if self.depths[r] > blk + 1]),
            w.pool,
        )

    # ------------------------------------------------------------------ the report

    def result(self) -> SimResult:
        sim, arrivals, done_at = self.sim, self.arrivals, self.done_at
        n = len(arrivals)
        answered = ~np.isnan(done_at)
        lat = (done_at[answered] - arrivals[answered]) * 1e3
        within = int(np.sum(lat <= sim.slo_s * 1e3 + 1e-9))
        # from the first arrival to the last answer (or arrival): answers per second over that span can
        # never beat what the GPUs serve, the drain after the last arrival included
        span = float(arrivals[-1] - arrivals[0]) if n > 1 else 0.0
        last = float(np.nanmax(done_at)) - float(arrivals[0]) if answered.any() else 0.0
        duration = max(span, last) if n > 1 else 1.0
        tail = arrivals >= arrivals[0] + span * 2.0 / 3.0 if n > 1 else np.zeros(n, dtype=bool)
        with np.errstate(invalid="ignore"):
            tail_within = int(np.sum(tail & ((done_at - arrivals) * 1e3 <= sim.slo_s * 1e3 + 1e-9)))
        batches = sum(w.batches for per in sim.workers for ws in per for w in ws)
        rows = sum(w.rows for per in sim.workers for ws in per for w in ws)
        return SimResult(
            sim.name,
            n,
            int(answered.sum()),
            within,
            self.dropped,
            max(duration, 1e-9),
            lat,
            sim.cost,
            rows / max(batches, 1),
            int(tail.sum()),
            tail_within,
            self.blk_rows,
            self.blk_runs,
            self.answers,
            busy_ms=self.busy_ms,
        )
