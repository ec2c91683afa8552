"""Matching held-out texts to a trace's lengths: closest length, seeded draws, concatenation for long inputs."""

import numpy as np
import pytest

from exitplan.client.texts import SPECIAL_TOKENS, InputError, concatenated_length, match_lengths


def _brute_closest(target, lengths, max_length):
    usable = [n for n in lengths if n <= max_length]
    return min(usable, key=lambda n: (abs(n - target), n))


def test_each_target_gets_a_text_of_the_closest_length():
    rng = np.random.default_rng(3)
    lengths = rng.integers(5, 60, size=300)
    lengths[:5] = [200, 300, 129, 500, 130]  # over max_length: never chosen
    targets = rng.integers(1, 59, size=500)
    parts = match_lengths(targets, lengths, max_length=128, seed=1)
    assert len(parts) == len(targets)
    for target, combo in zip(targets, parts):
        assert len(combo) == 1
        assert lengths[combo[0]] == _brute_closest(int(target), lengths, 128)


def test_ties_go_to_the_shorter_length():
    lengths = np.array([10, 14, 14, 10])
    (combo,) = match_lengths([12], lengths, max_length=64)
    assert lengths[combo[0]] == 10


def test_same_seed_same_choice_other_seed_other_texts():
    lengths = np.full(200, 20)  # every text fits: the draw alone decides
    targets = [20] * 100
    assert match_lengths(targets, lengths, 64, seed=7) == match_lengths(targets, lengths, 64, seed=7)
    assert match_lengths(targets, lengths, 64, seed=7) != match_lengths(targets, lengths, 64, seed=8)
    picked = {c[0] for c in match_lengths(targets, lengths, 64, seed=7)}
    assert len(picked) > 50  # draws spread over the equally good texts, not always the first one


def test_targets_longer_than_any_text_are_met_by_concatenation():
    lengths = np.arange(5, 61)  # every length 5..60 once: content 3..58 tokens
    targets = [61, 80, 100, 128, 500, 127]
    parts = match_lengths(targets, lengths, max_length=128, seed=0)
    for target, combo in zip(targets, parts):
        assert len(combo) > 1 or target == 61  # 61: the longest text (60) is within one token already
        total = concatenated_length(combo, lengths)
        assert total == sum(int(lengths[p]) - SPECIAL_TOKENS for p in combo) + SPECIAL_TOKENS
        assert total <= 128
        assert abs(total - min(target, 128)) <= 1  # dense pool: the greedy fills to within one token


def test_concatenation_never_exceeds_the_largest_bucket():
    lengths = np.array([40, 41, 42, 43])
    for target in range(44, 200):
        (combo,) = match_lengths([target], lengths, max_length=100, seed=target)
        assert concatenated_length(combo, lengths) <= 100


def test_no_usable_text_is_a_clear_error():
    with pytest.raises(InputError, match="longer than 16 tokens"):
        match_lengths([4], [20, 30], max_length=16)
    with pytest.raises(InputError, match="max_length"):
        match_lengths([4], [2, 3], max_length=0)
