"""The demo's summary: best goodput per configuration, and a plain warning when no configuration
fell behind at the highest load (then the ratios say nothing about capacity)."""

from __future__ import annotations

from rich.console import Console

from exitplan.localrun.demo import CONFIGS, DemoResult, saturated, summary_table


def _result(goodput_at_top: dict[str, float], errors_at_top: dict[str, int] | None = None) -> DemoResult:
    result = DemoResult(thresholds={}, capacity_rps=10.0)
    for config in CONFIGS:
        for load, offered in ((0.5, 5.0), (1.6, 16.0)):
            goodput = goodput_at_top[config] if load == 1.6 else offered
            errors = (errors_at_top or {}).get(config, 0) if load == 1.6 else 0
            result.runs.append(
                {
                    "config": config,
                    "load": load,
                    "offered_rps": offered,
                    "goodput_rps": goodput,
                    "p50_ms": 30.0,
                    "p95_ms": 60.0,
                    "p99_ms": 90.0,
                    "agreement_drop": 0.0,
                    "overload": errors,
                    "errors": errors,
                    "lost": 0,
                }
            )
    return result


def _caption(result: DemoResult) -> str:
    console = Console(width=300, record=True)
    console.print(summary_table(result, 250.0))
    return " ".join(console.export_text().split())  # the caption wraps


def test_saturation_is_goodput_behind_the_offered_rate_or_errors():
    result = _result({"vanilla": 12.0, "naive-ee": 15.9, "exitplan": 16.0}, {"naive-ee": 3})
    assert saturated(result, "vanilla")  # 12 of 16 rps
    assert saturated(result, "naive-ee")  # kept up, but with overload errors
    assert not saturated(result, "exitplan")
    text = _caption(result)
    assert "exitplan = 1.33x vanilla" in text and "lower bounds" not in text


def test_no_configuration_behind_says_the_ratios_are_lower_bounds():
    text = _caption(_result({"vanilla": 15.9, "naive-ee": 16.0, "exitplan": 16.0}))
    assert "exitplan = 1.01x vanilla" in text
    assert "lower bounds" in text and "--loads ...,3.2" in text
