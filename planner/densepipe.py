"""DensePipe: skip-probability-aware placement of splits on heterogeneous pools (an integer program).

Given a fixed layout of splits, where split i is executed by a fraction q_i of the inputs (1 minus
its skip probability: the survival before it), place replicas x_ip of every split on every pool:

    variables  x_ip in Z>=0 (replicas of split i on pool p), Z >= 0 (goodput, requests/s)
    (a) sum_i x_ip <= cap_p                            pool capacity
    (b) x_ip = 0 where split i does not fit pool p's memory
    (c) sum_p x_ip mu_ip >= Z q_i                      every split keeps up with its share
    (d) sum_p x_ip mu_ip / q_i <= (1 + balance) * sum_p x_jp mu_jp / q_j   for adjacent i, j
                                                       (no stage far faster than its neighbour)
    (e) sum_ip x_ip cost_p <= cost cap (when the service has one)
    objective: maximise Z, then minimise cost sum_ip x_ip cost_p.

Often-executed splits get more (and faster) replicas; a split may span pools. Solved with OR-Tools
CP-SAT on integers (capacities scaled to 1e-4 of the largest), with a time limit; an instance it
cannot solve to optimality is reported as such (`Placement.optimal`), an infeasible one raises
PlanInfeasible. The hop between splits is `dispatch.least_loaded` (running / capacity).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from exitplan.planner.errors import PlanInfeasible, PlanInvalid

SCALE = 10_000

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass
class Placement:
    replicas: np.ndarray
    """replicas[i, p]."""
    goodput: float
    cost: float
    optimal: bool

    def verify(self, mu: np.ndarray, q: np.ndarray, caps: np.ndarray, fits: np.ndarray) -> None:
        if np.any(self.replicas.sum(axis=0) > caps):
            raise PlanInvalid("placement exceeds a pool's capacity")
        if np.any((self.replicas > 0) & ~fits):
            raise PlanInvalid("placement puts a split on a pool whose memory it does not fit")
        cap = (self.replicas * mu).sum(axis=1)
        if np.any(cap + 1e-9 < self.goodput * q):
            raise PlanInvalid("a split cannot keep up with the claimed goodput")


def place(
    mu: Sequence[Sequence[float]] | FloatArray,
    q: Sequence[float] | FloatArray,
    caps: Sequence[int] | IntArray,
    costs: Sequence[float] | FloatArray,
    fits: np.ndarray | None = None,
    balance: float | None = None,
    time_limit_s: float = 5.0,
    cost_cap: float | None = None,
) -> Placement:
    """Maximise goodput (then minimise cost) over integer replica placements; see the module docstring.

    mu[i][p]: requests/s one replica of split i on pool p takes in (0 = cannot run there).
    """
    from ortools.sat.python import cp_model

    mu_a = np.asarray(mu, dtype=np.float64)
    q_a = np.asarray(q, dtype=np.float64)
    caps_a = np.asarray(caps, dtype=np.int64)
    costs_a = np.asarray(costs, dtype=np.float64)
    n, P = mu_a.shape
    fits_a = (mu_a > 0) if fits is None else (np.asarray(fits, dtype=bool) & (mu_a > 0))
    if np.any(q_a <= 0) or np.any(q_a > 1):
        raise PlanInfeasible("execution probabilities must lie in (0, 1]", field="q")
    if not np.all(fits_a.any(axis=1)):
        i = int(np.flatnonzero(~fits_a.any(axis=1))[0])
        raise PlanInfeasible(
            f"split {i} fits no pool (memory or rate); give it more memory or split it further", field=f"splits[{i}]"
        )
    # normalised capacity units: a replica of split i on pool p adds mu_ip / q_i goodput to split i
    unit = np.where(fits_a, mu_a / q_a[:, None], 0.0)
    scale = SCALE / unit.max()
    w = np.round(unit * scale).astype(np.int64)

    def build(fix_goodput: int | None) -> tuple[cp_model.CpModel, list[list[cp_model.IntVar]], cp_model.IntVar]:
        m = cp_model.CpModel()
        x = [[m.new_int_var(0, int(caps_a[p]) if fits_a[i, p] else 0, f"x{i}_{p}") for p in range(P)] for i in range(n)]
        ub = int(w.max() * caps_a.sum()) + 1
        z = m.new_int_var(0, ub, "z")
        for p in range(P):  # (a)
            m.add(sum(x[i][p] for i in range(n)) <= int(caps_a[p]))
        if cost_cap is not None:  # the service's cost cap, in thousandths
            m.add(
                sum(int(round(costs_a[p] * 1000)) * x[i][p] for i in range(n) for p in range(P))
                <= int(cost_cap * 1000 + 1e-6)
            )
        level = [sum(int(w[i, p]) * x[i][p] for p in range(P)) for i in range(n)]
        for i in range(n):  # (c)
            m.add(level[i] >= z)
        if balance is not None:  # (d)
            num, den = int(round((1 + balance) * 1000)), 1000
            for i in range(n - 1):
                m.add(den * level[i] <= num * level[i + 1])
                m.add(den * level[i + 1] <= num * level[i])
        if fix_goodput is None:
            m.maximize(z)
        else:
            m.add(z >= fix_goodput)
            m.minimize(sum(int(round(costs_a[p] * 1000)) * x[i][p] for i in range(n) for p in range(P)))
        return m, x, z

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 1
    model, x, z = build(None)
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise PlanInfeasible(
            "no placement fits the pools' capacities and the balance limit; raise capacity or the balance",
            field="pools",
        )
    optimal = status == cp_model.OPTIMAL
    best_z = int(solver.value(z))
    model, x, z = build(best_z)
    status = solver.solve(model)
    optimal = optimal and status == cp_model.OPTIMAL
    reps = np.asarray([[solver.value(x[i][p]) for p in range(P)] for i in range(n)], dtype=np.int64)
    goodput = float(((reps * mu_a).sum(axis=1) / q_a).min())
    return Placement(reps, goodput, float((reps.sum(axis=0) * costs_a).sum()), optimal)


def exhaustive(
    mu: Sequence[Sequence[float]],
    q: Sequence[float],
    caps: Sequence[int],
    costs: Sequence[float],
    balance: float | None = None,
) -> float:
    """The best goodput over every placement (tests; balance checked on the same scaled units)."""
    from itertools import product

    mu_a, q_a = np.asarray(mu, dtype=np.float64), np.asarray(q, dtype=np.float64)
    n, P = mu_a.shape
    unit = np.where(mu_a > 0, mu_a / q_a[:, None], 0.0)
    scale = SCALE / unit.max()
    w = np.round(unit * scale).astype(np.int64)
    best = -1.0
    ranges = [range(int(caps[p]) + 1) if mu_a[i, p] > 0 else range(1) for i in range(n) for p in range(P)]
    for flat in product(*ranges):
        x = np.asarray(flat).reshape(n, P)
        if np.any(x.sum(axis=0) > np.asarray(caps)):
            continue
        level = (w * x).sum(axis=1)
        if balance is not None:
            num = int(round((1 + balance) * 1000))
            if any(1000 * level[i] > num * level[i + 1] or 1000 * level[i + 1] > num * level[i] for i in range(n - 1)):
                continue
        best = max(best, float(level.min()))
    return best / scale if best >= 0 else -1.0
