"""What `kubectl get ees` shows and what the status says about a plan: READY (worker replicas ready /
planned), the planned and the measured goodput, REASON (the phase's condition reason), numbers
rounded to what a person reads, and one reason per plan in its events, its conditions and its status.

The pure parts (status.py) are checked directly; the rest with the real operator under kopf against
the emulated API server (tests/test_operator_support.py), and `kubectl get` where kubectl is.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_operator_support import (
    ClusterThread,
    condition,
    install_profiles,
    load_docs,
    mark_ready,
    operator,
    pool,
    service,
    status,
    wait_for,
)

from exitplan.api.plan import Cell, Plan, Prediction, SplitPlan
from exitplan.operator import crdgen
from exitplan.operator.status import (
    Condition,
    DriftReport,
    Phase,
    ServiceStatus,
    parse_status,
    set_condition,
    summarize,
    with_columns,
)


def _plan(goodput: float = 172393.1521609003) -> Plan:
    return Plan(
        service="minilm",
        model="minilm",
        splits=[SplitPlan(index=0, first_block=0, last_block=5)],
        buckets=[32, 128],
        cells=[
            Cell(split=0, bucket=32, pool="gpu-a", replicas=3, batch_size=8),
            Cell(split=0, bucket=128, pool="gpu-b", replicas=1, batch_size=4),
        ],
        prediction=Prediction(goodput_rps=goodput, p99_ms=43.21987654, cost_per_hour=4.123456789),
    )


def test_status_numbers_are_rounded_as_they_enter_the_status() -> None:
    summary = summarize(_plan())
    dumped = summary.model_dump(by_alias=True, mode="json")
    assert (dumped["goodputRps"], dumped["p99Ms"], dumped["costPerHour"]) == (172393.2, 43.22, 4.123)
    drift = DriftReport(
        length_score=0.123456789, survival_error=0.0000449, p99_ms=51.239, goodput_rps=99.96, goodput_ratio=0.45678
    )
    assert drift.model_dump(by_alias=True) | {"observedAt": ""} == {
        "observedAt": "",
        "lengthScore": 0.1235,
        "survivalError": 0.0,
        "p99Ms": 51.24,
        "requests": 0,
        "windowStart": "",
        "windowEnd": "",
        "goodputRps": 100.0,
        "goodputRatio": 0.46,
        "trigger": "",
        "routers": "",
    }
    # what is stored parses back to the same status (a write that changes nothing stays a no-op)
    status = ServiceStatus(plan=summary, drift=drift)
    assert parse_status(status.model_dump(by_alias=True, mode="json")) == status


def test_exits_name_the_ramps_or_say_there_are_none() -> None:
    """A bundle without an exit ramp is served as the plain model: kubectl's EXITS says so."""
    assert [summarize(_plan(), ramps=n).exits for n in (0, 1, 2, None)] == ["no exits", "1 ramp", "2 ramps", ""]


def _conditions(*entries: tuple[str, bool, str]) -> list[Condition]:
    out: list[Condition] = []
    for kind, value, reason in entries:
        out = set_condition(out, kind, value, reason, "", 1)
    return out


def test_ready_and_reason_follow_the_plan_and_the_conditions() -> None:
    summary = summarize(_plan(), {(0, 32, "gpu-a"): 2, (0, 128, "gpu-b"): 1})
    rolling = ServiceStatus(
        phase=Phase.deploying,
        plan=summary,
        conditions=_conditions(
            ("Planned", True, "Planned"), ("Ready", False, "Waiting"), ("Progressing", True, "Rollout")
        ),
    )
    assert (with_columns(rolling).ready, rolling.reason) == ("3/4", "Rollout")
    rolling.phase = Phase.ready
    rolling.conditions = set_condition(rolling.conditions, "Ready", True, "AllReady", "", 1)
    assert with_columns(rolling).reason == "AllReady"
    refused = ServiceStatus(phase=Phase.infeasible, conditions=_conditions(("PlanInfeasible", True, "PoolCapacity")))
    assert (with_columns(refused).ready, refused.reason) == ("", "PoolCapacity")
    waiting = ServiceStatus(phase=Phase.profiling, conditions=_conditions(("Progressing", True, "ProfileMissing")))
    assert with_columns(waiting).reason == "ProfileMissing"
    advisory = ServiceStatus(phase=Phase.advisory, plan=summary, conditions=_conditions(("Planned", True, "Advisory")))
    assert (with_columns(advisory).ready, advisory.reason) == ("", "Advisory")  # nothing of it runs
    assert (with_columns(ServiceStatus()).ready, ServiceStatus().reason) == ("", "")


def _schema_has(schema: dict, json_path: str) -> bool:
    node = schema
    for part in json_path.strip(".").split("."):
        node = (node.get("properties") or {}).get(part)
        if node is None:
            return False
    return True


@pytest.mark.parametrize("kind", sorted(crdgen.KINDS))
def test_every_printer_column_reads_a_field_the_schema_has(kind: str) -> None:
    crd = crdgen.build_crd(kind)
    (version,) = crd["spec"]["versions"]
    schema = version["schema"]["openAPIV3Schema"]
    for column in version["additionalPrinterColumns"]:
        if column["jsonPath"] != ".metadata.creationTimestamp":
            assert _schema_has(schema, column["jsonPath"]), f"{kind} column {column['name']}: {column['jsonPath']}"
    assert not _schema_has(schema, ".status.nothing")  # the check can fail


def _replans(namespace: str, name: str, reason: str) -> float:
    from exitplan.operator.metrics import METRICS

    wanted = {"namespace": namespace, "service": name, "reason": reason}
    for metric in METRICS.replans.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and sample.labels == wanted:
                return sample.value
    return 0.0


def _kubectl(cluster: ClusterThread, tmp: Path, *args: str) -> list[list[str]]:
    proc = subprocess.run(
        ["kubectl", f"--kubeconfig={cluster.kubeconfig}", f"--cache-dir={tmp / 'cache'}", *args],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = lines[0].split()
    starts = [lines[0].index(name) for name in header] + [None]  # a cell may hold a space ("no exits")
    return [header] + [[line[a:b].strip() for a, b in zip(starts, starts[1:])] for line in lines[1:]]


def ramps(cluster: ClusterThread, ns: str) -> str:
    """What EXITS should read: the ramps of the service's profiles."""
    (count,) = {len(p["spec"]["ramps"]) for p in cluster.list("ModelProfile", ns)}
    assert count > 1, "the test's profiles have ramps"
    return f"{count} ramps"


def test_one_reason_per_plan_and_the_kubectl_columns(tmp_path: Path) -> None:
    ns, name = "columns", "minilm"
    with ClusterThread(tmp_path) as cluster:
        cluster.create(pool("gpu-a", 4, 3.0))
        cluster.create(pool("gpu-b", 6, 1.0))
        install_profiles(cluster, ns)
        with operator(cluster):
            cluster.create(service(name, ns))
            first = wait_for("planned and applied", lambda: (s := status(cluster, ns, name)).get("plan") and s)
            assert first["plan"]["reason"] == first["lastReplanReason"] == "initial"
            # A ModelProfile event re-plans with reason profile-change and finds the same plan: the
            # plan keeps its own reason in every place that names it.
            profile = load_docs("profiles.yaml")[0]["metadata"]["name"]
            for touch in ("1", "2"):  # the second re-plan starts only after the first one wrote its status
                cluster.patch("ModelProfile", ns, profile, {"metadata": {"labels": {"touch": touch}}})
                wait_for(f"re-plan {touch}", lambda n=int(touch): _replans(ns, name, "profile-change") >= n)
            st = status(cluster, ns, name)
            assert st["plan"]["hash"] == first["plan"]["hash"]
            reasons = {st["plan"]["reason"], st["lastReplanReason"]}
            reasons |= set(re.findall(r"\(([a-z-]+)\)", condition(st, "Planned")["message"]))
            for event in cluster.events(ns, name):
                if event["reason"] == "Applied":
                    reasons |= set(re.findall(r"plan [0-9a-f]+ \(([a-z-]+)\)", event["message"]))
            assert reasons == {"initial"}, (reasons, condition(st, "Planned"), cluster.events(ns, name))
            # READY and REASON: before and after the Deployments report ready
            planned = sum(c["replicas"] for c in st["plan"]["cells"])
            assert (st["ready"], st["reason"]) == (f"0/{planned}", "Rollout")
            assert re.fullmatch(r"\d+(\.\d)?", str(st["plan"]["goodputRps"]))
            mark_ready(cluster, ns, name)
            st = wait_for("ready", lambda: (s := status(cluster, ns, name)).get("phase") == "Ready" and s)
            assert (st["ready"], st["reason"]) == (f"{planned}/{planned}", "AllReady")
            if shutil.which("kubectl") is not None:
                cluster.patch("EarlyExitService", ns, name, {"status": {"drift": {"goodputRps": 181.5}}}, "status")
                header, row = _kubectl(cluster, tmp_path, "get", "ees", "-n", ns)
                assert header == ["NAME", "PHASE", "READY", "GOODPUT", "MEASURED", "P99-MS", "EXITS", "REASON", "AGE"]
                cells = dict(zip(header, row))
                assert (cells["READY"], cells["MEASURED"], cells["REASON"]) == (
                    f"{planned}/{planned}",
                    "181.5",
                    "AllReady",
                )
                assert cells["GOODPUT"] == str(st["plan"]["goodputRps"])
                assert cells["EXITS"] == st["plan"]["exits"] == ramps(cluster, ns)
                wide = _kubectl(cluster, tmp_path, "get", "ees", "-n", ns, "-o", "wide")[0]
                assert {"SPLITS", "COST/H"} <= set(wide)
