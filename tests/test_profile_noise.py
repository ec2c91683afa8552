"""Profiles that hold up on a busy machine: spikes measured again, tables written as their monotone lower
envelope, and a cached profile the planner rejects measured anew instead of failing every rerun."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import yaml

from exitplan.api.resources import ModelProfile
from exitplan.localrun.service_setup import ServiceSetup, ensure_profiles
from exitplan.planner.costmodel import validate_profile
from exitplan.planner.errors import ProfileError
from exitplan.prepare.profile import REPAIRS_ANNOTATION, ProfileOptions, envelope, profile_bundle, spikes


def test_envelope_is_monotone_and_never_above_the_measurement():
    rng = np.random.default_rng(0)
    for _ in range(50):
        table = np.add.outer(rng.uniform(0, 1, size=3).cumsum(), rng.uniform(0.1, 1.0, size=7).cumsum())  # monotone
        noisy = table * np.where(rng.uniform(size=table.shape) < 0.2, rng.uniform(1.5, 6.0, size=table.shape), 1.0)
        env = envelope(noisy)
        assert np.all(np.diff(env, axis=1) >= 0) and np.all(np.diff(env, axis=0) >= 0)
        assert np.all(env <= noisy)
        assert np.all(env >= table - 1e-12)  # the spikes go, the true (monotone) curve stays


def test_a_spike_is_found_where_it_is():
    table = np.array([[0.6, 0.8, 1.4, 2.5], [0.9, 4.6, 1.6, 2.9]])
    assert spikes(table) == [(1, 1)]
    assert spikes(envelope(table)) == []


def test_the_profiler_on_a_busy_machine_writes_a_profile_the_planner_takes(digits_bundle):
    """Two CPU-bound processes beside the profiler (the machine has 2 cores), each stopping by itself."""
    burn = "import time\nt = time.time()\nwhile time.time() - t < 90:\n    pass\n"
    hogs = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(2)]
    try:
        profile = profile_bundle(digits_bundle, ProfileOptions(pool="cpu", repeats=3))
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    validate_profile(profile.spec)  # raises ProfileError on a dip
    for block in profile.spec.blocks:
        table = np.asarray(block.latency_ms)
        assert np.all(np.diff(table, axis=1) >= 0) and np.all(np.diff(table, axis=0) >= 0)
    repairs = profile.metadata["annotations"][REPAIRS_ANNOTATION]  # what it took, in words: "N cell(s) ..."
    assert repairs.split()[0].isdigit(), repairs


def test_an_invalid_cached_profile_is_measured_again(digits_bundle, tmp_path):
    from exitplan.api.bundle import read_manifest
    from exitplan.api.resources import EarlyExitServiceSpec, GPUPoolSpec

    bundle = tmp_path / "bundle"
    subprocess.run(["cp", "-r", str(digits_bundle), str(bundle)], check=True)
    good = profile_bundle(bundle, ProfileOptions(pool="cpu", batch_sizes=(1, 2, 4), repeats=1))
    doc = good.model_dump(mode="json", by_alias=True, exclude_none=True)
    doc["spec"]["blocks"][0]["latencyMs"][0][0] = 100.0  # a planted spike: 100 ms at batch 1
    cache = bundle / "profiles" / "cpu.yaml"
    cache.parent.mkdir(exist_ok=True)
    cache.write_text(yaml.safe_dump(doc))
    with pytest.raises(ProfileError):
        validate_profile(ModelProfile.model_validate(doc).spec)
    spec = EarlyExitServiceSpec.model_validate(
        {"model": {"name": "digits-cnn", "bundle": str(bundle)}, "slo": {"latencyMs": 100},
         "accuracy": {"maxDrop": 0.01}, "pools": [{"name": "cpu"}]}
    )  # fmt: skip
    setup = ServiceSetup("digits", spec, bundle, read_manifest(bundle), {"cpu": GPUPoolSpec(capacity=1)})
    said: list[str] = []
    ensure_profiles(setup, said.append)
    assert said and "cannot be used" in said[0] and "latency falls" in said[0]
    validate_profile(setup.profiles["cpu"])
    assert max(max(row) for row in setup.profiles["cpu"].blocks[0].latency_ms) < 100.0


def test_plans_on_this_machine_are_sized_for_the_survival_at_the_served_thresholds(digits_bundle):
    """The profile's curve is the profiler's thresholds'; `planned` (exitplan up, the demo) reads the curve
    at the thresholds it serves from the bundle's calibration window, as the profiler reads its own."""
    from exitplan.api.bundle import read_manifest
    from exitplan.api.resources import EarlyExitServiceSpec, GPUPoolSpec
    from exitplan.localrun.service_setup import at_thresholds
    from exitplan.planner.tuning.initial import survival_at

    manifest = read_manifest(digits_bundle)
    profile = profile_bundle(digits_bundle, ProfileOptions(pool="cpu", batch_sizes=(1, 2), repeats=1)).spec
    spec = EarlyExitServiceSpec.model_validate(
        {"model": {"name": "digits-cnn", "bundle": str(digits_bundle)}, "slo": {"latencyMs": 100},
         "accuracy": {"maxDrop": 0.01}, "pools": [{"name": "cpu"}]}
    )  # fmt: skip
    setup = ServiceSetup("digits", spec, digits_bundle, manifest, {"cpu": GPUPoolSpec(capacity=1)}, {"cpu": profile})
    strict = {r.name: 0.999 for r in manifest.ramps}
    loose = {r.name: 0.5 for r in manifest.ramps}
    high, low = at_thresholds(setup, strict).profiles["cpu"], at_thresholds(setup, loose).profiles["cpu"]
    expected = survival_at(digits_bundle, manifest, strict)
    assert high.survival == [expected[r.name] for r in profile.ramps]
    assert all(h >= lo for h, lo in zip(high.survival, low.survival)) and high.survival != low.survival
    assert setup.profiles["cpu"].survival == profile.survival  # the setup itself is left as it was


def test_a_cell_is_timed_by_its_fastest_run_so_preemptions_do_not_count(digits_bundle):
    """prepare/measure.py `time_chain` on the real bundle, block 0 held up by 50 ms in three of every five
    runs (as a call is when the scheduler gives its core to another process): the median would be a
    held-up run, the fastest is the block's own cost."""
    import time

    from exitplan.prepare.measure import batch_state, load_heldout, time_chain
    from exitplan.worker_image.bundle_runtime import BundleRuntime

    runtime = BundleRuntime(digits_bundle)
    heldout = load_heldout(digits_bundle, runtime.manifest)
    state = batch_state(runtime, heldout, 4, 1)
    real = runtime.run_block
    calls = {"n": 0}

    def held_up(index, work, bucket):
        if index == 0:
            calls["n"] += 1
            if calls["n"] % 5 in (1, 2, 3):
                time.sleep(0.05)
        return real(index, work, bucket)

    runtime.run_block = held_up  # type: ignore[method-assign]
    timing = time_chain(runtime, state, 1, repeats=5, warmup=1)
    assert calls["n"] >= 6
    assert timing.block_ms[0] < 25.0, timing.block_ms  # a run of the block itself, not a 50 ms one


def test_a_cached_profile_is_measured_again_when_asked(digits_bundle, tmp_path):
    """ensure_profiles(remeasure=True) (bench/plan_accuracy.py's default): a valid cached profile written at
    another time is replaced by one measured now."""
    from exitplan.api.bundle import read_manifest
    from exitplan.api.resources import EarlyExitServiceSpec, GPUPoolSpec

    bundle = tmp_path / "bundle"
    subprocess.run(["cp", "-r", str(digits_bundle), str(bundle)], check=True)
    old = profile_bundle(bundle, ProfileOptions(pool="cpu", batch_sizes=(1, 2, 4), repeats=1))
    doc = old.model_dump(mode="json", by_alias=True, exclude_none=True)
    doc["spec"]["blocks"] = [
        {**b, "latencyMs": [[x * 3 for x in row] for row in b["latencyMs"]]} for b in doc["spec"]["blocks"]
    ]  # valid, three times slower: as if measured under heavy load
    doc["spec"]["serving"] = {"routerMs": 0.4, "hopMs": 0.3, "colocatedMs": 0.4, "computeScale": [1.1]}  # complete
    cache = bundle / "profiles" / "cpu.yaml"
    cache.parent.mkdir(exist_ok=True)
    cache.write_text(yaml.safe_dump(doc))
    spec = EarlyExitServiceSpec.model_validate(
        {"model": {"name": "digits-cnn", "bundle": str(bundle)}, "slo": {"latencyMs": 100},
         "accuracy": {"maxDrop": 0.01}, "pools": [{"name": "cpu"}]}
    )  # fmt: skip
    kept = ServiceSetup("digits", spec, bundle, read_manifest(bundle), {"cpu": GPUPoolSpec(capacity=1)})
    ensure_profiles(kept, print)
    assert kept.profiles["cpu"].blocks[0].latency_ms == doc["spec"]["blocks"][0]["latencyMs"]
    fresh = ServiceSetup("digits", spec, bundle, read_manifest(bundle), {"cpu": GPUPoolSpec(capacity=1)})
    said: list[str] = []
    ensure_profiles(fresh, said.append, remeasure=True)
    assert said and "re-measuring the profile" in said[0]
    # measured now with `exitplan profile`'s defaults (the cached one had three batch sizes)
    assert len(fresh.profiles["cpu"].batch_sizes) > 3 and fresh.profiles["cpu"].batch_sizes[:3] == [1, 2, 4]
    assert yaml.safe_load(cache.read_text())["spec"]["batchSizes"] == fresh.profiles["cpu"].batch_sizes
