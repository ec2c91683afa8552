"""The search for E3's largest feasible goodput: `max_goodput` (planner/e3.py) drives it.

Feasibility in the goodput G is a step function that changes only where some option's replica
count steps (`breakpoints`: r * rate / load, r no more than its pool can hold), so per split count
the optimum is its largest feasible breakpoint. `upper_bounds` gives each split count a bound from
the fractional relaxation; `GoodputSearch` races the split counts at levels just below the largest
bound until one is feasible, bisects over that one's breakpoints, and settles every other split
count from what the race saw (out without a probe when seen infeasible below the best so far) or
by probes at and just above the best so far. A probe is the caller's (`Reach`): whether some plan
with s splits reaches G, and if so the largest goodput it knows s to reach (at least G: a witness
plan's own best, planner/e3_bounds.py), which lifts the lower bound past the breakpoints below it.
Lower bounds may also be seeded (`seed`: a previous plan's layout), so a warm search starts there.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from exitplan.planner.e3_model import E3Problem

FloatArray = npt.NDArray[np.float64]
Reach = Callable[[float, int], "float | None"]
"""(goodput G, splits s) -> None when no plan with s splits reaches G, else a goodput >= G that s reaches."""


def breakpoints(problem: E3Problem, s: int, lo: float, hi: float) -> FloatArray:
    """The goodputs in (lo, hi] at which some option's replica count steps, with `s` splits, sorted.

    Option (pool p, blocks [a, b], bucket k) needs r replicas up to G = r * rate / load; only
    r <= the most replicas pool p can hold (its cap, and the cost cap alone) matter, since above
    that the option is out anyway. Feasibility in G is constant between consecutive breakpoints.
    """
    rate = problem.rate[s - 1]  # (P, N, N, K)
    load = np.broadcast_to(problem.shares[None, None, None, :] * problem.sigma_in[None, :, None, None], rate.shape)
    ok = (rate > 0) & (load > 0)
    x = rate[ok] / load[ok]
    limit = problem.pool_limits()
    lim = np.broadcast_to(limit[:, None, None, None], rate.shape)[ok]
    r0 = np.floor(lo / x * (1 + 1e-12)) + 1
    r1 = np.minimum(lim, np.floor(hi / x * (1 + 1e-12)))
    count = np.clip(r1 - r0 + 1, 0, None).astype(np.int64)
    keep = count > 0
    x, r0, count = x[keep], r0[keep], count[keep]
    if not len(x):
        return np.zeros(0)
    starts = np.cumsum(count) - count
    r = np.repeat(r0, count) + (np.arange(int(count.sum())) - np.repeat(starts, count))
    vals = np.sort(np.repeat(x, count) * r)
    vals = vals[(vals > lo) & (vals <= hi)]
    if not len(vals):
        return vals
    # breakpoints closer than 1e-9 (relative) are one: keep the largest of each run
    last = np.append(vals[1:] > vals[:-1] * (1 + 1e-9), True)
    distinct: FloatArray = vals[last]
    return distinct


def upper_bounds(problem: E3Problem) -> FloatArray:
    """A goodput bound per split count (index s-1) from the fractional relaxation.

    Any plan with goodput G puts G * w replicas' worth of work on its splits, w = sum over buckets of
    share * sigma_in / rate, so G * sum_i w_i <= the replicas, each pool's counted at its best
    relative efficiency (at most maxReplicas of them, the most efficient first), and G * sum_i cost_i
    w_i <= the cost cap; the cheapest sum over layouts is a shortest path, taking each split's best pool.
    """
    load = problem.shares[None, None, None, None, :] * problem.sigma_in[None, None, :, None, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        w = np.where(problem.rate > 0, load / np.where(problem.rate > 0, problem.rate, 1.0), np.inf).sum(
            axis=-1
        )  # (S, P, N, N)
    out = np.zeros(problem.max_splits)
    n = problem.n_blocks
    ends_ok = np.ones(n, dtype=bool) if problem.cuts is None else np.append(problem.cuts.astype(bool), True)
    for s in range(1, problem.max_splits + 1):
        ws = w[s - 1]
        # A replica on pool p does at most rho_p of a best-pool replica's work on any split, so the
        # replicas count as sum_p rho_p * caps[p] best-pool replicas.
        best_w = ws.min(axis=0)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(np.isfinite(ws) & np.isfinite(best_w)[None], best_w[None] / ws, 0.0)
        rho = np.nan_to_num(ratio.reshape(len(problem.caps), -1).max(axis=1), nan=0.0)
        total = _replica_capacity(rho, problem.caps, problem.max_replicas)
        bounds = []
        for weight in (ws.min(axis=0), (ws * problem.costs[:, None, None]).min(axis=0)):
            dist = np.full(n + 1, np.inf)
            dist[0] = 0.0
            for _ in range(s):
                nxt = np.full(n + 1, np.inf)
                cand = dist[:n, None] + weight  # (a, b)
                cand[:, ~ends_ok] = np.inf
                nxt[1:] = cand.min(axis=0)
                dist = nxt
            bounds.append(dist[n])
        ub = total / bounds[0] if bounds[0] > 0 else np.inf
        if problem.cost_cap is not None and bounds[1] > 0:
            ub = min(ub, problem.cost_cap / bounds[1])
        out[s - 1] = ub if np.isfinite(bounds[0]) else 0.0
    return out


def _replica_capacity(rho: FloatArray, caps: np.ndarray, max_replicas: int | None) -> float:
    """The most best-pool replicas' worth of work the pools hold: caps[p] replicas of relative efficiency
    rho[p] each, at most `max_replicas` in all (the most efficient pools first)."""
    left = np.inf if max_replicas is None else float(max_replicas)
    total = 0.0
    for p in np.argsort(-rho, kind="stable"):
        take = min(float(caps[p]), left)
        total += float(rho[p]) * take
        left -= take
    return total


RACE = (0.92, 0.85, 0.7, 0.4)
"""The race's probe levels, as fractions of the largest upper bound: the fractional bound is
usually 5-10 % above the optimum, so the first or second level brackets it."""
GALLOP_UP = (0.01, 0.03, 0.07, 0.15)
"""A split count that beats the best so far (lo) is probed at lo x (1 + these) until one is
infeasible: split counts' optima usually lie within a few per cent of each other."""


class GoodputSearch:
    """`max_goodput`'s state per split count (`order`: those with a positive bound, most promising first): the largest
    goodput known feasible (`lower`, 0: none), a bound above which every breakpoint is infeasible (`upper`); `probes`
    counts the probes. `reach(g, s)` is the probe itself (`Reach`)."""

    def __init__(self, problem: E3Problem, reach: Reach) -> None:
        self.problem, self.reach = problem, reach
        self.ubs = ubs = upper_bounds(problem)
        self.probes = 0
        self.order = [s for s in sorted(range(1, problem.max_splits + 1), key=lambda x: -ubs[x - 1]) if ubs[s - 1] > 0]
        self.lower = dict.fromkeys(self.order, 0.0)
        self.upper = {s: ubs[s - 1] * (1 + 1e-9) for s in self.order}

    def seed(self, s: int, goodput: float) -> None:
        """A goodput that split count s is known to reach (a warm start: the previous plan's layout)."""
        if s in self.lower and goodput > self.lower[s]:
            self.lower[s] = goodput
            self.upper[s] = max(self.upper[s], goodput)

    def probe(self, g: float, s: int) -> bool:
        self.probes += 1
        got = self.reach(g, s)
        if got is not None:
            self.seed(s, max(g, got))
            return True
        self.upper[s] = min(self.upper[s], g * (1 - 1e-12))
        return False

    def search(self, s: int, guesses: list[float], gallop_up: bool) -> None:
        """The largest feasible breakpoint of s in (lower[s], upper[s]], lower[s] known feasible or 0."""
        bps = breakpoints(self.problem, s, self.lower[s], self.upper[s])
        known, out = -1, len(bps)  # index known feasible (-1: lower[s]), smallest known infeasible

        def lifted(i: int) -> int:  # a probe may prove more than bps[i]: every breakpoint up to lower[s]
            return min(max(i, int(np.searchsorted(bps, self.lower[s], side="right")) - 1), out - 1)

        for g in guesses:
            i = int(np.searchsorted(bps, g))
            if not known < i < out:
                continue
            if self.probe(float(bps[i]), s):
                known = lifted(i)
                if not gallop_up:
                    break
            else:
                out = i
                if gallop_up:
                    break
        while out - known > 1:
            mid = (known + out) // 2
            if self.probe(float(bps[mid]), s):
                known = lifted(mid)
            else:
                out = mid

    def race(self) -> int | None:
        """The first split count probed feasible at a level of the race (None: none at any level); a
        split count already known to reach the level (seeded) wins without a probe."""
        top = max(self.ubs) if len(self.order) else 0.0
        for level in RACE:
            g = level * top
            for s in self.order:
                if self.lower[s] >= g:
                    return s
                if self.upper[s] < g:
                    continue
                bps = breakpoints(self.problem, s, g * (1 - 1e-12), self.upper[s])
                if len(bps) and self.probe(float(bps[0]), s):
                    return s
        return None

    def settle(self, lead: int | None) -> float:
        """Every split count but the lead settled against the best so far; returns the optimum (0: none)."""
        lo = self.lower[lead] if lead is not None else 0.0
        for s in self.order:
            if s == lead or self.upper[s] < lo * (1 - 1e-9):
                continue  # seen infeasible at or below the best so far
            if lo > 0:
                if self.lower[s] < lo and not self.probe(lo, s):
                    continue  # infeasible at the best so far: infeasible above it too
                self.lower[s] = max(self.lower[s], lo)
            self.search(s, [self.lower[s] * (1 + f) for f in GALLOP_UP] if lo > 0 else [], gallop_up=lo > 0)
            lo = max(lo, self.lower[s])
        return lo

    def ties(self, lo: float) -> list[int]:
        """The split counts known to reach the optimum `lo` (each was probed at it or lifted to it)."""
        return [s for s in self.order if lo > 0 and self.lower[s] >= lo]
