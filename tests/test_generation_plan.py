"""E3-style planning for generation: the split cost model and search, the threshold under the accuracy
budget, the service plan (exitplan.planner.generation), and the measurements that feed it."""

from __future__ import annotations

import itertools

import pytest
from generation_helpers import PROMPTS, tiny_decoder_bundle

from exitplan.planner.generation import GenerationPlanError, GenerationProfile, evaluate, plan_splits
from exitplan.worker_image.generate.decoder import DecoderModel
from exitplan.worker_image.generate.measure import measure_profile


def profile(hop: float = 0.0, shares=None) -> GenerationProfile:
    return GenerationProfile(
        block_ms=[1.0, 2.0, 3.0, 4.0],
        head_ms={0: 0.5, 2: 0.5, 3: 1.0},
        decide_share=shares or {0: 0.5, 2: 0.25, 3: 0.25},
        hop_ms=hop,
    )


def test_evaluate_matches_the_hand_computation():
    c = evaluate(profile(hop=10.0), [(0, 1), (2, 3)])
    # decided after block 0 at 1.5; after block 2 at 1.5 + 2 + 10 + 3 + 0.5 = 17; final at 17 + 4 + 1 = 22
    assert c.decision_ms == pytest.approx(0.5 * 1.5 + 0.25 * 17 + 0.25 * 22)
    # stage 0: 1 + 2 + head0 (every token) 0.5; stage 1: 3 + 4 + 0.5 * head2 + 0.25 * final head
    assert c.bottleneck_ms == pytest.approx(max(3.5, 7 + 0.25 + 0.25) + 10)
    assert c.time_per_token_ms == max(c.decision_ms, c.bottleneck_ms)


def test_plan_is_the_best_of_every_contiguous_split():
    for hop, stages in itertools.product((0.0, 1.0, 10.0), (1, 2, 3, 4)):
        plan = plan_splits(profile(hop), stages)
        assert len(plan.candidates) == len(list(itertools.combinations(range(1, 4), stages - 1)))
        assert all(plan.best.time_per_token_ms <= c.time_per_token_ms for c in plan.candidates)
        for c in plan.candidates:  # contiguous, covering, in order
            assert c.splits[0][0] == 0 and c.splits[-1][1] == 3
            assert all(a[1] + 1 == b[0] for a, b in zip(c.splits, c.splits[1:]))
    # no hop cost: balancing the blocks wins (1+2+3 | 4 leaves the least work on the busiest stage)
    assert plan_splits(profile(0.0), 2).best.splits == ((0, 2), (3, 3))


def test_bad_profiles_are_refused():
    with pytest.raises(GenerationPlanError, match="sum to 1"):
        plan_splits(profile(shares={0: 0.5, 3: 0.4}), 2)
    with pytest.raises(GenerationPlanError, match="stages must be within"):
        plan_splits(profile(), 5)
    with pytest.raises(GenerationPlanError, match="final head"):
        plan_splits(GenerationProfile([1.0, 1.0], {0: 0.1}, {0: 1.0}), 1)


def test_measured_profile_on_the_tiny_bundle():
    model = DecoderModel(tiny_decoder_bundle())
    never = GenerationProfile.load(measure_profile(model, PROMPTS, 1.0, repeats=3))
    assert never.decide_share[model.n_blocks - 1] == pytest.approx(1.0)
    assert len(never.block_ms) == model.n_blocks and all(t > 0 for t in never.block_ms)
    always = GenerationProfile.load(measure_profile(model, PROMPTS, 0.0, repeats=3))
    assert always.decide_share[0] == pytest.approx(1.0)
    assert plan_splits(always, 2).best.splits in {((0, 0), (1, 2)), ((0, 1), (2, 2))}


# ------------------------------------------------------------------------------------ threshold and service plan

from exitplan.api.resources import EarlyExitServiceSpec, GPUPoolSpec  # noqa: E402
from exitplan.planner.errors import PlanInfeasible  # noqa: E402
from exitplan.planner.generation import ThresholdPoint, choose_threshold, generation_threshold, plan_generation  # noqa: E402
from exitplan.worker_image.generate.measure import measure_thresholds  # noqa: E402


def points(*pairs) -> list[ThresholdPoint]:
    return [ThresholdPoint(t, d, {0: 1 - t, 3: t}) for t, d in pairs]


def test_threshold_is_the_lowest_whose_disagreement_and_every_higher_one_meet_the_budget():
    table = points((0.2, 0.10), (0.4, 0.03), (0.6, 0.012), (0.8, 0.004), (0.9, 0.006), (1.0, 0.0))
    for budget in (0.0, 0.001, 0.005, 0.0055, 0.006, 0.01, 0.02, 0.05, 0.2):
        got = choose_threshold(table, budget)
        # brute force: every point at or above the chosen threshold meets the budget, and no lower one qualifies
        admissible = [
            p.threshold for p in table if all(q.disagreement <= budget for q in table if q.threshold >= p.threshold)
        ]
        assert got.threshold == min(admissible)
    assert choose_threshold(points((0.5, 0.2)), 0.01).threshold == 1.0  # only a failing point measured: never exit
    with pytest.raises(GenerationPlanError, match="accuracy budget"):
        choose_threshold(table, 1.5)


def spec(pools=(("a", None),), max_splits=4, max_drop=0.01) -> EarlyExitServiceSpec:
    return EarlyExitServiceSpec.model_validate(
        {
            "model": {"name": "gen", "bundle": "/b", "task": "text-generation"},
            "slo": {"latencyMs": 100},
            "accuracy": {"maxDrop": max_drop},
            "planner": {"maxSplits": max_splits},
            "pools": [{"name": n, **({"maxGpus": m} if m is not None else {})} for n, m in pools],
        }
    )


def test_service_plan_ranks_stage_counts_and_places_one_replica_per_stage():
    pools = {"a": GPUPoolSpec(capacity=1, cost_per_hour=2.0), "b": GPUPoolSpec(capacity=4, cost_per_hour=1.0)}
    table = points((0.5, 0.05), (0.8, 0.005), (1.0, 0.0))
    for hop in (0.0, 1.0, 50.0):
        result = plan_generation(
            "svc",
            spec((("a", None), ("b", None))),
            pools,
            n_blocks=4,
            exit_ramps=["e0", "e1", "e2"],
            max_context=128,
            profile=profile(hop),
            thresholds=table,
        )
        assert result.threshold == 0.8 and result.plan.thresholds == {"e0": 0.8, "e1": 0.8, "e2": 0.8}
        shares = table[1].decide_share
        brute = min(
            (
                evaluate(profile(hop).with_shares(shares), c).time_per_token_ms
                if len(c) > 1
                else evaluate(profile(hop).with_shares(shares), c).decision_ms,
                len(c),
            )
            for s in range(1, 5)
            for c in _splits(4, s)
        )
        assert (result.predicted_ms_per_token, len(result.plan.splits)) == pytest.approx(brute)
        assert [c.pool for c in result.plan.cells] == (["a", "b", "b", "b"][: len(result.plan.splits)])
        assert all(c.replicas == 1 and c.bucket == 128 for c in result.plan.cells)
        assert result.mode == ("recompute" if len(result.plan.splits) == 1 else "pipeline")
        assert generation_threshold(result.plan) == 0.8
    # a big hop makes one stage (KV recomputation) the best
    assert (
        len(
            plan_generation(
                "svc", spec(), pools, n_blocks=4, exit_ramps=[], max_context=8, profile=profile(50.0), thresholds=table
            ).plan.splits
        )
        == 1
    )


def test_service_plan_without_measurements_and_its_limits():
    pools = {"a": GPUPoolSpec(capacity=2)}
    bare = plan_generation("svc", spec(), pools, n_blocks=5, exit_ramps=["e0"], max_context=64)
    assert bare.threshold == 1.0 and bare.mode == "recompute" and "no early exit" in bare.note
    two = plan_generation("svc", spec(), pools, n_blocks=5, exit_ramps=["e0"], max_context=64, stages=2)
    assert [(s.first_block, s.last_block) for s in two.plan.splits] == [(0, 2), (3, 4)] and two.mode == "pipeline"
    with pytest.raises(PlanInfeasible, match="at most 2 fit"):
        plan_generation("svc", spec(), pools, n_blocks=5, exit_ramps=[], max_context=64, stages=3)
    with pytest.raises(PlanInfeasible, match="at most 1 fit"):
        plan_generation("svc", spec(max_splits=1), pools, n_blocks=5, exit_ramps=[], max_context=64, stages=2)
    with pytest.raises(PlanInfeasible, match="no capacity"):
        plan_generation("svc", spec((("a", 0),)), pools, n_blocks=5, exit_ramps=[], max_context=64)
    with pytest.raises(GenerationPlanError, match="not given"):
        plan_generation("svc", spec((("zz", None),)), pools, n_blocks=5, exit_ramps=[], max_context=64)


def _splits(n: int, stages: int):
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        yield [(bounds[i], bounds[i + 1] - 1) for i in range(stages)]


def test_measured_thresholds_on_the_tiny_bundle():
    model = DecoderModel(tiny_decoder_bundle())
    table = [ThresholdPoint.load(p) for p in measure_thresholds(model, PROMPTS, [0.0, 0.5, 1.0])]
    zero, _, one = table
    assert one.disagreement == 0.0 and one.decide_share[model.n_blocks - 1] == pytest.approx(1.0)
    assert zero.decide_share[0] == pytest.approx(1.0)
    # at 0 every position is exit0's: its disagreement is exit0 vs the final head, counted directly
    diff = total = 0
    for text in PROMPTS:
        logits = model.full_forward(model.codec.encode(text)).logits
        diff += int((logits["exit0"].argmax(1) != logits["head"].argmax(1)).sum())
        total += logits["head"].shape[0]
    assert zero.disagreement == pytest.approx(diff / total)
    assert all(abs(sum(p.decide_share.values()) - 1.0) < 1e-9 for p in table)


def test_recomputation_cost_decides_between_one_stage_and_a_pipeline():
    shares = {0: 0.5, 2: 0.25, 3: 0.25}
    free = GenerationProfile([1.0, 2.0, 3.0, 4.0], {0: 0.5, 2: 0.5, 3: 1.0}, shares, 0.5, recompute_ratio=0.0)
    costly = GenerationProfile([1.0, 2.0, 3.0, 4.0], {0: 0.5, 2: 0.5, 3: 1.0}, shares, 0.5, recompute_ratio=1.0)
    one = evaluate(costly, [(0, 3)])
    assert one.recompute_ms == pytest.approx(0.5 * (2 + 3 + 4) + 0.25 * 4)  # the blocks exited tokens skipped
    assert one.time_per_token_ms == pytest.approx(one.decision_ms + one.recompute_ms)
    pools = {"a": GPUPoolSpec(capacity=4)}
    args = dict(n_blocks=4, exit_ramps=[], max_context=8, thresholds=[ThresholdPoint(0.5, 0.0, shares)])
    assert plan_generation("s", spec(), pools, profile=free, **args).mode == "recompute"
    assert plan_generation("s", spec(), pools, profile=costly, **args).mode == "pipeline"
    measured = GenerationProfile.load(measure_profile(DecoderModel(tiny_decoder_bundle()), PROMPTS, 0.5, repeats=3))
    assert 0.0 <= measured.recompute_ratio <= 10.0
