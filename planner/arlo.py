"""Arlo: allocation of instances across length-bucket runtimes, target-tracking autoscaling, and the
replacement plan that changes the fewest instances. (The request scheduler, Algorithm 1, lives in
`dispatch.py`, shared with the router.)

The allocation integer program, as implemented here (our reading of Arlo's Eq. 1-7):

    variables  n_i in Z>=0     instances of runtime i (bucket i, shortest first)
               x_ij >= 0       requests/s of length class j served by runtime i, i >= j (demotion
                               only to longer runtimes, which can hold the input)
    (1) sum_i n_i <= N                       instances available
    (2) sum_{i >= j} x_ij = lambda_j         every class is served
    (3) sum_{j <= i} x_ij <= U * n_i mu_i    runtime i at most at utilisation U (mu_i: requests/s
                                             one instance of runtime i sustains)
    objective: minimise the peak utilisation U (then spare instances go to the busiest runtime).

Exact solution: because demotion only goes upward, the flow x exists iff for every m the classes
m..K fit in the runtimes m..K (Hall's condition on nested sets): D_m = sum_{j>=m} lambda_j <=
U * sum_{i>=m} n_i mu_i. For a given U the fewest instances meeting every suffix condition are
placed greedily from the longest runtime down (exact when mu does not grow with length: capacity
on a shorter runtime is worth at least as much to every condition it enters); a bisection on U
finds the least U whose count fits N. `exhaustive` checks it against linear programs over every
allocation on small instances.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from exitplan.planner.errors import PlanInfeasible


@dataclass
class Allocation:
    instances: np.ndarray
    """Per bucket (int)."""
    utilisation: float
    """The least peak utilisation U (inf if some class cannot be served)."""
    flows: np.ndarray = field(repr=False, default_factory=lambda: np.zeros((0, 0)))
    """flows[i, j]: requests/s of class j on runtime i (greedy: each class as short as it fits)."""

    def verify(self, demand: np.ndarray, mu: np.ndarray, total: int) -> None:
        from exitplan.planner.errors import PlanInvalid

        if self.instances.sum() > total or np.any(self.instances < 0):
            raise PlanInvalid(f"allocation {self.instances.tolist()} uses more than {total} instances")
        cap = self.utilisation * self.instances * mu
        if np.any(self.flows.sum(axis=1) > cap * (1 + 1e-6) + 1e-9):
            raise PlanInvalid("a runtime carries more than U x its capacity")
        if not np.allclose(self.flows.sum(axis=0), demand, rtol=1e-6, atol=1e-9):
            raise PlanInvalid("the flows do not serve every length class")


def _min_instances(demand: np.ndarray, mu: np.ndarray, util: float) -> np.ndarray:
    """The fewest instances meeting every suffix condition at utilisation `util`."""
    K = len(demand)
    suffix = np.cumsum(demand[::-1])[::-1]
    n = np.zeros(K, dtype=np.int64)
    have = 0.0
    for m in range(K - 1, -1, -1):
        need = suffix[m] / util - have
        if need > 1e-12:
            if mu[m] <= 0:
                n[m] = 10**12  # cannot help; forces infeasibility unless a longer runtime covers it
                continue
            n[m] = math.ceil(need / mu[m] - 1e-9)
            have += n[m] * mu[m]
    return n


def _flows(demand: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Each class on its own runtime as far as it fits, the overflow demoted upward."""
    K = len(demand)
    flows = np.zeros((K, K))
    carry: list[tuple[int, float]] = []
    for i in range(K):
        carry.append((i, float(demand[i])))
        room = float(capacity[i])
        left = []
        for j, amount in carry:
            take = min(amount, room)
            flows[i, j] += take
            room -= take
            if amount - take > 1e-12:
                left.append((j, amount - take))
        carry = left
    if carry and K:
        for j, amount in carry:  # numerical dust at the top
            flows[K - 1, j] += amount
    return flows


def allocate(
    demand: Sequence[float], mu: Sequence[float], total: int, previous: Sequence[int] | None = None
) -> Allocation:
    """The least-peak-utilisation allocation of `total` instances (see the module docstring).

    Spare instances go one at a time to the runtime with the highest own load per capacity;
    with `previous`, ties keep instances where they were (fewest replaced).
    """
    d = np.asarray(demand, dtype=np.float64)
    m = np.asarray(mu, dtype=np.float64)
    K = len(d)
    if K == 0 or len(m) != K:
        raise PlanInfeasible("demand and per-instance rates must have one entry per bucket", field="buckets")
    if total < 0:
        raise PlanInfeasible(f"instances must be >= 0, got {total}", field="instances")
    if np.any(d < 0) or np.any(m < 0):
        raise PlanInfeasible("demand and rates must be >= 0", field="demand")
    if d.sum() <= 0:
        n = np.zeros(K, dtype=np.int64)
        n[-1] = min(total, 1)
        return Allocation(n, 0.0, np.zeros((K, K)))
    if total == 0 or m[-1] <= 0:
        return Allocation(np.zeros(K, dtype=np.int64), math.inf, np.zeros((K, K)))
    lo, hi = 0.0, 1.0
    while _min_instances(d, m, hi).sum() > total:
        hi *= 2.0
        if hi > 1e12:
            return Allocation(np.zeros(K, dtype=np.int64), math.inf, np.zeros((K, K)))
    # lo is infeasible (U -> 0 needs infinitely many), hi feasible.
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _min_instances(d, m, mid).sum() <= total:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-12 * hi:
            break
    n = _min_instances(d, m, hi)
    util = _peak(d, m, n)
    n = _spend_spare(d, m, n, total, previous)
    return Allocation(n, util, _flows(d, util * n * m))


def _peak(demand: np.ndarray, mu: np.ndarray, n: np.ndarray) -> float:
    """max_m D_m / C_m: the least U at which allocation n serves every class."""
    D = np.cumsum(demand[::-1])[::-1]
    C = np.cumsum((n * mu)[::-1])[::-1]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(D > 0, np.where(C > 0, D / np.where(C > 0, C, 1.0), np.inf), 0.0)
    return float(ratio.max())


def _spend_spare(d: np.ndarray, m: np.ndarray, n: np.ndarray, total: int, previous: Sequence[int] | None) -> np.ndarray:
    n = n.copy()
    prev = np.asarray(previous, dtype=np.int64) if previous is not None and len(previous) == len(n) else None
    spare = total - int(n.sum())
    while spare > 0:
        own = np.where(m > 0, d / np.maximum(n * m, 1e-12), -np.inf)
        if prev is not None and np.any(prev > n):
            # Keep instances where they were: fill the runtimes that shrank first, busiest first.
            own = np.where(prev > n, own + 1e6, own)
        i = int(np.argmax(own))
        n[i] += 1
        spare -= 1
    return n


def exhaustive(demand: Sequence[float], mu: Sequence[float], total: int) -> float:
    """The least peak utilisation over every allocation, each checked by a linear program (tests)."""
    from itertools import product

    from scipy.optimize import linprog

    d = np.asarray(demand, dtype=np.float64)
    m = np.asarray(mu, dtype=np.float64)
    K = len(d)
    best = math.inf
    pairs = [(i, j) for i in range(K) for j in range(K) if i >= j]
    for n in product(range(total + 1), repeat=K):
        if sum(n) > total:
            continue
        # variables: x_ij for pairs, then U; minimise U
        nv = len(pairs) + 1
        c = np.zeros(nv)
        c[-1] = 1.0
        a_eq = np.zeros((K, nv))
        for v, (_, j) in enumerate(pairs):
            a_eq[j, v] = 1.0
        a_ub = np.zeros((K, nv))
        for v, (i, _) in enumerate(pairs):
            a_ub[i, v] = 1.0
        for i in range(K):
            a_ub[i, -1] = -n[i] * m[i]
        res = linprog(c, A_ub=a_ub, b_ub=np.zeros(K), A_eq=a_eq, b_eq=d, bounds=[(0, None)] * nv, method="highs")
        if res.status == 0:
            best = min(best, float(res.fun))
    return best


# ---------------------------------------------------------------- autoscaling and replacement


@dataclass(frozen=True)
class ScaleState:
    low_since: float | None = None
    """When p98 first went below the scale-in mark (None: it is not below)."""
    last_change: float = -math.inf


@dataclass(frozen=True)
class ScaleDecision:
    instances: int
    reason: str


def autoscale(
    instances: int,
    p98_ms: float,
    slo_ms: float,
    now: float,
    state: ScaleState = ScaleState(),
    *,
    out_at: float = 0.95,
    in_at: float = 0.5,
    in_period_s: float = 60.0,
    cooldown_s: float = 30.0,
    min_instances: int = 1,
    max_instances: int = 1 << 30,
) -> tuple[ScaleDecision, ScaleState]:
    """Target tracking (pure): p98 >= out_at x SLO -> scale out to instances x p98 / (out_at x SLO)
    (at least +1); p98 < in_at x SLO for `in_period_s` -> scale in by one. A cooldown separates changes."""
    if now - state.last_change < cooldown_s:
        return ScaleDecision(instances, "cooldown"), state
    if p98_ms >= out_at * slo_ms:
        want = max(instances + 1, math.ceil(instances * p98_ms / (out_at * slo_ms)))
        want = min(want, max_instances)
        if want != instances:
            return ScaleDecision(want, f"p98 {p98_ms:.1f} ms >= {out_at:.0%} of the SLO"), ScaleState(None, now)
        return ScaleDecision(instances, "at the maximum"), ScaleState(None, state.last_change)
    if p98_ms < in_at * slo_ms:
        since = state.low_since if state.low_since is not None else now
        if now - since >= in_period_s and instances > min_instances:
            return ScaleDecision(
                instances - 1, f"p98 below {in_at:.0%} of the SLO for {now - since:.0f} s"
            ), ScaleState(None, now)
        return ScaleDecision(instances, "low, waiting"), ScaleState(since, state.last_change)
    return ScaleDecision(instances, "steady"), ScaleState(None, state.last_change)


@dataclass(frozen=True)
class Move:
    source: int
    target: int
    count: int


def replacement(old: Sequence[int], new: Sequence[int]) -> list[Move]:
    """Instances to re-purpose from shrinking buckets to growing ones (nearest first); starts (-1 as
    source) and stops (-1 as target) only for the net change. Moves sum(max(0, new - old)) at most,
    the fewest possible."""
    o, n = np.asarray(old, dtype=np.int64), np.asarray(new, dtype=np.int64)
    give = [[i, int(o[i] - n[i])] for i in range(len(o)) if o[i] > n[i]]  # [bucket, instances left to give]
    take = [(i, int(n[i] - o[i])) for i in range(len(o)) if n[i] > o[i]]
    moves: list[Move] = []
    for j, want in take:
        while want > 0 and give:
            give.sort(key=lambda g: abs(g[0] - j))
            src = give[0]
            k = min(want, src[1])
            moves.append(Move(src[0], j, k))
            want -= k
            src[1] -= k
            if src[1] == 0:
                give.pop(0)
        if want > 0:
            moves.append(Move(-1, j, want))
    for i, left in give:
        if left > 0:
            moves.append(Move(i, -1, left))
    return moves
