"""plan_service: sound plans (verify), the local CPU case, buckets, previous plans, and bad input."""

from __future__ import annotations

import numpy as np
import pytest

from exitplan.api.observations import Observations
from exitplan.api.resources import (
    SLO,
    Accuracy,
    EarlyExitServiceSpec,
    GPUPoolSpec,
    ModelRef,
    PlannerSettings,
    PoolRef,
    Workload,
)
from exitplan.planner import PlanInfeasible, ProfileError, SpecError, plan_change, plan_service
from exitplan.planner.synthetic import bert_base_profile, gpu_pool, synthetic_profile

SEQ = [32, 64, 128]


def cpu_profile(pool: str = "cpu", **kw):
    """A MiniLM-on-CPU-like profile: 6 blocks, latency ~ linear in batch x length, ramps after 1 and 3."""
    return synthetic_profile(
        "minilm",
        pool,
        6,
        SEQ,
        [1, 2, 4, 8],
        lambda k, b, L: 0.4 + 0.02 * b * L,
        ramp_after=[1, 3],
        ramp_ms=lambda b, L: 0.05,
        survival=kw.pop("survival", [0.6, 0.3]),
        output_bytes=lambda L: 384 * 4 * L,
        weight_bytes=7_000_000,
        **kw,
    )


def cpu_spec(**kw) -> EarlyExitServiceSpec:
    planner = kw.pop("planner", PlannerSettings(max_splits=2))
    return EarlyExitServiceSpec(
        model=ModelRef(name="minilm", bundle="x"),
        slo=SLO(latency_ms=kw.pop("slo", 250), slack_ms=20),
        pools=[PoolRef(name="cpu")],
        planner=planner,
        **kw,
    )


CPU_POOLS = {
    "cpu": GPUPoolSpec(capacity=2, gpu_resource="", cost_per_hour=1.0, memory_bytes=4 << 30, link_bandwidth_gbps=20)
}


def test_local_cpu_plan_is_runnable():
    result = plan_service(
        "minilm", cpu_spec(), CPU_POOLS, {"cpu": cpu_profile()}, thresholds={"ramp1": 0.8, "ramp3": 0.8}
    )
    result.verify()
    plan = result.plan
    assert sum(c.replicas for c in plan.cells) <= 2  # pool capacity = worker processes
    assert all(c.replicas >= 1 and c.batch_size in (1, 2, 4, 8) for c in plan.cells)
    assert set(plan.buckets) <= set(SEQ)
    for s in plan.splits:  # every (split, bucket) the router may send to has a replica
        for b in plan.buckets:
            assert any(c.split == s.index and c.bucket == b for c in plan.cells)
    assert plan.thresholds == {"ramp1": 0.8, "ramp3": 0.8}
    assert plan.prediction.p99_ms <= 230 + 1e-6


def test_length_observations_give_several_buckets_within_capacity():
    pools = {"cpu": CPU_POOLS["cpu"].model_copy(update={"capacity": 6})}
    lengths = np.r_[np.full(700, 20), np.full(300, 120)]
    result = plan_service("minilm", cpu_spec(), pools, {"cpu": cpu_profile()}, lengths=lengths)
    result.verify()
    assert len(result.plan.buckets) >= 2 and result.plan.buckets[-1] == 128
    assert result.plan.length_histogram[0] == pytest.approx(0.7)
    single = plan_service(
        "minilm", cpu_spec(workload=Workload(length_buckets=[128])), pools, {"cpu": cpu_profile()}, lengths=lengths
    )
    assert result.plan.prediction.goodput_rps > single.plan.prediction.goodput_rps


def test_observation_window_sets_survival_and_histogram():
    obs = Observations(
        service="minilm",
        model="minilm",
        since=0,
        until=60,
        ramps=["ramp1", "ramp3"],
        survival=[0.2, 0.1],
        length_buckets=[32, 64, 128],
        length_histogram=[90, 0, 10],
        thresholds={"ramp1": 0.8, "ramp3": 0.8},
    )
    pools = {"cpu": CPU_POOLS["cpu"].model_copy(update={"capacity": 4})}
    result = plan_service("minilm", cpu_spec(), pools, {"cpu": cpu_profile()}, observations=obs)
    result.verify()
    assert result.plan.survival == pytest.approx([0.2, 0.1])
    assert result.plan.thresholds == {"ramp1": 0.8, "ramp3": 0.8}  # the thresholds it was sized with
    assert result.plan.buckets[-1] == 128
    # a window without thresholds: the plan names none, so the data plane exits nowhere -- and it is sized so
    bare = plan_service(
        "minilm", cpu_spec(), pools, {"cpu": cpu_profile()}, observations=obs.model_copy(update={"thresholds": {}})
    )
    assert bare.plan.thresholds == {} and bare.plan.survival == [1.0, 1.0]
    assert bare.plan.prediction.goodput_rps < result.plan.prediction.goodput_rps
    assert any("without exits" in n for n in bare.notes)


def test_thresholds_off_mean_no_exits_and_less_goodput():
    spec = cpu_spec()
    on = plan_service("minilm", spec, CPU_POOLS, {"cpu": cpu_profile()}, thresholds={"ramp1": 0.5, "ramp3": 0.5})
    off = plan_service("minilm", spec, CPU_POOLS, {"cpu": cpu_profile()}, thresholds={"ramp1": 2.0})
    assert off.plan.survival == [1.0, 1.0]
    assert off.plan.prediction.goodput_rps < on.plan.prediction.goodput_rps
    only3 = plan_service("minilm", spec, CPU_POOLS, {"cpu": cpu_profile()}, thresholds={"ramp3": 0.5})
    assert only3.plan.survival == pytest.approx([1.0, 0.3])  # ramp1's exits ride on to ramp3


def test_heterogeneous_pools_and_cost_cap():
    gpus = ["v100", "p100", "k80"]
    spec = EarlyExitServiceSpec(
        model=ModelRef(name="bert-base-ee", bundle="x"),
        slo=SLO(latency_ms=100),
        pools=[PoolRef(name=g) for g in gpus],
        planner=PlannerSettings(max_splits=3, cost_cap_per_hour=20.0),
    )
    result = plan_service("bert", spec, {g: gpu_pool(g, 4) for g in gpus}, {g: bert_base_profile(g) for g in gpus})
    result.verify()
    assert result.plan.prediction.cost_per_hour <= 20.0 + 1e-9


def test_previous_layout_is_kept_when_close():
    profiles = {"cpu": cpu_profile()}
    pools = {"cpu": CPU_POOLS["cpu"].model_copy(update={"capacity": 4})}
    first = plan_service("minilm", cpu_spec(), pools, profiles)
    again = plan_service(
        "minilm",
        cpu_spec(),
        pools,
        {"cpu": cpu_profile(survival=[0.58, 0.3])},
        previous=first.plan,
        reason="survival-drift",
    )
    again.verify()
    assert again.kept_previous
    assert [(s.first_block, s.last_block) for s in again.plan.splits] == [
        (s.first_block, s.last_block) for s in first.plan.splits
    ]
    change = plan_change(first.plan, again.plan)
    assert change.added <= 1 and again.plan.reason == "survival-drift"


def test_min_cost_objective_reaches_target_cheaply():
    pools = {"cpu": CPU_POOLS["cpu"].model_copy(update={"capacity": 8})}
    top = plan_service("minilm", cpu_spec(), pools, {"cpu": cpu_profile()}).plan.prediction.goodput_rps
    spec = cpu_spec(planner=PlannerSettings(max_splits=2, objective="min-cost", target_rps=top * 0.3))
    cheap = plan_service("minilm", spec, pools, {"cpu": cpu_profile()})
    cheap.verify()
    assert cheap.plan.prediction.goodput_rps >= top * 0.3
    assert cheap.plan.prediction.cost_per_hour < 8


# ---------------------------------------------------------------- bad input


def test_slo_no_pool_can_meet_names_the_slo():
    with pytest.raises(PlanInfeasible) as err:
        plan_service("minilm", cpu_spec(slo=25), CPU_POOLS, {"cpu": cpu_profile()})
    assert err.value.field == "spec.slo.latencyMs"
    assert "SLO budget 5 ms" in str(err.value) and "pool cpu" in str(err.value)


def test_pool_without_capacity():
    pools = {"cpu": CPU_POOLS["cpu"].model_copy(update={"capacity": 0})}
    with pytest.raises(PlanInfeasible) as err:
        plan_service("minilm", cpu_spec(), pools, {"cpu": cpu_profile()})
    assert err.value.field == "spec.pools" and "no capacity" in str(err.value)


def test_missing_cells_non_monotone_negative_latencies():
    prof = cpu_profile()
    missing = prof.model_copy(deep=True)
    missing.blocks[2].latency_ms[1] = missing.blocks[2].latency_ms[1][:2]
    with pytest.raises(ProfileError) as err:
        plan_service("minilm", cpu_spec(), CPU_POOLS, {"cpu": missing})
    assert err.value.field == "profiles[cpu].blocks[2].latencyMs"
    bumpy = prof.model_copy(deep=True)
    bumpy.blocks[0].latency_ms[0] = [5.0, 1.0, 6.0, 7.0]
    with pytest.raises(ProfileError) as err:
        plan_service("minilm", cpu_spec(), CPU_POOLS, {"cpu": bumpy})
    assert "falls as the batch size grows" in str(err.value) and err.value.field.startswith("profiles[cpu].blocks[0]")
    negative = prof.model_copy(deep=True)
    negative.ramps[0].latency_ms[0][0] = -1.0
    with pytest.raises(ProfileError) as err:
        plan_service("minilm", cpu_spec(), CPU_POOLS, {"cpu": negative})
    assert err.value.field == "profiles[cpu].ramps[0].latencyMs"
    rising = prof.model_copy(update={"survival": [0.3, 0.6]})
    with pytest.raises(ProfileError, match="must not increase"):
        plan_service("minilm", cpu_spec(), CPU_POOLS, {"cpu": rising})


def test_accuracy_budget_outside_range_is_a_spec_error():
    spec = cpu_spec()
    bad = spec.model_copy(update={"accuracy": Accuracy.model_construct(max_drop=1.5, shadow_fraction=0.05)})
    with pytest.raises(SpecError) as err:
        plan_service("minilm", bad, CPU_POOLS, {"cpu": cpu_profile()})
    assert err.value.field == "spec.accuracy.maxDrop"


def test_unknown_pool_missing_profile_unknown_ramp():
    spec = cpu_spec().model_copy(update={"pools": [PoolRef(name="gpu")]})
    with pytest.raises(SpecError) as err:
        plan_service("minilm", spec, CPU_POOLS, {"cpu": cpu_profile()})
    assert err.value.field == "spec.pools[0].name"
    with pytest.raises(ProfileError) as err:
        plan_service("minilm", cpu_spec(), CPU_POOLS, {})
    assert err.value.field == "profiles[cpu]" and "exitplan profile" in str(err.value)
    with pytest.raises(SpecError) as err:
        plan_service("minilm", cpu_spec(), CPU_POOLS, {"cpu": cpu_profile()}, thresholds={"nope": 0.5})
    assert err.value.field == "thresholds"


def test_cost_cap_below_one_worker():
    spec = cpu_spec(planner=PlannerSettings(cost_cap_per_hour=0.5))
    with pytest.raises(PlanInfeasible) as err:
        plan_service("minilm", spec, CPU_POOLS, {"cpu": cpu_profile()})
    assert err.value.field == "spec.planner.costCapPerHour"


def test_densepipe_spreads_a_split_over_pools():
    pools = {n: CPU_POOLS["cpu"].model_copy(update={"capacity": 2}) for n in ("a", "b")}
    spec = cpu_spec(planner=PlannerSettings(max_splits=1), workload=Workload(length_buckets=[128]))
    spec = spec.model_copy(update={"pools": [PoolRef(name="a"), PoolRef(name="b")]})
    result = plan_service("minilm", spec, pools, {"a": cpu_profile("a"), "b": cpu_profile("b")})
    result.verify()
    assert {c.pool for c in result.plan.cells} == {"a", "b"}  # E3 alone puts the one split on one pool
    assert sum(c.replicas for c in result.plan.cells) == 4
    assert any("DensePipe" in n for n in result.notes)


def test_too_many_pool_states_is_a_typed_error():
    names = ("a", "b", "c")
    pools = {n: CPU_POOLS["cpu"].model_copy(update={"capacity": 200}) for n in names}
    spec = cpu_spec(planner=PlannerSettings(max_replicas=600))  # maxReplicas 64 would cap each pool at 64
    spec = spec.model_copy(update={"pools": [PoolRef(name=n) for n in names]})
    with pytest.raises(PlanInfeasible) as err:
        plan_service("minilm", spec, pools, {n: cpu_profile(n) for n in names})
    assert err.value.field == "spec.pools" and "maxGpus" in str(err.value)


def _e3_setting(rebatch: bool, **planner):
    spec = EarlyExitServiceSpec(
        model=ModelRef(name="bert-base-ee", bundle="x"),
        slo=SLO(latency_ms=100),
        pools=[PoolRef(name="v100")],
        planner=PlannerSettings(max_splits=4, rebatch=rebatch, **planner),
    )
    ramps = {r.name: 0.9 for r in bert_base_profile("v100").ramps}
    return plan_service(
        "bert",
        spec,
        {"v100": gpu_pool("v100", 16)},
        {"v100": bert_base_profile("v100")},
        thresholds=ramps,
        lengths=np.full(1000, 128),
    )


def test_rebatching_plan_marks_its_splits_and_plans_more_goodput():
    on, off = _e3_setting(True), _e3_setting(False)
    on.verify()
    off.verify()
    assert on.rebatch and all(s.rebatch for s in on.plan.splits)
    assert not off.rebatch and not any(s.rebatch for s in off.plan.splits)
    assert on.plan.prediction.goodput_rps >= off.plan.prediction.goodput_rps
    assert on.plan.prediction.cost_per_hour == pytest.approx(off.plan.prediction.cost_per_hour)
    # a plan whose splits claim the other mode than it was sized for is caught
    flipped = on.plan.model_copy(update={"splits": [s.model_copy(update={"rebatch": False}) for s in on.plan.splits]})
    bad = type(on)(**{**on.__dict__, "plan": flipped})
    assert any("rebatch" in p for p in bad.problems())


@pytest.mark.parametrize("gpu,count", [("v100", 16), ("p100", 27), ("k80", 88)])
def test_a_split_rebatches_only_where_that_is_no_slower(gpu, count):
    """Per split, rebatching is taken where its tables are at least as fast for every pool and
    bucket and need REBATCH_MIN_GAIN fewer replicas, so the plan's predicted goodput is never below
    split-and-replicate's."""
    spec = EarlyExitServiceSpec(
        model=ModelRef(name="bert-base-ee", bundle="x"),
        slo=SLO(latency_ms=100),
        pools=[PoolRef(name=gpu)],
        planner=PlannerSettings(max_splits=4, max_replicas=count),  # E3's K80 setting has 88, over the default 64
    )
    ramps = {r.name: 0.9 for r in bert_base_profile(gpu).ramps}
    plans = {
        rb: plan_service(
            "bert",
            spec.model_copy(update={"planner": spec.planner.model_copy(update={"rebatch": rb})}),
            {gpu: gpu_pool(gpu, count)},
            {gpu: bert_base_profile(gpu)},
            thresholds=ramps,
        )
        for rb in (True, False)
    }
    plans[True].verify()
    assert plans[True].plan.prediction.goodput_rps >= plans[False].plan.prediction.goodput_rps * (1 - 1e-9)
    if gpu == "k80":
        # the later splits' queues fill too slowly within a cycle and the first split gains less than
        # REBATCH_MIN_GAIN: none rebatches (rebatching there sustained less than split and replicate in
        # the simulator: 26,416 against 26,780 req/s, BENCHMARKS.md)
        assert not any(s.rebatch for s in plans[True].plan.splits)
    else:
        assert any(s.rebatch for s in plans[True].plan.splits)


def test_rebatch_off_reproduces_split_and_replicate():
    """rebatch=False plans as before rebatching existed: on E3's setting, blocks 0-1 | 2-4 | 5-11 on
    6 + 6 + 4 V100s at batch 8 (BENCHMARKS.md)."""
    off = _e3_setting(False)
    assert [(s.first_block, s.last_block) for s in off.plan.splits] == [(0, 1), (2, 4), (5, 11)]
    assert [(c.replicas, c.batch_size) for c in off.plan.cells] == [(6, 8), (6, 8), (4, 8)]


def test_without_exits_nothing_rebatches():
    spec = cpu_spec(planner=PlannerSettings(max_splits=2, rebatch=True))
    result = plan_service("minilm", spec, CPU_POOLS, {"cpu": cpu_profile()}, thresholds={"ramp1": 2.0, "ramp3": 2.0})
    result.verify()
    assert not result.rebatch and not any(s.rebatch for s in result.plan.splits)
    plain = plan_service(
        "minilm",
        cpu_spec(planner=PlannerSettings(max_splits=2, rebatch=False)),
        CPU_POOLS,
        {"cpu": cpu_profile()},
        thresholds={"ramp1": 2.0, "ramp3": 2.0},
    )
    assert result.plan.content_hash() == plain.plan.content_hash()


@pytest.mark.parametrize("rebatch", [False, True])
def test_dp_on_the_rebatching_tables_equals_exhaustive_enumeration(rebatch):
    from exitplan.planner.e3 import exhaustive, max_goodput
    from exitplan.planner.inputs import resolve_inputs
    from exitplan.planner.service import build_problem

    pools = {
        "cpu": CPU_POOLS["cpu"].model_copy(update={"capacity": 5}),
        "slow": CPU_POOLS["cpu"].model_copy(update={"capacity": 3, "cost_per_hour": 0.4}),
    }
    profiles = {"cpu": cpu_profile(), "slow": cpu_profile("slow")}
    spec = cpu_spec(planner=PlannerSettings(max_splits=3, rebatch=rebatch))
    spec = spec.model_copy(update={"pools": [PoolRef(name="cpu"), PoolRef(name="slow")]})
    inp = resolve_inputs(spec, pools, profiles, thresholds={"ramp1": 0.8, "ramp3": 0.8})
    problem = build_problem(inp, [64, 128], 3, rebatch=rebatch)
    best_goodput, best_cost = exhaustive(problem)
    sol = max_goodput(problem)
    sol.verify(problem)
    assert best_goodput > 0
    assert sol.goodput == pytest.approx(best_goodput, rel=1e-7) and sol.cost == pytest.approx(best_cost, rel=1e-7)


def test_a_lower_max_splits_is_not_held_back_by_the_previous_layout():
    """spec.planner.maxSplits lowered below the previous plan's splits: the re-plan obeys it, even where the
    previous layout would be kept (within the hysteresis, or keep_layout)."""
    from exitplan.api.plan import Cell, Plan, SplitPlan

    thresholds = {"ramp1": 0.8, "ramp3": 0.8}
    first = plan_service("minilm", cpu_spec(), CPU_POOLS, {"cpu": cpu_profile()}, thresholds=thresholds).plan
    previous = Plan(
        service="minilm",
        model="minilm",
        splits=[SplitPlan(index=0, first_block=0, last_block=2), SplitPlan(index=1, first_block=3, last_block=5)],
        buckets=first.buckets,
        cells=[Cell(split=s, bucket=b, pool="cpu", replicas=1, batch_size=1) for s in (0, 1) for b in first.buckets],
    )
    one = cpu_spec(planner=PlannerSettings(max_splits=1))
    for keep in (False, True):
        again = plan_service(
            "minilm", one, CPU_POOLS, {"cpu": cpu_profile()}, thresholds=thresholds, previous=previous, keep_layout=keep
        )
        assert len(again.plan.splits) == 1
