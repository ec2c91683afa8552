"""A CPU pool's block tables scaled to what its workers' compute really costs (`serving.computeScale`)."""

from __future__ import annotations

import numpy as np
import pytest
from test_planner_service import CPU_POOLS, SEQ, cpu_profile

from exitplan.api.resources import GPUPoolSpec, ServingCosts
from exitplan.planner.costmodel import CostModel, validate_profile
from exitplan.planner.errors import ProfileError
from exitplan.prepare.profile import ProfileOptions, profile_bundle


def _scaled(scale: list[float]):
    profile = cpu_profile()
    profile.serving = ServingCosts(router_ms=0.5, hop_ms=0.0, compute_scale=scale)
    return profile


def test_a_cpu_pools_tables_are_scaled_per_length_and_an_accelerators_never():
    scale = [1.5 + 0.25 * i for i in range(len(SEQ))]
    plain = CostModel(cpu_profile(), "cpu", CPU_POOLS["cpu"])
    cpu = CostModel(_scaled(scale), "cpu", CPU_POOLS["cpu"])
    for i, length in enumerate(SEQ):
        for k in range(6):
            assert cpu.block_ms(k, 4, length) == pytest.approx(plain.block_ms(k, 4, length) * scale[i])
        assert cpu.full_model_ms(length) == pytest.approx(plain.full_model_ms(length) * scale[i])
    # between two profiled lengths the scaled tables are interpolated
    mid = 0.5 * (SEQ[0] + SEQ[1])
    between = cpu.block_ms(0, 4, mid) / plain.block_ms(0, 4, mid)
    assert scale[0] < between < scale[1]
    gpu = GPUPoolSpec(capacity=2, gpu_resource="nvidia.com/gpu", cost_per_hour=1.0, memory_bytes=4 << 30)
    on_gpu = CostModel(_scaled(scale), "cpu", gpu)
    assert on_gpu.full_model_ms(SEQ[-1]) == pytest.approx(CostModel(cpu_profile(), "cpu", gpu).full_model_ms(SEQ[-1]))


def test_a_scale_that_does_not_match_the_lengths_is_refused_with_its_field():
    with pytest.raises(ProfileError) as err:
        validate_profile(_scaled([1.1]), "profiles[cpu]")
    assert "computeScale has 1 entries" in str(err.value) and "re-run `exitplan profile`" in str(err.value)
    assert err.value.field == "profiles[cpu].serving.computeScale"


def test_the_scale_is_the_measured_compute_over_the_tables(digits_bundle):
    """Measured on the real digits bundle: against tables at half the profiled figures the scale doubles."""
    from exitplan.prepare.compute_scale import compute_scale

    spec = profile_bundle(digits_bundle, ProfileOptions(pool="cpu", batch_sizes=(1, 2), repeats=3)).spec
    halved = spec.model_copy(deep=True)
    for entry in [*halved.blocks, *halved.ramps]:
        entry.latency_ms = [[x / 2 for x in row] for row in entry.latency_ms]
    ratios = []
    for _ in range(5):  # alternately, so a burst of other load hits both alike (the median of 5: one of 3 was
        # not enough beside two busy loops, the suite and `make demo` on 2 cores, session 22: 2.94)
        ratios.append(compute_scale(digits_bundle, halved, 1)[0] / compute_scale(digits_bundle, spec, 1)[0])
    assert len(compute_scale(digits_bundle, spec, 1)) == len(spec.seq_lens) == 1
    assert 1.6 < float(np.median(ratios)) < 2.5


def test_a_cached_profile_from_an_older_profiler_gets_its_scale(digits_bundle, tmp_path):
    """`exitplan up`, `demo` and `plan_accuracy` reuse a cached profile; one written before the profiler measured
    computeScale has its serving path measured again and written back, with a message."""
    import subprocess

    import yaml

    from exitplan.api.bundle import read_manifest
    from exitplan.api.resources import EarlyExitServiceSpec, ModelProfile
    from exitplan.localrun.service_setup import ServiceSetup, ensure_profiles

    bundle = tmp_path / "bundle"
    subprocess.run(["cp", "-r", str(digits_bundle), str(bundle)], check=True)
    old = profile_bundle(bundle, ProfileOptions(pool="cpu", batch_sizes=(1, 2), repeats=1))
    old.spec.serving = ServingCosts(router_ms=0.4, hop_ms=0.3, colocated_ms=0.4, requests=100)  # no computeScale
    cache = bundle / "profiles" / "cpu.yaml"
    cache.parent.mkdir(exist_ok=True)
    cache.write_text(yaml.safe_dump(old.model_dump(mode="json", by_alias=True, exclude_none=True)))
    spec = EarlyExitServiceSpec.model_validate(
        {"model": {"name": "digits-cnn", "bundle": str(bundle)}, "slo": {"latencyMs": 100}, "pools": [{"name": "cpu"}]}
    )
    setup = ServiceSetup("digits", spec, bundle, read_manifest(bundle), {"cpu": GPUPoolSpec(capacity=1)})
    said: list[str] = []
    ensure_profiles(setup, said.append)
    assert any("serving.computeScale" in line for line in said), said
    written = ModelProfile.model_validate(yaml.safe_load(cache.read_text())).spec
    assert written.serving is not None and len(written.serving.compute_scale) == 1
    assert setup.profiles["cpu"].serving == written.serving and written.serving.requests >= 100


def test_a_cached_profile_without_the_costs_is_used_as_it_is_where_measuring_them_fails(
    digits_bundle, tmp_path, monkeypatch
):
    """No dead end: a valid cached profile that lacks the serving path's costs (`--no-serving`) is measured
    again; where that fails it is planned with as it is, with a message. An invalid one still stops."""
    import subprocess
    import sys

    import yaml

    from exitplan.api.bundle import read_manifest
    from exitplan.api.resources import EarlyExitServiceSpec
    from exitplan.localrun import service_setup
    from exitplan.localrun.service_setup import ServiceFileError, ServiceSetup, ensure_profiles

    bundle = tmp_path / "bundle"
    subprocess.run(["cp", "-r", str(digits_bundle), str(bundle)], check=True)
    old = profile_bundle(bundle, ProfileOptions(pool="cpu", batch_sizes=(1, 2), repeats=1))
    cache = bundle / "profiles" / "cpu.yaml"
    cache.parent.mkdir(exist_ok=True)
    cache.write_text(yaml.safe_dump(old.model_dump(mode="json", by_alias=True, exclude_none=True)))
    # a profiler that fails (exit 3), whatever it is asked
    monkeypatch.setattr(service_setup, "exitplan_command", lambda: [sys.executable, "-c", "raise SystemExit(3)"])
    spec = EarlyExitServiceSpec.model_validate(
        {"model": {"name": "digits-cnn", "bundle": str(bundle)}, "slo": {"latencyMs": 100}, "pools": [{"name": "cpu"}]}
    )

    def setup() -> ServiceSetup:
        return ServiceSetup("digits", spec, bundle, read_manifest(bundle), {"cpu": GPUPoolSpec(capacity=1)})

    said: list[str] = []
    kept = setup()
    ensure_profiles(kept, said.append)
    assert "no serving)" in said[0] and "failed (exit 3)" in said[1] and "as it is" in said[1], said
    assert kept.profiles["cpu"].serving is None and kept.profiles["cpu"].blocks == old.spec.blocks
    with pytest.raises(ServiceFileError, match="failed \\(exit 3\\)"):
        ensure_profiles(setup(), said.append, remeasure=True)  # asked to measure it: no fallback
    cache.write_text("kind: ModelProfile\n")  # unreadable as a profile
    with pytest.raises(ServiceFileError, match="failed \\(exit 3\\)"):
        ensure_profiles(setup(), said.append)
