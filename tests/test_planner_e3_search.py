"""The E3 search's shortcuts against the plain DP and exhaustive enumeration: the certificates
(planner/e3_bounds.py) never contradict the DP, the DP over the options they leave is the DP, and a warm
start (a previous plan's layout) returns exactly the cold search's plan."""

from __future__ import annotations

import numpy as np
import pytest
from test_planner_e3 import CASES, assert_matches_exhaustive, random_problem

from exitplan.planner import e3, e3_bounds
from exitplan.planner.e3 import max_goodput, reaches, solution
from exitplan.planner.e3_bounds import Verdict, layout_goodput, multipliers, settle
from exitplan.planner.e3_model import E3Problem
from exitplan.planner.errors import PlanInfeasible


def larger_problem(seed: int) -> E3Problem:
    """Random shapes with caps up to 30, a cost cap, maxReplicas or cuts on some seeds."""
    rng = np.random.default_rng(7000 + seed)
    n, pools, buckets, splits = int(rng.integers(3, 10)), int(rng.integers(1, 4)), int(rng.integers(1, 3)), 4
    problem = random_problem(rng, n, pools, buckets, splits, float(rng.uniform(5, 60)) if seed % 3 == 0 else None)
    problem.caps = rng.integers(1, 30, pools)
    if seed % 4 == 1:
        problem.max_replicas = int(rng.integers(2, 40))
    if seed % 5 == 2:
        problem.cuts = rng.random(n - 1) < 0.6
    return problem


def plan_of(sol) -> list[tuple[int, int, int, list[int]]]:
    return [(g.pool, g.first, g.last, g.replicas.tolist()) for g in sol.segments]


@pytest.mark.parametrize("seed,n,pools,buckets,splits", CASES)
def test_dp_alone_and_dp_over_pruned_options_equal_exhaustive(monkeypatch, seed, n, pools, buckets, splits):
    """With every probe left to the DP (over all options, or over those the bound leaves) the search still
    finds exhaustive enumeration's optimum."""
    rng = np.random.default_rng(seed)
    problem = random_problem(rng, n, pools, buckets, splits, float(rng.uniform(3, 12)) if seed % 2 else None)
    monkeypatch.setattr(e3_bounds, "MAX_LABELS", 0)  # no enumeration: the DP over the options kept
    assert_matches_exhaustive(problem)
    monkeypatch.setattr(e3, "settle", lambda *args, **kwargs: Verdict())  # no certificate at all
    assert_matches_exhaustive(problem)


@pytest.mark.parametrize("seed", range(30))
def test_certificates_agree_with_the_dp(monkeypatch, seed):
    """At goodputs around the optimum: a probe proved infeasible is infeasible for the DP, every witness
    keeps to the limits and reaches the goodput, and the DP over the options kept reaches it exactly
    when the DP over all options does."""
    problem = larger_problem(seed)
    try:
        top = max_goodput(problem).goodput
    except PlanInfeasible:
        top = 10.0
    weights, bounds = multipliers(problem)

    def keep_only(*args, **kwargs):  # the DP over the options the bound leaves, nothing else
        return Verdict(keep=settle(*args, need_keep=True).keep)

    for g in top * np.array([0.5, 0.9, 0.99, 1.0, 1.001, 1.05, 1.3]):
        for s in range(1, problem.max_splits + 1):
            verdict = settle(problem, problem.demand(float(g), s), s, weights, bounds, need_keep=True)
            one = E3Problem(**{**problem.__dict__, "rate": problem.rate.copy()})
            one.rate[[x for x in range(problem.max_splits) if x != s - 1]] = 0.0  # only s splits
            with monkeypatch.context() as m:
                m.setattr(e3, "settle", lambda *args, **kwargs: Verdict())
                dp = reaches(one, float(g))
                m.setattr(e3, "settle", keep_only)
                assert reaches(one, float(g)) == dp
            if verdict.infeasible:
                assert not dp
            for layout in verdict.witnesses:
                sol = solution(problem, float(g), layout)
                assert problem.fits(sol.replicas_per_pool(len(problem.caps)).astype(float))
                assert sol.goodput >= g * (1 - 1e-9)
                assert dp


@pytest.mark.parametrize("seed", range(30))
def test_warm_start_returns_the_cold_plan(seed):
    """The previous plan's layout as a hint (and a stale layout from another problem) changes nothing."""
    problem = larger_problem(seed)
    try:
        cold = max_goodput(problem)
    except PlanInfeasible:
        with pytest.raises(PlanInfeasible):
            max_goodput(problem, hints=[[e3.Segment(0, problem.n_blocks - 1, 0, np.ones(1, dtype=np.int64))]])
        return
    rng = np.random.default_rng(seed)
    cut = int(rng.integers(0, problem.n_blocks - 1)) if problem.n_blocks > 1 else 0
    one_rep = np.ones(len(problem.shares), dtype=np.int64)
    stale = [e3.Segment(0, cut, 0, one_rep), e3.Segment(cut + 1, problem.n_blocks - 1, 0, one_rep)]
    for hints in ([cold.segments], [stale, cold.segments], [stale]):
        warm = max_goodput(problem, hints=hints)
        assert (warm.goodput, warm.cost, warm.splits) == (cold.goodput, cold.cost, cold.splits)
        assert plan_of(warm) == plan_of(cold)


@pytest.mark.parametrize("seed", range(20))
def test_layout_goodput_is_the_largest_goodput_the_layout_reaches(seed):
    """Against a scan of every breakpoint of the layout: the largest at which its replicas fit."""
    problem = larger_problem(seed)
    rng = np.random.default_rng(seed)
    s = int(rng.integers(1, problem.max_splits + 1))
    if s > problem.n_blocks:
        return
    cuts = sorted(rng.choice(np.arange(problem.n_blocks - 1), s - 1, replace=False).tolist())
    bounds_ = list(zip([0, *[c + 1 for c in cuts]], [*cuts, problem.n_blocks - 1]))
    layout = tuple((int(rng.integers(0, len(problem.caps))), a, b) for a, b in bounds_)
    if any(problem.rate[s - 1, p, a, b].min() <= 0 for p, a, b in layout):
        assert layout_goodput(problem, layout) == 0.0  # some bucket cannot run a split of it
        return
    best = 0.0
    for p, a, b in layout:
        for k, share in enumerate(problem.shares):
            rate, load = problem.rate[s - 1, p, a, b, k], share * problem.sigma_in[a]
            if rate <= 0 or load <= 0:
                continue
            for r in range(1, int(problem.caps.max()) + 1):
                g = r * (rate / load)
                sol = solution(problem, g, layout)
                if problem.fits(sol.replicas_per_pool(len(problem.caps)).astype(float)):
                    best = max(best, g)
    assert layout_goodput(problem, layout) == pytest.approx(best, rel=1e-12)
