"""Trace windows for a run: rescaling to a target rate, speed-ups, bounds, and clear errors."""

import json

import numpy as np
import pytest

from exitplan.client.bench import BenchError, schedule


@pytest.fixture
def trace(tmp_path):
    """A JSON-lines trace with bursty, uneven arrivals (about 4 requests/s) and lengths 10..4000."""
    rng = np.random.default_rng(0)
    gaps = rng.exponential(0.25, size=2000) * np.where(rng.random(2000) < 0.1, 6.0, 1.0)
    times = np.cumsum(gaps)
    path = tmp_path / "t.jsonl"
    path.write_text(
        "".join(json.dumps({"timestamp": float(t), "input_length": int(rng.integers(10, 4000))}) + "\n" for t in times)
    )
    return path


@pytest.mark.parametrize("rps", [3.0, 17.0, 120.0])
def test_rps_with_a_duration_gives_that_many_requests(trace, rps):
    plan = schedule(trace, max_length=128, rps=rps, duration=5.0)
    assert len(plan.trace) == round(rps * 5.0)
    assert plan.rate == pytest.approx(rps, rel=0.01)
    assert plan.trace.timestamps.max() < 5.0
    assert plan.trace.lengths.max() <= 128


def test_rps_with_a_start_offset_scans_for_the_rate(trace):
    plan = schedule(trace, max_length=128, rps=40.0, duration=4.0, start=2.0)
    assert len(plan.trace) == 160


def test_rps_with_only_a_limit_spans_limit_over_rps(trace):
    plan = schedule(trace, max_length=128, rps=25.0, limit=200)
    assert len(plan.trace) == 200
    assert plan.trace.timestamps[-1] == pytest.approx(200 / 25.0, rel=1e-6)


def test_speed_compresses_the_trace_clock(trace):
    slow = schedule(trace, max_length=128, limit=100)
    fast = schedule(trace, max_length=128, speed=4.0, limit=100)
    np.testing.assert_allclose(fast.trace.timestamps * 4.0, slow.trace.timestamps)
    np.testing.assert_array_equal(fast.trace.lengths, slow.trace.lengths)


def test_length_modes(trace):
    scaled = schedule(trace, max_length=128, limit=500).trace.lengths
    clipped = schedule(trace, max_length=128, limit=500, length_mode="clip").trace.lengths
    assert clipped.min() >= 10 and (clipped == 128).mean() > 0.9
    assert scaled.max() <= 128 and np.median(scaled) < 100
    tighter = schedule(trace, max_length=128, limit=500, reference_max=1000).trace.lengths
    assert np.median(tighter) > np.median(scaled)


def test_bad_options_name_the_option(trace, tmp_path):
    with pytest.raises(BenchError, match="--rps"):
        schedule(trace, max_length=128, rps=0)
    with pytest.raises(BenchError, match="--duration"):
        schedule(trace, max_length=128, duration=-1)
    with pytest.raises(BenchError, match="--limit"):
        schedule(trace, max_length=128, limit=0)
    with pytest.raises(BenchError, match="--speed"):
        schedule(trace, max_length=128, speed=0)
    with pytest.raises(BenchError, match="no such trace"):
        schedule(tmp_path / "missing.csv", max_length=128)


def test_a_window_past_the_traces_size_loops_its_pattern(tmp_path):
    """A rate x duration above the requests the whole trace holds: the trace's pattern is repeated back to
    back at that rate (each arrival with its own length) until the duration is covered, instead of the whole
    trace squeezed into the window at the rate the trace allows (a silent ceiling on what could be offered)."""
    rng = np.random.default_rng(1)
    gaps = rng.exponential(1.0, 500)
    lengths = rng.integers(1, 100, 500)
    path = tmp_path / "t.jsonl"
    path.write_text("".join(f'{{"timestamp": {t}, "input_length": {n}}}\n' for t, n in zip(np.cumsum(gaps), lengths)))
    part = schedule(path, max_length=128, rps=50.0, duration=5.0)  # 250 requests: a window of the trace
    assert len(part.trace) == 250
    looped = schedule(path, max_length=128, rps=400.0, duration=5.0)  # 2,000: four passes
    assert len(looped.trace) == pytest.approx(2000, rel=0.01)
    assert looped.rate == pytest.approx(400.0, rel=0.01) and looped.window_s == 5.0
    t = looped.trace.timestamps
    assert np.all(np.diff(t) >= 0) and 0 <= t[0] and t[-1] < 5.0
    # each pass carries the trace's own lengths in order (fitted to max_length as the trace is)
    own = schedule(path, max_length=128).trace.lengths  # the whole trace as it is
    assert len(own) == 500 and list(looped.trace.lengths[:500]) == list(own) == list(looped.trace.lengths[500:1000])
    assert len(schedule(path, max_length=128, rps=400.0, duration=5.0, limit=700).trace) == 700
