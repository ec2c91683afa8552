"""Report arithmetic on synthetic outcome lists: accounting, percentiles, goodput, exits, agreement."""

import json

import numpy as np
import pytest

from exitplan.client.loadgen import Outcome, classify
from exitplan.client.report import latency_summary, run_seconds, summarize


def _ok(i, sent, latency_ms, label="pos", ramp="ramp1"):
    return Outcome(
        i, scheduled_s=sent, sent_s=sent, kind="ok", status=200, done_s=sent + latency_ms / 1000, label=label, ramp=ramp
    )


def _outcomes():
    # 10 requests, one every 0.1 s: 6 results (10..60 ms), 2 overloads (one without Retry-After), a 502, a lost one
    out = [
        _ok(i, 0.1 * i, 10.0 * (i + 1), label="pos" if i % 2 == 0 else "neg", ramp=["ramp0", "ramp1", "final"][i % 3])
        for i in range(6)
    ]
    out.append(Outcome(6, 0.6, 0.6, "overload", 429, 0.601, retry_after="1", error="bucket 32 cannot answer"))
    out.append(Outcome(7, 0.7, 0.7, "overload", 503, 0.702, error="router at its limit"))
    out.append(Outcome(8, 0.8, 0.8, "server_error", 502, 0.85, error="worker died"))
    out.append(Outcome(9, 0.9, 0.9, "lost", error="no answer within 30 s"))
    return out


def test_every_request_is_counted_once_by_kind():
    report = summarize(_outcomes(), ["pos"] * 10, ["pos"] * 10, slo_ms=35)
    assert report.requests == 10
    assert report.results == 6
    assert report.errors == {"overload": 2, "bad_request": 0, "server_error": 1, "invalid": 0, "transport": 0}
    assert report.lost == 1
    assert report.accounted == report.requests
    assert report.by_status == {"429": 1, "503": 1, "502": 1}
    assert report.overload_without_retry_after == 1
    assert report.error_samples["lost"] == ["no answer within 30 s"]


def test_percentiles_goodput_and_throughput():
    report = summarize(_outcomes(), ["pos"] * 10, ["pos"] * 10, slo_ms=35)
    # latencies 10, 20, ..., 60 ms: linear-interpolated percentiles
    assert report.latency["p50"] == pytest.approx(35.0)
    assert report.latency["p95"] == pytest.approx(57.5)
    assert report.latency["p99"] == pytest.approx(59.5)
    assert report.latency["max"] == pytest.approx(60.0)
    assert report.within_slo == 3  # 10, 20, 30 ms
    # run: from 0 to the last answer (the 502 at 0.85 s; the lost request does not stretch it) vs last arrival 0.9 s
    assert report.run_s == pytest.approx(0.9)
    assert report.goodput_rps == pytest.approx(3 / 0.9)
    assert report.throughput_rps == pytest.approx(6 / 0.9)
    assert report.offered_rps == pytest.approx(10 / 0.9)


def test_slo_boundary_counts_as_within():
    report = summarize([_ok(0, 0.0, 50.0)], ["pos"], ["pos"], slo_ms=50.0)
    assert report.within_slo == 1


def test_exit_histogram_follows_ramp_order_and_sums_to_one():
    report = summarize(_outcomes(), ["pos"] * 10, ["pos"] * 10, slo_ms=35, ramp_order=["ramp0", "ramp1"])
    assert list(report.exits) == ["ramp0", "ramp1", "final"]
    assert report.exits == {"ramp0": 2, "ramp1": 2, "final": 2}
    assert sum(report.exit_share.values()) == pytest.approx(1.0)


def test_agreement_with_full_model_and_accuracy_on_known_labels():
    outcomes = _outcomes()  # results 0..5 answer pos, neg, pos, neg, pos, neg
    reference = ["pos", "neg", "pos", "pos", "pos", "pos"] + ["pos"] * 4
    truth = ["pos", "pos", None, "neg", None, "neg"] + [None] * 4  # None: a concatenation, label unknown
    report = summarize(outcomes, reference, truth, slo_ms=35)
    assert report.agreement == pytest.approx(4 / 6)  # 0, 1, 2, 4 agree
    assert report.agreement_drop == pytest.approx(2 / 6)
    assert report.accuracy_n == 4
    assert report.accuracy == pytest.approx(3 / 4)  # 0, 3, 5 right; 1 wrong
    assert report.full_model_accuracy == pytest.approx(1 / 4)  # full model right on 0 only


def test_no_results_gives_empty_statistics_not_a_crash():
    out = [Outcome(0, 0.0, 0.0, "lost"), Outcome(1, 0.5, 0.5, "transport", done_s=0.5, error="reset")]
    report = summarize(out, ["a", "a"], [None, None], slo_ms=10)
    assert report.results == 0 and report.goodput_rps == 0
    assert report.latency["p99"] is None and report.agreement is None and report.accuracy is None
    json.dumps(report.to_dict())  # JSON-ready even when empty


def test_to_dict_is_json_and_carries_the_derived_counts():
    report = summarize(_outcomes(), ["pos"] * 10, ["pos"] * 10, slo_ms=35, run={"trace_name": "t.csv"})
    doc = json.loads(json.dumps(report.to_dict()))
    assert doc["accounted"] == doc["requests"] == 10
    assert doc["error_total"] == 3 and doc["lost"] == 1
    assert len(report.tables()) == 3


def test_bad_outcome_lists_are_rejected():
    with pytest.raises(ValueError, match="twice"):
        summarize([_ok(0, 0, 1), _ok(0, 0, 1)], ["a"], ["a"], slo_ms=10)
    with pytest.raises(ValueError, match="out of range"):
        summarize([_ok(3, 0, 1)], ["a"], ["a"], slo_ms=10)
    with pytest.raises(ValueError, match="slo_ms"):
        summarize([_ok(0, 0, 1)], ["a"], ["a"], slo_ms=0)


def test_helpers():
    assert latency_summary([])["p50"] is None
    assert latency_summary([0.001, 0.003])["mean"] == pytest.approx(2.0)
    assert run_seconds([Outcome(0, 2.0, 2.0, "lost")]) == 2.0
    assert [classify(s) for s in (429, 503, 400, 404, 413, 502, 504, 500, 204)] == [
        "overload",
        "overload",
        "bad_request",
        "bad_request",
        "bad_request",
        "server_error",
        "server_error",
        "server_error",
        "invalid",
    ]
    assert np.isfinite(summarize([_ok(0, 0.0, 5.0)], ["a"], ["a"], slo_ms=10).goodput_rps)
