"""The per-bucket AIMD admission limit, and the router's admission decision built on it."""

import math

import pytest

from exitplan.worker_image.classify.admission import Admission, Admitted, BucketLimiter, Refusal


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
    for _i in range(8):  # one late batch of 8 answers at the same instant counts once
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


# ---------------------------------------------------------------- the router's admission decision


def admission(capacities, slo_s=0.1, max_inflight=4096, buckets=(16, 64)):
    return Admission(list(buckets), slo_s, lambda b: capacities[b], max_inflight=max_inflight)


def test_admitted_inputs_go_to_their_buckets_and_count_in_flight():
    adm = admission([100.0, 100.0])  # limit 10 per bucket (100/s x 0.1 s)
    verdict = adm.admit([10, 50, 12])
    assert isinstance(verdict, Admitted)
    assert verdict.buckets == [0, 1, 0] and verdict.ideal == [0, 1, 0]
    assert verdict.groups() == {0: [0, 2], 1: [1]}
    assert adm.outstanding == [2, 1] and adm.inflight == 3
    adm.answered(0, 2, latency_s=0.01, now=1.0)
    adm.answered(1, 1, latency_s=0.01, now=1.0)
    adm.release(3)
    assert adm.outstanding == [0, 0] and adm.inflight == 0


def test_a_congested_bucket_demotes_to_an_idle_longer_one():
    adm = admission([100.0, 100.0])
    for _ in range(9):
        assert isinstance(adm.admit([10]), Admitted)  # bucket 16 at 9 of 10: load 0.9 >= 0.85
    verdict = adm.admit([10])
    assert isinstance(verdict, Admitted) and verdict.buckets == [1] and verdict.ideal == [0]


def test_an_idle_bucket_takes_a_request_larger_than_its_limit():
    adm = admission([10.0, 0.0])  # limit 1
    verdict = adm.admit([10, 10, 10])
    assert isinstance(verdict, Admitted) and verdict.buckets == [0, 0, 0]


def test_a_bucket_at_its_limit_refuses_with_429_and_retry_after_from_its_latency():
    adm = admission([100.0, 0.0])  # bucket 64 has no ready pod
    for _ in range(10):
        assert isinstance(adm.admit([10]), Admitted)
    adm.answered(0, 1, latency_s=3.0, now=1.0)  # late: the limit drops to 9, 9 still in flight
    verdict = adm.admit([10])
    assert verdict == Refusal(429, "bucket 16 cannot answer within the SLO of 100 ms at the current load", 3.0, [0])
    assert adm.outstanding == [9, 0] and adm.inflight == 10  # nothing counted for a refusal


def test_a_request_refused_midway_counts_none_of_its_inputs():
    adm = admission([20.0, 0.0])  # limit 2
    assert isinstance(adm.admit([10]), Admitted)
    verdict = adm.admit([10, 10])  # the first input fits (load 0.5), the second would be over the limit
    assert isinstance(verdict, Refusal) and verdict.status == 429 and verdict.retry_after_s == 1.0
    assert adm.outstanding == [1, 0] and adm.inflight == 1


def test_no_ready_bucket_or_no_bucket_long_enough_refuses_every_bucket():
    for capacities, lengths in (([0.0, 0.0], [10]), ([100.0, 100.0], [100])):
        verdict = admission(capacities).admit(lengths)
        assert isinstance(verdict, Refusal)
        assert (verdict.status, verdict.retry_after_s) == (429, 1.0)
        assert verdict.reason == "every bucket cannot answer within the SLO of 100 ms at the current load"


def test_the_router_in_flight_limit_refuses_with_503_before_choosing_buckets():
    adm = admission([100.0, 100.0], max_inflight=4)
    assert isinstance(adm.admit([10, 10, 10]), Admitted)
    verdict = adm.admit([10, 10])
    assert verdict == Refusal(503, "router is at its limit of 4 inputs in flight; retry later", 1.0)
    assert verdict.ideal == ()  # not counted in the length histogram
    adm.release(3)
    assert isinstance(adm.admit([10, 10]), Admitted)


def test_loads_are_in_flight_over_limit_and_inf_without_capacity():
    adm = admission([100.0, 0.0])
    adm.admit([10, 10])
    assert adm.loads() == [pytest.approx(0.2), float("inf")]
