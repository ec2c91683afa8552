"""The dashboards and alerts against a real Prometheus scraping a real run.

One run for the module: the MiniLM bundle served by `exitplan up`'s LocalDeployment (a router and two
splits of workers, as processes), a text-generation service the same way (the tiny decoder), and the
operator under kopf in this process against the emulated API server, planning an EarlyExitService of
the same name whose routers' control endpoint is the LocalDeployment's router (so the drift loop reads
its real observations). A real `prometheus` (Debian's package, run directly on a free port with a
temporary TSDB) scrapes all of them every second with the chart's rules loaded. The run takes a short
load with a threshold update, a plan update, an overload burst (429s) and a spec change (a re-plan).

Then: every query of every dashboard returns at least one series (Grafana's variables set to All,
$__rate_interval and $__range to windows the run fits in); what the issue found wrong tells the truth
now (increase() counts the re-plan, the 429s and the threshold updates; one name per ramp; no -1
load); every rule evaluates without error; `promtool check metrics` is clean on each component's
/metrics. HANG_GUARD only stops a broken run from hanging the suite.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import yaml
from dataplane_helpers import control_headers, free_port_block, heldout_texts, ramp_names, service_spec, two_split_plan
from generation_helpers import PROMPTS, tiny_decoder_bundle
from prometheus_client import REGISTRY
from prometheus_helpers import RULES, PrometheusServer, binary, promtool, scrape_job
from test_dashboards import DASHBOARDS, load, queries
from test_operator_support import ClusterThread, install_profiles, mark_ready, operator, pool, service, status, wait_for

from exitplan.api.resources import EarlyExitServiceSpec, GPUPoolSpec
from exitplan.localrun.deployment import LocalDeployment
from exitplan.operator import names

pytestmark = pytest.mark.slow

NS, NAME = "live", "minilm"
HANG_GUARD = 120.0
WINDOWS = {"$__rate_interval": "20s", "$__interval": "5s", "$__range": "10m"}
"""Grafana's interval variables: the rate window spans several 1 s scrapes, the range the whole run."""
DRIFT = {"periodSeconds": 5, "drift": {"lengthScore": 1.0, "survivalError": 1.0, "sloRisk": 2.0}}
"""The drift loop reads the run's router every 5 s and scores it, but never re-plans on it: the
operator's service plans a synthetic model (tests/test_operator_data, two ramps), not the bundle the
run serves (a re-plan from its observations would name ramps that model lacks)."""


@dataclass
class Live:
    prom: PrometheusServer
    dep: LocalDeployment
    gen: LocalDeployment
    operator_port: int
    ramps: list[str]
    """The bundle's exit ramps and its final head's name, as the data plane names them."""


def _post(url: str, body: object, headers: dict[str, str] | None = None) -> int:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as err:
        err.read()
        return err.code


def _infer_body(texts: list[str]) -> dict:
    return {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts)], "data": texts}]}


class Trickle:
    """A steady light load on the router until stopped (windows keep rolling with answers in them)."""

    def __init__(self, url: str, texts: list[str]) -> None:
        self.url, self.texts, self.stopped = url, texts, threading.Event()
        self.codes: list[int] = []
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        i = 0
        while not self.stopped.is_set():
            self.codes.append(
                _post(f"{self.url}/v2/models/minilm/infer", _infer_body([self.texts[i % len(self.texts)]]))
            )
            i += 1
            self.stopped.wait(0.05)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=HANG_GUARD)


async def _burst(url: str, texts: list[str], n: int) -> list[int]:
    """n requests of 4 inputs each at once: more than the buckets answer within the SLO."""
    async with aiohttp.ClientSession() as s:

        async def one(i: int) -> int:
            body = _infer_body([texts[(i + k) % len(texts)] for k in range(4)])
            async with s.post(f"{url}/v2/models/minilm/infer", json=body, timeout=aiohttp.ClientTimeout(60)) as r:
                await r.read()
                return r.status

        return await asyncio.gather(*(one(i) for i in range(n)))


def _generation_deployment(workdir: Path) -> LocalDeployment:
    from exitplan.planner.generation import plan_generation
    from exitplan.worker_image.generate.decoder import DecoderModel

    bundle = tiny_decoder_bundle()
    spec = EarlyExitServiceSpec.model_validate(
        {
            "model": {"name": "tweets", "bundle": str(bundle), "task": "text-generation"},
            "slo": {"latencyMs": 1000},
            "accuracy": {"maxDrop": 0.02},
            "pools": [{"name": "cpu"}],
        }
    )
    manifest = DecoderModel(bundle, last_block=0).manifest
    plan = plan_generation(
        "writer",
        spec,
        {"cpu": GPUPoolSpec(capacity=2)},
        n_blocks=len(manifest.blocks),
        exit_ramps=[r.name for r in manifest.exit_ramps()],
        max_context=manifest.decoder.max_context,
        stages=1,
    ).plan
    base = free_port_block(3)
    return LocalDeployment(bundle, plan, spec, workdir, port=base + 2, base_port=base)


def _classify_deployment(bundle: Path, workdir: Path) -> LocalDeployment:
    ramps = ramp_names(bundle)
    plan = two_split_plan(ramps, 0.8, {}).model_copy(update={"service": NAME})
    spec = service_spec(bundle, slo_ms=300.0, shadow=0.5)
    n = sum(c.replicas for c in plan.cells) + 1
    base = free_port_block(n + 1)
    return LocalDeployment(bundle, plan, spec, workdir, port=base + n, base_port=base, window_seconds=2.0)


def _operator_service(cluster: ClusterThread, dep: LocalDeployment) -> None:
    """The EarlyExitService the operator plans, answering to the run's control token (its Secret made
    first, which the operator keeps), its routers' control endpoint published as the run's router."""
    cluster.create(pool("gpu-a", 4, 3.0))
    cluster.create(pool("gpu-b", 6, 1.0))
    install_profiles(cluster, NS)
    token = base64.b64encode(dep.control_token.encode()).decode()
    cluster.create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": names.control_secret_name(NAME), "namespace": NS},
            "data": {names.TOKEN_KEY: token},
        }
    )
    cluster.create(service(NAME, NS, planner=DRIFT, slo={"latencyMs": 2000}))


def _publish_router(cluster: ClusterThread, dep: LocalDeployment) -> None:
    control = names.control_service_name(NAME)
    wait_for("the routers' control Service", lambda: cluster.get("Service", NS, control))
    ingress = [{"ip": "127.0.0.1", "ports": [{"port": dep.control_port, "protocol": "TCP"}]}]
    cluster.patch("Service", NS, control, {"status": {"loadBalancer": {"ingress": ingress}}}, "status")


def _scrape_jobs(dep: LocalDeployment, gen: LocalDeployment, operator_port: int) -> list[dict]:
    def target(proc, component: str) -> tuple[str, dict[str, str]]:
        return f"127.0.0.1:{proc.port}", {"namespace": NS, "pod": proc.name, "component": component}

    routers = [target(p, "router") for p in dep.router_procs()]
    workers = [target(p, "worker") for p in dep.procs if p.name.startswith("worker")]
    writer = [target(p, "router") for p in gen.router_procs()]
    return [
        scrape_job("data-plane", routers + workers),
        scrape_job("generation", writer),
        scrape_job("operator", [(f"127.0.0.1:{operator_port}", {})], honor_labels=True),
    ]


def _drive(live: Live, cluster: ClusterThread, texts: list[str]) -> None:
    """Threshold update, plan update, overload burst, generation requests, a spec change."""
    dep, exits = live.dep, live.ramps[:-1]
    body = {"thresholds": {exits[0]: 0.6}, "reason": "api"}
    assert _post(f"{dep.control_url}/v1/thresholds", body, control_headers(dep)) == 200
    dep.write_plan(dep.plan.model_copy(update={"thresholds": {r: 0.9 for r in exits}}))
    codes = asyncio.run(_burst(dep.url, texts, 120))
    assert 429 in codes, sorted(set(codes))
    url = f"{live.gen.url}/v2/models/tweets/generate"
    for threshold in (0.0, 1.0):
        body = {"text_input": PROMPTS[0], "parameters": {"max_tokens": 8, "threshold": threshold, "ignore_eos": True}}
        assert _post(url, body) == 200
    assert _post(url, {"text_input": ""}) == 400
    cluster.patch("EarlyExitService", NS, NAME, {"spec": {"slo": {"latencyMs": 3000}}})
    labels = {"namespace": NS, "service": NAME, "reason": "spec-change"}  # the operator runs in this process
    wait_for("the spec change re-planned", lambda: REGISTRY.get_sample_value("exitplan_replan_total", labels))


@pytest.fixture(scope="module")
def live(minilm_bundle, tmp_path_factory) -> Iterator[Live]:
    binary("prometheus")  # fail first, naming the install command, when missing
    binary("promtool")
    from prometheus_client import start_http_server

    tmp = tmp_path_factory.mktemp("prometheus-live")
    dep = _classify_deployment(minilm_bundle, tmp / "classify")
    gen = _generation_deployment(tmp / "generate")
    with ExitStack() as stack, ThreadPoolExecutor(2) as starter:
        started = [starter.submit(d.start, HANG_GUARD) for d in (dep, gen)]

        def stop_deployments() -> None:
            for f in started:
                f.exception()  # wait for a start still under way before stopping
            dep.stop()
            gen.stop()

        stack.callback(stop_deployments)
        # the operator's /metrics (this process), on a port the kernel picks as it binds: a port picked before
        # (free_port) could be taken meanwhile by the deployments starting beside it (EADDRINUSE, once)
        server, _ = start_http_server(0, addr="127.0.0.1")
        operator_port = server.server_port
        stack.callback(server.shutdown)
        cluster = stack.enter_context(ClusterThread(tmp))
        _operator_service(cluster, dep)
        stack.enter_context(operator(cluster))
        wait_for("the service planned", lambda: status(cluster, NS, NAME).get("plan"))
        mark_ready(cluster, NS, NAME)
        for f in started:
            f.result()
        _publish_router(cluster, dep)
        prom = stack.enter_context(PrometheusServer(tmp, _scrape_jobs(dep, gen, operator_port)))
        wait_for(
            "every target scraped",
            lambda: (t := prom.api("targets")["activeTargets"]) and all(x["health"] == "up" for x in t),
        )
        texts = heldout_texts(minilm_bundle, 40)
        trickle = Trickle(dep.url, texts)
        stack.callback(trickle.stop)
        result = Live(prom, dep, gen, operator_port, [*ramp_names(minilm_bundle), "head"])
        time.sleep(3)  # a few windows roll with answers (and shadow samples) in them
        _drive(result, cluster, texts)
        truths = (
            'sum(increase(exitplan_replan_total{reason="spec-change"}[10m])) > 0',
            'sum(increase(exitplan_router_requests_total{code="429"}[10m])) > 0',
            # the router and 4 workers (job data-plane: the operator's job serves this pytest process's registry,
            # where earlier tests' in-process routers left series of their own)
            'count(increase(exitplan_threshold_updates_total{job="data-plane",reason="api"}[10m]) > 0) == 5',
            'count(increase(exitplan_threshold_updates_total{job="data-plane",reason="plan-update"}[10m]) > 0) == 5',
            "max(exitplan_router_agreement_samples) > 0",
            "count(exitplan_drift_length_score_ratio) > 0",
        )
        unseen: list[str] = list(truths)

        def seen_all() -> bool:
            unseen[:] = [q for q in truths if not prom.query(q)]
            return not unseen

        try:  # a slow machine scrapes late: the guard only stops a broken run from hanging
            wait_for("Prometheus saw the run", seen_all, guard=3 * HANG_GUARD)
        except AssertionError as e:
            raise AssertionError(f"{e}; still false: {unseen}") from None
        yield result


def substitute(expr: str) -> str:
    """A Grafana query as Prometheus takes it: the namespace and service variables at All (.*)."""
    for var, value in WINDOWS.items():
        expr = expr.replace(var, value)
    return expr.replace("$namespace", ".*").replace("$service", ".*")


def test_every_dashboard_query_returns_series(live: Live) -> None:
    empty, asked = [], 0
    for path in DASHBOARDS:
        for where, expr, _ in queries(load(path)):
            promql = substitute(expr)
            form = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", promql)
            if form:  # a variable: the label's values on the metric
                promql = f"count by ({form.group(2)}) ({form.group(1)})"
            asked += 1
            if not live.prom.query(promql):
                empty.append(f"{path.name} {where}: {promql}")
    assert asked >= 50 and empty == [], "\n".join(empty)


def test_counters_count_their_first_events_and_ramps_have_one_name(live: Live) -> None:
    prom = live.prom
    # the re-plan, the 429s and the threshold updates counted by increase(): their series were at 0 first
    assert prom.value('sum(increase(exitplan_replan_total{reason="spec-change"}[10m]))') >= 1
    assert prom.value('sum(increase(exitplan_router_requests_total{code="429"}[10m]))') >= 1
    assert prom.value('sum(increase(exitplan_router_errors_total{reason="overload"}[10m]))') >= 1
    for reason in ("api", "plan-update"):  # the router and every worker applied each update once
        updates = prom.query(f'increase(exitplan_threshold_updates_total{{job="data-plane",reason="{reason}"}}[10m])')
        assert len(updates) == 5 and all(float(u["value"][1]) > 0 for u in updates), updates
    # one name per ramp: the router's exits and the workers' carry the same names, the final head's own
    router = {s["metric"]["ramp"] for s in prom.query("exitplan_router_exits_total")}
    workers = {s["metric"]["ramp"] for s in prom.query("exitplan_worker_exits_total")}
    assert router == workers == set(live.ramps)
    assert prom.value('sum(increase(exitplan_router_exits_total{ramp="head"}[10m]))') > 0
    # gauges tell only what they know: a load in [0, inf), agreement with its samples and interval
    loads = [float(s["value"][1]) for s in prom.query("exitplan_router_bucket_load_ratio")]
    assert loads and min(loads) >= 0
    low, estimate, high = (prom.value(f"exitplan_router_agreement{part}_ratio") for part in ("_low", "", "_high"))
    assert 0 <= low <= estimate <= high <= 1 and prom.value("exitplan_router_agreement_samples") >= 1
    # the operator: its conditions, its last solve, and the generation router's heads
    planned = prom.value(f'exitplan_service_condition{{namespace="{NS}", service="{NAME}", condition="Planned"}}')
    assert planned == 1
    assert prom.value(f'exitplan_planner_last_solve_seconds{{namespace="{NS}", service="{NAME}"}}') > 0
    heads = {s["metric"]["ramp"] for s in prom.query("exitplan_generation_tokens_total")}
    assert "head" in heads and len(heads) >= 2


def test_every_rule_evaluates_on_the_run(live: Live) -> None:
    """The chart's rules, loaded by this Prometheus, evaluate without error on real series; the router
    of the operator's service is seen (no RoutersAbsent), and no router is down."""

    def evaluated():
        rules = [r for g in live.prom.api("rules")["groups"] for r in g["rules"]]
        return all(r["health"] != "unknown" for r in rules) and rules

    rules = wait_for("every rule evaluated", evaluated)
    assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
    assert len(rules) == sum(len(g["rules"]) for g in yaml.safe_load(RULES.read_text())["groups"])

    # A scrape that times out on a busy machine makes one evaluation see no router (pending); the next
    # scrape that answers clears it. What must hold is that this run's routers are found: no RoutersAbsent
    # or RouterDown alert in this run's namespace (the operator runs in the test process, so its registry also
    # holds the series of services earlier tests of the session planned in other namespaces, without routers).
    def ours() -> list[dict]:
        alerts = live.prom.api("alerts")["alerts"]
        router_alerts = {"ExitplanRoutersAbsent", "ExitplanRouterDown"}
        return [
            a for a in alerts if a["labels"].get("alertname") in router_alerts and a["labels"].get("namespace") == NS
        ]

    try:
        wait_for("no router alert for the live service", lambda: not ours(), guard=60.0)
    except AssertionError:
        raise AssertionError(f"router alerts still active: {ours()}") from None
    assert live.prom.value('count(exitplan_service:slo_miss:ratio_rate5m{namespace="live", service="minilm"})') == 1


def test_promtool_check_metrics_is_clean_on_every_component(live: Live) -> None:
    dep = live.dep
    sources = {
        "router": dep.router_procs()[0].address,
        "worker split 0": next(p.address for p in dep.procs if p.name.startswith("worker-s0")),
        "worker split 1": next(p.address for p in dep.procs if p.name.startswith("worker-s1")),
        "generation router": live.gen.router_procs()[0].address,
        "operator": f"127.0.0.1:{live.operator_port}",
    }
    for name, address in sources.items():
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as r:
            text = r.read()
        assert b"exitplan_" in text, name
        done = promtool("check", "metrics", stdin=text)
        assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), (name, done.stdout + done.stderr)
