"""The capacity search: the highest offered rate at which >= 99 % of requests finish within the SLO,
over a step and over its last third (errors and lost requests are misses), bracketed by doubling and
then bisected. First against a deterministic single-server queue, then against a real router and
worker serving the digits bundle."""

from __future__ import annotations

import json
import math
import urllib.request

import numpy as np
import pytest
from capacity_helpers import queue_probe
from dataplane_helpers import control_headers, deployment, service_spec

from exitplan.api.bundle import read_manifest
from exitplan.client.bench import BenchError, find_capacity
from exitplan.client.capacity import meets_slo, search_capacity
from exitplan.client.loadgen import Outcome
from exitplan.client.report import summarize
from exitplan.localrun.service_setup import ServiceSetup, single_split_plan


def _report(kinds_and_latencies: list[tuple[str, float | None]], slo_ms: float = 100.0, window_s: float = 10.0):
    """Requests evenly over `window_s`; the i-th ends as kinds_and_latencies[i] (latency in seconds)."""
    n = len(kinds_and_latencies)
    outcomes = []
    for i, (kind, latency) in enumerate(kinds_and_latencies):
        at = i * window_s / n
        done = None if latency is None else at + latency
        outcomes.append(Outcome(i, at, at, kind, 200 if kind == "ok" else 429, done, "a" if kind == "ok" else None))
    return summarize(outcomes, ["a"] * n, [None] * n, slo_ms=slo_ms, window_s=window_s)


def _brackets(rates: list[float], passed: list[bool]) -> list[tuple[float | None, float | None]]:
    """(highest rate passed, lowest rate missed) before each step."""
    low = high = None
    out = []
    for rate, ok in zip(rates, passed):
        out.append((low, high))
        if ok:
            low = rate
        else:
            high = rate
    return out


def _assert_search_shape(result, start: float, resolution: float) -> None:
    """Double from `start` while steps pass, halve while they miss, then geometric midpoints of the bracket;
    every rate that passed below every rate that missed; the capacity is the highest that passed."""
    rates = [s.rps for s in result.steps]
    passed = [s.passed for s in result.steps]
    assert rates[0] == pytest.approx(start)
    for rate, (low, high) in zip(rates[1:], _brackets(rates, passed)[1:]):
        if high is None:
            assert rate == pytest.approx(2 * low)
        elif low is None:
            assert rate == pytest.approx(high / 2)
        else:
            assert low < rate < high and rate == pytest.approx(math.sqrt(low * high))
    ok_rates = [r for r, p in zip(rates, passed) if p]
    missed = [r for r, p in zip(rates, passed) if not p]
    assert ok_rates and missed and max(ok_rates) < min(missed)
    at = result.at_capacity
    assert at is result.steps[rates.index(max(ok_rates))].report
    assert result.capacity_rps == at.offered_rps
    assert result.failed_rps == result.steps[rates.index(min(missed))].report.offered_rps
    assert result.ended == "bracketed" and min(missed) <= max(ok_rates) * (1 + resolution)


# ---------------------------------------------------------------- the criterion


def test_a_step_passes_on_99_percent_within_the_slo_over_the_run_and_its_last_third():
    fast, slow = ("ok", 0.02), ("ok", 0.5)
    early_misses = _report([slow] * 3 + [fast] * 297)
    assert early_misses.within_slo_share == pytest.approx(0.99)
    assert early_misses.last_third_within_slo_share == 1.0
    assert meets_slo(early_misses)  # 99 % exactly is enough
    late_misses = _report([fast] * 297 + [slow] * 3)
    assert late_misses.within_slo_share == pytest.approx(0.99)
    assert late_misses.last_third_within_slo_share == pytest.approx(0.97)
    assert not meets_slo(late_misses)  # the same share overall, but the end of the run fell behind
    assert not meets_slo(_report([slow] * 4 + [fast] * 296))


def test_errors_and_lost_requests_count_as_misses():
    fast = ("ok", 0.02)
    two = _report([("overload", 0.001), ("lost", None)] + [fast] * 198)
    assert two.within_slo_share == pytest.approx(0.99) and meets_slo(two)
    three = _report([("overload", 0.001), ("server_error", 0.001), ("lost", None)] + [fast] * 197)
    assert three.within_slo_share == pytest.approx(0.985) and not meets_slo(three)
    assert three.results == 197 and three.within_slo == 197  # every answer in time: the errors alone fail it


# ---------------------------------------------------------------- the search, on a single-server queue


def test_search_doubles_to_a_miss_then_bisects_to_the_resolution():
    calls: list[float] = []
    result = search_capacity(queue_probe(37.0, calls=calls), start_rps=8.0, max_rps=1000.0, resolution=0.05)
    assert calls[:4] == [8.0, 16.0, 32.0, 64.0]
    assert [s.passed for s in result.steps[:4]] == [True, True, True, False]
    _assert_search_shape(result, 8.0, 0.05)
    assert calls == [s.rps for s in result.steps]  # one probe per step
    # the server's real capacity lies between the rate that passed and the rate that missed
    assert result.capacity_rps <= 37.0 * 1.02 and result.failed_rps > 37.0
    assert result.capacity_rps >= 37.0 / 1.05
    assert "passed at" in result.reason and "missed at" in result.reason


def test_search_halves_when_the_first_step_misses():
    result = search_capacity(queue_probe(5.0, slo_ms=500.0), start_rps=40.0, max_rps=1000.0, resolution=0.1)
    assert [s.rps for s in result.steps[:4]] == [40.0, 20.0, 10.0, 5.0]
    _assert_search_shape(result, 40.0, 0.1)
    assert result.capacity_rps <= 5.0 * 1.02 < result.failed_rps


def test_search_stops_at_the_ceiling_the_floor_or_its_step_budget_and_says_so():
    top = search_capacity(queue_probe(500.0), start_rps=8.0, max_rps=100.0)
    assert [s.rps for s in top.steps] == [8.0, 16.0, 32.0, 64.0, 100.0]
    assert top.ended == "ceiling" and top.capacity_rps == pytest.approx(100.0) and top.failed_rps is None
    assert "at least" in top.reason
    bottom = search_capacity(queue_probe(0.5, slo_ms=1000.0), start_rps=8.0, max_rps=100.0, min_rps=1.0)
    assert [s.rps for s in bottom.steps] == [8.0, 4.0, 2.0, 1.0]
    assert bottom.ended == "floor" and bottom.capacity_rps == 0.0 and bottom.at_capacity is None
    short = search_capacity(queue_probe(37.0), start_rps=8.0, max_rps=1000.0, max_steps=3)
    assert len(short.steps) == 3 and short.ended == "steps" and "out of steps" in short.reason
    assert short.capacity_rps == pytest.approx(32.0) and short.failed_rps is None
    with pytest.raises(ValueError):
        search_capacity(queue_probe(37.0), start_rps=8.0, max_rps=0.1)


def test_settling_runs_first_and_after_each_miss_at_a_rate_that_passed():
    """A service that, once overloaded, misses the next run too unless a run it keeps up with comes
    first (as the router's admission limits, cut by late answers, grow back only under load)."""
    fifo = queue_probe(37.0)
    state = {"hurt": False}
    settles: list[float] = []

    def probe(rps: float):
        report = fifo(rps)
        if state["hurt"]:
            report.within_slo_share = 0.5
        state["hurt"] = not meets_slo(report)
        return report

    def settle(rps: float) -> None:
        settles.append(rps)
        state["hurt"] = not meets_slo(fifo(rps))

    hurt = search_capacity(probe, start_rps=8.0, max_rps=1000.0)
    assert hurt.capacity_rps == pytest.approx(32.0)  # every step after the miss at 64 missed as well
    state["hurt"] = False
    result = search_capacity(probe, start_rps=8.0, max_rps=1000.0, settle=settle)
    _assert_search_shape(result, 8.0, 0.05)
    assert result.capacity_rps <= 37.0 * 1.02 < result.failed_rps and result.capacity_rps >= 37.0 / 1.05
    after_miss = [
        _brackets([s.rps for s in result.steps], [s.passed for s in result.steps])[i + 1][0]
        for i, s in enumerate(result.steps[:-1])
        if not s.passed
    ]
    assert settles == [4.0, *after_miss] and len(settles) < len(result.steps)


def test_the_result_as_json_and_as_a_table():
    result = search_capacity(queue_probe(37.0), start_rps=8.0, max_rps=1000.0, resolution=0.2)
    doc = json.loads(json.dumps(result.to_dict()))
    assert doc["capacity_rps"] == result.capacity_rps and doc["ended"] == "bracketed"
    assert [s["passed"] for s in doc["steps"]] == [s.passed for s in result.steps]
    assert doc["steps"][0]["within_slo_share"] == 1.0 and doc["target_share_within_slo"] == 0.99
    from rich.console import Console

    console = Console(width=300, record=True)
    console.print(result.table())
    text = console.export_text()
    assert f"{result.capacity_rps:.1f} rps offered" in text and text.count("miss") >= 2


# ---------------------------------------------------------------- a real router and worker


@pytest.fixture(scope="module")
def slowed_digits(digits_bundle, tmp_path_factory):
    """The digits bundle behind a router, one worker taking one input at a time, its service time
    stretched x20 (the fault endpoint's slowdown): a capacity a doubling search reaches in a few steps."""
    manifest = read_manifest(digits_bundle)
    spec = service_spec(digits_bundle, slo_ms=300.0)
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"name": "digits"})})
    setup = ServiceSetup("capacity-digits", spec, digits_bundle, manifest)
    thresholds = {r.name: 0.9 for r in manifest.exit_ramps()}
    plan = single_split_plan(setup, thresholds=thresholds, replicas=1, batch_size=1, reason="capacity test")
    work = tmp_path_factory.mktemp("capacity")
    with deployment(digits_bundle, plan, spec, work, EXITPLAN_ENABLE_FAULTS="1") as dep:
        worker = next(p for p in dep.procs if p.name.startswith("worker"))
        body = json.dumps({"slowdown": 20}).encode()
        request = urllib.request.Request(f"http://{worker.address}/v1/faults", data=body, headers=control_headers(dep))
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert json.loads(resp.read())["slowdown"] == 20
        yield dep


@pytest.fixture(scope="module")
def poisson_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "poisson.jsonl"
    arrivals = np.cumsum(np.random.default_rng(0).exponential(1.0, 3000))
    path.write_text("".join(json.dumps({"timestamp": float(t), "input_length": 1}) + "\n" for t in arrivals))
    return path


@pytest.mark.slow
def test_find_capacity_on_a_real_service_passes_at_its_capacity_and_misses_one_step_above(
    slowed_digits, digits_bundle, poisson_trace
):
    seen = []
    result = find_capacity(
        slowed_digits.url,
        "digits",
        digits_bundle,
        poisson_trace,
        start_rps=16.0,
        max_rps=4000.0,
        resolution=0.25,
        step_duration=2.0,
        max_steps=12,
        settle_s=1.0,
        slo_ms=300.0,
        on_step=seen.append,
    )
    assert seen == result.steps
    _assert_search_shape(result, 16.0, 0.25)
    for step in result.steps:
        report = step.report
        assert report.accounted == report.requests and report.lost == 0, report.error_samples
        assert report.errors["bad_request"] == report.errors["invalid"] == 0, report.error_samples
        assert report.requests == round(step.rps * 2.0)  # the window holds the step's rate x its duration
        assert report.within_slo_share == report.within_slo / report.requests
    at = result.at_capacity
    assert at.within_slo_share >= 0.99 and (at.last_third_within_slo_share or 1.0) >= 0.99
    above = next(s for s in result.steps if s.report.offered_rps == result.failed_rps).report
    last = above.last_third_within_slo_share
    assert above.within_slo_share < 0.99 or (last is not None and last < 0.99)
    with pytest.raises(BenchError, match="min_rps <= max_rps"):
        find_capacity(slowed_digits.url, "digits", digits_bundle, poisson_trace, max_rps=0.1, slo_ms=300.0)
