"""E3-style split planning for pipeline generation (issue 7): the cost model and the search."""

from __future__ import annotations

import itertools

import pytest

from exitplan.worker.generation import DecoderModel, GenerationError
from exitplan.worker.generation_plan import GenerationProfile, evaluate, measure_profile, plan_splits

from generation_helpers import PROMPTS, tiny_decoder_bundle


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
    with pytest.raises(GenerationError, match="sum to 1"):
        plan_splits(profile(shares={0: 0.5, 3: 0.4}), 2)
    with pytest.raises(GenerationError, match="stages must be within"):
        plan_splits(profile(), 5)
    with pytest.raises(GenerationError, match="final head"):
        plan_splits(GenerationProfile([1.0, 1.0], {0: 0.1}, {0: 1.0}), 1)


def test_measured_profile_on_the_tiny_bundle():
    model = DecoderModel(tiny_decoder_bundle())
    never = measure_profile(model, PROMPTS, 1.0, repeats=3)
    assert never.decide_share[model.n_blocks - 1] == pytest.approx(1.0)
    assert len(never.block_ms) == model.n_blocks and all(t > 0 for t in never.block_ms)
    always = measure_profile(model, PROMPTS, 0.0, repeats=3)
    assert always.decide_share[0] == pytest.approx(1.0)
    assert plan_splits(always, 2).best.splits in {((0, 0), (1, 2)), ((0, 1), (2, 2))}
