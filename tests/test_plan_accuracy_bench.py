"""bench/plan_accuracy.py's pure parts, the capacity search it predicts with, and the simulator's trimming."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from exitplan.api.plan import Cell, Plan, SplitPlan
from exitplan.api.resources import SLO, EarlyExitServiceSpec, ModelRef, PlannerSettings, PoolRef
from exitplan.planner.compare import plan_config, simulate_plan
from exitplan.planner.predict import search
from exitplan.planner.simulator import poisson_arrivals
from exitplan.planner.synthetic import bert_base_profile, gpu_pool

_spec = importlib.util.spec_from_file_location(
    "plan_accuracy", Path(__file__).resolve().parents[1] / "bench" / "plan_accuracy.py"
)
assert _spec is not None and _spec.loader is not None
plan_accuracy = importlib.util.module_from_spec(_spec)
sys.modules["plan_accuracy"] = plan_accuracy  # its dataclasses look their module up there
_spec.loader.exec_module(plan_accuracy)


def test_capacity_search_finds_the_edge_from_either_side_within_the_tolerance():
    for start in (10.0, 123.4, 900.0):
        found = search(lambda r: r <= 123.4, start, ceiling=10_000.0)
        assert 123.4 * 0.99 <= found <= 123.4
    assert search(lambda r: True, 10.0, ceiling=50.0) == 50.0
    assert search(lambda r: False, 10.0, ceiling=50.0) == 0.0


def _plan(batch: int, replicas: int = 1) -> Plan:
    return Plan(
        service="s",
        model="m",
        splits=[SplitPlan(index=0, first_block=0, last_block=3)],
        buckets=[128],
        cells=[Cell(split=0, bucket=128, pool="cpu", replicas=replicas, batch_size=batch)],
    )


def test_same_cells_compares_layout_replicas_and_batches():
    assert plan_accuracy.same_cells(_plan(4), _plan(4))
    assert not plan_accuracy.same_cells(_plan(4), _plan(8))
    assert not plan_accuracy.same_cells(_plan(4), _plan(4, replicas=2))


@pytest.fixture(scope="module")
def vanilla():
    spec = EarlyExitServiceSpec(
        model=ModelRef(name="bert-base-ee", bundle="x"),
        slo=SLO(latency_ms=200),
        pools=[PoolRef(name="v100")],
        planner=PlannerSettings(max_splits=1),
    )
    profiles = {"v100": bert_base_profile("v100", seq_lens=(128, 384))}
    return plan_config("vanilla", "bert", spec, {"v100": gpu_pool("v100", 2)}, profiles)


def test_trimmed_batches_of_short_inputs_cost_their_length_not_the_buckets(vanilla):
    assert vanilla.plan.buckets == [384]
    rng = np.random.default_rng(0)
    arrivals = poisson_arrivals(rng, 100.0, 500)
    short = np.full(500, 100)
    plain = simulate_plan(vanilla, arrivals, short, 200.0)
    trimmed = simulate_plan(vanilla, arrivals, short, 200.0, trim=[128, 384])
    assert plain.answered == trimmed.answered == 500
    assert 0 < trimmed.busy_ms < 0.9 * plain.busy_ms  # batches at 128 tokens, not 384
    assert trimmed.pct(50) < plain.pct(50)
    # inputs longer than every shorter length run at the bucket's length, trimmed or not
    long = np.full(500, 300)
    assert simulate_plan(vanilla, arrivals, long, 200.0, trim=[128, 384]).busy_ms == pytest.approx(
        simulate_plan(vanilla, arrivals, long, 200.0).busy_ms
    )


def test_the_table_gives_medians_of_repeated_measurements(capsys):
    """--repeats: each configuration's row takes the medians of its predictions and measurements, and the
    summary counts single measurements against their own prediction too."""
    Measured, Trial, Row = plan_accuracy.Measured, plan_accuracy.Trial, plan_accuracy.Row

    def one(simulated: float, measured: float) -> Trial:
        m = Measured(measured, measured * 1.04, "bracketed", 0.3, {"routers": 1.0, "workers": 2.0}, 0.6, None)
        return Trial(simulated, 1.0, 0.5, 0.0, m)

    rows = [
        Row("svc", "vanilla", "1 split", 300.0, 200.0, [one(100, 90), one(110, 140), one(105, 100)], []),
        Row("svc", "exitplan", "1 split", 400.0, 250.0, [one(150, 100), one(150, 200)], []),
    ]
    assert rows[0].simulated == 105 and rows[0].measured == 100
    assert rows[1].simulated == 150 and rows[1].measured == 150
    plan_accuracy.print_table(rows)
    out = capsys.readouterr().out
    assert "90.0-140.0" in out and "1.05x" in out and "1.00x" in out
    # medians: both within +-20 %; single: 100/90, 105/100 within, 110/140 and 150/100, 150/200 not
    assert "simulated 2/2; each measurement against its own prediction: 2/5" in out
