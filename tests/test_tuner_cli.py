"""`exitplan tune WINDOW.npz`: the JSON it writes and its errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from exitplan.cli import app
from exitplan.planner.tuning.synthetic_windows import synthetic_window
from exitplan.planner.tuning.thresholds import FeedbackWindow, evaluate

runner = CliRunner()


def _write(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


def _arrays(n=300, r=4, seed=0):
    w = synthetic_window(np.random.default_rng(seed), n=n, r=r)
    return dict(conf=w.conf, pred=w.pred, final=w.final, saving_ms=w.saving_ms, cost_ms=w.cost_ms)


def test_tune_writes_exactly_the_three_keys(tmp_path):
    path = _write(tmp_path / "w.npz", **_arrays())
    out = tmp_path / "out" / "tuned.json"
    result = runner.invoke(app, ["tune", path, "--budget", "0.02", "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert set(doc) == {"thresholds", "agreement", "saving_ms"}
    assert len(doc["thresholds"]) == 4
    w = FeedbackWindow.load(path)
    agreement, saving = evaluate(w, doc["thresholds"])
    assert doc["agreement"] == pytest.approx(agreement) and doc["saving_ms"] == pytest.approx(saving)
    assert agreement >= 0.98
    assert "ramp3" in result.output and "agreement" in result.output  # the per-ramp table and the summary


def test_tune_from_given_start_thresholds(tmp_path):
    path = _write(tmp_path / "w.npz", **_arrays())
    out = tmp_path / "t.json"
    result = runner.invoke(app, ["tune", path, "--budget", "0.01", "--start", "0,0,0,0", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "repaired" in result.output  # everyone exiting at ramp 0 broke the budget first
    assert json.loads(out.read_text())["agreement"] >= 0.99


@pytest.mark.parametrize(
    "change, args, words",
    [
        (None, ["--budget", "1.0"], ["budget", "[0, 1)"]),
        (None, ["--budget", "-0.1"], ["budget"]),
        (lambda a: a.update(pred=a["pred"][:, :3]), [], ["pred", "shape"]),
        (lambda a: a.update(final=a["final"][:10]), [], ["final", "shape"]),
        (lambda a: a.update(conf=a["conf"][:0], pred=a["pred"][:0], final=a["final"][:0]), [], ["conf", "no inputs"]),
        (lambda a: a["conf"].__setitem__((5, 2), np.nan), [], ["conf", "NaN"]),
        (lambda a: a.pop("saving_ms"), [], ["saving_ms"]),
        (None, ["--start", "0.9,0.9"], ["start", "4 values"]),
    ],
)
def test_bad_input_exits_2_naming_the_field(tmp_path, change, args, words):
    arrays = _arrays()
    if change is not None:
        change(arrays)
    path = _write(tmp_path / "w.npz", **arrays)
    result = runner.invoke(app, ["tune", path, *args])
    assert result.exit_code == 2, result.output
    for word in words:
        assert word in result.output
    assert "Traceback" not in result.output


def test_missing_window_file(tmp_path):
    result = runner.invoke(app, ["tune", str(tmp_path / "nope.npz")])
    assert result.exit_code == 2
    assert "does not exist" in result.output


@pytest.mark.slow
def test_tune_on_the_minilm_bundle_window(minilm_bundle, tmp_path):
    """The real ramp outputs the bundle ships (data/window.npz) tune within budget."""
    path = minilm_bundle / "data" / "window.npz"
    w = FeedbackWindow.load(path)
    assert w.n_ramps == 5
    out = tmp_path / "t.json"
    result = runner.invoke(app, ["tune", str(path), "--budget", "0.01", "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    agreement, saving = evaluate(w, doc["thresholds"])
    assert agreement >= 0.99 and saving == pytest.approx(doc["saving_ms"])
    assert saving > 0.0  # some inputs exit early on real ramps within a 1 % budget
