"""E3's problem and solution as data: `E3Problem` (every option's rate per split count, pool, blocks and
bucket, the caps, cost cap and maxReplicas), `Segment` and `E3Solution` with `verify()`.

The solvers (planner/e3.py: the exact DP; planner/e3_search.py: the goodput search; planner/e3_bounds.py:
certificates that settle a probe without the DP) read these; nothing here solves anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from exitplan.planner.errors import PlanInvalid

FloatArray = npt.NDArray[np.float64]

EPS = 1e-9
"""A replica count is ceil(need / rate - EPS): a goodput at a breakpoint needs exactly r replicas."""


@dataclass
class E3Problem:
    n_blocks: int
    pool_names: list[str]
    caps: np.ndarray
    """Replicas allowed per pool (int, shape P)."""
    costs: np.ndarray
    """Cost per hour of one replica per pool (shape P)."""
    shares: np.ndarray
    """Share of requests per bucket (shape K, sums to 1; a 0 share still gets one replica per split)."""
    sigma_in: np.ndarray
    """Fraction of requests that reach block a (shape N)."""
    rate: np.ndarray
    """Per-replica throughput, shape (max_splits, P, N, N, K); 0 where infeasible."""
    batch: np.ndarray
    """Batch size behind `rate` (same shape)."""
    stage_ms: np.ndarray
    """Stage time behind `rate` (same shape)."""
    cost_cap: float | None = None
    cuts: np.ndarray | None = None
    """cuts[b] (b < N-1): may a split end after block b; None = anywhere."""
    max_replicas: int | None = None
    """The most replicas over all pools (spec.planner.maxReplicas); None: the caps alone."""

    @property
    def max_splits(self) -> int:
        return int(self.rate.shape[0])

    def pool_limits(self) -> FloatArray:
        """The most replicas a plan can put on each pool: its cap, maxReplicas, and what the cost cap
        alone pays for (shape P)."""
        limit = self.caps.astype(np.float64)
        if self.max_replicas is not None:
            limit = np.minimum(limit, float(self.max_replicas))
        if self.cost_cap is not None:
            limit = np.minimum(limit, np.floor(self.cost_cap / self.costs + 1e-9))
        return limit

    def ends_ok(self) -> npt.NDArray[np.bool_]:
        """ends_ok[b]: may a split end after block b (the last block always)."""
        if self.cuts is None:
            return np.ones(self.n_blocks, dtype=bool)
        return np.append(self.cuts.astype(bool), True)

    def fits(self, use: FloatArray) -> bool:
        """Whether replicas `use` per pool keep to the caps, maxReplicas and the cost cap (the DP's tolerances)."""
        if np.any(use > self.caps + EPS):
            return False
        if self.max_replicas is not None and float(use.sum()) > self.max_replicas + EPS:
            return False
        return self.cost_cap is None or float(use @ self.costs) <= self.cost_cap + 1e-9

    def demand(self, goodput: float, s: int) -> FloatArray:
        """Replicas per option (P, N, N) at `goodput` with `s` splits in all; inf where infeasible."""
        rate = self.rate[s - 1]  # (P, N, N, K)
        need = goodput * self.shares[None, None, None, :] * self.sigma_in[None, :, None, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            reps = np.where(rate > 0, np.maximum(1.0, np.ceil(need / np.where(rate > 0, rate, 1.0) - EPS)), np.inf)
        total: FloatArray = reps.sum(axis=-1)
        return total

    def split_goodput(self, s: int, p: int, a: int, b: int, replicas: np.ndarray) -> float:
        """Goodput one split sustains with `replicas` per bucket (inf when it carries no traffic)."""
        best = math.inf
        for k, share in enumerate(self.shares):
            load = share * self.sigma_in[a]
            if load > 0:
                best = min(best, replicas[k] * self.rate[s - 1, p, a, b, k] / load)
        return best


@dataclass
class Segment:
    first: int
    last: int
    pool: int
    replicas: np.ndarray
    """Per bucket."""


@dataclass
class E3Solution:
    splits: int
    segments: list[Segment]
    goodput: float
    cost: float
    probes: int = 0
    notes: list[str] = field(default_factory=list)

    def replicas_per_pool(self, n_pools: int) -> np.ndarray:
        use = np.zeros(n_pools, dtype=np.int64)
        for seg in self.segments:
            use[seg.pool] += int(seg.replicas.sum())
        return use

    def verify(self, problem: E3Problem) -> None:
        """Raise AssertionError-free typed checks: coverage, caps, cost, goodput as claimed."""
        if not self.segments or self.segments[0].first != 0 or self.segments[-1].last != problem.n_blocks - 1:
            raise PlanInvalid("the splits do not cover every block")
        for x, y in zip(self.segments, self.segments[1:]):
            if y.first != x.last + 1:
                raise PlanInvalid("the splits are not contiguous")
        use = self.replicas_per_pool(len(problem.caps))
        if np.any(use > problem.caps):
            raise PlanInvalid(f"replicas per pool {use.tolist()} exceed the caps {problem.caps.tolist()}")
        cost = float(use @ problem.costs)
        if problem.cost_cap is not None and cost > problem.cost_cap + 1e-6:
            raise PlanInvalid(f"cost {cost} exceeds the cap {problem.cost_cap}")
        if problem.max_replicas is not None and int(use.sum()) > problem.max_replicas:
            raise PlanInvalid(f"{int(use.sum())} replicas exceed maxReplicas {problem.max_replicas}")
        got = min(problem.split_goodput(self.splits, s.pool, s.first, s.last, s.replicas) for s in self.segments)
        if got + 1e-6 * max(1.0, got) < self.goodput:
            raise PlanInvalid(f"claimed goodput {self.goodput} but the replicas sustain {got}")
