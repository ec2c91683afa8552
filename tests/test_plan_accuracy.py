"""The comparison of measured with planned goodput (exitplan.operator.plan_accuracy), the per-bucket
figures it reads (the router's WindowStats, drift.combine / subtract) and the profile correction:
pure functions, no kopf, no HTTP."""

from __future__ import annotations

import numpy as np
import pytest

from exitplan.api.observations import BucketObservations, ErrorCounts, Observations
from exitplan.api.plan import Cell, Plan, Prediction, SplitPlan
from exitplan.api.resources import ModelProfileSpec
from exitplan.operator import drift, plan_accuracy
from exitplan.operator.plan_accuracy import Tracker, corrected_profiles, judge, update_condition
from exitplan.operator.status import ServiceStatus, set_condition
from exitplan.worker_image.classify.observe import WindowStats

PERIOD = 10.0
SPAN = 10.0  # seconds of one observation window (>= drift.JUDGED_PERIODS periods)


def plan(goodput: float = 1000.0) -> Plan:
    """Buckets 32 (cells on pool a) and 128 (cells on pool b), sized for a 50/50 mix."""
    return Plan(
        service="svc",
        model="m",
        splits=[SplitPlan(index=0, first_block=0, last_block=1), SplitPlan(index=1, first_block=2, last_block=3)],
        buckets=[32, 128],
        cells=[
            Cell(split=0, bucket=32, pool="a", replicas=2, batch_size=8),
            Cell(split=1, bucket=32, pool="a", replicas=1, batch_size=8),
            Cell(split=0, bucket=128, pool="b", replicas=2, batch_size=4),
            Cell(split=1, bucket=128, pool="b", replicas=2, batch_size=4),
        ],
        length_histogram=[0.5, 0.5],
        prediction=Prediction(goodput_rps=goodput, p99_ms=40.0),
    )


def bucket(rps: float, *, refused: float = 0.0, late: float = 0.0, load: float = 0.3) -> BucketObservations:
    """One bucket's window answering `rps` within the SLO, `refused` and `late` as shares of its inputs."""
    within = round(rps * SPAN)
    answered = round(within / (1 - late)) if late else within
    return BucketObservations(
        requests=answered,
        within_slo=within,
        refused=round(refused * answered / (1 - refused)) if refused else 0,
        p99_ms=30.0,
        load_seconds=load * SPAN,
    )


def window(b32: BucketObservations, b128: BucketObservations, since: float = 0.0, **extra) -> Observations:
    per = {"32": b32, "128": b128}
    return Observations(
        service="svc",
        model="m",
        since=since,
        until=since + SPAN,
        requests=sum(b.requests for b in per.values()),
        within_slo=sum(b.within_slo for b in per.values()),
        errors=ErrorCounts(overload=sum(b.refused for b in per.values())),
        length_buckets=[32, 128],
        length_histogram=[b.requests + b.refused for b in per.values()],
        per_bucket=per,
        **extra,
    )


# ---------------------------------------------------------------- one window


def test_below_the_plan_counts_only_when_saturated():
    # Planned 1000 rps at 50/50: 500 per bucket. Both buckets answer 200 rps within the SLO.
    idle = judge(plan(), window(bucket(200), bucket(200)))
    assert idle.verdict == "idle" and not idle.judged and idle.ratio == pytest.approx(0.4)
    assert "not saturated" in idle.text() and "0.40" in idle.text()
    refusing = judge(plan(), window(bucket(200, refused=0.05), bucket(200)))
    assert refusing.verdict == "below" and refusing.off and refusing.pools == ("a",)  # the cells of bucket 32
    assert refusing.off_ratio == pytest.approx(0.4)
    assert "bucket 32: 5% refused" in refusing.saturated and "0.40 (400.0 / 1000.0 rps" in refusing.text()
    late = judge(plan(), window(bucket(200), bucket(200, late=0.03)))
    assert late.verdict == "below" and late.pools == ("b",) and "3% late" in late.saturated
    busy = judge(plan(), window(bucket(200, load=0.95), bucket(200, load=0.95)))
    assert busy.verdict == "below" and busy.pools == ("a", "b") and "capacity 95% in use" in busy.saturated
    # a saturated bucket within 30 % of its share: the plan held under load
    held = judge(plan(), window(bucket(400, refused=0.05), bucket(100)))
    assert held.verdict == "match" and held.judged and not held.off
    # the limit itself: 0.7 of the share is still a match, below it is not
    assert judge(plan(), window(bucket(351, refused=0.05), bucket(100))).verdict == "match"
    assert judge(plan(), window(bucket(349, refused=0.05), bucket(100))).verdict == "below"


def test_a_router_without_per_bucket_figures_is_judged_as_a_whole():
    obs = window(bucket(200, refused=0.05), bucket(200)).model_copy(update={"per_bucket": {}})
    whole = judge(plan(), obs)
    assert whole.verdict == "below" and whole.pools == ("a", "b") and whole.buckets == ()
    assert whole.off_ratio == pytest.approx(0.4) and "refused" in whole.saturated
    quiet = obs.model_copy(update={"errors": ErrorCounts()})
    assert judge(plan(), quiet).verdict == "idle"


def test_above_the_plan_counts_without_saturation_but_only_at_the_plans_mix():
    above = judge(plan(), window(bucket(700), bucket(700)))  # 1400 rps, nothing refused: still above
    assert above.verdict == "above" and above.pools == ("a", "b") and above.off_ratio == pytest.approx(1.4)
    assert "above the plan by more than 30%" in above.text()
    assert judge(plan(), window(bucket(640), bucket(640))).verdict == "idle"  # 1.28: within the tolerance
    # the same goodput at another mix: the bucket that does not limit the plan has slack -> not judged
    shifted = judge(plan(), window(bucket(1000), bucket(400)))
    assert shifted.verdict == "mix" and not shifted.judged and "another length mix" in shifted.text()
    # or with more exits than the plan was sized for
    exits = judge(
        plan().model_copy(update={"survival": [0.6, 0.3]}), window(bucket(700), bucket(700), survival=[0.4, 0.2])
    )
    assert exits.verdict == "mix"


def test_too_little_traffic_or_no_prediction_is_not_judged():
    few = window(bucket(2), bucket(2))  # 40 arrivals
    assert judge(plan(), few).verdict == "quiet"
    assert judge(plan(goodput=0.0), window(bucket(200, refused=0.05), bucket(200))).verdict == "quiet"


# ---------------------------------------------------------------- persistence over windows


def feed(tracker: Tracker, p: Plan, windows: list[Observations]) -> list[str]:
    return [v.verdict for w in windows if (v := tracker.add(w, p, PERIOD)) is not None]


def test_a_mismatch_needs_consecutive_windows_off_in_one_direction():
    p = plan()
    short = [window(bucket(200, refused=0.05), bucket(200), since=SPAN * i) for i in range(6)]
    idle = window(bucket(200), bucket(200), since=SPAN * 10)
    fine = window(bucket(450, refused=0.05), bucket(450), since=SPAN * 11)
    above = window(bucket(700), bucket(700), since=SPAN * 12)
    t = Tracker()
    assert feed(t, p, short[:2]) == ["below", "below"] and t.mismatch() is None
    assert feed(t, p, [idle]) == ["idle"] and t.mismatch() is None  # an idle window neither counts nor resets
    assert feed(t, p, short[2:3]) == ["below"]
    found = t.mismatch()
    assert found is not None and found.direction == "below" and found.pools == ("a",)
    assert found.ratio == pytest.approx(0.4) and "3 consecutive windows (ratios 0.40, 0.40, 0.40)" in found.text()
    # a window that matches the plan resets the count
    t = Tracker()
    feed(t, p, [short[0], short[1], fine, short[2], short[3]])
    assert t.mismatch() is None
    # so does a window off the other way
    t = Tracker()
    feed(t, p, [short[0], short[1], above, short[2]])
    assert t.mismatch() is None and [w.verdict for w in t.streak] == ["below"]
    # a new plan (or a new prediction) starts over; acting on a mismatch too
    t = Tracker()
    feed(t, p, short[:3])
    assert t.mismatch() is not None
    feed(t, plan(goodput=900.0), short[3:4])
    assert t.mismatch() is None and len(t.streak) == 1
    feed(t, plan(goodput=900.0), short[4:6])
    mismatch = t.mismatch()
    assert mismatch is not None
    t.acted(mismatch, {})
    assert t.mismatch() is None and t.streak == []


def test_short_slices_fill_one_window_before_it_is_judged():
    t, p = Tracker(), plan()
    whole = window(bucket(200, refused=0.05), bucket(200))
    third = SPAN / 3
    pieces = []
    for i in range(3):  # three slices of a third of the window each, counts split evenly
        part = whole.model_copy(deep=True, update={"since": i * third, "until": (i + 1) * third})
        part.requests, part.within_slo = whole.requests // 3, whole.within_slo // 3
        part.length_histogram = [n // 3 for n in whole.length_histogram]
        part.errors = ErrorCounts(overload=whole.errors.overload // 3)
        part.per_bucket = {
            k: b.model_copy(
                update={
                    "requests": b.requests // 3,
                    "within_slo": b.within_slo // 3,
                    "refused": b.refused // 3,
                    "load_seconds": b.load_seconds / 3,
                }
            )
            for k, b in whole.per_bucket.items()
        }
        pieces.append(part)
    assert t.add(pieces[0], p, PERIOD) is None  # 3.3 s of a 10 s period: less than half a period
    verdict = t.add(pieces[1], p, PERIOD)
    assert verdict is not None and verdict.verdict == "below" and verdict.ratio == pytest.approx(0.4, abs=0.01)
    assert t.block == []  # the next window starts empty
    assert t.add(pieces[2], p, PERIOD) is None


# ---------------------------------------------------------------- the condition


def test_the_condition_carries_the_ratio_and_turns_false_only_when_persistent():
    p, t, status = plan(), Tracker(), ServiceStatus()
    short = [window(bucket(200, refused=0.05), bucket(200), since=SPAN * i) for i in range(3)]

    def step(w: Observations):
        verdict = t.add(w, p, PERIOD)
        assert verdict is not None
        update_condition(status, t, verdict, p.content_hash(), 1)
        return next(c for c in status.conditions if c.type == plan_accuracy.CONDITION)

    first = step(short[0])
    assert first.status == "Unknown" and first.reason == "NotJudged"
    assert "measured/planned goodput 0.40" in first.message and "(window 1 of 3 before it counts)" in first.message
    assert step(short[1]).status == "Unknown"  # an existing condition is left as it is while the streak builds
    cond = step(short[2])
    assert (cond.status, cond.reason) == ("False", "MeasuredBelowPlan")
    assert cond.message.startswith(f"plan {p.content_hash()}: measured/planned goodput 0.40 (400.0 / 1000.0 rps")
    assert "bucket 32: 200.0/500.0 rps = 0.40, saturated (5% refused)" in cond.message
    assert "pool(s) a to re-profile" in cond.message
    # an idle window leaves it False; a window that matches the plan under load turns it True
    assert step(window(bucket(100), bucket(100), since=40.0)).status == "False"
    good = step(window(bucket(480, refused=0.02), bucket(480), since=50.0))
    assert (good.status, good.reason) == ("True", "MeasuredMatchesPlan") and "0.96" in good.message
    # the condition's type is one the CRD allows, in its place among the others
    status.conditions = set_condition(status.conditions, "Planned", True, "Planned", "", 1)
    assert [c.type for c in status.conditions] == ["Planned", plan_accuracy.CONDITION]


# ---------------------------------------------------------------- the profile correction


def profile(pool: str) -> ModelProfileSpec:
    return ModelProfileSpec(
        model="m",
        pool=pool,
        batch_sizes=[1, 4],
        seq_lens=[32],
        blocks=[{"name": "b0", "latencyMs": [[1.0, 2.0]]}],
        ramps=[{"name": "r0", "afterBlock": 0, "latencyMs": [[0.1, 0.2]]}],
    )


def test_a_correction_scales_the_named_pools_latencies_until_the_profile_changes():
    profiles = {"a": profile("a"), "b": profile("b")}
    slower = corrected_profiles(profiles, ["a"], 0.5)
    assert slower["a"].blocks[0].latency_ms == [[2.0, 4.0]] and slower["a"].ramps[0].latency_ms == [[0.2, 0.4]]
    assert slower["b"] == profiles["b"] and profiles["a"].blocks[0].latency_ms == [[1.0, 2.0]]  # not in place
    assert corrected_profiles(profiles, ["b"], 100.0)["b"].blocks[0].latency_ms == [[0.25, 0.5]]  # clamped to 4x
    t = Tracker()
    mismatch = plan_accuracy.Mismatch("below", 0.5, ("a",), ())
    t.acted(mismatch, profiles)
    assert t.correct(profiles)["a"].blocks[0].latency_ms == [[2.0, 4.0]]
    t.acted(mismatch, profiles)  # measured against a plan not made with it (e.g. a proposal): replaced
    assert t.correct(profiles)["a"].blocks[0].latency_ms == [[2.0, 4.0]]
    t.planned_with_corrections(*t.plan_key)  # the plan in force was made with the correction ...
    t.acted(mismatch, profiles)  # ... and is still off: the corrections compound
    assert t.correct(profiles)["a"].blocks[0].latency_ms == [[4.0, 8.0]]
    remeasured = {**profiles, "a": profile("a").model_copy(update={"measured_on": "again"})}
    assert t.correct(remeasured) == remeasured and t.corrections == {}  # measured again: the correction goes


# ---------------------------------------------------------------- the per-bucket figures


def test_window_stats_fill_the_per_bucket_figures():
    w = WindowStats("svc", "m", ["r0"], [32, 128], since=0.0)
    for k in range(100):
        w.record_answer(k % 2, 0.001 * (k + 1), k < 90, 0)  # bucket 32: 1..100 ms, 90 within
    w.record_answer(1, 0.5, False, 1)
    w.record_answer(1, 0.5, False)  # not counted per bucket
    w.record_refused([0, 0, -1, 1])
    w.record_load([0.5, float("inf")], 2.0)
    w.record_load([1.0, 0.25], 1.0)
    obs = w.observations(4.0, {}, {}, "h")
    b32, b128 = obs.per_bucket["32"], obs.per_bucket["128"]
    assert (b32.requests, b32.within_slo, b32.refused) == (100, 90, 2)
    assert b32.p99_ms == pytest.approx(np.percentile(np.arange(1, 101), 99)) and b32.load_seconds == 2.0
    assert (b128.requests, b128.within_slo, b128.refused, b128.p99_ms, b128.load_seconds) == (1, 0, 1, 500.0, 0.25)
    assert obs.requests == 102  # the top-level figures count every answer
    again = Observations.model_validate(obs.model_dump(by_alias=True, mode="json"))
    assert again.per_bucket == obs.per_bucket and "perBucket" in obs.model_dump(by_alias=True)


def test_per_bucket_figures_add_over_routers_and_subtract_within_a_window():
    a = window(bucket(200, refused=0.05, load=0.5), bucket(100))
    b = window(bucket(100, load=0.4), bucket(100, late=0.1))
    both = drift.combine([a, b])
    assert both.per_bucket["32"].requests == a.per_bucket["32"].requests + b.per_bucket["32"].requests
    assert both.per_bucket["32"].refused == a.per_bucket["32"].refused
    assert both.per_bucket["32"].load_seconds == pytest.approx(9.0)  # two routers' outstanding inputs add
    assert both.per_bucket["128"].within_slo == 2000 and both.per_bucket["128"].p99_ms == 30.0
    earlier = a.model_copy(deep=True, update={"until": 4.0})
    for part in earlier.per_bucket.values():
        part.requests, part.within_slo, part.refused, part.load_seconds = 10, 9, 1, 1.5
    later = drift.subtract(a, earlier)
    assert (later.since, later.until) == (4.0, SPAN)
    assert later.per_bucket["32"].requests == a.per_bucket["32"].requests - 10
    assert later.per_bucket["32"].within_slo == a.per_bucket["32"].within_slo - 9
    assert later.per_bucket["32"].refused == a.per_bucket["32"].refused - 1
    assert later.per_bucket["32"].load_seconds == pytest.approx(5.0 - 1.5)
    assert a.per_bucket["32"].requests == 2000  # subtract leaves its inputs alone


# ---------------------------------------------------------------- against the plan as served


def test_a_window_below_the_solvers_rate_is_judged_against_the_plan_as_served():
    """The planned goodput is the lower of the solver's rate and the plan's capacity as served: a service
    that serves what the simulated serving path says matches; one short of that too is still below; a
    plan that serves more than the solver says keeps the solver's rate."""
    p = plan()
    saturated = window(bucket(200, refused=0.05), bucket(200))  # 400 rps within the SLO, 0.4x the solver
    assert judge(p, saturated).verdict == "below"
    served = judge(p, saturated, served_rps=450.0)
    assert served.verdict == "match" and served.planned_rps == 450.0 and served.fluid_rps == 1000.0
    assert served.ratio == pytest.approx(400 / 450, abs=0.01)
    assert "(400.0 / 450.0 rps within the SLO; planned as served, the solver's 1000.0)" in served.text()
    short = judge(p, saturated, served_rps=800.0)
    assert short.verdict == "below" and short.off_ratio == pytest.approx(0.5) and short.fluid_rps == 1000.0
    for above in (1200.0, 0.0, None):  # above the solver's, failed, unknown: the solver's rate
        same = judge(p, saturated, served_rps=above)
        assert (same.verdict, same.planned_rps, same.fluid_rps) == ("below", 1000.0, 0.0)
        assert "planned as served" not in same.text()


def test_the_tracker_keeps_the_plans_capacity_as_served_until_the_plan_changes():
    p, t = plan(), Tracker()
    short = [window(bucket(200, refused=0.05), bucket(200), since=SPAN * i) for i in range(4)]
    whole = t.fill(short[0], p, PERIOD, p.content_hash())
    assert whole is not None
    verdict = judge(p, whole, t.served)
    assert t.needs_served(verdict)  # below the solver's rate, not simulated yet
    t.served = 450.0
    assert t.record(judge(p, whole, t.served)).verdict == "match"
    assert [t.add(w, p, PERIOD).verdict for w in short[1:3]] == ["match", "match"]  # type: ignore[union-attr]
    assert not t.needs_served(judge(p, short[3], t.served))
    assert t.mismatch() is None
    new = plan(goodput=900.0)
    t.fill(short[3], new, PERIOD, new.content_hash())  # a new plan: simulated again when needed
    assert t.served is None
