"""Events as a cluster shows them: the operator's events aggregate (count + lastTimestamp) instead of
piling up, `kubectl describe ees NAME` lists them from the emulated API (it selects Events by
`involvedObject.*` field selectors), a failed container is quoted by the first line of its error,
and a plan's reason reads the same in its status, its event and its metric after an SLO patch."""

from __future__ import annotations

import asyncio
import collections
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from test_operator_status_columns import _replans
from test_operator_support import ClusterThread, condition, install_profiles, operator, pool, service, status, wait_for

from exitplan.api.termination import error_line, log_tail
from exitplan.operator.events import BURST, RECORDER, REFILL_SECONDS, EventRecorder, cut

NS = "events"


def test_the_error_line_is_the_error_not_a_header_or_progress():
    header = "--- 12:00:01 worker: exitplan worker --bundle /b"
    assert error_line(f"{header}\nloading bundle /b\nerror: bundle /b: no bundle.yaml\nexiting") == (
        "error: bundle /b: no bundle.yaml"
    )
    traceback = (
        'loading\nTraceback (most recent call last):\n  File "x.py", line 1, in <module>\n    boom()\n'
        "ValueError: the bundle has 3 blocks, the plan 4\n"
    )
    assert error_line(traceback) == "ValueError: the bundle has 3 blocks, the plan 4"
    assert error_line(f"warming up\n{header}") == "warming up"  # a header is never the error
    assert error_line("") == "" and error_line(header) == ""


def test_a_termination_message_is_the_last_runs_tail():
    log = "--- 12:00:01 c: run\nfirst run failed\n--- 12:00:03 c: run\n" + "x\n" * 100 + "error: second\n"
    tail = log_tail(log)
    assert "first run" not in tail and tail.endswith("error: second") and len(tail.splitlines()) == 80
    assert len(log_tail("y" * 5000)) == 2048


def test_long_messages_are_cut_in_the_middle():
    message = "a" * 600 + "b" * 600
    out = cut(message)
    assert len(out) == 1024 and out.startswith("a") and out.endswith("b") and "..." in out


@pytest.fixture
def cluster(tmp_path):
    with ClusterThread(tmp_path) as c:
        c.create(pool("gpu-a", 4, 3.0))
        c.create(pool("gpu-b", 6, 1.0))
        yield c


def test_repeated_events_aggregate_and_kubectl_describe_lists_them(cluster, tmp_path: Path):
    svc = cluster.create(service("agg", NS))
    for _ in range(3):
        cluster.run(RECORDER.post(cluster.client, svc, "Warning", "RolloutStalled", "pod agg-0 keeps exiting"))
    cluster.run(RECORDER.post(cluster.client, svc, "Normal", "Applied", "plan 1234 (initial)"))
    events = cluster.events(NS, "agg")
    assert sorted((e["reason"], e["count"]) for e in events) == [("Applied", 1), ("RolloutStalled", 3)]
    stalled = next(e for e in events if e["reason"] == "RolloutStalled")
    assert stalled["involvedObject"]["uid"] == svc["metadata"]["uid"] and stalled["firstTimestamp"]
    assert stalled["lastTimestamp"] >= stalled["firstTimestamp"]
    # One that went meanwhile (a server's TTL) is written again, counting from one.
    cluster.delete("Event", NS, stalled["metadata"]["name"])
    cluster.run(RECORDER.post(cluster.client, svc, "Warning", "RolloutStalled", "pod agg-0 keeps exiting"))
    assert [e["count"] for e in cluster.events(NS, "agg") if e["reason"] == "RolloutStalled"] == [1]
    cluster.run(RECORDER.post(cluster.client, svc, "Warning", "RolloutStalled", "pod agg-0 keeps exiting"))
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    described = subprocess.run(
        ["kubectl", f"--kubeconfig={cluster.kubeconfig}", f"--cache-dir={tmp_path / 'cache'}"]
        + ["describe", "ees", "agg", "-n", NS],
        capture_output=True,
        text=True,
    )
    assert described.returncode == 0, described.stderr
    events_part = described.stdout[described.stdout.index("\nEvents:") :]
    assert "<none>" not in events_part
    assert re.search(r"Warning\s+RolloutStalled\s+.*\(x2 over .*\)\s+exitplan-operator\s+pod agg-0", events_part)
    assert re.search(r"Normal\s+Applied\s+.*exitplan-operator\s+plan 1234 \(initial\)", events_part)
    listed = subprocess.run(
        ["kubectl", f"--kubeconfig={cluster.kubeconfig}", f"--cache-dir={tmp_path / 'cache'}"]
        + ["get", "events", "-n", NS],
        capture_output=True,
        text=True,
    )
    assert listed.returncode == 0, listed.stderr
    header = listed.stdout.splitlines()[0].split()
    assert header == ["LAST", "SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"], listed.stdout
    assert "earlyexitservice/agg" in listed.stdout


def test_a_recurring_normal_report_is_rate_limited_per_object_and_reason_and_warnings_never_are(cluster):
    recorder = EventRecorder()
    svc, other = cluster.create(service("chatty", NS)), cluster.create(service("quiet", NS))

    async def report(times: int) -> None:
        for i in range(times):  # each with new figures: a new Event each, as ThresholdsTuned once a period
            recorder.record(cluster.client, svc, "Normal", "ThresholdsTuned", f"re-tuned: agreement 0.99{i:02d}")
        recorder.record(cluster.client, svc, "Normal", "Applied", "plan abc (length-drift)")  # another reason
        recorder.record(cluster.client, other, "Normal", "ThresholdsTuned", "re-tuned: agreement 0.9950")
        for i in range(BURST + 5):
            recorder.record(cluster.client, svc, "Warning", "RoutersUnread", f"1 of {i + 2} router replicas answered")
        await asyncio.gather(*recorder._tasks)

    cluster.run(report(BURST + 10))
    reasons = collections.Counter(e["reason"] for e in cluster.events(NS, "chatty"))
    assert reasons == {"ThresholdsTuned": BURST, "Applied": 1, "RoutersUnread": BURST + 5}, reasons
    assert [e["reason"] for e in cluster.events(NS, "quiet")] == ["ThresholdsTuned"]
    # the bucket refills: one more every REFILL_SECONDS
    key_time = time.monotonic()
    assert not recorder.allowed(svc, "Normal", "ThresholdsTuned", now=key_time)
    assert recorder.allowed(svc, "Normal", "ThresholdsTuned", now=key_time + REFILL_SECONDS + 1)
    assert not recorder.allowed(svc, "Normal", "ThresholdsTuned", now=key_time + REFILL_SECONDS + 2)


def test_an_slo_patch_reads_spec_change_in_status_event_and_metric(cluster):
    name = "slo"
    install_profiles(cluster, NS)
    with operator(cluster):
        cluster.create(service(name, NS))
        first = wait_for("planned", lambda: (s := status(cluster, NS, name)).get("plan") and s)
        assert first["plan"]["reason"] == "initial"
        before = _replans(NS, name, "spec-change")
        latency = cluster.get("EarlyExitService", NS, name)["spec"]["slo"]["latencyMs"]
        cluster.patch("EarlyExitService", NS, name, {"spec": {"slo": {"latencyMs": latency + 1}}})

        def replanned() -> dict:
            st = status(cluster, NS, name)
            done = st.get("observedGeneration") == 2 and _replans(NS, name, "spec-change") > before
            return st if done and st.get("lastReplanReason") else {}

        st = wait_for("re-planned for the new SLO", replanned)
        assert st["plan"]["reason"] == st["lastReplanReason"] == "spec-change", st
        assert st["plan"]["hash"] == first["plan"]["hash"]  # the same workers: where the old reason stuck
        assert "(spec-change)" in condition(st, "Planned")["message"]
        applied = wait_for(
            "the Applied event of the re-plan",
            lambda: [
                e for e in cluster.events(NS, name) if e["reason"] == "Applied" and "(spec-change)" in e["message"]
            ],
        )
        assert applied[0]["message"].startswith(f"plan {st['plan']['hash']} (spec-change)")
