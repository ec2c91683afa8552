"""Simulator sanity: light load loses nothing, exits draw as the survival curve says, oracle bounds all."""

from __future__ import annotations

import numpy as np
import pytest

from exitplan.api.resources import SLO, EarlyExitServiceSpec, ModelRef, PlannerSettings, PoolRef
from exitplan.planner.compare import oracle_for, plan_config, simulate_plan, sustainable_rate
from exitplan.planner.simulator import depths_from_survival, poisson_arrivals
from exitplan.planner.synthetic import PUBLISHED_V100_FP16_MS, bert_base_profile, gpu_pool

SPEC = EarlyExitServiceSpec(
    model=ModelRef(name="bert-base-ee", bundle="x"),
    slo=SLO(latency_ms=100),
    pools=[PoolRef(name="v100")],
    planner=PlannerSettings(max_splits=3),
)
POOLS = {"v100": gpu_pool("v100", 4)}
PROFILES = {"v100": bert_base_profile("v100")}


@pytest.fixture(scope="module")
def plans():
    return {c: plan_config(c, "bert", SPEC, POOLS, PROFILES) for c in ("vanilla", "naive-ee", "e3")}


def test_light_load_answers_everything_within_slo(plans):
    rng = np.random.default_rng(0)
    arrivals = poisson_arrivals(rng, 50.0, 1500)
    lengths = np.full(1500, 128)
    for name, result in plans.items():
        res = simulate_plan(result, arrivals, lengths, 100.0, name=name)
        assert res.dropped == 0 and res.answered == 1500, name
        assert res.within_slo == 1500, name
        assert res.pct(99) <= 100.0


def test_overload_is_refused_not_lost(plans):
    rng = np.random.default_rng(1)
    rate = plans["vanilla"].plan.prediction.goodput_rps * 3
    arrivals = poisson_arrivals(rng, rate, 4000)
    res = simulate_plan(plans["vanilla"], arrivals, np.full(4000, 128), 100.0)
    assert res.dropped > 0
    assert res.answered + res.dropped == res.offered  # every request answered or refused


def test_exit_depths_follow_survival():
    rng = np.random.default_rng(2)
    survival = [0.8, 0.5, 0.2]
    depths = depths_from_survival(rng, 200_000, 4, [0, 1, 2], survival, [True, True, True])
    for k, s in enumerate(survival):
        assert np.mean(depths > k + 1) == pytest.approx(s, abs=0.01)
    off = depths_from_survival(rng, 50_000, 4, [0, 1, 2], survival, [True, False, True])
    assert np.mean(off == 2) == 0.0  # ramp after block 1 is off: nobody exits there
    assert np.mean(off > 1) == pytest.approx(0.8, abs=0.01)


def test_oracle_bounds_every_configuration_and_exits_help(plans):
    lengths = np.full(2000, 128)
    # search runs of 2 s, the rate found confirmed on 10 s; goodput = answers within the SLO per second
    rates = {
        name: sustainable_rate(result, np.array([128]), 100.0, duration_s=2.0, confirm_s=10.0)[0]
        for name, result in plans.items()
    }
    bound = oracle_for(plans["e3"], lengths, 1e12)
    assert all(0 < r <= bound for r in rates.values()), (rates, bound)
    # what the GPUs serve, never more than the plan's own capacity (vanilla: 4 x 8 rows per published batch time)
    assert rates["vanilla"] <= 4 * 8 / (PUBLISHED_V100_FP16_MS[8] / 1e3)
    assert rates["e3"] > rates["naive-ee"] > 1.3 * rates["vanilla"]


def test_exited_rows_that_keep_their_slots_cost_time(plans):
    """A batch that cannot shrink mid-model runs every block at its starting size while anyone is
    left: at a load where batches of several rows form (about 6 here) the answers come later on average."""
    rng = np.random.default_rng(3)
    arrivals = poisson_arrivals(rng, 1000.0, 1000)
    lengths = np.full(1000, 128)
    ref = plans["naive-ee"]
    depths = depths_from_survival(
        np.random.default_rng(4), 1000, 12, list(range(11)), list(ref.plan.survival), [True] * 11
    )
    shrink = simulate_plan(ref, arrivals, lengths, 100.0, depths=depths, max_wait_ms=20.0)
    padded = simulate_plan(ref, arrivals, lengths, 100.0, depths=depths, max_wait_ms=20.0, compact_exits=False)
    assert shrink.answered == padded.answered == 1000
    assert np.mean(padded.latencies_ms) > np.mean(shrink.latencies_ms)


def _layout(result, rebatch: bool):
    """The same plan with its splits rebatching or not."""
    plan = result.plan.model_copy(
        update={"splits": [s.model_copy(update={"rebatch": rebatch}) for s in result.plan.splits]}
    )
    return type(result)(**{**result.__dict__, "plan": plan})


@pytest.fixture(scope="module")
def one_split():
    """4 V100s, one split of the whole model at batch 8 (naive early exit's layout)."""
    return plan_config("naive-ee", "bert", SPEC, POOLS, PROFILES)


def test_rebatching_answers_every_request_once_with_fuller_batches_and_the_drawn_exits(one_split):
    n = 6000
    rng = np.random.default_rng(5)
    rate = 0.6 * one_split.plan.prediction.goodput_rps
    arrivals = poisson_arrivals(rng, rate, n)
    depths = depths_from_survival(
        np.random.default_rng(6), n, 12, list(range(11)), list(one_split.plan.survival), [True] * 11
    )
    runs = {
        rb: simulate_plan(
            _layout(one_split, rb), arrivals, np.full(n, 128), 100.0, depths=depths, max_wait_ms=float("inf")
        )
        for rb in (False, True)
    }
    for rb, res in runs.items():
        assert res.dropped == 0 and res.answered == n and res.answers == n, rb  # none lost, none answered twice
        # every block ran exactly the rows whose drawn exit depth lies beyond it
        assert np.array_equal(res.block_rows, [(depths > k).sum() for k in range(12)]), rb
    plain, rebatched = runs[False].block_batch, runs[True].block_batch
    assert np.all(rebatched >= plain - 1e-9)
    assert rebatched[5:].mean() > 1.5 * plain[5:].mean()  # the blocks after most exits: regrouped vs leftovers


def test_rebatching_answers_more_within_the_slo_than_the_same_layout_without_it(one_split):
    """80:20 easy:hard, offered 1.4x what the layout sustains without rebatching: 80 % of the inputs
    leave by block 5, so without rebatching blocks 5-11 run about 2 of a batch's 8 rows at nearly
    the cost of 8; with it they run full batches and more requests are answered within the SLO."""
    n = 8000
    rate = 1.4 * one_split.plan.prediction.goodput_rps
    arrivals = poisson_arrivals(np.random.default_rng(7), rate, n)
    runs = {
        rb: simulate_plan(_layout(one_split, rb), arrivals, np.full(n, 128), 100.0, max_wait_ms=float("inf"))
        for rb in (False, True)
    }
    assert runs[True].goodput > 1.15 * runs[False].goodput
    assert runs[True].answered + runs[True].dropped == n
