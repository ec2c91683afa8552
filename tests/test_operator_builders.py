"""Unit tests of the pure manifest builders, apply helpers and drift decisions (no cluster)."""

from __future__ import annotations

import json

import pytest

from exitplan.api.commands import CPU_MAX_WAIT_MS
from exitplan.api.observations import (
    LATENCY_EDGES_MS,
    BucketObservations,
    Observations,
    RampAgreement,
    histogram_quantile_ms,
)
from exitplan.api.plan import Cell, Plan, SplitPlan
from exitplan.api.resources import DriftLimits, EarlyExitServiceSpec, GPUPoolSpec
from exitplan.operator import apply as applying
from exitplan.operator import builders, drift, names, pod_template
from exitplan.operator.status import Phase, ServiceStatus, parse_status, set_condition, summarize

OWNER = {
    "apiVersion": "exitplan.io/v1alpha1",
    "kind": "EarlyExitService",
    "metadata": {"name": "minilm", "namespace": "ml", "uid": "1234-uid"},
}
SPEC = EarlyExitServiceSpec.model_validate(
    {
        "model": {"name": "minilm", "bundle": "file:///models/minilm"},
        "slo": {"latencyMs": 100},
        "pools": [{"name": "gpu-a"}, {"name": "cpu"}],
        "router": {"replicas": 2},
    }
)
POOLS = {
    "gpu-a": GPUPoolSpec(
        capacity=8,
        node_selector={"pool": "a"},
        gpu_resource="nvidia.com/gpu",
        tolerations=[{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        cpu="4",
        memory="8Gi",
    ),
    "cpu": GPUPoolSpec(capacity=4, gpu_resource=""),
}


def make_plan(cells: list[tuple[int, int, str, int]], hist: list[float] | None = None) -> Plan:
    return Plan(
        service="minilm",
        model="minilm",
        splits=[SplitPlan(index=0, first_block=0, last_block=2), SplitPlan(index=1, first_block=3, last_block=5)],
        buckets=[32, 128],
        cells=[Cell(split=s, bucket=b, pool=p, replicas=r, batch_size=8) for s, b, p, r in cells],
        survival=[0.55, 0.3],
        length_histogram=hist or [0.7, 0.3],
    )


PLAN = make_plan([(0, 32, "gpu-a", 3), (0, 128, "cpu", 1), (1, 32, "gpu-a", 2), (1, 128, "gpu-a", 1)])


def by_name(children: list[dict]) -> dict[str, dict]:
    return {f"{c['kind']}/{c['metadata']['name']}": c for c in children}


def test_children_cover_every_cell_with_labels_owner_and_hash():
    children = builders.build_children(OWNER, SPEC, PLAN, POOLS)
    objs = by_name(children)
    assert set(objs) == {
        "ConfigMap/minilm-plan",
        "Deployment/minilm-router",
        "Service/minilm",
        "Service/minilm-split-0",
        "Service/minilm-split-1",
        "Service/minilm-control",
        "Deployment/minilm-s0-b32-gpu-a",
        "Deployment/minilm-s0-b128-cpu",
        "Deployment/minilm-s1-b32-gpu-a",
        "Deployment/minilm-s1-b128-gpu-a",
    }
    for child in children:
        meta = child["metadata"]
        assert meta["namespace"] == "ml"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "exitplan.io/v1alpha1",
                "kind": "EarlyExitService",
                "name": "minilm",
                "uid": "1234-uid",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert meta["labels"][names.L_SERVICE] == "minilm"
        # the plan ConfigMap names the whole plan; every other child the plan less its thresholds (a re-tune
        # that writes new thresholds into plan.json changes no other child)
        want = PLAN.content_hash() if child["kind"] == "ConfigMap" else PLAN.layout_hash()
        assert meta["annotations"][names.A_PLAN_HASH] == want
    worker = objs["Deployment/minilm-s0-b128-cpu"]
    assert worker["spec"]["replicas"] == 1
    assert {names.L_SPLIT: "0", names.L_BUCKET: "128", names.L_POOL: "cpu"}.items() <= worker["metadata"][
        "labels"
    ].items()
    # The ConfigMap holds the plan exactly, naming the routers' control Service as its routers.
    held = Plan.model_validate_json(objs["ConfigMap/minilm-plan"]["data"]["plan.json"])
    assert held == PLAN.model_copy(update={"routers": ["minilm-control.ml.svc:8081"]})
    assert held.content_hash() == PLAN.content_hash()  # wiring, not part of the plan's hash


def test_selectors_match_pod_labels():
    for child in builders.build_children(OWNER, SPEC, PLAN, POOLS):
        if child["kind"] == "Deployment":
            pod_labels = child["spec"]["template"]["metadata"]["labels"]
            assert child["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        if child["kind"] == "Service" and child["metadata"]["name"].startswith("minilm-split-"):
            assert child["spec"]["clusterIP"] == "None"
            split = child["metadata"]["name"].rsplit("-", 1)[1]
            assert child["spec"]["selector"] == {
                names.L_SERVICE: "minilm",
                names.L_COMPONENT: "worker",
                names.L_SPLIT: split,
            }


def test_worker_pod_follows_the_contract_and_the_pool():
    objs = by_name(builders.build_children(OWNER, SPEC, PLAN, POOLS))
    pod = objs["Deployment/minilm-s0-b32-gpu-a"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["exitplan", "worker"]
    assert c["args"] == [
        "--bundle",
        "/models/minilm",
        "--plan",
        "/etc/exitplan/plan.json",
        "--split",
        "0",
        "--bucket",
        "32",
        "--pool",
        "gpu-a",
        "--port",
        "8080",
        "--control-token-file",
        "/var/run/exitplan-control/token",
        "--device",
        "gpu",  # a pool with a gpuResource: never serve on the CPU in its stead
        "--next",
        "minilm-split-1.ml.svc:8080",
    ]
    assert pod["nodeSelector"] == {"pool": "a"}
    assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["resources"]["requests"]["cpu"] == "4"
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    # a large model loads before liveness counts: the startup probe allows STARTUP_SECONDS
    start = c["startupProbe"]
    assert start["httpGet"]["path"] == "/v2/health/live" and "initialDelaySeconds" not in c["livenessProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] == pod_template.STARTUP_SECONDS >= 300
    # the recommended instance label names the service, on the Deployment and on its pods (not in the selector)
    dep = objs["Deployment/minilm-s1-b128-gpu-a"]
    assert dep["metadata"]["labels"]["app.kubernetes.io/instance"] == "minilm"
    assert dep["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/instance"] == "minilm"
    assert "app.kubernetes.io/instance" not in dep["spec"]["selector"]["matchLabels"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]} and c["securityContext"]["readOnlyRootFilesystem"]
    term = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert {"name": "plan", "mountPath": "/etc/exitplan", "readOnly": True} in c["volumeMounts"]
    assert {"name": "control-token", "mountPath": "/var/run/exitplan-control", "readOnly": True} in c["volumeMounts"]
    token = next(v for v in pod["volumes"] if v["name"] == "control-token")
    assert token["secret"]["secretName"] == "minilm-control-token" and token["secret"]["defaultMode"] == 0o440
    # The last split has no --next; a CPU-only pool asks for no GPU.
    last = objs["Deployment/minilm-s1-b128-gpu-a"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--next" not in last
    cpu = objs["Deployment/minilm-s0-b128-cpu"]["spec"]["template"]["spec"]
    assert not any("gpu" in k for k in cpu["containers"][0]["resources"]["limits"]) and "nodeSelector" not in cpu
    # a CPU worker launches a partial batch after a short wait (its batch latency grows with the batch: at low
    # load every input would otherwise wait until its deadline nearly ran out); a GPU worker waits for a batch
    args = cpu["containers"][0]["args"]
    assert args[args.index("--max-wait-ms") + 1] == str(CPU_MAX_WAIT_MS) and "--device" not in args
    assert "--max-wait-ms" not in c["args"]


def test_router_and_entry_service():
    objs = by_name(builders.build_children(OWNER, SPEC, PLAN, POOLS))
    router = objs["Deployment/minilm-router"]
    assert router["spec"]["replicas"] == 2
    (c,) = router["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["exitplan", "router"]
    assert c["args"][:8] == [
        "--bundle",
        "/models/minilm",
        "--plan",
        "/etc/exitplan/plan.json",
        "--port",
        "8080",
        "--peers",
        "minilm-split-0.ml.svc:8080",
    ]
    flags = dict(zip(c["args"][8::2], c["args"][9::2]))
    assert flags["--slo-ms"] == "100" and flags["--accuracy-budget"] == "0.01" and flags["--max-inflight"] == "4096"
    assert flags["--control-port"] == "8081" and flags["--control-token-file"] == "/var/run/exitplan-control/token"
    assert {"name": "control", "containerPort": 8081} in c["ports"]
    svc = objs["Service/minilm"]
    assert (
        svc["spec"]["ports"][0]["port"] == 8080 and svc["spec"]["selector"] == router["spec"]["selector"]["matchLabels"]
    )
    assert [p["port"] for p in svc["spec"]["ports"]] == [8080]  # clients reach only the inference port
    control = objs["Service/minilm-control"]  # headless: every router pod, at the control port
    assert control["spec"]["clusterIP"] == "None" and control["spec"]["selector"] == svc["spec"]["selector"]
    assert control["spec"]["ports"] == [{"name": "control", "port": 8081, "targetPort": "control", "protocol": "TCP"}]


def test_builders_are_pure_and_deterministic():
    one = json.dumps(builders.build_children(OWNER, SPEC, PLAN, POOLS), sort_keys=True)
    two = json.dumps(builders.build_children(OWNER, SPEC, PLAN, POOLS), sort_keys=True)
    assert one == two


def test_plan_on_unknown_pool_is_refused():
    plan = make_plan([(0, 32, "nope", 1), (1, 32, "gpu-a", 1)])
    with pytest.raises(ValueError, match="nope"):
        builders.build_children(OWNER, SPEC, plan, POOLS)


def test_dns_names_stay_valid():
    name = names.dns_name("A" * 80, "s0", "b128", "Pool_X")
    assert len(name) <= 63 and name == name.lower() and "_" not in name
    assert names.dns_name("A" * 80, "x") != names.dns_name("A" * 80, "y")


def test_profile_job_measures_then_publishes_on_the_pool():
    job = builders.build_profile_job(OWNER, SPEC, "gpu-a", POOLS["gpu-a"], "minilm-gpu-a")
    pod = job["spec"]["template"]["spec"]
    assert pod["initContainers"][0]["command"] == ["exitplan", "profile"]
    assert pod["initContainers"][0]["args"][:3] == ["/models/minilm", "--pool", "gpu-a"]
    assert pod["containers"][0]["command"] == ["exitplan", "operator", "publish-profile"]
    assert pod["nodeSelector"] == {"pool": "a"} and pod["restartPolicy"] == "Never"
    assert job["metadata"]["ownerReferences"][0]["uid"] == "1234-uid"


def test_contains_and_diff():
    assert applying.contains({"a": 1, "b": {"c": [1, {"d": 2, "e": 3}]}}, {"b": {"c": [1, {"d": 2}]}})
    assert not applying.contains({"a": [1, 2]}, {"a": [1]})
    assert applying.contains({"x": 2}, {"x": 2.0})
    children = builders.build_children(OWNER, SPEC, PLAN, POOLS)
    existing = {
        "Deployment": [
            {"kind": "Deployment", "metadata": {"name": "minilm-s0-b32-gpu-a"}, "spec": {"replicas": 1}},
            {"kind": "Deployment", "metadata": {"name": "minilm-s9-b32-old"}, "spec": {"replicas": 1}},
        ]
    }
    changes = applying.diff_children(existing, children)
    assert "scale minilm-s0-b32-gpu-a: 1 -> 3" in changes
    assert "delete Deployment minilm-s9-b32-old" in changes
    assert any(c.startswith("create Deployment minilm-s1-b32-gpu-a") for c in changes)


def test_conditions_keep_transition_time_and_order():
    conds = set_condition([], "Ready", False, "Waiting", "x", 1)
    conds = set_condition(conds, "Planned", True, "Planned", "y", 1)
    assert [c.type for c in conds] == ["Planned", "Ready"]
    again = set_condition(conds, "Ready", False, "Waiting", "still", 2)
    assert again[1].last_transition_time == conds[1].last_transition_time and again[1].observed_generation == 2
    status = ServiceStatus(phase=Phase.ready, conditions=again, plan=summarize(PLAN))
    assert parse_status(status.model_dump(by_alias=True, mode="json") | {"kopf": {}}) == status
    assert status.plan.replicas == 7 and status.plan.splits == 2


def window(hist: list[int], survival: list[float], p99: float = 20.0, n: int | None = None) -> Observations:
    total = sum(hist) if n is None else n
    return Observations(
        service="minilm",
        model="minilm",
        since=1,
        until=60,
        requests=total,
        within_slo=total,
        length_buckets=[32, 128],
        length_histogram=hist,
        survival=survival,
        latency={"p99Ms": p99},
        ramps=["ramp1", "ramp3"],
    )


def test_drift_statistics_and_triggers():
    limits = DriftLimits(length_score=0.15, survival_error=0.1, slo_risk=0.95)
    calm = drift.assess(PLAN, window([700, 300], [0.55, 0.3]), limits, 100.0, [])
    assert calm.trigger == "" and calm.length_score == pytest.approx(0.0)
    shifted = drift.assess(PLAN, window([200, 800], [0.55, 0.3]), limits, 100.0, [])
    assert shifted.length_score == pytest.approx(0.5) and shifted.trigger == "length-drift"
    harder = drift.assess(PLAN, window([700, 300], [0.9, 0.7]), limits, 100.0, [[0.9, 0.7]] * 3)
    assert harder.trigger == "survival-drift" and harder.survival_error > 0.1
    slow = drift.assess(PLAN, window([200, 800], [0.55, 0.3], p99=99.0), limits, 100.0, [])
    assert slow.trigger == "slo-risk"
    tiny = drift.assess(PLAN, window([0, 10], [0.9, 0.9]), limits, 100.0, [])
    assert tiny.trigger == "" and tiny.requests == 10
    # the window's bounds, to line MEASURED up with a load generator's figures: 60 s at 10 within the SLO
    assert (tiny.window_start, tiny.window_end) == ("1970-01-01T00:00:01.000Z", "1970-01-01T00:01:00.000Z")
    assert tiny.goodput_rps == pytest.approx(10 / 59, abs=0.05)
    # Few answers (the plan is short of capacity for the new lengths) but many arrivals: the
    # length test still judges; the survival and latency tests wait for answers.
    backlog = drift.assess(PLAN, window([100, 900], [0.9, 0.9], p99=500.0, n=10), limits, 100.0, [])
    assert backlog.trigger == "length-drift" and backlog.survival_error == 0.0


def test_move_cap_steps_toward_the_target():
    old = make_plan([(0, 32, "gpu-a", 6), (0, 128, "gpu-a", 0), (1, 32, "gpu-a", 2), (1, 128, "gpu-a", 2)])
    new = make_plan([(0, 32, "gpu-a", 2), (0, 128, "gpu-a", 4), (1, 32, "gpu-a", 2), (1, 128, "gpu-a", 2)])
    assert drift.moved_replicas(old, new) == 4
    step, remaining = drift.limit_moves(old, new, 0.25)  # 10 replicas: at most 2 move now
    assert drift.moved_replicas(old, step) == 2 and remaining == 2
    assert sum(c.replicas for c in step.cells) == sum(c.replicas for c in old.cells)
    final, none_left = drift.limit_moves(step, new, 0.25)
    assert none_left == 0 and final == new
    whole, _ = drift.limit_moves(old, new, 1.0)
    assert whole == new


def test_cooldown():
    import datetime as dt

    now = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)
    assert drift.cooldown_left("", 300, now) == 0
    assert drift.cooldown_left("2026-01-01T11:58:00Z", 300, now) == pytest.approx(180)
    assert drift.cooldown_left("2026-01-01T11:50:00Z", 300, now) == 0


def test_initial_thresholds_keep_the_budget_in_every_length_stratum():
    """Disagreement that depends on length: the whole-window tune spends the budget on short
    inputs (their mistakes hide among the long inputs' agreement); per stratum it holds in each."""
    import numpy as np

    from exitplan.planner.tuning.autotune import sample_budget
    from exitplan.planner.tuning.initial import stratify
    from exitplan.planner.tuning.thresholds import FeedbackWindow, evaluate, tune

    rng = np.random.default_rng(0)
    n = 800
    lengths = np.where(np.arange(n) < n // 2, 16, 100)
    final = rng.integers(0, 2, n)
    conf = rng.uniform(0.5, 1.0, (n, 1))
    pred = np.repeat(final[:, None], 1, axis=1)
    short = lengths <= 32
    wrong = short & (rng.uniform(size=n) < 0.15)  # short inputs: 15 % of early answers are wrong
    pred[wrong, 0] = 1 - final[wrong]
    window = FeedbackWindow(conf=conf, pred=pred, final=final, saving_ms=np.array([1.0]), cost_ms=np.array([0.01]))
    budget = 0.03

    def sub(mask):
        return FeedbackWindow(
            conf=conf[mask], pred=pred[mask], final=final[mask], saving_ms=window.saving_ms, cost_ms=window.cost_ms
        )

    whole = np.asarray(tune(window, sample_budget(budget, n)).thresholds)
    assert 1 - evaluate(sub(short), whole)[0] > budget  # the whole-window tune breaks the short stratum
    thresholds, report = stratify(window, lengths, budget, [32, 128])
    assert [r[0] for r in report] == [n // 2, n // 2]
    for mask in (short, ~short):
        assert 1 - evaluate(sub(mask), thresholds)[0] <= sample_budget(budget, int(mask.sum()))
    assert (thresholds >= whole).all() and evaluate(window, thresholds)[1] > 0  # still exits some inputs
    same, _ = stratify(window, None, budget, [32, 128])  # no lengths: the whole window
    assert np.array_equal(same, whole)


def router_window(since: float, until: float, hist: list[int], survivors: list[int], answered: int) -> Observations:
    """A router window's counters at one read: arrivals per bucket, answers and survivors per ramp."""
    return Observations(
        service="minilm",
        model="minilm",
        since=since,
        until=until,
        requests=answered,
        within_slo=answered,
        length_buckets=[32, 128],
        length_histogram=hist,
        survival=[s / answered if answered else 0.0 for s in survivors],
        ramps=["ramp1", "ramp3"],
    )


def test_since_last_keeps_only_what_arrived_after_the_previous_read():
    first = router_window(100, 103, [30, 0], [12, 6], 30)
    piece = drift.since_last([first], None)  # the first read: everything
    assert piece.length_histogram == [30, 0] and piece.requests == 30
    # Same router window, later: only the difference.
    later = router_window(100, 106, [40, 25], [24, 12], 60)
    piece = drift.since_last([router_window(90, 100, [99, 0], [1, 1], 99), later], first)
    assert piece.length_histogram == [10, 25] and piece.requests == 30 and piece.since == 103 and piece.until == 106
    assert piece.survival == pytest.approx([12 / 30, 6 / 30])
    # The window rolled between reads: the rest of the closed one plus all of the new one.
    closed = router_window(100, 110, [45, 40], [30, 15], 80)
    current = router_window(110, 112, [0, 7], [0, 0], 0)
    piece = drift.since_last([closed, current], later)
    assert piece.length_histogram == [5, 22] and piece.requests == 20
    # Nothing new: None; an unchanged window in progress: zero arrivals.
    assert drift.since_last([closed], closed) is None
    assert drift.arrivals(drift.since_last([current], router_window(110, 111, [0, 7], [0, 0], 0))) == 0


def test_combined_windows_read_latency_and_agreement_from_counts_and_share_nothing_with_their_parts():
    """combine / since_last: p50/p95/p99 from the summed (or subtracted) latency histograms, agreement from the
    summed shadow counts; the result's lists, dicts and models are its own (a caller may change them)."""
    edges = len(LATENCY_EDGES_MS) + 1

    def window(since, until, fast, slow, agree, samples):
        w = router_window(since, until, [fast + slow, 0], [0, 0], fast + slow)
        hist = [0] * edges
        hist[10], hist[60] = fast, slow
        agreement = [RampAgreement(ramp=r, samples=samples, agree=agree) for r in w.ramps]
        per_bucket = {"32": BucketObservations(requests=fast + slow, within_slo=fast, p99_ms=9.0, load_seconds=1.5)}
        return w.model_copy(
            update={"latency_histogram": hist, "agreement": agreement, "exit_counts": [0, 0, fast + slow],
                    "per_bucket": per_bucket}
        )  # fmt: skip

    a, b = window(0, 5, 90, 10, 40, 50), window(5, 10, 0, 100, 10, 50)
    both = drift.combine([a, b])
    hist = [x + y for x, y in zip(a.latency_histogram, b.latency_histogram)]
    assert both.latency_histogram == hist and both.requests == 200
    assert [both.latency.p50_ms, both.latency.p95_ms, both.latency.p99_ms] == [
        histogram_quantile_ms(hist, q) for q in (0.50, 0.95, 0.99)
    ]
    # a alone answers fast at its median; with b's slow answers the median is a slow one (110 of 200)
    assert histogram_quantile_ms(a.latency_histogram, 0.5) <= LATENCY_EDGES_MS[10]
    assert LATENCY_EDGES_MS[59] < both.latency.p50_ms < both.latency.p99_ms <= LATENCY_EDGES_MS[60]
    assert [(r.agree, r.samples) for r in both.agreement] == [(50, 100), (50, 100)]
    assert both.agreement[0].ci_low < 0.5 < both.agreement[0].ci_high
    assert both.per_bucket["32"].requests == 200 and both.per_bucket["32"].load_seconds == 3.0
    later = window(0, 10, 90, 110, 50, 100)  # a's window read again later: b's answers arrived since
    piece = drift.since_last([later], a)
    assert piece.latency_histogram == b.latency_histogram and piece.latency.p50_ms == pytest.approx(
        histogram_quantile_ms(b.latency_histogram, 0.5)
    )
    assert [(r.agree, r.samples) for r in piece.agreement] == [(10, 50), (10, 50)]
    for out, parts in ((both, (a, b)), (piece, (later, a))):
        before = [w.model_dump() for w in parts]
        out.latency_histogram[60] += 1
        out.length_histogram[0] += 1
        out.thresholds["ramp1"] = 0.5
        out.load["32"] = 9.0
        out.latency.p99_ms = 1.0
        out.errors.worker = 7
        out.per_bucket["32"].requests = 0
        out.agreement[0].agree = 0
        assert [w.model_dump() for w in parts] == before, "changing the result changed a window it was made of"


def test_judged_window_is_the_newest_half_period_with_enough_arrivals():
    slices = [router_window(t, t + 2.5, [20, 0], [0, 0], 20) for t in (0, 2.5, 5.0)]
    slices += [router_window(t, t + 2.5, [0, 30], [0, 0], 30) for t in (7.5, 10.0)]
    judged = drift.recent(slices, period_s=10.0)  # half a period = 5 s, 50 arrivals: the last two slices
    assert judged.since == 7.5 and judged.length_histogram == [0, 60]
    few = [router_window(t, t + 2.5, [5, 5], [0, 0], 10) for t in (0, 2.5, 5.0, 7.5)]
    judged = drift.recent(few, period_s=10.0)  # short of 50 arrivals: reaches back for more
    assert judged.since == 0 and drift.arrivals(judged) == 40
    report = drift.assess(PLAN, drift.recent(slices, 10.0), DriftLimits(), 100.0, [])
    assert report.trigger == "length-drift" and report.length_score == pytest.approx(0.7)


def test_after_change_is_the_traffic_since_the_shift():
    before = [
        router_window(t, t + 2.5, [18, 2], [0, 0], 20) for t in (0, 2.5, 5.0)
    ]  # like the plan (0.7 / 0.3)... short
    after = [router_window(t, t + 2.5, [1, 19], [0, 0], 20) for t in (7.5, 10.0)]  # long since 7.5
    slices = before + after
    judged = drift.recent(slices, period_s=10.0)
    shifted = drift.after_change(slices, PLAN)
    assert shifted.since == 7.5 and shifted.length_histogram == [2, 38]  # only what came after the shift
    assert drift.bucket_shares(judged, PLAN.buckets)[1] < drift.bucket_shares(shifted, PLAN.buckets)[1]
    assert drift.after_change(slices[:1], PLAN) is None  # fewer arrivals than it needs


def test_a_new_layout_moves_every_replica():
    old = make_plan([(0, 32, "gpu-a", 6), (0, 128, "gpu-a", 0), (1, 32, "gpu-a", 2), (1, 128, "gpu-a", 2)])
    other = old.model_copy(
        update={
            "splits": [SplitPlan(index=0, first_block=0, last_block=1), SplitPlan(index=1, first_block=2, last_block=5)]
        }
    )
    assert not drift.same_layout(old, other) and drift.moved_replicas(old, other) == 10
    taken, remaining = drift.limit_moves(old, other, 0.25)  # cannot be stepped: taken whole (the caller holds it back)
    assert taken == other and remaining == 0
