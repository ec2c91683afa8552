"""Grafana dashboards (charts/exitplan/dashboards/*.json): every PromQL query names only metrics the
code declares, with labels those metrics carry, every declared metric has a panel, every panel shows
one kind of quantity with a unit that fits it, and the JSON is a well-formed Grafana dashboard.

Declared metrics are read from the prometheus_client declarations (Counter/Gauge/Histogram/Summary
calls, and the data plane's `metrics.Declare` helper: `d = Declare(registry, [fixed labels])`, then
`d.counter(name, doc, *labels)`, `d.gauge(...)`, `d.histogram(name, doc, buckets, *labels)`) in
worker_image/metrics.py (router, worker, thresholds) and operator/metrics.py (planner, re-plans, cells,
drift) by parsing the source; a counter is queried as `<name>_total`, a gauge as `<name>`, a histogram
only as `<name>_bucket`, `_sum` or `_count`.
"""

from __future__ import annotations

import ast
import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ast_source
import pytest
from test_chart_support import CHART, ROOT

METRIC_MODULES = (ROOT / "worker_image" / "metrics.py", ROOT / "operator" / "metrics.py")
DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
TARGET_LABELS = {"namespace", "pod", "container", "instance", "job", "endpoint", "component"}
"""Labels Prometheus adds to every scraped series (PodMonitor/ServiceMonitor target labels; the chart's
PodMonitor adds `component`, router or worker)."""
KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "and",
    "or",
    "unless",
    "inf",
    "nan",
    "atan2",
}
SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
}


@dataclass(frozen=True)
class Declared:
    name: str
    kind: str
    labels: frozenset[str]
    where: str

    def series(self) -> set[str]:
        base = self.name[: -len("_total")] if self.kind == "counter" and self.name.endswith("_total") else self.name
        return {base + s for s in SUFFIXES[self.kind]}


# ------------------------------------------------------------------ declarations, from the source


def _label_names(expr: ast.expr, fn: ast.AST, where: str) -> list[str]:
    """Label names of a declaration's labelnames argument, following simple local assignments."""
    if isinstance(expr, (ast.List, ast.Tuple)):
        out: list[str] = []
        for elt in expr.elts:
            if isinstance(elt, ast.Constant) and isinstance(elt.value, str):
                out.append(elt.value)
            elif isinstance(elt, ast.Starred):
                out += _label_names(elt.value, fn, where)
            else:
                raise AssertionError(f"{where}: label `{ast.unparse(elt)}` is not a literal")
        return out
    if isinstance(expr, ast.Dict):
        return [k.value for k in expr.keys if isinstance(k, ast.Constant)]
    if (
        isinstance(expr, ast.Call)
        and isinstance(expr.func, ast.Name)
        and expr.func.id in ("list", "tuple")
        and expr.args
    ):
        return _label_names(expr.args[0], fn, where)
    if isinstance(expr, (ast.Name, ast.Attribute)):
        target = ast.unparse(expr)
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and any(ast.unparse(t) == target for t in node.targets):
                return _label_names(node.value, fn, where)
    raise AssertionError(f"{where}: cannot read the label names `{ast.unparse(expr)}`")


DECLARE_METHODS = {"counter": 2, "gauge": 2, "histogram": 3}
"""`Declare`'s methods, and where each one's own labels start among its arguments."""


def _declare_labels(receiver: ast.expr, fn: ast.AST, where: str) -> list[str] | None:
    """The fixed labels of a `Declare(registry, labels)` the call's receiver is (directly, or a local name
    assigned one); None when the receiver is not a Declare."""
    if isinstance(receiver, ast.Name):
        if isinstance(fn, ast.Module):  # a local name: read in its own function, where it means one thing
            return None
        local = receiver.id
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and any(ast.unparse(t) == local for t in node.targets):
                receiver = node.value
    if isinstance(receiver, ast.Call) and getattr(receiver.func, "id", "") == "Declare" and len(receiver.args) > 1:
        return _label_names(receiver.args[1], fn, where)
    return None


def _declaration(call: ast.Call, fn: ast.AST, where: str) -> tuple[str, list[str]] | None:
    """(kind, label names) of a metric declaration: a prometheus_client constructor or a `Declare` method."""
    ctor = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
    if ctor in ("Counter", "Gauge", "Histogram", "Summary"):
        labels_arg = (
            call.args[2]
            if len(call.args) > 2
            else next((k.value for k in call.keywords if k.arg == "labelnames"), ast.List(elts=[]))
        )
        return ctor.lower(), _label_names(labels_arg, fn, where)
    if isinstance(call.func, ast.Attribute) and ctor in DECLARE_METHODS:
        fixed = _declare_labels(call.func.value, fn, where)
        if fixed is not None:
            return ctor, fixed + _label_names(ast.List(elts=call.args[DECLARE_METHODS[ctor] :]), fn, where)
    return None


@functools.lru_cache(maxsize=1)
def declared() -> dict[str, Declared]:
    out: dict[str, Declared] = {}
    for path in METRIC_MODULES:
        tree = ast_source.parse(path.read_text(), str(path))
        for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.Module))]:
            for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
                where = f"{path.relative_to(ROOT)}:{call.lineno}"
                found = _declaration(call, fn, where)
                if found is None:
                    continue
                kind, labels = found
                assert call.args and isinstance(call.args[0], ast.Constant), f"{where}: metric name is not a literal"
                name = call.args[0].value
                decl = Declared(name, kind, frozenset(labels), where)
                previous = out.get(name)
                assert previous is None or previous == Declared(name, decl.kind, decl.labels, previous.where), (
                    f"{name} declared twice with different types or labels: {previous.where}, {where}"
                )
                out.setdefault(name, decl)
    return out


def series_index() -> dict[str, Declared]:
    return {s: d for d in declared().values() for s in d.series()}


# ------------------------------------------------------------------ PromQL: the names a query uses


_VAR = re.compile(r"\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_IDENT = re.compile(r"(?<![\w:.])([A-Za-z_:][A-Za-z0-9_:]*)(?![\w:])")


@dataclass
class Query:
    metrics: set[str]
    labels: set[str]  # labels the query matches on, groups by, or joins on


def parse_promql(expr: str) -> Query:
    """Metric names and label names in a PromQL expression (Grafana variables allowed)."""
    labels: set[str] = set()
    text = _STRING.sub('""', _VAR.sub("VAR", expr))
    # label_values(metric{...}, label): the template-variable form
    lv = re.fullmatch(r"\s*label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*", text)
    if lv:
        inner = parse_promql(lv.group(1))
        return Query(inner.metrics, inner.labels | {lv.group(2)})
    for matchers in re.findall(r"\{([^}]*)\}", text):
        labels |= {m.group(1) for m in re.finditer(r"([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)", matchers)}
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    for _, names in _GROUPING.findall(text):
        labels |= {n.strip() for n in names.split(",") if n.strip()}
    text = _GROUPING.sub(" ", text)
    metrics = set()
    for match in _IDENT.finditer(text):
        name = match.group(1)
        after = text[match.end() :].lstrip()
        if after.startswith("(") or name in KEYWORDS or name == "VAR" or re.fullmatch(r"\d.*", name):
            continue  # functions and aggregations, keywords, variables
        metrics.add(name)
    return Query(metrics, labels)


def test_parse_promql_finds_metrics_and_labels() -> None:
    q = parse_promql(
        "histogram_quantile(0.99, sum by (le, bucket) (rate(exitplan_router_latency_seconds_bucket"
        '{namespace=~"$namespace", service=~"a,b"}[$__rate_interval]))) / ignoring(x) group_left '
        "max(up offset 5m) and on(pod) vector(1)"
    )
    assert q.metrics == {"exitplan_router_latency_seconds_bucket", "up"}
    assert q.labels == {"le", "bucket", "namespace", "service", "x", "pod"}
    q = parse_promql('label_values(exitplan_router_requests_total{namespace=~"$namespace"}, service)')
    assert q.metrics == {"exitplan_router_requests_total"} and q.labels == {"namespace", "service"}
    assert parse_promql("1 - max(exitplan_router_accuracy_budget_ratio)").metrics == {
        "exitplan_router_accuracy_budget_ratio"
    }


def test_declarations_are_read_from_the_code() -> None:
    decl = declared()
    assert decl["exitplan_router_latency_seconds"].kind == "histogram"
    assert decl["exitplan_worker_exits_total"].labels == {"service", "split", "bucket", "pool", "ramp"}
    assert decl["exitplan_replan_total"].labels == {"namespace", "service", "reason"}
    # the same names the live registry reports (one component instantiated)
    from prometheus_client import CollectorRegistry

    from exitplan.operator.metrics import OperatorMetrics

    registry = CollectorRegistry()
    OperatorMetrics(registry)
    live = {m.name for m in registry.collect()}
    ast_names = {d.name.removesuffix("_total") for d in decl.values() if d.where.startswith("operator")}
    assert live == ast_names


# ------------------------------------------------------------------ the dashboards


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out += p.get("panels", [])  # collapsed rows keep their panels inside
    return out


def queries(dash: dict[str, Any]) -> list[tuple[str, str, str | None]]:
    """(where, expr, legendFormat) of every panel target and query variable."""
    out = [
        (f"panel {p['id']} {p['title']!r} target {t['refId']}", t["expr"], t.get("legendFormat"))
        for p in panels(dash)
        for t in p.get("targets", [])
    ]
    for var in dash.get("templating", {}).get("list", []):
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            out.append((f"variable ${var['name']}", query, None))
    return out


def test_there_are_dashboards() -> None:
    assert DASHBOARDS, "charts/exitplan/dashboards/ holds no *.json"


def check_query(where: str, expr: str, legend: str | None) -> tuple[list[str], int]:
    """Problems with one query (undeclared series, labels its metrics do not carry) and how many
    metric names it holds."""
    index = series_index()
    problems = []
    q = parse_promql(expr)
    if not q.metrics:
        problems.append(f"{where}: no metric in {expr!r}")
    known = set(TARGET_LABELS)
    for name in q.metrics:
        decl = index.get(name)
        if decl is None:
            base = next((d for d in declared().values() if name.startswith(d.name.removesuffix("_total"))), None)
            hint = f" ({base.name} is a {base.kind}: query {sorted(base.series())})" if base else ""
            problems.append(f"{where}: {name} is not declared in worker_image/metrics.py or operator/metrics.py{hint}")
            continue
        known |= decl.labels | ({"le"} if name.endswith("_bucket") and decl.kind == "histogram" else set())
    used = q.labels | set(re.findall(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", legend or ""))
    for label in sorted(used - known):
        problems.append(f"{where}: label {label!r} is not on {sorted(q.metrics)}")
    return problems, len(q.metrics)


@pytest.mark.parametrize("path", DASHBOARDS, ids=[p.name for p in DASHBOARDS])
def test_every_query_names_only_declared_metrics_and_their_labels(path: Path) -> None:
    problems, found = [], 0
    for where, expr, legend in queries(load(path)):
        got, n = check_query(where, expr, legend)
        problems += got
        found += n
    assert problems == [], "\n".join(problems)
    assert found >= 10


def test_an_undeclared_metric_or_suffix_is_caught() -> None:
    index = series_index()
    assert "exitplan_router_latency_seconds_bucket" in index
    assert "exitplan_router_slo_seconds_bucket" not in index  # a gauge has no buckets
    assert "exitplan_router_requests" not in index  # a counter is queried with _total
    assert "exitplan_plan_cost_per_hour" in index  # the operator declares it
    assert "exitplan_made_up_things_total" not in index  # never declared
    problems, _ = check_query("q", "sum by (split) (rate(exitplan_router_exits_total[5m]))", "{{pool}}")
    assert problems == [
        "q: label 'pool' is not on ['exitplan_router_exits_total']",
        "q: label 'split' is not on ['exitplan_router_exits_total']",
    ]
    problems, _ = check_query("q", "histogram_quantile(0.9, rate(exitplan_router_slo_seconds_bucket[5m]))", None)
    assert len(problems) == 1 and "is a gauge" in problems[0]


@pytest.mark.parametrize("path", DASHBOARDS, ids=[p.name for p in DASHBOARDS])
def test_dashboard_is_a_valid_grafana_model(path: Path) -> None:
    """The Grafana dashboard JSON model: uid, title, schemaVersion, templating with a Prometheus
    datasource variable, panels with unique ids and a 24-column gridPos that do not overlap,
    targets with unique refIds on the Prometheus datasource."""
    dash = load(path)
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,40}", dash["uid"]), dash["uid"]
    assert dash["title"] and isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 36
    assert dash.get("id") is None, "leave id out: Grafana assigns it"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids, cells = set(), set()
    allowed_types = {"row", "timeseries", "stat", "bargauge", "gauge", "table", "heatmap", "barchart", "text"}
    for p in panels(dash):
        assert p["type"] in allowed_types, p["type"]
        assert isinstance(p["id"], int) and p["id"] not in ids, f"panel id {p['id']} repeats"
        ids.add(p["id"])
        g = p["gridPos"]
        assert set(g) == {"h", "w", "x", "y"} and all(isinstance(v, int) and v >= 0 for v in g.values()), g
        assert g["w"] >= 1 and g["h"] >= 1 and g["x"] + g["w"] <= 24, f"panel {p['title']!r} leaves the 24-column grid"
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, f"panel {p['title']!r} overlaps another"
        cells |= area
        if p["type"] in ("row", "text"):
            continue
        assert p["title"] and p.get("description"), f"panel {p['id']} needs a title and a description"
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert p["targets"], f"panel {p['title']!r} has no query"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), f"panel {p['title']!r} repeats a refId"
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"] and t["expr"].strip()
            assert t["expr"].count("(") == t["expr"].count(")"), f"unbalanced parentheses in {t['expr']!r}"


def test_the_issue_panels_are_there() -> None:
    """Goodput and request rate, p50/p99 against the SLO, per-ramp exits, per-split batch size
    against the plan, agreement against the budget, length histogram and drift, replicas per cell
    and pool, planner solve time and re-plans by reason: each has a query on its metrics."""
    used = {m for path in DASHBOARDS for _, expr, _ in queries(load(path)) for m in parse_promql(expr).metrics}
    needed = {
        "goodput": {"exitplan_router_within_slo_total", "exitplan_router_inputs_total"},
        "latency vs SLO": {"exitplan_router_latency_seconds_bucket", "exitplan_router_slo_seconds"},
        "exits per ramp": {"exitplan_router_exits_total"},
        "batch vs plan": {
            "exitplan_worker_batch_inputs_sum",
            "exitplan_worker_batch_inputs_count",
            "exitplan_worker_planned_batch_inputs",
        },
        "accuracy vs budget": {"exitplan_router_agreement_ratio", "exitplan_router_accuracy_budget_ratio"},
        "lengths and drift": {"exitplan_router_length_inputs_total", "exitplan_drift_length_score_ratio"},
        "replicas": {"exitplan_cell_desired_replicas", "exitplan_cell_ready_replicas"},
        "planner": {"exitplan_planner_solve_seconds_bucket", "exitplan_replan_total"},
        "agreement evidence": {
            "exitplan_router_agreement_low_ratio",
            "exitplan_router_agreement_high_ratio",
            "exitplan_router_agreement_samples",
        },
        "generation": {
            "exitplan_generation_token_seconds_bucket",
            "exitplan_generation_first_token_seconds_bucket",
            "exitplan_generation_tokens_total",
        },
        "conditions": {"exitplan_service_condition"},
        "planned vs measured goodput": {"exitplan_plan_goodput_per_second", "exitplan_measured_goodput_per_second"},
        "stragglers a router marks": {"exitplan_router_stragglers_marked_total"},
    }
    missing = {topic: sorted(names - used) for topic, names in needed.items() if names - used}
    assert missing == {}


def test_the_exit_share_panel_shows_each_ramps_share_of_the_answers() -> None:
    (panel,) = [
        p for p in panels(load(CHART / "dashboards" / "exitplan-overview.json")) if p["title"] == "Exit share per ramp"
    ]
    (target,) = panel["targets"]
    top, bottom = _split_top(target["expr"], "/")
    assert "sum by (ramp)" in top and "exitplan_router_exits_total" in bottom and "by (ramp)" not in bottom
    assert quantity(target["expr"]) == "ratio" and panel["fieldConfig"]["defaults"]["unit"] == "percentunit"


def test_every_declared_metric_has_a_panel() -> None:
    used = {m for path in DASHBOARDS for _, expr, _ in queries(load(path)) for m in parse_promql(expr).metrics}
    index = series_index()
    shown = {index[m].name for m in used if m in index}
    assert sorted(set(declared()) - shown) == []


# ------------------------------------------------------------------ units: one kind of quantity per panel


def unit_word(series: str) -> str:
    """The unit a series' name carries: seconds, ratio, bytes, per_hour, state (a condition), else count."""
    base = re.sub(r"_(bucket|sum|count)$", "", series).removesuffix("_total")
    for word in ("seconds", "ratio", "bytes", "per_hour", "per_second"):
        if base.endswith("_" + word):
            return word
    return "state" if base.endswith("_condition") else "count"


def _split_top(text: str, op: str) -> list[str]:
    """`text` split at `op` outside parentheses, braces and brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == op and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def quantity(expr: str) -> str:
    """What a query measures, from the unit words of its series and the functions over them: `seconds`,
    `ratio`, `count`, `state`, ... as a level; `<word>/s` under rate(); `<word> in range` under
    increase(); rate(X_sum) / rate(X_count) is X's word (a mean); a quotient of like quantities a ratio."""
    halves = _split_top(expr, "/")
    if len(halves) == 2:
        top, bottom = (parse_promql(h).metrics for h in halves)
        if any(m.endswith("_sum") for m in top) and any(m.endswith("_count") for m in bottom):
            return unit_word(next(iter(top)))
        left, right = quantity(halves[0]), quantity(halves[1])
        return "ratio" if left == right else f"{left} per {right}"
    words = {unit_word(m) for m in parse_promql(expr).metrics}
    if len(words) != 1:
        return "mixed " + "+".join(sorted(words))
    word = words.pop()
    if "histogram_quantile(" in expr:
        return word
    if re.search(r"\brate\(", expr):
        return f"{word}/s"
    if re.search(r"\bincrease\(", expr):
        return f"{word} in range"
    return word


def unit_fits(q: str, unit: str) -> bool:
    """Whether a Grafana unit id shows quantity `q` (custom units: `suffix:<text>`)."""
    custom = unit.removeprefix("suffix:") if unit.startswith("suffix:") else None
    fits = {
        "seconds": unit == "s",
        "ratio": unit == "percentunit",
        "bytes/s": unit in ("Bps", "binBps"),
        "count/s": unit in ("reqps", "ops") or (custom is not None and custom.endswith("/s")),
        "count": unit == "short" or (custom is not None and not custom.endswith("/s")),
        "count in range": unit == "short" or (custom is not None and not custom.endswith("/s")),
        "per_hour": custom is not None and custom.endswith("/h"),
        "per_second": unit == "reqps" or (custom is not None and custom.endswith("/s")),
        "state": unit == "bool",
    }
    return fits.get(q, False)


def test_quantities_tell_mixed_panels_apart() -> None:
    rate = "rate(exitplan_worker_forward_bytes_total[5m])"
    assert quantity(f"sum by (split) ({rate})") == "bytes/s"
    assert quantity("sum(rate(exitplan_worker_forward_errors_total[5m]))") == "count/s"
    assert quantity("max(exitplan_worker_next_stragglers)") == "count"
    assert quantity("histogram_quantile(0.99, sum by (le) (rate(exitplan_router_latency_seconds_bucket[1m])))") == (
        "seconds"
    )
    assert quantity("rate(exitplan_worker_batch_inputs_sum[1m]) / rate(exitplan_worker_batch_inputs_count[1m])") == (
        "count"
    )
    assert quantity("increase(exitplan_router_within_slo_total[1h]) / increase(exitplan_router_inputs_total[1h])") == (
        "ratio"
    )
    assert quantity("1 - max(exitplan_router_accuracy_budget_ratio)") == "ratio"
    assert quantity("increase(exitplan_threshold_updates_total[1h])") == "count in range"
    assert quantity("exitplan_threshold_ratio + exitplan_router_slo_seconds").startswith("mixed")
    assert unit_fits("count/s", "suffix:inputs/s") and not unit_fits("count/s", "suffix:inputs")
    assert not unit_fits("bytes/s", "reqps") and not unit_fits("ratio", "")


@pytest.mark.parametrize("path", DASHBOARDS, ids=[p.name for p in DASHBOARDS])
def test_every_panel_has_a_unit_and_one_kind_of_quantity(path: Path) -> None:
    problems = []
    for p in panels(load(path)):
        if p["type"] in ("row", "text"):
            continue
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        kinds = {quantity(t["expr"]) for t in p["targets"]}
        if len(kinds) != 1:
            problems.append(f"panel {p['title']!r} mixes {sorted(kinds)}")
        elif not unit_fits(next(iter(kinds)), unit):
            problems.append(f"panel {p['title']!r}: unit {unit!r} does not show {kinds.pop()!r}")
    assert problems == [], "\n".join(problems)
