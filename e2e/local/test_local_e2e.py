"""Local end-to-end (DESIGN.md tier 3): `exitplan dev-cluster` + `exitplan operator` as processes,
the real MiniLM early-exit bundle, real routers and workers started by the pod runner, and the
shared Azure trace replayed open-loop through the router Service's local endpoint.

1. A ModelProfile measured here (`exitplan profile`, re-measured when the planner rejects it as
   noisy: this machine is shared) is published with `exitplan operator publish-profile`.
2. GPUPool + EarlyExitService applied with kubectl; the service must become Ready.
3. Trace with its lengths scaled into the model's range (short inputs): every request answered,
   agreement with the full model within the accuracy budget.
4. The same trace with lengths clipped (long inputs): the operator re-plans with reason
   `length-drift` while the traffic runs, within two drift periods of the first shifted request
   (asserted as a count of periods), and again no request is lost. (The SLO is loose and
   sloRisk at its maximum so that on this shared CPU machine the shift shows as length drift,
   not as `slo-risk`, which takes precedence; an earlier run with a 500 ms SLO re-planned for
   slo-risk at p99 488 ms.)

Waits poll with a hang guard (GUARD) that only stops a broken run from hanging the suite; the
measured delays go to BENCHMARKS.md, nothing here asserts a duration.
"""

from __future__ import annotations

import asyncio
import calendar
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO.parent / "shared" / "data" / "traces" / "azure-llm-inference-conv-2023.csv"
BUNDLES = Path(os.environ.get("EXITPLAN_TEST_BUNDLES", REPO / "artifacts" / "test-bundles"))
EXITPLAN = [str(Path(sys.executable).with_name("exitplan"))]
GUARD = 600.0
PERIOD = 10
BUDGET = 0.03
RPS = 8.0
PHASE_S = 4 * PERIOD

pytestmark = [pytest.mark.slow]


def _bundle() -> Path:
    """The MiniLM test bundle, shared with tests/conftest.py (same options, same cache folder)."""
    from exitplan.prepare.build import BuildOptions, tqdm_bar
    from exitplan.prepare.presets import prepare_bundle

    options = {"model": "minilm", "train_size": 2000, "heldout_size": 600}
    return prepare_bundle(BuildOptions(**options), BUNDLES / "minilm", bar=tqdm_bar(enabled=False)).path


def _wait(what: str, probe, guard: float = GUARD):
    deadline = time.monotonic() + guard
    last = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.5)
    raise AssertionError(f"never happened: {what} (last: {str(last)[:800]})")


class Proc:
    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        self.popen = subprocess.Popen(args, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                return self.popen.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
        return self.popen.wait()

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])


def measure_profile(bundle: Path, out: Path) -> bool:
    """`exitplan profile` until the planner accepts the table; True when it had to be smoothed.

    On this shared 2-core machine sub-millisecond cells (the ramps) sometimes dip by more than the
    planner tolerates as timer noise. After three rejected measurements the last one is published
    with each latency row and column made non-decreasing (running maximum) -- what the planner
    does itself for smaller dips -- and the run records that it did so."""
    from exitplan.api.resources import ModelProfileSpec
    from exitplan.planner.costmodel import validate_profile
    from exitplan.planner.errors import ProfileError

    for _ in range(3):
        proc = subprocess.run(
            [
                *EXITPLAN,
                "profile",
                str(bundle),
                "--pool",
                "local",
                "--out",
                str(out),
                "--batch-sizes",
                "1,2,4,8,16",
                "--seq-lens",
                "32,64,128",
                "--repeats",
                "9",
            ],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        doc = yaml.safe_load(out.read_text())
        try:
            validate_profile(ModelProfileSpec.model_validate(doc.get("spec", doc)))
            return False
        except ProfileError:
            continue
    spec = doc.get("spec", doc)
    for entry in spec["blocks"] + spec.get("ramps", []):
        table = np.maximum.accumulate(np.maximum.accumulate(np.asarray(entry["latencyMs"]), axis=1), axis=0)
        entry["latencyMs"] = table.round(4).tolist()
    validate_profile(ModelProfileSpec.model_validate(spec))
    out.write_text(yaml.safe_dump(doc))
    return True


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed on this machine (the test applies resources with it)")
    if not TRACE.is_file():
        pytest.skip(f"the shared Azure trace is not at {TRACE}")
    tmp = tmp_path_factory.mktemp("e2e")
    bundle = _bundle()
    kubeconfig = tmp / "kubeconfig"
    cluster = Proc(
        [*EXITPLAN, "dev-cluster", "--kubeconfig", str(kubeconfig), "--workdir", str(tmp / "work")],
        tmp / "dev-cluster.log",
    )
    _wait("the dev-cluster's kubeconfig", kubeconfig.exists, 60)
    operator = Proc(
        [
            *EXITPLAN,
            "operator",
            "--kubeconfig",
            str(kubeconfig),
            "--tick",
            "1",
            "--metrics-port",
            "0",
            "--health-port",
            "0",
            "--allow-host-path",  # the pods mount the bundle directory as a host path
            str(bundle.resolve()),
        ],
        tmp / "operator.log",
    )
    try:
        yield {"tmp": tmp, "bundle": bundle, "kubeconfig": kubeconfig, "cluster": cluster, "operator": operator}
    finally:
        rc_op = operator.stop()
        rc_cluster = cluster.stop()
        print("---- operator ----\n" + operator.tail() + "\n---- dev-cluster ----\n" + cluster.tail())
        assert rc_op == 0 and rc_cluster == 0, "graceful shutdown failed"


def publish(stack, profile: Path) -> None:
    """`exitplan operator publish-profile` of a profile file (its model and pool as the file names them)."""
    subprocess.run(
        [*EXITPLAN, "operator", "publish-profile", str(profile), "--namespace", "default", "--model", "minilm",
         "--kubeconfig", str(stack["kubeconfig"])],
        check=True,
        capture_output=True,
    )  # fmt: skip


def apply_service(stack, name: str, pool: str, capacity: int, **spec: dict) -> None:
    """A CPU GPUPool `pool` and an EarlyExitService `name` of the MiniLM bundle on it (1.5 s SLO, `spec`'s
    further fields), applied with kubectl."""
    manifest = stack["tmp"] / f"{name}.yaml"
    pool_spec = {"capacity": capacity, "gpuResource": "", "costPerHour": 1.0, "cpu": "1", "memory": "1Gi"}
    service = {
        "model": {"name": "minilm", "bundle": str(stack["bundle"])},
        "slo": {"latencyMs": 1500},
        "pools": [{"name": pool}],
        **spec,
    }
    docs = [
        {"apiVersion": "exitplan.io/v1alpha1", "kind": "GPUPool", "metadata": {"name": pool}, "spec": pool_spec},
        {
            "apiVersion": "exitplan.io/v1alpha1",
            "kind": "EarlyExitService",
            "metadata": {"name": name, "namespace": "default"},
            "spec": service,
        },
    ]
    manifest.write_text(yaml.safe_dump_all(docs))
    kubectl(stack, "apply", "--validate=false", "-f", str(manifest))


def kubectl(stack, *args: str) -> str:
    proc = subprocess.run(
        ["kubectl", f"--kubeconfig={stack['kubeconfig']}", f"--cache-dir={stack['tmp'] / 'kcache'}", *args],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def ees(stack) -> dict:
    return json.loads(kubectl(stack, "get", "ees", "minilm", "-o", "json"))


def bench(stack, url: str, mode: str, setup=None):
    from exitplan.client.bench import BenchSetup, run_bench_async

    setup = setup or BenchSetup.connect(url, "minilm", stack["bundle"])
    report = asyncio.run(run_bench_async(setup, TRACE, rps=RPS, duration=PHASE_S, length_mode=mode, timeout_s=30.0))
    return report, setup


def within_budget(report) -> bool:
    """Disagreement with the full model within the budget plus the sampling error of the distinct
    inputs the phase sent. The requests reuse held-out texts matched to the trace's lengths (phase
    1's short lengths come from a few dozen short tweets), so the sample is the distinct texts, not
    the requests, and a few dozen texts cannot pin 3 % down: on the MiniLM test bundle the
    calibrated thresholds disagree on 4 of the 301 inputs of <= 32 tokens (1.3 %), 3 of them among
    the 70 of 9-20 tokens that phase 1 draws most from, so one text more or less moves phase 1's
    figure by ~2 points. The allowance is the one-sided 95 % error of a proportion at the budget
    over the distinct texts (`autotune.sample_budget`'s, the other way); thresholds that ignored
    the budget (every input out at its first ramp) disagree far beyond it."""
    from exitplan.planner.tuning.autotune import sample_budget

    distinct = int(report.run["inputs"]["distinct_inputs"])
    allowed = BUDGET + (BUDGET - sample_budget(BUDGET, distinct))
    return report.agreement_drop is not None and report.agreement_drop <= allowed


@pytest.fixture(scope="module")
def published(stack) -> bool:
    """The MiniLM profile measured here and published for the services of this module; True when smoothed."""
    profile = stack["tmp"] / "profile.yaml"
    smoothed = measure_profile(stack["bundle"], profile)
    publish(stack, profile)
    return smoothed


def test_local_end_to_end(stack, published):
    smoothed = published
    applied = time.monotonic()
    apply_service(
        stack,
        "minilm",
        "local",
        4,
        accuracy={"maxDrop": BUDGET, "shadowFraction": 0.2},
        workload={"rps": RPS, "lengthBuckets": [32, 128]},
        planner={"periodSeconds": PERIOD, "drift": {"cooldownSeconds": 0, "maxMoveFraction": 1.0, "sloRisk": 2.0}},
    )
    _wait("the service is Ready", lambda: (ees(stack).get("status") or {}).get("phase") == "Ready")
    ready_s = time.monotonic() - applied
    port = _wait(
        "the router Service's local endpoint",
        lambda: (
            (json.loads(kubectl(stack, "get", "svc", "minilm", "-o", "json")).get("status") or {})
            .get("loadBalancer", {})
            .get("ingress")
        ),
    )[0]["ports"][0]["port"]
    url = f"http://127.0.0.1:{port}"
    head, row = kubectl(stack, "get", "ees").splitlines()[:2]
    header = head.split()
    assert header == ["NAME", "PHASE", "READY", "GOODPUT", "MEASURED", "P99-MS", "EXITS", "REASON", "AGE"]
    starts = [head.index(name) for name in header] + [None]  # MEASURED is blank before a drift window
    cells = {name: row[a:b].strip() for name, a, b in zip(header, starts, starts[1:])}
    ready, planned = cells["READY"].split("/")
    assert ready == planned and cells["REASON"] == "AllReady", cells

    # Phase 1: short inputs. Every request answered; accuracy within budget.
    short, setup = bench(stack, url, "scale")
    assert short.requests > 0 and short.lost == 0 and short.accounted == short.requests, short.to_dict()
    assert short.results > 0 and within_budget(short), short.to_dict()
    before = ees(stack)["status"]

    # Phase 2: the lengths shift long. A length-drift re-plan is applied while traffic runs.
    long, _ = bench(stack, url, "clip", setup)
    ended_at = time.time()
    shifted_at = ended_at - long.run_s  # the first shifted request (input preparation comes before it)

    def replanned_after_shift():
        st = ees(stack)["status"]
        when = calendar.timegm(time.strptime(st["lastReplanTime"], "%Y-%m-%dT%H:%M:%SZ"))
        return st if st["lastReplanReason"] == "length-drift" and when >= shifted_at - 1 else None

    after = _wait("a length-drift re-plan after the shift", replanned_after_shift, 3 * PERIOD)
    replanned_at = calendar.timegm(time.strptime(after["lastReplanTime"], "%Y-%m-%dT%H:%M:%SZ"))
    assert after["plan"]["hash"] != before["plan"]["hash"]
    assert replanned_at <= ended_at, "the re-plan must be applied while the shifted traffic runs"
    events = json.loads(kubectl(stack, "get", "events", "-o", "json"))["items"]
    scores = [
        float(e["message"].split("length score ")[1].split(" ")[0])
        for e in events
        if e.get("reason") == "Replan" and e["message"].startswith("length-drift")
    ]
    assert scores and max(scores) > 0.15, scores  # the window that triggered it
    assert after["drift"]["lengthScore"] <= 0.15 or after["drift"]["trigger"] == "length-drift"  # the new plan fits
    assert long.lost == 0 and long.accounted == long.requests, long.to_dict()
    assert long.results > 0 and within_budget(long), long.to_dict()
    import datetime as dt

    def at(e: dict) -> float:
        return dt.datetime.fromisoformat(e["firstTimestamp"].replace("Z", "+00:00")).timestamp()

    applied_after = sorted(
        round(at(e) - shifted_at, 1)
        for e in events
        if e.get("reason") == "Applied" and "(length-drift)" in e["message"] and at(e) >= shifted_at
    )
    # Within two periods: the first length-drift apply after the shift, counted in drift periods.
    assert applied_after, "no Applied (length-drift) event after the shift"
    periods = min(applied_after) / PERIOD
    assert periods <= 2, (applied_after, PERIOD)
    record = {
        "profile_smoothed": smoothed,
        "trigger_length_score": max(scores),
        "apply_to_ready_s": round(ready_s, 1),
        "shift_to_first_length_drift_apply_periods": round(periods, 2),
        "shift_to_last_replan_s": round(replanned_at - shifted_at, 1),
        "length_drift_applies_after_shift_s": applied_after,
        "period_s": PERIOD,
        "short": {
            k: short.to_dict()[k]
            for k in ("requests", "results", "lost", "error_total", "errors", "agreement_drop", "goodput_rps")
        },
        "long": {
            k: long.to_dict()[k]
            for k in ("requests", "results", "lost", "error_total", "errors", "agreement_drop", "goodput_rps")
        },
    }
    (REPO / "artifacts").mkdir(exist_ok=True)
    (REPO / "artifacts" / "e2e_local.json").write_text(json.dumps(record, indent=2))
    print(json.dumps(record, indent=2))


def test_routers_that_run_split_0_serve_on_the_dev_cluster(stack, published):
    """`planner.colocate: on`: the operator runs split 0 inside the router pods (no split-0 worker
    Deployment, the routers' args say --colocate), the service becomes Ready, and every request of a
    replayed stretch of the trace is answered (a result, or an admission refusal on a busy machine). A pool of its own (a pool's capacity is shared by the
    services that use it, and the other test's service may hold all of "local"), with the same profile."""
    doc = yaml.safe_load((stack["tmp"] / "profile.yaml").read_text())
    doc["spec"]["pool"], doc["metadata"]["name"] = "local-co", "minilm-local-co"
    (stack["tmp"] / "profile-co.yaml").write_text(yaml.safe_dump(doc))
    publish(stack, stack["tmp"] / "profile-co.yaml")
    apply_service(
        stack,
        "minilm-co",
        "local-co",
        2,
        accuracy={"maxDrop": BUDGET},
        workload={"rps": RPS, "lengthBuckets": [128]},
        router={"replicas": 1},
        planner={"colocate": "on", "maxSplits": 2},
    )

    def status():
        doc = json.loads(kubectl(stack, "get", "ees", "minilm-co", "-o", "json"))
        return doc.get("status") or {}

    _wait("the co-located service is Ready", lambda: status().get("phase") == "Ready")
    configmap = json.loads(kubectl(stack, "get", "configmap", "minilm-co-plan", "-o", "json"))
    plan = json.loads(configmap["data"]["plan.json"])
    assert plan["colocate"] is True
    deployments = json.loads(kubectl(stack, "get", "deployments", "-l", "exitplan.io/service=minilm-co", "-o", "json"))[
        "items"
    ]
    labels = [d["metadata"]["labels"] for d in deployments]
    splits = {x.get("exitplan.io/split") for x in labels if x.get("app.kubernetes.io/component") == "worker"}
    assert "0" not in splits, "no split-0 worker Deployment when the routers run split 0"
    (router,) = [d for d in deployments if d["metadata"]["labels"].get("app.kubernetes.io/component") == "router"]
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--colocate" in args
    port = _wait(
        "the co-located router Service's local endpoint",
        lambda: (
            (json.loads(kubectl(stack, "get", "svc", "minilm-co", "-o", "json")).get("status") or {})
            .get("loadBalancer", {})
            .get("ingress")
        ),
    )[0]["ports"][0]["port"]
    from exitplan.client.bench import BenchSetup, run_bench_async

    setup = BenchSetup.connect(f"http://127.0.0.1:{port}", "minilm", stack["bundle"])
    report = asyncio.run(run_bench_async(setup, TRACE, rps=RPS, duration=15.0, timeout_s=30.0))
    brief = {k: getattr(report, k) for k in ("requests", "results", "errors", "by_status", "lost", "error_samples")}
    assert report.requests > 0 and report.lost == 0 and report.accounted == report.requests, brief
    # Every request answered: with a result, or refused by the router's admission (429/503 with Retry-After:
    # no bucket could answer it within the SLO), never another error. On an idle machine all are results; on
    # one that runs other jobs (the whole suite beside two busy loops: 22 of 120 refused once) the router
    # refuses what its measured service times say it cannot serve within the SLO, as it is built to.
    assert {k for k, n in report.errors.items() if n} <= {"overload"} and report.overload_without_retry_after == 0, (
        brief
    )
    assert report.results >= report.requests / 2, brief
    kubectl(stack, "delete", "ees", "minilm-co")
