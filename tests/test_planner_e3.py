"""E3's exact DP against exhaustive enumeration on small instances (equal objective)."""

from __future__ import annotations

import numpy as np
import pytest

from exitplan.planner.e3 import E3Problem, exhaustive, max_goodput, min_cost
from exitplan.planner.errors import PlanInfeasible


def random_problem(
    rng: np.random.Generator, n: int, pools: int, buckets: int, splits: int, cost_cap: float | None = None
) -> E3Problem:
    caps = rng.integers(1, 6, pools)
    costs = rng.uniform(0.5, 3.0, pools)
    shares = rng.dirichlet(np.ones(buckets))
    if buckets > 1 and rng.random() < 0.3:
        shares[0] = 0.0  # a bucket with no traffic still needs one replica per split
        shares /= shares.sum()
    sigma = np.concatenate([[1.0], np.sort(rng.uniform(0.1, 1.0, n - 1))[::-1]])
    rate = rng.uniform(5.0, 50.0, (splits, pools, n, n, buckets))
    for a in range(n):
        for b in range(n):
            rate[:, :, a, b] = 0.0 if b < a else rate[:, :, a, b] / (b - a + 1)
    rate[rng.random(rate.shape) < 0.1] = 0.0  # options that miss the cycle or memory
    ones = np.ones_like(rate)
    return E3Problem(n, [f"p{i}" for i in range(pools)], caps, costs, shares, sigma, rate, ones, ones, cost_cap)


CASES = [
    (seed, n, p, k, s)
    for seed, (n, p, k, s) in enumerate(
        [(2, 1, 1, 2), (3, 2, 1, 3), (4, 2, 2, 2), (5, 3, 1, 3), (4, 3, 2, 3), (5, 1, 2, 4), (3, 3, 3, 2), (5, 2, 2, 3)]
        * 3
    )
]


def assert_matches_exhaustive(problem) -> None:
    """The DP's max goodput (and its least cost there) equals exhaustive enumeration's; both infeasible alike."""
    best_goodput, best_cost = exhaustive(problem)
    if best_goodput <= 0:
        with pytest.raises(PlanInfeasible):
            max_goodput(problem)
        return
    sol = max_goodput(problem)
    sol.verify(problem)
    assert sol.goodput == pytest.approx(best_goodput, rel=1e-7)
    assert sol.cost == pytest.approx(best_cost, rel=1e-7)


@pytest.mark.parametrize("seed,n,pools,buckets,splits", CASES)
def test_max_goodput_equals_exhaustive(seed, n, pools, buckets, splits):
    rng = np.random.default_rng(seed)
    cap = float(rng.uniform(3, 12)) if seed % 2 else None
    problem = random_problem(rng, n, pools, buckets, splits, cap)
    assert_matches_exhaustive(problem)


@pytest.mark.parametrize("seed", range(8))
def test_min_cost_equals_exhaustive(seed):
    rng = np.random.default_rng(100 + seed)
    problem = random_problem(rng, 4, 2, 2, 3)
    top, _ = exhaustive(problem)
    assert top > 0  # these seeds have plans
    target = top * float(rng.uniform(0.2, 0.95))
    _, best_cost = exhaustive(problem, target=target)
    sol = min_cost(problem, target)
    sol.verify(problem)
    assert sol.goodput >= target * (1 - 1e-9)
    assert sol.cost == pytest.approx(best_cost, rel=1e-9)


def test_min_cost_out_of_reach_names_the_target_field():
    problem = random_problem(np.random.default_rng(7), 3, 1, 1, 2)
    top = max_goodput(problem).goodput
    with pytest.raises(PlanInfeasible) as err:
        min_cost(problem, top * 1.5)
    assert err.value.field == "spec.planner.targetRps"
    assert "out of reach" in str(err.value)


def test_splitting_pays_when_survival_drops():
    """Homogeneous pool, inputs leave after block 0: the optimum gives the later split fewer replicas."""
    n = 4
    sigma = np.array([1.0, 0.2, 0.2, 0.2])
    rate = np.zeros((2, 1, n, n, 1))
    for a in range(n):
        for b in range(a, n):
            rate[:, 0, a, b, 0] = 100.0 / (b - a + 1)
    ones = np.ones_like(rate)
    problem = E3Problem(n, ["gpu"], np.array([10]), np.array([1.0]), np.array([1.0]), sigma, rate, ones, ones)
    sol = max_goodput(problem)
    assert sol.splits == 2
    first, second = sol.segments
    assert first.replicas.sum() > second.replicas.sum()
    one_split = E3Problem(
        n, ["gpu"], np.array([10]), np.array([1.0]), np.array([1.0]), sigma, rate[:1], ones[:1], ones[:1]
    )
    assert sol.goodput > max_goodput(one_split).goodput


@pytest.mark.parametrize("seed", range(6))
def test_feasibility_probe_matches_the_full_dp(seed):
    """The probe the search runs (options that fit their pool, grouped by end) keeps the same
    feasible final states as the full DP with argmins, on instances with larger caps."""
    from exitplan.planner.e3 import _final_values, _Grid, _run_dp

    rng = np.random.default_rng(200 + seed)
    problem = random_problem(rng, 7, 3, 2, 4)
    problem.caps = rng.integers(3, 12, 3)
    grid = _Grid(problem.caps)
    cap_v = problem.caps[grid.value_pool]
    for goodput in rng.uniform(1.0, 60.0, 4):
        for s in range(1, 5):
            full = _run_dp(problem, grid, float(goodput), s, track=False)[0]
            fast = _final_values(problem, grid, float(goodput), s)
            assert np.array_equal(np.where(full <= cap_v, full, np.inf), np.where(fast <= cap_v, fast, np.inf))


@pytest.mark.parametrize("seed", range(40))
def test_max_goodput_equals_exhaustive_random_shapes(seed):
    """Random sizes too (blocks, pools, buckets, split counts, cost cap or none)."""
    rng = np.random.default_rng(1000 + seed)
    n, pools, buckets, splits = (
        int(rng.integers(2, 6)),
        int(rng.integers(1, 4)),
        int(rng.integers(1, 3)),
        int(rng.integers(1, 5)),
    )
    problem = random_problem(rng, n, pools, buckets, splits, float(rng.uniform(3, 12)) if seed % 2 else None)
    assert_matches_exhaustive(problem)


def test_cheap_slow_pool_takes_the_lightly_loaded_late_split():
    """Same cost cap: the fast, dear pool serves the block every input needs; the cheap, slow pool
    (relatively better where batches are small) serves the late block a tenth of the inputs reach."""
    n = 2
    sigma = np.array([1.0, 0.1])
    rate = np.zeros((2, 2, n, n, 1))
    rate[:, 0, 0, 0, 0], rate[:, 0, 1, 1, 0], rate[:, 0, 0, 1, 0] = 100.0, 100.0, 60.0  # pool "fast"
    rate[:, 1, 0, 0, 0], rate[:, 1, 1, 1, 0], rate[:, 1, 0, 1, 0] = 20.0, 50.0, 15.0  # pool "cheap"
    ones = np.ones_like(rate)
    problem = E3Problem(
        n,
        ["fast", "cheap"],
        np.array([10, 10]),
        np.array([3.0, 1.0]),
        np.array([1.0]),
        sigma,
        rate,
        ones,
        ones,
        cost_cap=10.0,
    )
    sol = max_goodput(problem)
    sol.verify(problem)
    assert [(s.first, s.last, problem.pool_names[s.pool], int(s.replicas[0])) for s in sol.segments] == [
        (0, 0, "fast", 3),
        (1, 1, "cheap", 1),
    ]
    assert sol.goodput == pytest.approx(300.0)
    assert exhaustive(problem) == pytest.approx((300.0, 10.0))
