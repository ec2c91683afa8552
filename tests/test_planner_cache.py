"""Re-plans of one service: the OptionCache reuses exactly the options whose inputs did not change (a cached
plan equals a cold one), is invalidated by what they depend on, and holds one plan's tables; the previous
plan's layout warm-starts the search without changing the plan."""

from __future__ import annotations

import numpy as np
from test_planner_service import CPU_POOLS, cpu_profile, cpu_spec

from exitplan.api.resources import PlannerSettings, PoolRef
from exitplan.planner import plan_service
from exitplan.planner.problem import OptionCache
from exitplan.planner.synthetic import gpu_pool, tensorrt_bert_base_profile

THRESHOLDS = {"ramp1": 0.9, "ramp3": 0.9}


def two_pools(capacity: int = 4):
    pools = {n: CPU_POOLS["cpu"].model_copy(update={"capacity": capacity}) for n in ("a", "b")}
    spec = cpu_spec(planner=PlannerSettings(max_splits=2)).model_copy(
        update={"pools": [PoolRef(name="a"), PoolRef(name="b")]}
    )
    return spec, pools


def same(x, y) -> bool:
    """The same plan and the same notes (a cached option's clamps are told again)."""
    return x.plan.model_dump() == y.plan.model_dump() and x.notes == y.notes


def test_a_replan_with_the_same_inputs_reuses_every_option_and_plans_the_same():
    spec, pools = two_pools()
    profiles = {"a": cpu_profile("a"), "b": cpu_profile("b", survival=[0.5, 0.2])}
    lengths = np.r_[np.full(60, 30), np.full(40, 120)]
    cache = OptionCache()
    first = plan_service("s", spec, pools, profiles, thresholds=THRESHOLDS, lengths=lengths, cache=cache)
    assert cache.misses > 0
    misses = cache.misses
    again = plan_service("s", spec, pools, profiles, thresholds=THRESHOLDS, lengths=lengths, cache=cache)
    assert cache.misses == misses  # nothing computed again
    assert same(first, again)
    assert same(again, plan_service("s", spec, pools, profiles, thresholds=THRESHOLDS, lengths=lengths))


def test_the_cache_is_invalidated_by_what_the_options_depend_on():
    spec, pools = two_pools()
    profiles = {"a": cpu_profile("a"), "b": cpu_profile("b")}
    cache = OptionCache()

    def plan(**kw):
        args = {"spec": spec, "pools": pools, "profiles": profiles, "thresholds": THRESHOLDS, **kw}
        before = cache.misses
        cached = plan_service(
            "s", args["spec"], args["pools"], args["profiles"], thresholds=args["thresholds"], cache=cache
        )
        cold = plan_service("s", args["spec"], args["pools"], args["profiles"], thresholds=args["thresholds"])
        assert same(cached, cold)
        return cache.misses - before

    assert plan() > 0
    assert plan() == 0
    # caps, maxGpus and cost do not enter the options: reused
    assert plan(pools={n: p.model_copy(update={"capacity": 6, "cost_per_hour": 2.0}) for n, p in pools.items()}) == 0
    # one pool's profile: only that pool's options again
    slower = cpu_profile("b", survival=[0.6, 0.3])
    slower.blocks[0].latency_ms = [[x * 1.5 for x in row] for row in slower.blocks[0].latency_ms]
    first_b = plan(profiles={"a": profiles["a"], "b": slower})
    assert 0 < first_b
    assert plan(profiles={"a": profiles["a"], "b": slower}) == 0
    # the survival in force (thresholds) and the SLO: every option again
    assert plan(thresholds={"ramp1": 0.9}) >= first_b
    assert plan(spec=spec.model_copy(update={"slo": spec.slo.model_copy(update={"latency_ms": 300})})) >= first_b
    # a pool's memory or link: that pool's options again
    assert plan(pools={**pools, "a": pools["a"].model_copy(update={"link_bandwidth_gbps": 1.0})}) > 0


def test_the_cache_holds_only_the_last_plans_tables():
    spec, pools = two_pools()
    cache = OptionCache()
    for survival in ([0.6, 0.3], [0.5, 0.3], [0.4, 0.2], [0.3, 0.1]):
        profiles = {"a": cpu_profile("a", survival=survival), "b": cpu_profile("b", survival=survival)}
        plan_service("s", spec, pools, profiles, thresholds=THRESHOLDS, cache=cache)
        held = len(cache)
    fresh = OptionCache()
    plan_service("s", spec, pools, profiles, thresholds=THRESHOLDS, cache=fresh)
    assert held == len(fresh)


def test_a_trimming_pools_options_follow_the_length_mix():
    """CPU workers that end the model trim to their batch's longest row: their options depend on the lengths
    (lengths of 20 and 300 lie outside the profiled 32..128: the clamp notes come back on a cache hit)."""
    spec, pools = two_pools()
    spec = spec.model_copy(update={"planner": spec.planner.model_copy(update={"rebatch": False})})
    profiles = {"a": cpu_profile("a"), "b": cpu_profile("b")}
    cache = OptionCache()
    mixes = (np.full(100, 100), np.r_[np.full(50, 20), np.full(50, 100)], np.full(100, 100), np.full(100, 300))
    for lengths in mixes + mixes:
        cached = plan_service("s", spec, pools, profiles, thresholds=THRESHOLDS, lengths=lengths, cache=cache)
        assert same(cached, plan_service("s", spec, pools, profiles, thresholds=THRESHOLDS, lengths=lengths))


def test_a_replan_from_the_previous_plan_is_the_cold_plan():
    """The previous plan's layout seeds the search (warm start): the plan is the one a cold search makes."""
    pools = {g: gpu_pool(g, 8) for g in ("a100", "t4")}
    profiles = {g: tensorrt_bert_base_profile(g, seq_lens=(128, 384)) for g in pools}
    thresholds = {r.name: 0.9 for r in profiles["t4"].ramps}
    spec = cpu_spec(planner=PlannerSettings(max_splits=4)).model_copy(
        update={"pools": [PoolRef(name=g) for g in pools], "slo": cpu_spec().slo.model_copy(update={"latency_ms": 100})}
    )
    lengths = np.r_[np.full(80, 128), np.full(20, 384)]
    first = plan_service("s", spec, pools, profiles, thresholds=thresholds, lengths=lengths)
    for survival_scale in (1.0, 0.9, 0.7):
        drifted = {
            g: p.model_copy(update={"survival": [s * survival_scale for s in p.survival]}) for g, p in profiles.items()
        }
        warm = plan_service(
            "s", spec, pools, drifted, thresholds=thresholds, lengths=lengths, previous=first.plan, reason="drift"
        )
        cold = plan_service("s", spec, pools, drifted, thresholds=thresholds, lengths=lengths, reason="drift")
        assert warm.alternatives == cold.alternatives  # every bucket set's optimum, warm or cold
        if not warm.kept_previous:
            assert same(warm, cold)


def test_a_layout_kept_from_the_previous_plan_reuses_the_larger_tables():
    """The previous layout's problem (its own split count) is served from the tables of more split counts: no
    option computed again, and the plan is the one made without a cache."""
    spec, pools = two_pools()
    spec = spec.model_copy(update={"planner": spec.planner.model_copy(update={"max_splits": 3})})
    profiles = {"a": cpu_profile("a"), "b": cpu_profile("b")}
    cache = OptionCache()
    first = plan_service("s", spec, pools, profiles, thresholds=THRESHOLDS, cache=cache)
    misses = cache.misses
    kept = plan_service(
        "s", spec, pools, profiles, thresholds=THRESHOLDS, cache=cache, previous=first.plan, keep_layout=True
    )
    assert cache.misses == misses and kept.kept_previous
    cold = plan_service("s", spec, pools, profiles, thresholds=THRESHOLDS, previous=first.plan, keep_layout=True)
    assert same(kept, cold)
