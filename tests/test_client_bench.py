"""`exitplan bench` against a real router and workers (LocalDeployment) serving the MiniLM test bundle.

One deployment (one split, buckets 32 and 128, one worker each, exit thresholds 0.9) serves every
test here; each run is a few dozen to a few hundred requests.
"""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
from dataplane_helpers import control_headers, deployment, service_spec
from typer.testing import CliRunner

from exitplan.api.bundle import BundleError, read_manifest
from exitplan.api.resources import Workload
from exitplan.cli import app
from exitplan.client.bench import BenchError, BenchSetup, find_capacity, router_observations, run_bench
from exitplan.client.texts import build_inputs, load_pool
from exitplan.localrun.service_setup import ServiceSetup, single_split_plan

pytestmark = pytest.mark.slow

SLO_MS = 500.0


@pytest.fixture(scope="module")
def manifest(minilm_bundle):
    return read_manifest(minilm_bundle)


@pytest.fixture(scope="module")
def served(minilm_bundle, manifest, tmp_path_factory):
    spec = service_spec(minilm_bundle, slo_ms=SLO_MS).model_copy(
        update={"workload": Workload(length_buckets=[32, 128])}
    )
    setup = ServiceSetup("bench-test", spec, minilm_bundle, manifest)
    thresholds = {r.name: 0.9 for r in manifest.exit_ramps()}
    plan = single_split_plan(setup, thresholds=thresholds, replicas=1, batch_size=8, reason="bench test")
    dep = deployment(minilm_bundle, plan, spec, tmp_path_factory.mktemp("bench"))
    dep.start()
    yield dep
    dep.stop()


@pytest.fixture(scope="module")
def setup(served, minilm_bundle):
    setup = BenchSetup.connect(served.url, "minilm", minilm_bundle)
    setup.control_url, setup.control_token = served.control_url, served.control_token
    return setup


def _set_thresholds(served, thresholds: dict[str, float]) -> None:
    body = json.dumps({"thresholds": thresholds, "reason": "bench-test"}).encode()
    headers = {"Content-Type": "application/json", **control_headers(served)}
    req = urllib.request.Request(f"{served.control_url}/v1/thresholds", data=body, headers=headers)
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200


def _assert_all_answered(report):
    assert report.accounted == report.requests
    assert report.lost == 0, report.error_samples.get("lost")
    assert report.errors["transport"] == 0, report.error_samples.get("transport")
    assert report.errors["invalid"] == 0, report.error_samples.get("invalid")
    assert report.overload_without_retry_after == 0


def test_matched_texts_tokenize_to_the_lengths_reported(minilm_bundle):
    """The real tokenizer: single texts and concatenations have the token lengths the matcher counted."""
    pool = load_pool(minilm_bundle)
    targets = np.r_[np.arange(1, 129, 3), [128] * 10]
    inputs = build_inputs(pool, targets, max_length=128, seed=5)
    texts = [json.loads(b)["inputs"][0]["data"][0] for b in inputs.bodies]
    measured = np.array([len(e.ids) for e in pool.tokenizer.encode_batch(texts)])
    np.testing.assert_array_equal(measured, inputs.lengths)
    assert measured.max() <= 128
    assert inputs.concatenated > 0
    longest = int(pool.lengths[pool.lengths <= 128].max())
    long_targets = targets > longest
    assert np.abs(measured[long_targets] - targets[long_targets]).max() <= 3
    assert all(t is None for t, p in zip(inputs.truth, inputs.parts) if len(p) > 1)
    again = build_inputs(pool, targets, max_length=128, seed=5)
    assert again.bodies == inputs.bodies  # deterministic given the seed


def test_replay_accounts_for_every_request_and_agrees_with_the_routers_counts(served, setup, manifest, shared_trace):
    assert router_observations(served.control_url) is None  # not without the token
    before = router_observations(served.control_url, served.control_token)
    report = run_bench(served.url, "minilm", served.bundle, setup=setup, rps=25.0, limit=120, slo_ms=SLO_MS, seed=1)
    after = router_observations(served.control_url, served.control_token)
    assert report.requests == 120
    _assert_all_answered(report)
    assert report.results > 0
    assert after["requests"] - before["requests"] == report.results
    assert after["errors"]["overload"] - before["errors"]["overload"] == report.errors["overload"]
    names = [r.name for r in manifest.exit_ramps()] + [manifest.final_ramp().name]
    assert set(report.exits) <= set(names)
    assert sum(report.exits.values()) == report.results
    assert report.latency["p50"] <= report.latency["p95"] <= report.latency["p99"] <= report.latency_ms["max"]
    assert 0.0 <= report.agreement <= 1.0
    assert report.router is not None and report.router["model"] == "minilm"


def test_without_exits_every_answer_is_the_full_models(served, setup, manifest, shared_trace):
    """Thresholds above 1: the router answers with the final head, so agreement must be exact, concatenations included."""
    exit_ramps = [r.name for r in manifest.exit_ramps()]
    _set_thresholds(served, {r: 2.0 for r in exit_ramps})
    try:
        single = run_bench(served.url, "minilm", served.bundle, setup=setup, rps=20.0, limit=30, slo_ms=SLO_MS, seed=2)
        joined = run_bench(
            served.url,
            "minilm",
            served.bundle,
            setup=setup,
            rps=20.0,
            limit=30,
            slo_ms=SLO_MS,
            seed=3,
            length_mode="clip",
        )
    finally:
        _set_thresholds(served, {r: 0.9 for r in exit_ramps})
    for report in (single, joined):
        _assert_all_answered(report)
        assert report.results > 0
        assert set(report.exits) == {manifest.final_ramp().name}
        assert report.agreement == 1.0
    assert joined.run["inputs"]["concatenated"] > 0
    assert joined.accuracy_n < joined.results  # concatenations carry no true label
    assert single.accuracy == single.full_model_accuracy  # same answers, same accuracy


def test_a_burst_far_above_capacity_is_shed_with_explicit_overload_errors(served, setup, tmp_path):
    trace = tmp_path / "burst.jsonl"
    rng = np.random.default_rng(0)
    trace.write_text(
        "".join(
            json.dumps({"timestamp": 0.0005 * i, "input_length": int(rng.integers(8, 128))}) + "\n" for i in range(200)
        )
    )
    report = run_bench(served.url, "minilm", served.bundle, trace, setup=setup, length_mode="clip", slo_ms=SLO_MS)
    assert report.requests == 200
    _assert_all_answered(report)
    assert report.errors["overload"] > 0
    assert set(report.by_status) <= {"429", "503", "502", "504"}
    assert report.results > 0


def test_capacity_search_then_1_2x_capacity_loses_nothing(served, setup, shared_trace):
    result = find_capacity(
        served.url,
        "minilm",
        served.bundle,
        setup=setup,
        start_rps=8.0,
        resolution=0.25,
        step_duration=2.0,
        max_steps=4,
        slo_ms=SLO_MS,
    )
    assert 1 <= len(result.steps) <= 4 and result.steps[0].rps == 8.0
    for step in result.steps:
        _assert_all_answered(step.report)
        share = step.report.within_slo_share
        last = step.report.last_third_within_slo_share
        assert step.passed == (share >= 0.99 and (last is None or last >= 0.99))
    passed = [s.rps for s in result.steps if s.passed]
    missed = [s.rps for s in result.steps if not s.passed]
    assert not passed or not missed or max(passed) < min(missed)
    if passed:
        assert result.capacity_rps == result.at_capacity.offered_rps
        assert result.at_capacity is next(s for s in result.steps if s.rps == max(passed)).report
    report = run_bench(
        served.url,
        "minilm",
        served.bundle,
        setup=setup,
        rps=1.2 * max(result.capacity_rps, 8.0),
        duration=2.0,
        slo_ms=SLO_MS,
    )
    _assert_all_answered(report)


def test_cli_writes_the_report_as_json(served, minilm_bundle, tmp_path, shared_trace):
    out = tmp_path / "bench.json"
    done = CliRunner().invoke(
        app,
        [
            "bench",
            "--url",
            served.url,
            "--model",
            "minilm",
            "--bundle",
            str(minilm_bundle),
            "--rps",
            "20",
            "--limit",
            "25",
            "--duration",
            "0",
            "--json",
            str(out),
            "--no-progress",
        ],
    )
    assert done.exit_code == 0, done.output
    doc = json.loads(out.read_text())
    assert doc["requests"] == 25 and doc["accounted"] == 25 and doc["lost"] == 0
    assert doc["slo_ms"] == SLO_MS  # taken from the router's own SLO gauge
    assert "goodput" in done.output


def test_cli_names_what_is_wrong(served, minilm_bundle):
    done = CliRunner().invoke(
        app, ["bench", "--url", served.url, "--model", "nope", "--bundle", str(minilm_bundle), "--limit", "5"]
    )
    assert done.exit_code == 2
    assert "404" in done.output and "--model" in done.output
    with pytest.raises(BenchError, match="cannot reach the router"):
        BenchSetup.connect("http://127.0.0.1:9", "minilm", minilm_bundle)


def test_fixed_size_model_bench(digits_bundle, setup, tmp_path, shared_trace):
    """A model without a sequence axis: held-out images in seeded order, checked against the full model."""
    manifest = read_manifest(digits_bundle)
    spec = service_spec(digits_bundle, slo_ms=SLO_MS).model_copy(
        update={"model": service_spec(digits_bundle).model.model_copy(update={"name": "digits"})}
    )
    setup_ = ServiceSetup("bench-digits", spec, digits_bundle, manifest)
    plan = single_split_plan(
        setup_, thresholds={r.name: 2.0 for r in manifest.exit_ramps()}, replicas=1, batch_size=8, reason="bench test"
    )
    with deployment(digits_bundle, plan, spec, tmp_path) as dep:
        report = run_bench(dep.url, "digits", digits_bundle, rps=20.0, limit=40, slo_ms=SLO_MS, seed=4)
        with pytest.raises(BundleError, match="labels"):  # a setup made for another router is re-read for this one
            run_bench(dep.url, "digits", digits_bundle, setup=setup, limit=5, slo_ms=SLO_MS)
    _assert_all_answered(report)
    assert report.results > 0
    assert report.agreement == 1.0  # exits off: every answer is the final head's
    assert report.accuracy_n == report.results  # every image has its true label
    assert report.run["inputs"]["concatenated"] == 0
