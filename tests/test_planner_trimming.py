"""The cost model of a trimming worker (planner/trimming.py): a CPU worker that ends the model computes a
batch at its longest row rounded up to 8 tokens, so its mean time per batch is the profile's at the
expected such length for the bucket's inputs, checked here against batches drawn at random."""

from __future__ import annotations

import numpy as np
import pytest
from test_planner_service import CPU_POOLS, cpu_profile, cpu_spec

from exitplan.planner import plan_service
from exitplan.planner.problem import _length_options
from exitplan.planner.trimming import TRIM_STEP, length_support, trimmed_length, trims


def test_the_expected_trimmed_length_is_that_of_random_batches():
    rng = np.random.default_rng(7)
    lengths = np.sort(rng.integers(3, 129, size=5000))
    for lo, hi in ((0, 128), (64, 128), (0, 32)):
        values, probs = length_support([16, 32, 64, 128], np.ones(4) / 4, lengths, lo, hi)
        inside = lengths[(lengths > lo) & (lengths <= hi)]
        for batch in (1, 4, 16):
            draws = rng.choice(inside, size=(20000, batch)).max(axis=1)
            sampled = np.minimum(np.ceil(draws / TRIM_STEP) * TRIM_STEP, hi).mean()
            assert trimmed_length(values, probs, hi, batch) == pytest.approx(sampled, rel=0.01)
    assert trimmed_length(np.zeros(0), np.zeros(0), 64, 4) == 64  # a bucket without inputs: its own length


def test_without_raw_lengths_each_grid_bins_mass_spreads_over_its_lengths():
    values, probs = length_support([16, 32, 64], np.asarray([0.5, 0.0, 0.5]), None, 0, 64)
    assert probs.sum() == pytest.approx(1.0)
    assert set(values[values <= 16]) == set(range(1, 17)) and not ((values > 16) & (values <= 32)).any()
    assert probs[values <= 16].sum() == pytest.approx(0.5) and probs[values > 32].sum() == pytest.approx(0.5)
    one = trimmed_length(values, probs, 64, 1)  # half at 1..16 (rounded to 8 or 16), half at 33..64
    expected = 0.5 * (8 * 8 + 8 * 16) / 16 + 0.5 * np.mean(np.minimum(np.ceil(np.arange(33, 65) / 8) * 8, 64))
    assert one == pytest.approx(expected)


def test_only_cpu_pools_of_sequence_models_without_rebatching_trim():
    assert trims("", [16, 32, 64], False)
    assert not trims("nvidia.com/gpu", [16, 32, 64], False)
    assert not trims("", [1], False) and not trims("", [16, 32], True)


def test_a_cpu_plan_charges_the_last_split_its_batches_trimmed_length():
    """The options' mean time per batch of splits ending the model is the profile's at the trimmed length;
    the bound (what must fit a cycle) stays at the bucket's."""
    rng = np.random.default_rng(1)
    lengths = rng.integers(3, 60, size=2000)
    spec = cpu_spec()
    result = plan_service("minilm", spec, CPU_POOLS, {"cpu": cpu_profile()}, thresholds={}, lengths=lengths)
    inp = result.inputs
    assert inp.lengths is not None and len(inp.lengths) == 2000
    model, n = inp.models[0], inp.n_blocks
    top = int(max(inp.grid))
    rate, batch, stage, *_ = _length_options(inp, 0, top, 2, False)
    sizes = np.asarray(model.profile.batch_sizes, dtype=np.float64)
    values, probs = length_support(inp.grid, inp.mass, inp.lengths, 0, top)
    bound = model.stage_tables(sizes, top, inp.sigma(), inp.ramps_on())
    for s in range(2):
        b = int(batch[s, 0, n - 1])
        if b == 0:
            continue
        bi = list(sizes).index(b)
        at = trimmed_length(values, probs, top, b)
        assert at < top
        mean = model.stage_tables([b], at, inp.sigma(), inp.ramps_on(), expected=True, transfer=False)[0]
        assert rate[s, 0, n - 1] == pytest.approx(b / mean[0, n - 1] * 1e3)
        assert stage[s, 0, n - 1] == pytest.approx(bound[bi, 0, n - 1])
    gpu = {"cpu": CPU_POOLS["cpu"].model_copy(update={"gpu_resource": "nvidia.com/gpu"})}
    on_gpu = plan_service("minilm", spec, gpu, {"cpu": cpu_profile()}, thresholds={}, lengths=lengths)
    assert on_gpu.plan.prediction.goodput_rps < result.plan.prediction.goodput_rps  # no trimming credited
