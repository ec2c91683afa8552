"""The operator under kopf against the emulated API server over HTTP (tiers 2 of DESIGN.md).

Profiles are the synthetic ones in tests/test_operator_data/profiles.yaml; the planner is the
real one; observations for the drift tests come from a real tiny HTTP server in the test that
serves a crafted Observations window (that is the injected drift), published as the routers' control
Service's load-balancer ingress the way the dev-cluster's Service stand-in publishes its port. Like a
router's control port it answers only requests carrying the service's control token (the Secret the
operator created), so the drift and tuning tests show the operator sends it.
"""

from __future__ import annotations

import base64
import http.server
import json
import logging
import threading

import pytest
from test_operator_support import (
    ClusterThread,
    condition,
    events_where,
    install_profiles,
    mark_ready,
    operator,
    pool,
    service,
    status,
    wait_for,
    workers,
)

from exitplan.api.plan import Plan
from exitplan.operator import builders, names


@pytest.fixture
def cluster(tmp_path):
    with ClusterThread(tmp_path) as c:
        c.create(pool("gpu-a", 4, 3.0))
        c.create(pool("gpu-b", 6, 1.0))
        yield c


def plan_of(cluster: ClusterThread, ns: str, name: str) -> Plan | None:
    cm = cluster.get("ConfigMap", ns, names.plan_configmap_name(name))
    return Plan.model_validate_json(cm["data"]["plan.json"]) if cm else None


def deployed(cluster: ClusterThread, ns: str, name: str) -> dict:
    st = status(cluster, ns, name)
    return st if st.get("plan") and st.get("phase") in ("Deploying", "Ready") else {}


def test_create_builds_every_child_with_the_right_specs(cluster):
    ns = "create"
    install_profiles(cluster, ns)
    with operator(cluster):
        svc = cluster.create(service("minilm", ns))
        st = wait_for("the service is planned and applied", lambda: deployed(cluster, ns, "minilm"))
        plan = plan_of(cluster, ns, "minilm")
        assert plan is not None and st["plan"]["hash"] == plan.content_hash()
        deps = workers(cluster, ns, "minilm")
        assert {names.worker_name("minilm", c) for c in plan.cells} == set(deps)
        for cell in plan.cells:
            dep = deps[names.worker_name("minilm", cell)]
            assert dep["spec"]["replicas"] == cell.replicas
            pod = dep["spec"]["template"]["spec"]
            assert pod["nodeSelector"] == {"exitplan.io/pool": cell.pool}
            assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
            assert dep["metadata"]["annotations"][names.A_PLAN_HASH] == plan.layout_hash()
        services = {o["metadata"]["name"] for o in cluster.list("Service", ns, "exitplan.io/service=minilm")}
        splits = {names.split_service_name("minilm", s.index) for s in plan.splits}
        assert services == {"minilm", "minilm-control"} | splits
        secret = cluster.get("Secret", ns, "minilm-control-token")  # the control token, made once
        assert secret["metadata"]["ownerReferences"][0]["uid"] == svc["metadata"]["uid"]
        assert len(base64.b64decode(secret["data"]["token"])) >= 32
        router = cluster.get("Deployment", ns, "minilm-router")
        assert router["spec"]["template"]["spec"]["containers"][0]["command"] == ["exitplan", "router"]
        for kind in ("Deployment", "Service", "ConfigMap"):
            for obj in cluster.list(kind, ns, "exitplan.io/service=minilm"):
                assert obj["metadata"]["ownerReferences"][0]["uid"] == svc["metadata"]["uid"]
        assert condition(st, "Planned")["status"] == "True" and condition(st, "PlanInfeasible")["status"] == "False"
        assert st["observedGeneration"] == 1 and st["lastReplanReason"] == "initial"
        # Readiness: once the Deployments report ready replicas the service becomes Ready.
        mark_ready(cluster, ns, "minilm")
        st = wait_for("phase Ready", lambda: (s := status(cluster, ns, "minilm")).get("phase") == "Ready" and s)
        assert condition(st, "Ready")["status"] == "True" and condition(st, "Progressing")["status"] == "False"
        assert all(c["readyReplicas"] == c["replicas"] for c in st["plan"]["cells"])
        events_where(cluster, ns, "minilm", lambda e: e["reason"] == "Applied", "an Applied event")
        from prometheus_client import REGISTRY

        # the plan's goodput is exported beside the status (the dashboard's planned-vs-measured panel); no
        # window was measured yet, so the measured series is absent rather than 0
        labels = {"namespace": ns, "service": "minilm"}
        assert REGISTRY.get_sample_value("exitplan_plan_goodput_per_second", labels) == st["plan"]["goodputRps"] > 0
        assert REGISTRY.get_sample_value("exitplan_measured_goodput_per_second", labels) is None


def test_spec_change_replans_and_patches(cluster):
    ns = "update"
    install_profiles(cluster, ns)
    with operator(cluster):
        cluster.create(service("minilm", ns))
        first = wait_for("first plan applied", lambda: deployed(cluster, ns, "minilm"))
        before = workers(cluster, ns, "minilm")
        assert any(d["metadata"]["labels"]["exitplan.io/pool"] == "gpu-b" for d in before.values())
        cluster.patch("EarlyExitService", ns, "minilm", {"spec": {"pools": [{"name": "gpu-a"}]}})
        st = wait_for(
            "re-plan after the spec change",
            lambda: (s := deployed(cluster, ns, "minilm")) and s["plan"]["hash"] != first["plan"]["hash"] and s,
        )
        assert st["lastReplanReason"] == "spec-change" and st["observedGeneration"] == 2
        plan = plan_of(cluster, ns, "minilm")
        after = workers(cluster, ns, "minilm")
        assert set(after) == {names.worker_name("minilm", c) for c in plan.cells}
        assert all(d["metadata"]["labels"]["exitplan.io/pool"] == "gpu-a" for d in after.values())
        assert all(d["metadata"]["annotations"][names.A_PLAN_HASH] == plan.layout_hash() for d in after.values())
        kept = set(before) & set(after)
        for name in kept:  # patched in place, not re-created
            assert after[name]["metadata"]["uid"] == before[name]["metadata"]["uid"]


class ObservationServer:
    """A real HTTP endpoint standing in for a router: `window` is the last closed observation
    window (GET /v1/observations), `current` the one in progress (?window=current; by default an
    empty one that starts where `window` ends); GET/POST /v1/thresholds keep `thresholds`. Requests
    without `Authorization: Bearer <token>` are answered 401 and counted in `refused`."""

    def __init__(self) -> None:
        self.token: str | None = None
        self.refused = 0
        self.window: dict = {}
        self.current: dict | None = None
        self.thresholds: dict[str, float] = {}
        self.pushed: list[dict] = []
        self.feedback: bytes | None = None
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _send(self, code: int, doc: object) -> None:
                body = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def refuse(self) -> bool:
                if owner.token is not None and self.headers.get("Authorization") == f"Bearer {owner.token}":
                    return False
                owner.refused += 1
                self._send(401, {"error": "control endpoints need the service's control token"})
                return True

            def do_GET(self) -> None:  # noqa: N802
                if self.refuse():
                    return
                if self.path == "/v1/observations":
                    self._send(200, owner.window)
                elif self.path == "/v1/observations?window=current":
                    self._send(200, owner.in_progress())
                elif self.path == "/v1/thresholds":
                    self._send(200, {"thresholds": owner.thresholds})
                elif self.path.startswith("/v1/window.npz") and owner.feedback is not None:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/octet-stream")
                    self.send_header("Content-Length", str(len(owner.feedback)))
                    self.end_headers()
                    self.wfile.write(owner.feedback)
                else:
                    self._send(404, {"error": "not here"})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if self.refuse():
                    return
                if self.path == "/v1/thresholds":
                    owner.pushed.append(body)
                    owner.thresholds = dict(body["thresholds"])
                    self._send(200, {"thresholds": owner.thresholds})
                else:
                    self._send(404, {"error": "not here"})

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def in_progress(self) -> dict:
        if self.current is not None:
            return self.current
        w = self.window
        empty = {
            **w,
            "since": w.get("until", 0),
            "until": w.get("until", 0) + 1,
            "requests": 0,
            "withinSlo": 0,
            "lengthHistogram": [0] * len(w.get("lengthHistogram", [])),
        }
        return {**empty, "thresholds": self.thresholds} if self.thresholds else empty

    def close(self) -> None:
        self.httpd.shutdown()


def window(short: int, long: int, survival=(0.55, 0.3), p99: float = 20.0) -> dict:
    n = short + long
    return {
        "service": "minilm",
        "model": "minilm",
        "since": 0,
        "until": 60,
        "requests": n,
        "withinSlo": n,
        "ramps": ["ramp1", "ramp3"],
        "survival": list(survival),
        "lengthBuckets": [32, 128],
        "lengthHistogram": [short, long],
        "latency": {"p99Ms": p99},
    }


@pytest.fixture
def observations():
    server = ObservationServer()
    yield server
    server.close()


def publish_endpoint(cluster: ClusterThread, ns: str, name: str, server: ObservationServer) -> None:
    """Publish the observation server as the routers' control Service's one endpoint (the Endpoints object
    a cluster, or the dev cluster, keeps; the operator reads every router listed there), answering to the
    service's control token."""
    secret = cluster.get("Secret", ns, names.control_secret_name(name))
    server.token = base64.b64decode(secret["data"]["token"]).decode()
    subsets = [{"addresses": [{"ip": "127.0.0.1"}], "ports": [{"name": "control", "port": server.port}]}]
    endpoints = {
        "apiVersion": "v1",
        "kind": "Endpoints",
        "metadata": {"name": names.control_service_name(name), "namespace": ns},
        "subsets": subsets,
    }
    if cluster.get("Endpoints", ns, names.control_service_name(name)) is None:
        cluster.create(endpoints)
    else:
        cluster.patch("Endpoints", ns, names.control_service_name(name), {"subsets": subsets})


DRIFT = {"periodSeconds": 5, "drift": {"cooldownSeconds": 0, "maxMoveFraction": 1.0, "lengthScore": 0.15}}


def bucket_replicas(cluster: ClusterThread, ns: str, name: str) -> dict[int, int]:
    out: dict[int, int] = {}
    for dep in workers(cluster, ns, name).values():
        bucket = int(dep["metadata"]["labels"]["exitplan.io/bucket"])
        out[bucket] = out.get(bucket, 0) + dep["spec"]["replicas"]
    return out


def test_injected_length_drift_moves_replicas_between_cells(cluster, observations):
    ns = "drift"
    install_profiles(cluster, ns)
    with operator(cluster):
        cluster.create(service("minilm", ns, planner=DRIFT))
        first = wait_for("first plan applied", lambda: deployed(cluster, ns, "minilm"))
        plan0 = plan_of(cluster, ns, "minilm")
        before = bucket_replicas(cluster, ns, "minilm")
        observations.window = window(950, 50)  # the traffic turned short: most inputs fit bucket 32
        publish_endpoint(cluster, ns, "minilm", observations)
        st = wait_for(
            "a length-drift re-plan is applied",
            lambda: (s := deployed(cluster, ns, "minilm")) and s.get("lastReplanReason") == "length-drift" and s,
        )
        assert st["plan"]["hash"] != first["plan"]["hash"]
        assert st["drift"]["lengthScore"] > 0.15 and st["drift"]["trigger"] == "length-drift"
        plan1 = plan_of(cluster, ns, "minilm")
        assert plan1.reason == "length-drift" and plan1.length_histogram[0] > plan0.length_histogram[0]
        after = bucket_replicas(cluster, ns, "minilm")
        assert after[32] > before[32] and after[128] < before[128]
        for cell in plan1.cells:
            assert (
                workers(cluster, ns, "minilm")[names.worker_name("minilm", cell)]["spec"]["replicas"] == cell.replicas
            )
        events_where(
            cluster,
            ns,
            "minilm",
            lambda e: e["reason"] == "Replan" and "length-drift" in e["message"],
            "a Replan event",
        )
        # The operator's metrics saw it (the operator runs in this process under KopfRunner).
        from prometheus_client import REGISTRY

        svc = {"namespace": ns, "service": "minilm"}
        assert REGISTRY.get_sample_value("exitplan_replan_total", {**svc, "reason": "length-drift"}) >= 1
        assert REGISTRY.get_sample_value("exitplan_drift_length_score_ratio", svc) > 0.15
        assert REGISTRY.get_sample_value("exitplan_planner_solve_seconds_count", svc) >= 2
        cell = plan1.cells[0]
        labels = {**svc, "split": str(cell.split), "bucket": str(cell.bucket), "pool": cell.pool}
        wait_for(
            "desired replicas exported",
            lambda: REGISTRY.get_sample_value("exitplan_cell_desired_replicas", labels) == cell.replicas,
        )
        wait_for(
            "the plan's cost exported",
            lambda: (
                REGISTRY.get_sample_value("exitplan_plan_cost_per_hour", svc)
                == pytest.approx(plan1.prediction.cost_per_hour)
            ),
        )
        gone = {(c.split, c.bucket, c.pool) for c in plan0.cells} - {(c.split, c.bucket, c.pool) for c in plan1.cells}
        for split, bucket, pool in gone:  # a cell the new plan dropped leaves no stale series behind
            assert (
                REGISTRY.get_sample_value(
                    "exitplan_cell_desired_replicas", {**svc, "split": str(split), "bucket": str(bucket), "pool": pool}
                )
                is None
            )


def test_advisory_mode_reports_and_changes_nothing(cluster, observations):
    ns = "advisory"
    install_profiles(cluster, ns)
    with operator(cluster):
        cluster.create(service("fresh", ns, planner={"mode": "advisory"}))
        st = wait_for("advisory status", lambda: (s := status(cluster, ns, "fresh")).get("phase") == "Advisory" and s)
        assert any(c.startswith("create Deployment fresh-s") for c in st["proposal"]["changes"])
        assert cluster.list("Deployment", ns) == [] and cluster.list("ConfigMap", ns) == []
        events_where(cluster, ns, "fresh", lambda e: e["reason"] == "WouldApply", "a WouldApply event")
        # A running service switched to advisory: drift is reported, children stay as they are.
        cluster.create(service("minilm", ns, planner=DRIFT))
        wait_for("first plan applied", lambda: deployed(cluster, ns, "minilm"))
        cluster.patch("EarlyExitService", ns, "minilm", {"spec": {"planner": {"mode": "advisory"}}})
        wait_for("advisory after the switch", lambda: status(cluster, ns, "minilm").get("phase") == "Advisory")
        snapshot = {n: d["metadata"]["resourceVersion"] for n, d in workers(cluster, ns, "minilm").items()}
        cm_rv = cluster.get("ConfigMap", ns, "minilm-plan")["metadata"]["resourceVersion"]
        observations.window = window(950, 50)
        publish_endpoint(cluster, ns, "minilm", observations)
        st = wait_for(
            "a length-drift proposal",
            lambda: (
                (s := status(cluster, ns, "minilm")).get("proposal") and s["proposal"]["reason"] == "length-drift" and s
            ),
        )
        assert any(c.startswith("scale minilm-s") for c in st["proposal"]["changes"]), st["proposal"]
        assert st["proposal"]["heldBack"] == "advisory mode: nothing applied"
        assert {n: d["metadata"]["resourceVersion"] for n, d in workers(cluster, ns, "minilm").items()} == snapshot
        assert cluster.get("ConfigMap", ns, "minilm-plan")["metadata"]["resourceVersion"] == cm_rv
        events_where(
            cluster, ns, "minilm", lambda e: e["reason"] == "WouldApply" and "scale" in e["message"], "a scale proposal"
        )


def test_delete_takes_the_children(cluster):
    ns = "delete"
    install_profiles(cluster, ns)
    with operator(cluster):
        svc = cluster.create(service("minilm", ns))
        wait_for("applied", lambda: deployed(cluster, ns, "minilm"))
        children = [o for kind in ("Deployment", "Service", "ConfigMap") for o in cluster.list(kind, ns)]
        assert children and all(o["metadata"]["ownerReferences"][0]["uid"] == svc["metadata"]["uid"] for o in children)
        # The only finalizer is kopf's own marker for stopping the drift loop's daemon; the operator adds none.
        assert cluster.get("EarlyExitService", ns, "minilm")["metadata"].get("finalizers", []) in (
            [],
            ["kopf.zalando.org/KopfFinalizerMarker"],
        )
        cluster.delete("EarlyExitService", ns, "minilm")
        # The children go through their ownerReferences (the emulator's GC stand-in; a real
        # cluster's garbage collector does the same); the operator deletes nothing itself.
        wait_for("children gone", lambda: not any(cluster.list(k, ns) for k in ("Deployment", "Service", "ConfigMap")))


def test_restart_resumes_without_duplicating_children(cluster):
    ns = "restart"
    install_profiles(cluster, ns)
    with operator(cluster):
        cluster.create(service("minilm", ns))
        wait_for("applied", lambda: deployed(cluster, ns, "minilm"))
    snapshot = {
        (k, o["metadata"]["name"]): (o["metadata"]["uid"], o["metadata"]["resourceVersion"])
        for k in ("Deployment", "Service", "ConfigMap")
        for o in cluster.list(k, ns)
    }
    done: list[str] = []  # kopf logs the end of the resume handling (the plan keeps its reason, "initial")
    grab = logging.Handler()
    grab.emit = lambda record: done.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("kopf.objects").addHandler(grab)
    try:
        with operator(cluster):
            wait_for("the resume handler ran", lambda: any("Resuming is processed" in m for m in done))
            again = {
                (k, o["metadata"]["name"]): (o["metadata"]["uid"], o["metadata"]["resourceVersion"])
                for k in ("Deployment", "Service", "ConfigMap")
                for o in cluster.list(k, ns)
            }
    finally:
        logging.getLogger("kopf.objects").removeHandler(grab)
    assert again == snapshot  # same objects, not even patched
    assert "(initial)" in condition(status(cluster, ns, "minilm"), "Planned")["message"]  # one reason per plan


def test_invalid_specs_become_conditions_not_crash_loops(cluster):
    ns = "invalid"
    install_profiles(cluster, ns)
    with operator(cluster):
        cluster.create(service("ghost", ns, pools=[{"name": "gpu-a"}, {"name": "gpu-z"}]))
        cluster.create(service("tight", ns, slo={"latencyMs": 0.5}))
        ghost = wait_for(
            "unknown pool reported",
            lambda: (
                condition(status(cluster, ns, "ghost"), "PlanInfeasible").get("status") == "True"
                and status(cluster, ns, "ghost")
            ),
        )
        msg = condition(ghost, "PlanInfeasible")["message"]
        assert "gpu-z" in msg and "create" in msg and ghost["phase"] == "Infeasible"
        tight = wait_for(
            "infeasible SLO reported",
            lambda: (
                condition(status(cluster, ns, "tight"), "PlanInfeasible").get("status") == "True"
                and status(cluster, ns, "tight")
            ),
        )
        assert condition(tight, "PlanInfeasible")["reason"] == "PlanInfeasible"
        assert "no plan meets the spec" in tight["message"]
        # The operator keeps working: a valid service next to them is planned and applied.
        cluster.create(service("fine", ns))
        wait_for("valid service applied", lambda: deployed(cluster, ns, "fine"))
        for name in ("ghost", "tight"):
            assert cluster.list("Deployment", ns, f"exitplan.io/service={name}") == []
            warnings = events_where(cluster, ns, name, lambda e: e["type"] == "Warning", f"a Warning on {name}")
            assert len(warnings) == 1, warnings  # reported once, not retried in a loop
            annotations = cluster.get("EarlyExitService", ns, name)["metadata"].get("annotations", {})
            assert not any("retry" in v for v in annotations.values() if isinstance(v, str))


def test_missing_profile_starts_a_profiling_job_and_planning_waits(cluster, tmp_path):
    ns = "profiling"
    install_profiles(cluster, ns, pools=("gpu-a",))
    with operator(cluster):
        cluster.create(service("minilm", ns))
        st = wait_for(
            "waiting for a profile", lambda: (s := status(cluster, ns, "minilm")).get("phase") == "Profiling" and s
        )
        assert st["waitingForProfiles"] == ["gpu-b"] and "gpu-b" in condition(st, "Progressing")["message"]
        job = cluster.get("Job", ns, builders.profile_job_name("minilm", "gpu-b"))
        pod = job["spec"]["template"]["spec"]
        assert pod["initContainers"][0]["command"] == ["exitplan", "profile"] and pod["nodeSelector"] == {
            "exitplan.io/pool": "gpu-b"
        }
        assert cluster.list("Deployment", ns) == []
        # What the Job's last step does: publish the measured profile as a ModelProfile.
        from test_operator_support import load_docs
        from typer.testing import CliRunner

        from exitplan.cli import app

        profile = next(d for d in load_docs("profiles.yaml") if d["spec"]["pool"] == "gpu-b")
        (tmp_path / "profile.yaml").write_text(json.dumps(profile["spec"]))
        result = CliRunner().invoke(
            app,
            [
                "operator",
                "publish-profile",
                str(tmp_path / "profile.yaml"),
                "--namespace",
                ns,
                "--kubeconfig",
                str(cluster.kubeconfig),
            ],
        )
        assert result.exit_code == 0, result.output
        assert cluster.get("ModelProfile", ns, "minilm-gpu-b")["spec"]["pool"] == "gpu-b"
        wait_for("planned once the profile exists", lambda: deployed(cluster, ns, "minilm"))


def test_failed_apply_keeps_the_previous_plan_serving(cluster):
    import kmock

    ns = "faults"
    install_profiles(cluster, ns)
    failing = {"on": False}
    (
        cluster.api[
            lambda req: (
                failing["on"]
                and req.method == "POST"
                and req.namespace == ns
                and req.resource == kmock.resource("apps/v1/deployments")
            )
        ]
        << 500
    )
    with operator(cluster):
        cluster.create(service("minilm", ns))
        first = wait_for("first plan applied", lambda: deployed(cluster, ns, "minilm"))
        cm_before = cluster.get("ConfigMap", ns, "minilm-plan")["data"]["plan.json"]
        failing["on"] = True  # the API server now fails every Deployment creation
        cluster.patch("EarlyExitService", ns, "minilm", {"spec": {"pools": [{"name": "gpu-b"}]}})
        st = wait_for("Degraded", lambda: (s := status(cluster, ns, "minilm")).get("phase") == "Degraded" and s)
        assert "keeps serving" in condition(st, "Degraded")["message"]
        assert cluster.get("ConfigMap", ns, "minilm-plan")["data"]["plan.json"] == cm_before
        assert st["plan"]["hash"] == first["plan"]["hash"]
        failing["on"] = False  # the server recovers: kopf's retry applies the new plan
        st = wait_for(
            "recovered",
            lambda: (s := deployed(cluster, ns, "minilm")) and s["plan"]["hash"] != first["plan"]["hash"] and s,
        )
        assert condition(st, "Degraded")["status"] == "False"
        assert all(
            d["metadata"]["labels"]["exitplan.io/pool"] == "gpu-b" for d in workers(cluster, ns, "minilm").values()
        )


def test_two_replicas_with_peering_one_serves_the_other_takes_over(cluster):
    """Leader election: two operators share the kopf peering `exitplan`; the higher priority
    serves, the other is paused; when the leader stops, the other one serves."""
    ns = "peering"
    install_profiles(cluster, ns)
    cluster.call(
        "POST",
        "/apis/kopf.dev/v1/clusterkopfpeerings",
        {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "exitplan"}},
    )
    peering = ["--peering", "exitplan"]
    with operator(cluster, [*peering, "--priority", "10"]):
        with operator(cluster, [*peering, "--priority", "100"]):

            def peers() -> dict:
                return cluster.call("GET", "/apis/kopf.dev/v1/clusterkopfpeerings/exitplan").get("status") or {}

            seen = wait_for("both replicas in the peering", lambda: len(peers()) >= 2 and peers())
            assert sorted(p["priority"] for p in seen.values()) == [10, 100]
            cluster.create(service("minilm", ns))
            first = wait_for("applied once", lambda: deployed(cluster, ns, "minilm"))
            deps = workers(cluster, ns, "minilm")
            assert all(d["metadata"]["generation"] == 1 for d in deps.values())  # no second writer fought over them
        # The leader is gone: the standby resumes and serves the next change.
        cluster.patch("EarlyExitService", ns, "minilm", {"spec": {"pools": [{"name": "gpu-a"}]}})
        wait_for(
            "the standby re-plans",
            lambda: (s := deployed(cluster, ns, "minilm")) and s["plan"]["hash"] != first["plan"]["hash"],
        )


def test_pods_that_cannot_start_make_the_service_degraded(cluster):
    ns = "stalled"
    install_profiles(cluster, ns)
    with operator(cluster):
        cluster.create(service("minilm", ns))
        wait_for("applied", lambda: deployed(cluster, ns, "minilm"))
        mark_ready(cluster, ns, "minilm")
        wait_for("Ready", lambda: status(cluster, ns, "minilm").get("phase") == "Ready")
        name = sorted(workers(cluster, ns, "minilm"))[0]
        stalled = {
            "type": "Progressing",
            "status": "False",
            "reason": "ProgressDeadlineExceeded",
            "message": "pod x exited 3 times; last log line: error: bundle /models/minilm: no bundle.yaml",
        }
        cluster.patch("Deployment", ns, name, {"status": {"conditions": [stalled], "readyReplicas": 0}}, "status")
        st = wait_for("Degraded", lambda: (s := status(cluster, ns, "minilm")).get("phase") == "Degraded" and s)
        msg = condition(st, "Degraded")["message"]
        assert (
            name in msg
            and "no bundle.yaml" in msg
            and "/models/minilm" in msg
            and condition(st, "Degraded")["reason"] == "RolloutStalled"
        )
        events_where(
            cluster,
            ns,
            "minilm",
            lambda e: e["reason"] == "RolloutStalled" and e["type"] == "Warning",
            "a RolloutStalled Warning",
        )
        fine = {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable", "message": ""}
        cluster.patch("Deployment", ns, name, {"status": {"conditions": [fine]}}, "status")
        mark_ready(cluster, ns, "minilm")
        st = wait_for("recovered", lambda: (s := status(cluster, ns, "minilm")).get("phase") == "Ready" and s)
        assert condition(st, "Degraded")["status"] == "False"


def feedback_npz(n: int = 300, seed: int = 0) -> bytes:
    """A router's shadow-sampled feedback (GET /v1/window.npz): ramp1 is wrong on its less confident
    inputs, so thresholds of 0.5 break any small budget and re-tuning raises ramp1's."""
    import io

    import numpy as np

    rng = np.random.default_rng(seed)
    final = rng.integers(0, 2, n)
    conf = np.stack([rng.uniform(0.5, 1.0, n), np.full(n, 0.99)], axis=1).astype(np.float32)
    pred = np.stack([np.where(conf[:, 0] < 0.8, 1 - final, final), final], axis=1)
    buf = io.BytesIO()
    np.savez(buf, conf=conf, pred=pred, final=final, saving_ms=np.array([2.0, 1.0]), cost_ms=np.array([0.05, 0.05]))
    return buf.getvalue()


def test_live_tuned_thresholds_are_written_into_the_plan(cluster, observations):
    """The drift loop's re-tuning pushes thresholds to the routers and writes them into the plan
    ConfigMap (a router that restarts reads plan.json); thresholds someone else pushed to routers
    running the current plan are taken into the plan the same way. Neither is a re-plan."""
    from exitplan.worker_image.planfile import read_plan

    ns = "tuned"
    install_profiles(cluster, ns)
    observations.feedback = feedback_npz()
    observations.thresholds = {"ramp1": 0.5, "ramp3": 0.5}
    with operator(cluster):
        # The first plan has no thresholds (the operator cannot read this bundle), so it is sized without
        # exits; the live window's survival differs from that by design. Survival drift is another test's
        # subject: here it is kept quiet so that what is measured is the threshold path alone.
        quiet = {**DRIFT, "drift": {**DRIFT["drift"], "survivalError": 1.0}}
        cluster.create(service("minilm", ns, planner=quiet, accuracy={"maxDrop": 0.02}))
        first = wait_for("first plan applied", lambda: deployed(cluster, ns, "minilm"))
        built = {k: d["metadata"]["resourceVersion"] for k, d in workers(cluster, ns, "minilm").items()}
        observations.window = window(500, 500)
        publish_endpoint(cluster, ns, "minilm", observations)
        wait_for("thresholds pushed", lambda: observations.pushed)
        assert observations.refused == 0  # every read and push carried the service's control token
        pushed = observations.pushed[0]["thresholds"]
        assert pushed["ramp1"] > 0.75 and observations.pushed[0]["reason"] == "tune-accuracy"
        plan = wait_for(
            "the plan carries them", lambda: (p := plan_of(cluster, ns, "minilm")).thresholds == pushed and p
        )
        st = wait_for(
            "status follows", lambda: (s := status(cluster, ns, "minilm"))["plan"]["hash"] == plan.content_hash() and s
        )
        assert st["lastReplanReason"] == first["lastReplanReason"] and st["lastReplanTime"] == first["lastReplanTime"]
        # only the plan ConfigMap changed: the workers are built from the plan less its thresholds
        now = workers(cluster, ns, "minilm")
        assert {k: d["metadata"]["resourceVersion"] for k, d in now.items()} == built
        for dep in now.values():
            assert dep["metadata"]["annotations"][names.A_PLAN_HASH] == plan.layout_hash()
        events_where(
            cluster, ns, "minilm", lambda e: e["reason"] == "ThresholdsPersisted", "a ThresholdsPersisted event"
        )
        # What a restarted router reads: plan.json as the ConfigMap volume holds it.
        cm = cluster.get("ConfigMap", ns, "minilm-plan")
        assert cm["metadata"]["annotations"][names.A_PLAN_HASH] == plan.content_hash()
        (tmp := cluster.kubeconfig.parent / "plan.json").write_text(cm["data"]["plan.json"])
        assert read_plan(tmp).thresholds == pushed
        # Thresholds pushed by someone else to routers that run this plan: written in too, once the last
        # write is 5 periods old (live_thresholds.write_due: at most one write per service that often), and
        # up to 4 more after the service's first (live_thresholds.stagger).
        other = {"ramp1": 0.97, "ramp3": 0.93}
        observations.feedback = None
        observations.current = {
            **observations.in_progress(),
            "thresholds": other,
            "planHash": plan.content_hash(),
            "until": observations.in_progress()["until"] + 5,
        }
        wait_for("the plan carries the routers' thresholds", lambda: plan_of(cluster, ns, "minilm").thresholds == other)


def pool_replicas(cluster: ClusterThread, ns: str, name: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for dep in workers(cluster, ns, name).values():
        p = dep["metadata"]["labels"]["exitplan.io/pool"]
        out[p] = out.get(p, 0) + dep["spec"]["replicas"]
    return out


def test_gpupool_changes_replan_the_services_that_use_them(cluster):
    ns = "pools"
    install_profiles(cluster, ns)
    # Services share a pool's capacity (operator/capacity.py): gpu-a holds the 2 + 2 + 2 replicas that
    # minilm, other and marker may take of it.
    cluster.patch("GPUPool", None, "gpu-a", {"spec": {"capacity": 8}})
    with operator(cluster):
        cluster.create(service("minilm", ns, pools=[{"name": "gpu-a", "maxGpus": 2}, {"name": "gpu-b"}]))
        cluster.create(service("other", ns, pools=[{"name": "gpu-a", "maxGpus": 2}]))
        first = wait_for("planned", lambda: deployed(cluster, ns, "minilm"))
        other = wait_for("planned", lambda: deployed(cluster, ns, "other"))
        assert pool_replicas(cluster, ns, "minilm").get("gpu-b", 0) > 1
        # Capacity of gpu-b shrinks: the service on it re-plans within the new capacity.
        cluster.patch("GPUPool", None, "gpu-b", {"spec": {"capacity": 1}})
        st = wait_for(
            "re-plan after the pool change",
            lambda: (s := deployed(cluster, ns, "minilm")) and s["plan"]["hash"] != first["plan"]["hash"] and s,
        )
        assert st["lastReplanReason"] == "pool-changed"
        assert pool_replicas(cluster, ns, "minilm").get("gpu-b", 0) <= 1
        events_where(
            cluster,
            ns,
            "minilm",
            lambda e: e["reason"] == "Applied" and "(pool-changed)" in e["message"],
            "an Applied (pool-changed) event",
        )
        # The service that does not use gpu-b was left alone.
        assert status(cluster, ns, "other")["plan"] == other["plan"]
        assert "(pool-changed)" not in condition(status(cluster, ns, "other"), "Planned")["message"]
        # A change the plan does not depend on (a label) re-plans nothing.
        digest = status(cluster, ns, "minilm")["poolsDigest"]
        cluster.patch("GPUPool", None, "gpu-a", {"metadata": {"labels": {"team": "ml"}}})
        cluster.create(service("marker", ns, pools=[{"name": "gpu-a", "maxGpus": 2}]))  # an event after the label's
        wait_for("the next service planned", lambda: deployed(cluster, ns, "marker"))
        assert status(cluster, ns, "minilm")["poolsDigest"] == digest
        assert "(pool-changed)" not in condition(status(cluster, ns, "other"), "Planned")["message"]
        # A pool a service names but that did not exist: created -> the service plans.
        cluster.create(service("waiting", ns, pools=[{"name": "gpu-c"}]))
        wait_for("unknown pool", lambda: status(cluster, ns, "waiting").get("phase") == "Infeasible")
        cluster.create(pool("gpu-c", 2, 2.0))
        install_profiles_as(cluster, ns, "gpu-b", "gpu-c")
        st = wait_for("planned once the pool exists", lambda: deployed(cluster, ns, "waiting"))
        assert condition(st, "PlanInfeasible")["status"] == "False"
        # Deleted: PlanInfeasible, the children of the last plan keep serving.
        before = set(workers(cluster, ns, "waiting"))
        cluster.delete("GPUPool", None, "gpu-c")
        st = wait_for(
            "infeasible after the delete",
            lambda: (s := status(cluster, ns, "waiting")).get("phase") == "Infeasible" and s,
        )
        assert "gpu-c" in condition(st, "PlanInfeasible")["message"]
        assert set(workers(cluster, ns, "waiting")) == before


def install_profiles_as(cluster: ClusterThread, namespace: str, source: str, pool_name: str) -> None:
    """The synthetic profile of pool `source`, published for `pool_name` too."""
    from test_operator_support import load_docs

    doc = next(d for d in load_docs("profiles.yaml") if d["spec"]["pool"] == source)
    cluster.create(
        {
            **doc,
            "metadata": {"name": f"minilm-{pool_name}", "namespace": namespace},
            "spec": {**doc["spec"], "pool": pool_name},
        }
    )


def test_move_cap_moves_a_fraction_per_step_and_converges(cluster, observations):
    """maxMoveFraction 0.25: a drift re-plan moves at most a quarter of the worker replicas per
    step; the rest follows step by step (each once the previous one is rolled out; the cooldown
    does not hold the steps of a re-plan back) until the cluster runs the target."""
    from exitplan.operator import drift

    ns = "movecap"
    install_profiles(cluster, ns)
    planner = {"periodSeconds": 5, "drift": {"cooldownSeconds": 15, "maxMoveFraction": 0.25}}
    with operator(cluster):
        cluster.create(service("minilm", ns, planner=planner))
        wait_for("first plan applied", lambda: deployed(cluster, ns, "minilm"))
        mark_ready(cluster, ns, "minilm")
        seen = [plan_of(cluster, ns, "minilm")]
        observations.window = window(950, 50)
        publish_endpoint(cluster, ns, "minilm", observations)
        for _ in range(20):

            def moved() -> Plan | None:
                plan = plan_of(cluster, ns, "minilm")
                return plan if plan.content_hash() != seen[-1].content_hash() else None

            seen.append(wait_for("the next step", moved))
            total = sum(c.replicas for c in seen[-2].cells)
            assert drift.moved_replicas(seen[-2], seen[-1]) <= max(1, int(0.25 * total)), (seen[-2], seen[-1])
            st = wait_for(
                "step applied",
                lambda: (s := deployed(cluster, ns, "minilm")) and s["plan"]["hash"] == seen[-1].content_hash() and s,
            )
            if len(seen) == 2:  # the first step: the cooldown (from the initial plan) held it until now
                held = len([e for e in cluster.events(ns, "minilm") if e["reason"] == "ReplanHeld"])
            mark_ready(cluster, ns, "minilm")
            if not st.get("proposal"):
                break
            assert st["proposal"]["heldBack"].startswith("move cap") and st["proposal"]["reason"] == "length-drift"
        assert len(seen) >= 3, "the re-plan needed more than one step under the cap"
        assert held >= 1 and len([e for e in cluster.events(ns, "minilm") if e["reason"] == "ReplanHeld"]) == held
        # Every step kept the layout (a new layout would replace every worker at once: held back,
        # event LayoutHeldBack, when the planner's best plan has one).
        assert all(drift.same_layout(seen[0], p) for p in seen)
        assert not status(cluster, ns, "minilm").get("proposal")
        final = seen[-1]
        assert drift.moved_replicas(seen[0], final) > max(1, int(0.25 * sum(c.replicas for c in seen[0].cells)))
        for cell in final.cells:
            assert (
                workers(cluster, ns, "minilm")[names.worker_name("minilm", cell)]["spec"]["replicas"] == cell.replicas
            )
        assert final.length_histogram[0] > seen[0].length_histogram[0]
