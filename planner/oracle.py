"""The oracle: a fluid upper bound on the goodput of any plan of a service, as a linear program.

Every GPU is busy on exactly the blocks each input needs at its own length (no padding), plus the ramp
after each block it runs (the exit decision needs it; the ramp after the last block is the model's
head), each block at its best per-row cost over the profiled batch sizes (the first with one hop into a
worker per batch, the profile's serving.hopMs), with no latency limit. A pool
may take any share of any block at any length. GPUs are fractional, within each pool's cap, the cost
cap and maxReplicas: the bound spends the service's budget, not every GPU in sight.

    max R  s.t.  sum_p y[p, j] = R d[j]                  (every unit of work served)
                 sum_j c[p, j] y[p, j] / 1000 <= n[p]      (GPU-seconds per second on pool p)
                 0 <= n[p] <= cap[p],  sum_p cost[p] n[p] <= cost cap,  sum_p n[p] <= maxReplicas

j = (length, block): d[j] rows of that length reaching that block per request (from the exit depths
drawn), c[p, j] ms per row at the best batch. Units whose per-row costs agree on every pool are one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from scipy.optimize import linprog

from exitplan.planner.costmodel import CostModel


def _per_row_ms(model: CostModel, length: float, ramps_on: Sequence[bool]) -> np.ndarray:
    """[block]: ms per row of each block with its enabled ramp at `length`, at the best profiled batch."""
    sizes = model.batch_sizes
    comb = model.block_ramp_ms(length, ramps_on)  # (n, batch sizes)
    comb[0] += model.hop_ms  # every input crosses at least one hop into a worker (one split)
    best: np.ndarray = (comb / sizes[None, :]).min(axis=1)
    return best


def oracle_goodput(
    models: Mapping[str, CostModel],
    caps: Mapping[str, int],
    lengths: np.ndarray,
    depths: np.ndarray,
    arrivals_rate: float,
    *,
    costs: Mapping[str, float] | None = None,
    cost_cap: float | None = None,
    max_replicas: int | None = None,
    ramps_on: Sequence[bool] | None = None,
) -> float:
    """The fluid bound in requests/s (at most `arrivals_rate`): inputs of `lengths` that run `depths` blocks
    each, on the pools of `models` within `caps`, the cost cap (per-replica `costs`) and maxReplicas;
    `ramps_on` (default: every ramp) are charged after each block an input runs."""
    names = [p for p in models if caps.get(p, 0) > 0]
    if not names or len(lengths) == 0:
        return 0.0
    ref = models[names[0]]
    n_blocks = ref.n_blocks
    on = list(ramps_on) if ramps_on is not None else [True] * len(ref.ramp_after)
    lengths, depths = np.asarray(lengths), np.asarray(depths)
    uniq, inverse = np.unique(lengths, return_inverse=True)
    # d[l, k]: rows of length uniq[l] reaching block k, per request
    runs = depths[:, None] > np.arange(n_blocks)[None, :]
    demand = np.zeros((len(uniq), n_blocks))
    np.add.at(demand, inverse, runs.astype(np.float64))
    demand /= len(lengths)
    cost = np.stack([np.stack([_per_row_ms(models[p], float(L), on) for L in uniq]) for p in names])  # (P, l, k)
    flat_c, flat_d = cost.reshape(len(names), -1), demand.ravel()
    used = flat_d > 0
    units, where = np.unique(np.round(flat_c[:, used], 12), axis=1, return_inverse=True)
    d = np.zeros(units.shape[1])
    np.add.at(d, np.ravel(where), flat_d[used])
    return min(_solve(units, d, names, caps, costs, cost_cap, max_replicas), float(arrivals_rate))


def _solve(
    c: np.ndarray,
    d: np.ndarray,
    names: list[str],
    caps: Mapping[str, int],
    costs: Mapping[str, float] | None,
    cost_cap: float | None,
    max_replicas: int | None,
) -> float:
    """The LP of the module docstring over units with per-row costs c[p, j] (ms) and demands d[j]."""
    P, J = c.shape
    n_var = P * J + P + 1  # y[p, j], n[p], R
    obj = np.zeros(n_var)
    obj[-1] = -1.0
    a_eq = np.zeros((J, n_var))
    for p in range(P):
        a_eq[np.arange(J), p * J + np.arange(J)] = 1.0
    a_eq[:, -1] = -d
    rows, rhs = [], []
    for p in range(P):
        row = np.zeros(n_var)
        row[p * J : (p + 1) * J] = c[p] / 1e3
        row[P * J + p] = -1.0
        rows.append(row)
        rhs.append(0.0)
    if cost_cap is not None:
        row = np.zeros(n_var)
        row[P * J : P * J + P] = [(costs or {}).get(p, 1.0) for p in names]
        rows.append(row)
        rhs.append(float(cost_cap))
    if max_replicas is not None:
        row = np.zeros(n_var)
        row[P * J : P * J + P] = 1.0
        rows.append(row)
        rhs.append(float(max_replicas))
    bounds = [(0.0, None)] * (P * J) + [(0.0, float(caps[p])) for p in names] + [(0.0, None)]
    res = linprog(obj, A_ub=np.asarray(rows), b_ub=np.asarray(rhs), A_eq=a_eq, b_eq=np.zeros(J), bounds=bounds)
    if not res.success:
        raise RuntimeError(f"the oracle's linear program failed: {res.message}")
    return float(res.x[-1])
