"""Arlo: exact allocation vs exhaustive LPs, Algorithm 1 vs a reference reading, autoscaling, replacement."""

from __future__ import annotations

import math

import numpy as np
import pytest

from exitplan.planner.arlo import ScaleState, allocate, autoscale, exhaustive, replacement
from exitplan.planner.dispatch import QueueParams, choose_bucket, ideal_bucket, least_loaded


@pytest.mark.parametrize("seed", range(25))
def test_allocation_equals_exhaustive(seed):
    rng = np.random.default_rng(seed)
    K, N = int(rng.integers(1, 4)), int(rng.integers(1, 7))
    demand = rng.uniform(0, 10, K)
    demand[rng.random(K) < 0.2] = 0.0
    mu = np.sort(rng.uniform(1, 10, K))[::-1]  # longer runtimes are slower per instance
    alloc = allocate(demand, mu, N)
    best = exhaustive(demand, mu, N)
    if math.isinf(best):
        assert math.isinf(alloc.utilisation)
        return
    assert alloc.utilisation == pytest.approx(best, rel=1e-6, abs=1e-9)
    assert alloc.instances.sum() == N or demand.sum() == 0
    alloc.verify(demand, mu, N)


def test_overflow_is_demoted_to_longer_runtimes():
    # All demand is short, but short runtimes are capped by the instance count: flows go up.
    alloc = allocate([10.0, 0.0, 0.0], [5.0, 4.0, 2.0], 2)
    assert alloc.flows[1:, 0].sum() + alloc.flows[0, 0] == pytest.approx(10.0)
    assert alloc.utilisation == pytest.approx(1.0)
    assert alloc.instances.tolist() == [2, 0, 0]


def reference_algorithm_1(length, buckets, load, lam, alpha, peek):
    """Arlo's multi-level queue as stated in its paper: try the ideal runtime, then up to `peek`
    longer ones, each level's congestion threshold decayed by alpha; else stay at the ideal one."""
    ideal = next((i for i, b in enumerate(buckets) if length <= b), None)
    if ideal is None:
        return -1
    for level, j in enumerate(range(ideal, min(len(buckets), ideal + peek + 1))):
        if load[j] < lam * alpha**level:
            return j
    if load[ideal] != math.inf:
        return ideal
    finite = [(load[j], j) for j in range(ideal + 1, min(len(buckets), ideal + peek + 1)) if load[j] != math.inf]
    return min(finite)[1] if finite else -1


def test_algorithm_1_matches_reference():
    rng = np.random.default_rng(3)
    buckets = [16, 32, 64, 128, 256, 512]
    for _ in range(3000):
        load = [float(x) for x in rng.uniform(0, 1.3, len(buckets))]
        for j in range(len(buckets)):
            if rng.random() < 0.1:
                load[j] = math.inf
        length = int(rng.integers(1, 600))
        params = QueueParams(
            lam=float(rng.uniform(0.5, 1.0)), alpha=float(rng.uniform(0.5, 1.0)), peek=int(rng.integers(1, 6))
        )
        want = reference_algorithm_1(length, buckets, load, params.lam, params.alpha, params.peek)
        assert choose_bucket(length, buckets, load, params) == want


def test_algorithm_1_basic_cases():
    buckets = [32, 64, 128]
    assert ideal_bucket(40, buckets) == 1 and ideal_bucket(500, buckets) == -1
    assert choose_bucket(10, buckets, [0.1, 0.1, 0.1]) == 0  # idle ideal runtime
    assert choose_bucket(10, buckets, [0.9, 0.1, 0.1]) == 1  # congested -> demoted one level
    assert choose_bucket(10, buckets, [0.9, 0.8, 0.1]) == 2  # 0.8 >= 0.85 * 0.9 at level 1
    assert choose_bucket(10, buckets, [0.9, 0.9, 0.9]) == 0  # all congested: queue at the ideal one
    assert choose_bucket(100, buckets, [0.0, 0.0, 0.99]) == 2  # never demoted to a shorter runtime
    assert choose_bucket(999, buckets, [0.0, 0.0, 0.0]) == -1


def test_least_loaded_hop():
    assert least_loaded([4, 1, 3], [8, 1, 8]) == 2  # 3/8 < 4/8 < 1/1
    assert least_loaded([0, 0], [0, 4]) == 1  # no capacity -> never chosen
    assert least_loaded([1, 1], [4, 4], skip=[True, True]) == -1


def test_autoscale_target_tracking():
    d, s = autoscale(4, p98_ms=120.0, slo_ms=100.0, now=0.0)
    assert d.instances == math.ceil(4 * 120 / 95)
    d2, s2 = autoscale(d.instances, p98_ms=120.0, slo_ms=100.0, now=10.0, state=s)
    assert d2.instances == d.instances and d2.reason == "cooldown"
    state = ScaleState()
    for t in (100.0, 130.0, 159.0):
        d3, state = autoscale(6, p98_ms=30.0, slo_ms=100.0, now=t, state=state)
        assert d3.instances == 6
    d4, state = autoscale(6, p98_ms=30.0, slo_ms=100.0, now=161.0, state=state)
    assert d4.instances == 5
    d5, _ = autoscale(6, p98_ms=70.0, slo_ms=100.0, now=500.0, state=ScaleState(low_since=0.0))
    assert d5.instances == 6 and d5.reason == "steady"


def test_replacement_moves_the_fewest_instances():
    old, new = [4, 2, 0, 3], [1, 3, 2, 3]
    moves = replacement(old, new)
    started = sum(m.count for m in moves if m.target >= 0)
    assert started == sum(max(0, n - o) for o, n in zip(old, new))
    after = list(old)
    for m in moves:
        if m.source >= 0:
            after[m.source] -= m.count
        if m.target >= 0:
            after[m.target] += m.count
    assert after == new


def test_allocation_with_previous_keeps_instances_in_place():
    demand, mu = [5.0, 5.0], [5.0, 5.0]
    base = allocate(demand, mu, 5)
    kept = allocate(demand, mu, 5, previous=[1, 4])
    assert base.utilisation == kept.utilisation
    assert sum(abs(a - b) for a, b in zip(kept.instances, [1, 4])) <= sum(
        abs(a - b) for a, b in zip(base.instances, [1, 4])
    )
