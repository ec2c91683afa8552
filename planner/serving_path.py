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

A plan's predicted goodput is the least of the solver's and these; the notes say which one binds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from exitplan.api.plan import Cell, SplitPlan
from exitplan.planner.e3 import E3Problem
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


def path_limits(
    inp: Inputs,
    problem: E3Problem,
    splits: Sequence[SplitPlan],
    buckets: Sequence[int],
    cells: Sequence[Cell],
    routers: int,
) -> list[PathLimit]:
    """The routers' limit and each shared-cores pool's limit on the plan's goodput (empty: none applies).
    `buckets` in the problem's order (its bucket set)."""
    out: list[PathLimit] = []
    per_request_router = router_ms(inp)
    if per_request_router is not None and per_request_router > 0:
        out.append(
            PathLimit(
                routers * 1000.0 / per_request_router,
                f"{routers} router(s) at {per_request_router:.2f} ms CPU per request",
            )
        )
    s = len(splits)
    first = {sp.index: sp.first_block for sp in splits}
    last = {sp.index: sp.last_block for sp in splits}
    buckets = list(buckets)
    # per (split, bucket): the whole cell's capacity over its pools (replicas x rate per replica)
    capacity: dict[tuple[int, int], float] = {}
    for c in cells:
        rate = _rate(problem, inp, s, c, first, last, buckets)
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
        busy[c.pool] += load * 1000.0 * c.replicas / total * threads
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


def _rate(
    problem: E3Problem,
    inp: Inputs,
    s: int,
    cell: Cell,
    first: dict[int, int],
    last: dict[int, int],
    buckets: Sequence[int],
) -> float:
    """Inputs per second one replica of the cell serves (the solver's rate for its option)."""
    p = inp.pool_names.index(cell.pool)
    k = list(buckets).index(cell.bucket)
    return float(problem.rate[s - 1, p, first[cell.split], last[cell.split], k])
