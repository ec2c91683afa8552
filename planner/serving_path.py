"""What the serving path allows a plan beside its workers' compute: the routers and shared cores.

The solver sizes cells from each split's time per batch (the model's blocks and ramps, the transfer out,
and the worker's own work per batch, the profile's ``serving.hopMs``). Two limits sit outside any cell,
each from what the profiles measured (``ModelProfileSpec.serving``, by running the real processes) and
what the pools say:

- **routers**: every request costs a router ``routerMs`` of CPU (read, decode and tokenize, admission,
  the hop out, the answer); a router is one process on one core, so ``spec.router.replicas`` routers
  answer at most ``replicas x 1000 / routerMs`` requests/s.
- **shared cores** (``GPUPool.spec.sharedCores``: worker processes on one machine, as `exitplan up`
  runs them): the pool's workers together cannot keep more than its cores busy. Per request, a cell
  keeps its replicas busy for ``1000 / rate`` ms per input (the time a batch holds a replica over its
  inputs, the hop included) for the inputs of its bucket that reach its split, times the workers'
  threads; a cell spread over pools (DensePipe) puts on each pool the share of its capacity that pool
  holds. When every pool of the service shares cores (everything on one machine), the routers' CPU
  joins it. The pool answers at most ``cores x 1000 / (core-ms per request)`` requests/s.
- **shared devices** (``GPUPool.spec.sharedDevices``: a pool's worker processes sharing its accelerators,
  several runtimes per GPU): the same sum over the pool's cells, a batch holding a device whatever its
  threads, the routers apart (they run on the host): at most ``devices x 1000 / (device-ms per request)``.

A plan's predicted goodput is the least of the solver's and these; the notes say which one binds.

**Co-location** (``Plan.colocate``, `exitplan router --colocate`): split 0 runs inside the router
processes, so a request crosses no hop from the router to split 0. The profile measures that router's
CPU per request (``serving.colocatedMs``: everything but the model's compute, split 0's batching
included); split 0's cells lose their per-batch ``hopMs``; the routers are as many as the most split-0
replicas of a bucket (each holds split 0 of every bucket). It is open to a plan whose split 0 lives on
one pool, and, unless that pool's processes share cores (where one process or several changes nothing
in the cores' sum), to a plan with one bucket whose split-0 replicas are at least the routers asked for
(each router then takes one of the pool's accelerators, as a worker did). The cells' own goodput rises
by what split 0's shorter batches give (``colocated_gain``). The planner co-locates where that predicts
more goodput (``spec.planner.colocate``: auto), or always / never.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from exitplan.api.plan import Cell, SplitPlan, colocated_routers
from exitplan.planner.costmodel import CostModel
from exitplan.planner.e3_model import E3Problem
from exitplan.planner.inputs import Inputs


@dataclass
class PathLimit:
    goodput_rps: float
    """The most requests/s this part of the path allows."""
    what: str
    """The limit in words (for the plan's notes)."""


def router_ms(inp: Inputs) -> float | None:
    """Router CPU per request: the largest any profile measured (None: none measured it)."""
    measured = [m.profile.serving.router_ms for m in inp.models if m.profile.serving is not None]
    return max(measured) if measured else None


def colocated_router_ms(inp: Inputs) -> float | None:
    """CPU per request of a router that runs split 0 (None: a profile did not measure it)."""
    serving = [m.profile.serving for m in inp.models]
    measured = [c.colocated_ms for c in serving if c is not None and c.colocated_ms is not None]
    return max(measured) if len(measured) == len(serving) else None


def why_not_colocate(inp: Inputs, cells: Sequence[Cell], buckets: Sequence[int], routers: int) -> str | None:
    """None when the plan's routers can run its split 0 in their processes; else why they cannot."""
    pools = sorted({c.pool for c in cells if c.split == 0})
    if len(pools) != 1:
        return f"split 0 spans pools {pools}; a router runs on one"
    model = inp.models[inp.pool_names.index(pools[0])]
    if colocated_router_ms(inp) is None:
        return "the profiles do not hold serving.colocatedMs (re-profile with `exitplan profile --serving`)"
    if model.pool.shared_cores is None and model.pool.shared_devices is None:
        if len(buckets) > 1:
            return f"the split-0 runtimes of {len(buckets)} buckets would share one accelerator in each router"
        replicas = sum(c.replicas for c in cells if c.split == 0)
        if routers > replicas:
            return f"{routers} routers would each take an accelerator of pool {pools[0]}; split 0 has {replicas}"
    return None


def colocated_gain(
    inp: Inputs,
    problem: E3Problem,
    splits: Sequence[SplitPlan],
    buckets: Sequence[int],
    cells: Sequence[Cell],
) -> float:
    """How much more the cells serve when split 0 sheds the worker's hop (co-located): the least
    capacity over inputs reaching it among the (split, bucket) pairs, with split 0 at its rate without the
    hop (the problem's `colocated_rate`: at its best batch then), over the same without (>= 1; the solver's
    goodput scales by it)."""
    s = len(splits)
    first = {sp.index: sp.first_block for sp in splits}
    last = {sp.index: sp.last_block for sp in splits}
    apart: dict[tuple[int, int], float] = {}
    together: dict[tuple[int, int], float] = {}
    for c in cells:
        rate = _rate(problem, inp, s, c, first, last, buckets)
        serving = inp.models[inp.pool_names.index(c.pool)].profile.serving
        shed = rate
        co = getattr(problem, "colocated_rate", None)
        if c.split == 0 and co is not None:
            shed = max(rate, _rate(problem, inp, s, c, first, last, buckets, co))
        elif c.split == 0 and serving is not None and rate > 0:
            per_batch_s = c.batch_size / rate - serving.hop_ms / 1000.0
            shed = c.batch_size / per_batch_s if per_batch_s > 0 else rate
        key = (c.split, c.bucket)
        apart[key] = apart.get(key, 0.0) + c.replicas * rate
        together[key] = together.get(key, 0.0) + c.replicas * shed
    loads = {}
    for key in apart:
        k = list(buckets).index(key[1])
        loads[key] = float(problem.shares[k] * problem.sigma_in[first[key[0]]]) if k < len(problem.shares) else 0.0
    live = [key for key in apart if loads[key] > 0 and apart[key] > 0]
    if not live:
        return 1.0
    before = min(apart[key] / loads[key] for key in live)
    after = min(together[key] / loads[key] for key in live)
    return max(after / before, 1.0)


def path_limits(
    inp: Inputs,
    problem: E3Problem,
    splits: Sequence[SplitPlan],
    buckets: Sequence[int],
    cells: Sequence[Cell],
    routers: int,
    colocate: bool = False,
) -> list[PathLimit]:
    """The routers' limit and each shared-cores pool's limit on the plan's goodput (empty: none applies).
    `buckets` in the problem's order (its bucket set); `colocate`: split 0 in the routers (why_not_colocate
    must have found nothing against it)."""
    out: list[PathLimit] = []
    per_request_router = colocated_router_ms(inp) if colocate else router_ms(inp)
    if colocate:
        routers = colocated_routers(cells, routers)
    if per_request_router is not None and per_request_router > 0:
        out.append(
            PathLimit(
                routers * 1000.0 / per_request_router,
                f"{routers} router(s) at {per_request_router:.2f} ms CPU per request"
                + (", split 0 in them" if colocate else ""),
            )
        )
    s = len(splits)
    first = {sp.index: sp.first_block for sp in splits}
    last = {sp.index: sp.last_block for sp in splits}
    buckets = list(buckets)
    # per (split, bucket): the whole cell's capacity over its pools (replicas x rate per replica)
    capacity: dict[tuple[int, int], float] = {}
    co = getattr(problem, "colocated_rate", None) if colocate else None  # split 0's rate in the routers, no hop
    for c in cells:
        rate = _rate(problem, inp, s, c, first, last, buckets, co if c.split == 0 else None)
        capacity[(c.split, c.bucket)] = capacity.get((c.split, c.bucket), 0.0) + c.replicas * rate
    busy = dict.fromkeys(inp.pool_names, 0.0)  # core-ms per request on each pool
    for c in cells:
        k = buckets.index(c.bucket)
        total = capacity[(c.split, c.bucket)]
        if total <= 0 or k >= len(problem.shares):
            continue
        load = float(problem.shares[k] * problem.sigma_in[first[c.split]])  # inputs per request reaching the cell
        model = inp.models[inp.pool_names.index(c.pool)]
        threads = model.profile.serving.threads if model.profile.serving is not None else 1
        ms_per_input = 1000.0 * c.replicas / total  # a replica's time per input, the hop included
        if colocate and co is None and c.split == 0 and model.profile.serving is not None:
            ms_per_input = max(ms_per_input - model.profile.serving.hop_ms / max(c.batch_size, 1), 0.0)
        busy[c.pool] += load * ms_per_input * threads
    out.extend(_device_limits(inp, busy, threads_of={m.pool_name: _threads(m) for m in inp.models}))
    shared = {m.pool_name: m.pool.shared_cores for m in inp.models if m.pool.shared_cores is not None}
    all_shared = len(shared) == len(inp.models)
    for pool, cores in shared.items():
        demand = busy.get(pool, 0.0)
        if all_shared and per_request_router:
            demand += per_request_router
        if demand <= 0:
            continue
        with_routers = " and the routers" if all_shared and per_request_router else ""
        out.append(
            PathLimit(
                cores * 1000.0 / demand,
                f"pool {pool}: {cores} shared core(s) at {demand:.2f} core-ms per request (workers{with_routers})",
            )
        )
    return out


def _threads(model: CostModel) -> int:
    return model.profile.serving.threads if model.profile.serving is not None else 1


def _device_limits(inp: Inputs, busy: dict[str, float], threads_of: dict[str, int]) -> list[PathLimit]:
    """Each pool whose worker processes share its accelerators (`sharedDevices`): its batches take turns on
    them, so the pool answers at most devices x 1000 / (device-ms per request). `busy` holds core-ms (a
    replica's time per input x its threads): a device runs one batch at a time, whatever the threads."""
    out = []
    for m in inp.models:
        if m.pool.shared_devices is None:
            continue
        demand = busy.get(m.pool_name, 0.0) / max(threads_of[m.pool_name], 1)
        if demand > 0:
            out.append(
                PathLimit(
                    m.pool.shared_devices * 1000.0 / demand,
                    f"pool {m.pool_name}: {m.pool.shared_devices} shared device(s) at {demand:.2f} device-ms per "
                    f"request ({m.pool.capacity} worker processes take turns on them)",
                )
            )
    return out


def _rate(
    problem: E3Problem,
    inp: Inputs,
    s: int,
    cell: Cell,
    first: dict[int, int],
    last: dict[int, int],
    buckets: Sequence[int],
    table: np.ndarray | None = None,
) -> float:
    """Inputs per second one replica of the cell serves (the solver's rate for its option, or `table`'s)."""
    p = inp.pool_names.index(cell.pool)
    k = list(buckets).index(cell.bucket)
    return float((problem.rate if table is None else table)[s - 1, p, first[cell.split], last[cell.split], k])


def colocated_cells(
    inp: Inputs, problem: E3Problem, splits: Sequence[SplitPlan], buckets: Sequence[int], cells: Sequence[Cell]
) -> list[Cell]:
    """The cells with split 0's batch the best without the worker's hop (the problem's `colocated_batch`):
    what the routers run when split 0 is co-located (the hop the bigger batch amortized is gone)."""
    batch = getattr(problem, "colocated_batch", None)
    if batch is None:
        return list(cells)
    s, first, last = (
        len(splits),
        {sp.index: sp.first_block for sp in splits},
        {sp.index: sp.last_block for sp in splits},
    )
    out = []
    for c in cells:
        if c.split == 0:
            size = int(_rate(problem, inp, s, c, first, last, buckets, batch))
            c = c.model_copy(update={"batch_size": size}) if size >= 1 else c
        out.append(c)
    return out
