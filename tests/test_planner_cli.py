"""`exitplan plan` and `exitplan simulate` end to end on the bench service files (real planner, real simulator)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from exitplan.cli import app

ROOT = Path(__file__).resolve().parents[1]
SERVICE = ROOT / "bench" / "profiles" / "bert-e3-v100.yaml"


def test_plan_prints_tables_and_writes_json_and_png(tmp_path):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    res = CliRunner().invoke(app, ["plan", str(SERVICE), "--json", str(out), "--png", str(png)])
    assert res.exit_code == 0, res.output
    assert "cells" in res.output and "goodput" in res.output and "rebatch" in res.output
    body = json.loads(out.read_text())
    assert body["plan"]["model"] == "bert-base-ee" and body["plan"]["cells"]
    assert png.read_bytes()[:4] == b"\x89PNG"
    # the plan as served: simulated with bursts and admission, about the solver's rate or below it
    assert "as served" in res.output
    assert 0 < body["served_rps"] <= 1.05 * body["plan"]["prediction"]["goodputRps"], body["served_rps"]
    fluid = CliRunner().invoke(app, ["plan", str(SERVICE), "--fluid-only", "--json", str(out)])
    assert fluid.exit_code == 0 and json.loads(out.read_text())["served_rps"] is None


def test_plan_reports_an_unmeetable_slo_as_an_error(tmp_path):
    text = SERVICE.read_text().replace("latencyMs: 100.0", "latencyMs: 5.0")
    bad = tmp_path / "svc.yaml"
    bad.write_text(text)
    res = CliRunner().invoke(app, ["plan", str(bad)])
    assert res.exit_code == 2
    assert "PlanInfeasible" in res.output and "spec.slo.latencyMs" in res.output


def test_simulate_compares_configurations(tmp_path, shared_trace):
    out, png = tmp_path / "sim.json", tmp_path / "cdf.png"
    res = CliRunner().invoke(
        app,
        [
            "simulate",
            str(SERVICE),
            "--configs",
            "vanilla,e3,oracle",
            "--rate",
            "2000",
            "--duration",
            "2",
            "--json",
            str(out),
            "--png",
            str(png),
        ],
    )
    assert res.exit_code == 0, res.output
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"vanilla", "e3", "oracle"}
    assert rows["e3"]["dropped"] == 0 and rows["e3"]["attainment"] > 0.99
    assert rows["oracle"]["goodput_rps"] >= rows["e3"]["goodput_rps"] * 0.99
    assert png.read_bytes()[:4] == b"\x89PNG"
