"""The per-bucket AIMD admission limit."""

import math

from exitplan.worker.classify.admission import BucketLimiter


def test_limit_starts_from_reported_capacity_and_unknown_is_infinite_load():
    lim = BucketLimiter(target_s=0.08)
    assert lim.load(0) == math.inf
    lim.ensure(capacity_rps=100.0, budget_s=0.1)
    assert lim.limit == 10.0  # 100/s x 0.1 s
    lim.ensure(capacity_rps=1000.0, budget_s=0.1)
    assert lim.limit == 10.0  # set once; answers move it from there
    assert lim.load(10) == 1.0


def test_late_answers_cut_once_per_cooldown_and_timely_busy_answers_grow():
    lim = BucketLimiter(target_s=0.08, limit=10.0)
    for i in range(8):  # one late batch of 8 answers at the same instant counts once
        lim.on_answer(0.2, outstanding=10, now=1.0)
    assert abs(lim.limit - 9.0) < 1e-9
    lim.on_answer(0.2, outstanding=10, now=1.2)
    assert abs(lim.limit - 8.1) < 1e-9
    before = lim.limit
    lim.on_answer(0.01, outstanding=1, now=2.0)  # in time but the limit was barely used: no growth
    assert lim.limit == before
    for _ in range(100):
        lim.on_answer(0.01, outstanding=8, now=3.0)
    assert lim.limit > before + 5


def test_limit_never_drops_below_one_and_retry_after_is_whole_seconds():
    lim = BucketLimiter(target_s=0.08, limit=1.2)
    for k in range(50):
        lim.on_answer(5.0, outstanding=3, now=float(k))
    assert lim.limit == 1.0
    assert lim.retry_after_s(3) >= 1 and isinstance(lim.retry_after_s(3), int)
