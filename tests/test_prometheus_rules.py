"""exitplan's Prometheus rules (charts/exitplan/rules/exitplan-alerts.yaml): `promtool check rules` is
clean, `promtool test rules` runs unit tests for every alert (tests/prometheus/exitplan-alerts.test.yaml:
each alert fires on the series that should raise it and stays quiet on healthy ones), the tests fail
when a rule changes, the rules read only series the code declares, and the chart ships the same file
as a PrometheusRule (metrics.prometheusRule.enabled).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml
from prometheus_helpers import RULES, promtool
from test_chart_support import PROMETHEUS_PEER, of_kind, one, render
from test_dashboards import TARGET_LABELS, declared, parse_promql, series_index

RULE_TESTS = Path(__file__).resolve().parent / "prometheus" / "exitplan-alerts.test.yaml"


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def alert_names() -> set[str]:
    return {r["alert"] for r in rules() if "alert" in r}


def output(done) -> str:
    return done.stdout.decode() + done.stderr.decode()


def test_promtool_checks_the_rules_clean() -> None:
    done = promtool("check", "rules", str(RULES))
    assert done.returncode == 0, output(done)
    assert f"SUCCESS: {len(rules())} rules found" in output(done)


def test_the_issue_alerts_are_there() -> None:
    assert alert_names() >= {
        "ExitplanSLOBurnRateFast",
        "ExitplanSLOBurnRateSlow",
        "ExitplanAccuracyBudgetBreached",
        "ExitplanPlanInfeasible",
        "ExitplanProfilingFailed",
        "ExitplanPlanInaccurate",
        "ExitplanRouterDown",
        "ExitplanRoutersAbsent",
        "ExitplanStragglers",
    }
    assert all(r["labels"]["severity"] in ("warning", "critical") for r in rules() if "alert" in r)
    assert all({"summary", "description"} <= set(r["annotations"]) for r in rules() if "alert" in r)


def test_every_alert_has_unit_tests_that_pass() -> None:
    """Each alert is expected to fire in some test case and to stay quiet in another; promtool agrees."""
    cases = [case for test in yaml.safe_load(RULE_TESTS.read_text())["tests"] for case in test["alert_rule_test"]]
    fires = {c["alertname"] for c in cases if c["exp_alerts"]}
    quiet = {c["alertname"] for c in cases if not c["exp_alerts"]}
    assert sorted(alert_names() - fires) == [] and sorted(alert_names() - quiet) == []
    done = promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert done.returncode == 0, output(done)
    assert "SUCCESS" in output(done)


def test_the_unit_tests_fail_when_a_rule_changes(tmp_path: Path) -> None:
    """The unit tests pin the rules: a slower burn threshold, or a shorter `for`, makes them fail."""
    for old, new in ((" > (14.4 * 0.01)", " > (1.44 * 0.01)"), ("for: 10m", "for: 1m")):
        text = RULES.read_text()
        assert old in text
        (tmp_path / "rules").mkdir(exist_ok=True)
        (tmp_path / "rules" / RULES.name).write_text(text.replace(old, new))
        tests = yaml.safe_load(RULE_TESTS.read_text())
        tests["rule_files"] = [f"rules/{RULES.name}"]
        (tmp_path / "t.test.yaml").write_text(yaml.safe_dump(tests))
        done = promtool("test", "rules", "t.test.yaml", cwd=tmp_path)
        assert done.returncode != 0 and "FAILED" in output(done), (old, output(done))


def test_rules_read_only_declared_series_and_their_labels() -> None:
    index = series_index()
    recorded = {r["record"] for r in rules() if "record" in r}
    problems = []
    for rule in rules():
        name = rule.get("alert") or rule.get("record")
        q = parse_promql(rule["expr"])
        known = set(TARGET_LABELS) | {"le"}
        for metric in q.metrics:
            if metric in recorded:
                known |= {"namespace", "service"}
            elif metric != "up":  # the scrape's own series (target labels only)
                if metric not in index:
                    problems.append(f"{name}: {metric} is not a declared series")
                    continue
                known |= index[metric].labels
        problems += [f"{name}: label {label!r} is on none of {sorted(q.metrics)}" for label in q.labels - known]
    assert problems == []
    assert "exitplan_service_condition" in declared()  # PlanInfeasible and ProfilingFailed read it


def test_the_chart_ships_the_same_rules_as_a_prometheus_rule() -> None:
    assert of_kind(render(), "PrometheusRule") == []  # off by default
    values = {
        "metrics": {
            "prometheusRule": {"enabled": True, "additionalLabels": {"release": "monitoring-stack"}},
            "podMonitor": {"enabled": True},
        },
        "networkPolicy": {"metricsFrom": [PROMETHEUS_PEER]},  # the PodMonitor's scraper may reach the pods
    }
    objs = render(values)
    rule = one(objs, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "monitoring-stack"
    assert rule["spec"] == yaml.safe_load(RULES.read_text())  # the file as it is: promtool checked this
    endpoint = one(objs, "PodMonitor")["spec"]["podMetricsEndpoints"][0]
    assert {
        "sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_component"],
        "targetLabel": "component",
    } in (endpoint["relabelings"])  # the `component` label the router alerts select by


def test_promtool_check_metrics_flags_a_bad_exposition() -> None:
    """The lint the live test runs on /metrics can fail: a counter without _total is reported."""
    bad = b"# HELP things_count Things.\n# TYPE things_count counter\nthings_count 1\n"
    done = promtool("check", "metrics", stdin=bad)
    assert done.returncode != 0 and "_total" in output(done)
    good = b"# HELP things_total Things.\n# TYPE things_total counter\nthings_total 1\n"
    done = promtool("check", "metrics", stdin=good)
    assert done.returncode == 0 and output(done).strip() == "", output(done)
    assert shutil.which("promtool")
