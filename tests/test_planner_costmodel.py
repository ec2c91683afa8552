"""Cost model: the rebatching tables (a fusion queue per block inside a split) against the formula
worked out by hand from the profile, and the memory a rebatching replica holds."""

from __future__ import annotations

import math

import numpy as np
import pytest

from exitplan.planner.costmodel import CostModel, survival_before_blocks
from exitplan.planner.synthetic import bert_base_profile, gpu_pool

SEQ = 128


@pytest.fixture(scope="module")
def model():
    profile = bert_base_profile("v100")
    m = CostModel(profile, "v100", gpu_pool("v100", 4))
    on = [True] * len(m.ramp_after)
    sigma = survival_before_blocks(m.n_blocks, m.ramp_after, list(profile.survival), on)
    return m, sigma, on


def by_hand(m: CostModel, sigma, on, a: int, b: int, batch: int, expected: bool) -> float:
    """Rebatching split [a, b] at batch B: each block (and its ramp) at a full batch B, weighted by
    the share s(k)/s(a) of entering rows that reach it (expected), or once (the bound) plus the
    transfer of ceil(B x survivors) rows out."""
    total = 0.0
    for k in range(a, b + 1):
        t = m.block_ms(k, batch, SEQ)
        for r, after in enumerate(m.ramp_after):
            if after == k and on[r]:
                t += m.ramp_ms(r, batch, SEQ)
        share = sigma[k] / sigma[a]
        total += share * t if expected else (t if batch * share > 1e-9 else 0.0)
    if not expected and b < m.n_blocks - 1:
        total += m.transfer_ms(b, math.ceil(batch * sigma[b + 1] / sigma[a] - 1e-9), SEQ)
    return total


@pytest.mark.parametrize("a,b", [(0, 11), (0, 1), (2, 4), (5, 11), (3, 3)])
@pytest.mark.parametrize("batch", [1, 4, 8])
def test_rebatching_tables_follow_the_formula(model, a, b, batch):
    m, sigma, on = model
    mean = m.stage_tables([batch], SEQ, sigma, on, expected=True, transfer=False, rebatch=True)[0]
    bound = m.stage_tables([batch], SEQ, sigma, on, rebatch=True)[0]
    assert mean[a, b] == pytest.approx(by_hand(m, sigma, on, a, b, batch, expected=True), rel=1e-9)
    assert bound[a, b] == pytest.approx(by_hand(m, sigma, on, a, b, batch, expected=False), rel=1e-9)
    assert np.isinf(bound[b, a]) if b > a else True


def test_rebatching_saves_time_per_row_where_exits_shrink_batches(model):
    """At batch 1 there is nothing to regroup (both tables agree); at batch 8 a split whose rows exit
    inside it spends less per entering row with rebatching, and one round at full batches bounds
    the cycle from above."""
    m, sigma, on = model
    plain = m.stage_tables([1, 8], SEQ, sigma, on, expected=True, transfer=False)
    rebatch = m.stage_tables([1, 8], SEQ, sigma, on, expected=True, transfer=False, rebatch=True)
    assert rebatch[0, 0, 11] == pytest.approx(plain[0, 0, 11], rel=1e-9)
    assert rebatch[1, 0, 11] < 0.8 * plain[1, 0, 11]
    assert rebatch[1, 5, 9] == pytest.approx(plain[1, 5, 9], rel=1e-9)  # nobody exits inside 5-9
    bound_plain = m.stage_tables([8], SEQ, sigma, on)[0]
    bound_rebatch = m.stage_tables([8], SEQ, sigma, on, rebatch=True)[0]
    assert np.all(bound_rebatch[np.triu_indices(12)] >= bound_plain[np.triu_indices(12)] - 1e-12)


def test_rebatching_replica_holds_a_batch_at_every_inner_boundary(model):
    m, _, _ = model
    extra = m.replica_bytes(2, 5, 8, SEQ, rebatch=True) - m.replica_bytes(2, 5, 8, SEQ)
    assert extra == pytest.approx(8 * sum(m.bytes_per_sample(k, SEQ) for k in (2, 3, 4)))
    assert m.replica_bytes(3, 3, 8, SEQ, rebatch=True) == m.replica_bytes(3, 3, 8, SEQ)  # one block: no inner boundary


def test_rebatching_queues_that_fill_slowly_cost_more_and_solve_their_fixed_point(model):
    """With a wait limit W (fill_ms), block k of split [a, b] gathers at most B s(k)/s(a) W / T rows
    (T: the split's mean time per B entering rows), so it runs at x_k = min(B, that) rows, B s(k)/s(a)
    / x_k times per B entering rows; T must equal the sum of those runs."""
    m, sigma, on = model
    full = m.stage_tables([8], SEQ, sigma, on, expected=True, transfer=False, rebatch=True)[0]
    loose = m.stage_tables([8], SEQ, sigma, on, expected=True, transfer=False, rebatch=True, fill_ms=1e9)[0]
    tri = np.triu_indices(12)
    assert np.allclose(loose[tri], full[tri], rtol=1e-9)
    tight = m.stage_tables([8], SEQ, sigma, on, expected=True, transfer=False, rebatch=True, fill_ms=30.0)[0]
    a, b = 0, 11
    T = tight[a, b]
    assert np.isfinite(T) and T > full[a, b] * 1.003  # block 11 (7 % of the rows) cannot fill 8 rows in 30 ms
    again = 0.0
    for k in range(a, b + 1):
        share = sigma[k] / sigma[a]
        x = min(8.0, 8.0 * share * 30.0 / T)
        t = m.block_ms(k, x, SEQ) + sum(
            m.ramp_ms(r, x, SEQ) for r, after in enumerate(m.ramp_after) if after == k and on[r]
        )
        again += 8.0 * share / x * t
    assert again == pytest.approx(T, rel=1e-5)
    # a split whose rows would wait longer than two cycles in its queues is not offered; one whose
    # rows never exit inside it fills every inner queue at once
    assert np.isinf(
        m.stage_tables([8], SEQ, sigma, on, expected=True, transfer=False, rebatch=True, fill_ms=20.0)[0][0, 11]
    )
    assert m.stage_tables([8], SEQ, sigma, on, expected=True, transfer=False, rebatch=True, fill_ms=20.0)[0][
        5, 9
    ] == pytest.approx(full[5, 9])
