"""The demo's summary: each configuration's measured capacity within the SLO (from the capacity search),
the ratios of those capacities with the range the searches' brackets leave, and a plain note for a
capacity that is only a bound (the search passed at its ceiling, missed at its floor, or ran out of steps)."""

from __future__ import annotations

import json

import pytest
from capacity_helpers import queue_probe
from rich.console import Console

from exitplan.client.capacity import search_capacity
from exitplan.localrun.demo import CONFIGS, DemoResult, capacity_row, summary_table


def _result(capacities: dict[str, float], max_rps: float = 1000.0) -> DemoResult:
    """Each configuration searched on a single-server queue with the given capacity."""
    result = DemoResult(thresholds={}, slo_ms=100.0)
    for config in CONFIGS:
        cap = search_capacity(queue_probe(capacities[config]), start_rps=8.0, max_rps=max_rps, resolution=0.05)
        result.capacities[config] = capacity_row(config, "1 split(s), buckets [128], 2 workers, batch 2", cap)
    return result


def _text(result: DemoResult) -> str:
    console = Console(width=400, record=True)
    console.print(summary_table(result))
    return " ".join(console.export_text().split())  # the title and caption wrap


def test_the_summary_reports_the_ratio_of_measured_capacities_and_its_range():
    result = _result({"vanilla": 20.0, "naive-ee": 25.0, "exitplan": 30.0})
    for config, true in (("vanilla", 20.0), ("naive-ee", 25.0), ("exitplan", 30.0)):
        row = result.capacities[config]
        assert row["ended"] == "bracketed"
        assert row["capacity_rps"] <= true * 1.02 and row["failed_rps"] > true  # passed at it, missed above it
        assert row["p50_ms"] is not None and row["within_slo_share"] >= 0.99 and row["agreement"] == 1.0
    ratio = result.ratio("exitplan", "vanilla")
    assert ratio == result.capacity("exitplan") / result.capacity("vanilla")
    low, high = result.ratio_bounds("exitplan", "vanilla")
    assert low <= 1.5 <= high and low <= ratio <= high and high / low < 1.15
    text = _text(result)
    assert "measured capacity within the 100 ms SLO" in text and ">= 99 % of requests" in text
    assert f"measured capacities: exitplan = {ratio:.2f}x vanilla (between {low:.2f}x and {high:.2f}x" in text
    assert f"{result.ratio('exitplan', 'naive-ee'):.2f}x naive-ee" in text
    assert "lower bound" not in text
    doc = json.loads(json.dumps(result.to_dict()))
    assert doc["ratios"]["exitplan/vanilla"] == pytest.approx(ratio)
    assert doc["capacity_rps"]["naive-ee"] == result.capacity("naive-ee")


def test_a_capacity_at_the_search_ceiling_is_called_a_lower_bound():
    result = _result({"vanilla": 20.0, "naive-ee": 25.0, "exitplan": 500.0}, max_rps=100.0)
    assert result.capacities["exitplan"]["ended"] == "ceiling"
    assert result.ratio_bounds("exitplan", "vanilla") is None  # no rate above exitplan's missed
    text = _text(result)
    assert "exitplan passed at the highest rate tried: its capacity is a lower bound" in text
    assert f"exitplan = {result.ratio('exitplan', 'vanilla'):.2f}x vanilla," in text


def test_no_ratio_when_a_baseline_met_the_target_at_no_rate():
    result = _result({"vanilla": 20.0, "naive-ee": 25.0, "exitplan": 30.0})
    slow = search_capacity(queue_probe(0.5, slo_ms=1000.0), start_rps=8.0, max_rps=100.0, min_rps=1.0)
    result.capacities["vanilla"] = capacity_row("vanilla", "-", slow)
    assert result.ratio("exitplan", "vanilla") is None
    text = _text(result)
    assert "no ratio to vanilla" in text and "vanilla missed the target even at the lowest rate tried" in text


def test_the_summary_puts_the_planners_prediction_beside_each_measured_capacity():
    result = _result({"vanilla": 20.0, "naive-ee": 25.0, "exitplan": 30.0})
    for config, predicted in (("vanilla", 22.0), ("exitplan", 27.0)):
        result.capacities[config]["predicted_rps"] = predicted
    text = _text(result)
    assert "predicted rps" in text and "22.0" in text and "27.0" in text
    ratios = {c: result.capacities[c]["predicted_rps"] / result.capacity(c) for c in ("vanilla", "exitplan")}
    assert f"vanilla {ratios['vanilla']:.2f}x" in text and f"exitplan {ratios['exitplan']:.2f}x" in text
    assert "naive-ee 0" not in text and "naive-ee 1" not in text  # no prediction for it: no ratio
