"""The operator's children of a generation service: the pure builders, then the real operator under
kopf against the emulated API server (the harness of test_operator_integration.py), with a local bundle
and with a remote one (its bundle-info Job's publish step run for real, its failure a condition)."""

from __future__ import annotations

import json
import shutil

import pytest
from generation_helpers import tiny_decoder_bundle
from test_operator_support import (
    ClusterThread,
    condition,
    events_where,
    mark_ready,
    operator,
    pool,
    status,
    wait_for,
    workers,
)
from typer.testing import CliRunner

from exitplan.api.plan import Plan
from exitplan.api.resources import EarlyExitServiceSpec, GPUPoolSpec
from exitplan.cli import app
from exitplan.operator import generation_builders, names
from exitplan.operator.bundle_volumes import BUNDLE_DIR, STORAGE_INIT
from exitplan.planner.generation import plan_generation

OWNER = {
    "apiVersion": "exitplan.io/v1alpha1",
    "kind": "EarlyExitService",
    "metadata": {"name": "gen", "namespace": "ns", "uid": "u-1"},
}


def spec(bundle: str = "/models/decoder", pools=("gpu-a", "gpu-b"), max_splits: int = 4) -> EarlyExitServiceSpec:
    return EarlyExitServiceSpec.model_validate(
        {
            "model": {"name": "tweets", "bundle": bundle, "task": "text-generation"},
            "slo": {"latencyMs": 500},
            "planner": {"maxSplits": max_splits},
            "pools": [{"name": p} for p in pools],
        }
    )


POOLS = {
    "gpu-a": GPUPoolSpec(capacity=1, cost_per_hour=3.0, node_selector={"pool": "a"}),
    "gpu-b": GPUPoolSpec(capacity=3, cost_per_hour=1.0, node_selector={"pool": "b"}),
}


def plan(stages: int) -> Plan:
    return plan_generation(
        "gen", spec(), POOLS, n_blocks=4, exit_ramps=["exit0", "exit1", "exit2"], max_context=128, stages=stages
    ).plan


def by_kind(children: list[dict], kind: str) -> dict[str, dict]:
    return {c["metadata"]["name"]: c for c in children if c["kind"] == kind}


def test_pipeline_plan_builds_one_stage_deployment_per_split_chained_by_next():
    p = plan(3)
    children = generation_builders.build_children(OWNER, spec(), p, POOLS)
    deployments = by_kind(children, "Deployment")
    stages = {n: d for n, d in deployments.items() if d["metadata"]["labels"][names.L_COMPONENT] == "worker"}
    assert set(stages) == {names.worker_name("gen", c) for c in p.cells}
    for cell in p.cells:
        dep = stages[names.worker_name("gen", cell)]
        split = p.splits[cell.split]
        container = dep["spec"]["template"]["spec"]["containers"][0]
        args = container["args"]
        assert container["command"] == ["exitplan", "generate-stage"]
        assert args[args.index("--first") + 1] == str(split.first_block) and args[args.index("--last") + 1] == str(
            split.last_block
        )
        assert args[args.index("--mode") + 1] == "pipeline" and args[args.index("--bundle") + 1] == "/models/decoder"
        if cell.split < 2:
            assert args[args.index("--next") + 1] == names.split_host("gen", "ns", cell.split + 1)
        else:
            assert "--next" not in args
        assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
        assert dep["metadata"]["labels"][names.L_SPLIT] == str(cell.split)
        assert dep["spec"]["template"]["spec"]["nodeSelector"] == dict(POOLS[cell.pool].node_selector)
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert dep["metadata"]["annotations"][names.A_PLAN_HASH] == p.layout_hash()
    assert [c.pool for c in sorted(p.cells, key=lambda c: c.split)] == ["gpu-a", "gpu-b", "gpu-b"]
    router = deployments["gen-router"]["spec"]["template"]["spec"]["containers"][0]
    assert router["command"] == ["exitplan", "router"]
    assert router["args"][router["args"].index("--peers") + 1] == names.split_host("gen", "ns", 0)
    splits = {names.split_service_name("gen", i) for i in range(3)}
    assert set(by_kind(children, "Service")) == {"gen", "gen-control"} | splits  # the router's control port too
    assert json.loads(by_kind(children, "ConfigMap")["gen-plan"]["data"]["plan.json"])["splits"][2]["lastBlock"] == 3
    assert all(c["metadata"]["ownerReferences"][0]["uid"] == "u-1" for c in children)
    # apply order: the ConfigMap, stages from the last split back, Services, the router last
    kinds = [(c["kind"], c["metadata"]["labels"].get(names.L_SPLIT)) for c in children]
    assert kinds[0][0] == "ConfigMap" and kinds[-1][0] == "Deployment" and [s for k, s in kinds[1:4]] == ["2", "1", "0"]


def test_one_split_is_a_recompute_stage_and_bad_plans_are_refused():
    children = generation_builders.build_children(OWNER, spec(), plan(1), POOLS)
    (stage,) = [
        c for c in children if c["kind"] == "Deployment" and c["metadata"]["labels"][names.L_COMPONENT] == "worker"
    ]
    args = stage["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--mode") + 1] == "recompute" and "--next" not in args
    two = plan(2)
    doubled = two.model_copy(update={"cells": [two.cells[0].model_copy(update={"replicas": 2}), two.cells[1]]})
    with pytest.raises(ValueError, match="exactly one replica"):
        generation_builders.build_children(OWNER, spec(), doubled, POOLS)
    with pytest.raises(ValueError, match="not given"):
        generation_builders.build_children(OWNER, spec(), two, {"gpu-a": POOLS["gpu-a"]})


# ------------------------------------------------------------------------------------ the operator


@pytest.fixture
def cluster(tmp_path):
    with ClusterThread(tmp_path) as c:
        c.create(pool("gpu-a", 1, 3.0))
        c.create(pool("gpu-b", 3, 1.0))
        yield c


@pytest.fixture
def bundle_copy(tmp_path):
    """The tiny decoder bundle with generation measurements for pool gpu-a (crafted so that 2 stages win)."""
    target = tmp_path / "decoder"
    shutil.copytree(tiny_decoder_bundle(), target, ignore=shutil.ignore_patterns("profiles"))
    measured = {
        "profile": {
            "block_ms": [4.0, 4.0, 4.0],
            "head_ms": {"0": 0.1, "1": 0.1, "2": 0.1},
            "decide_share": {"2": 1.0},
            "hop_ms": 0.1,
            "recompute_ratio": 1.0,
        },  # compute-bound: recomputation costs what it skipped
        "thresholds": [
            {"threshold": 0.5, "disagreement": 0.2, "decide_share": {"0": 0.8, "2": 0.2}},
            {"threshold": 0.8, "disagreement": 0.005, "decide_share": {"0": 0.5, "1": 0.1, "2": 0.4}},
            {"threshold": 1.0, "disagreement": 0.0, "decide_share": {"2": 1.0}},
        ],
    }
    (target / "profiles").mkdir()
    (target / "profiles" / "generation-gpu-a.json").write_text(json.dumps(measured))
    return target


def generation_service(name: str, ns: str, bundle, pools=("gpu-a", "gpu-b")) -> dict:
    return {
        "apiVersion": "exitplan.io/v1alpha1",
        "kind": "EarlyExitService",
        "metadata": {"name": name, "namespace": ns},
        "spec": spec(str(bundle), pools, max_splits=2).dump(),
    }


def test_operator_creates_the_stage_deployments_of_a_generation_service(cluster, bundle_copy):
    ns = "gen"
    with operator(cluster, env={"EXITPLAN_ALLOWED_HOST_PATHS": str(bundle_copy.parent)}):
        svc = cluster.create(generation_service("tweets", ns, bundle_copy))
        st = wait_for(
            "the generation service is planned and applied",
            lambda: (s := status(cluster, ns, "tweets")).get("phase") in ("Deploying", "Ready") and s,
        )
        cm = cluster.get("ConfigMap", ns, names.plan_configmap_name("tweets"))
        plan = Plan.model_validate_json(cm["data"]["plan.json"])
        assert len(plan.splits) == 2 and set(plan.thresholds.values()) == {0.8}  # the measurements were used
        stages = workers(cluster, ns, "tweets")
        assert set(stages) == {names.worker_name("tweets", c) for c in plan.cells}
        commands = {d["spec"]["template"]["spec"]["containers"][0]["command"][1] for d in stages.values()}
        assert commands == {"generate-stage"}
        router = cluster.get("Deployment", ns, "tweets-router")
        assert router["spec"]["template"]["spec"]["containers"][0]["command"] == ["exitplan", "router"]
        assert not cluster.list("Job", ns), "a generation service needs no profiling Job"
        assert "pipeline, 2 stage(s), threshold 0.8" in condition(st, "Planned")["message"]
        for obj in cluster.list("Deployment", ns, "exitplan.io/service=tweets"):
            assert obj["metadata"]["ownerReferences"][0]["uid"] == svc["metadata"]["uid"]
        mark_ready(cluster, ns, "tweets")
        st = wait_for("phase Ready", lambda: (s := status(cluster, ns, "tweets")).get("phase") == "Ready" and s)
        assert all(c["readyReplicas"] == 1 for c in st["plan"]["cells"])


def test_without_measurements_the_plan_is_one_stage_that_never_exits(cluster, bundle_copy, tmp_path):
    ns = "bare"
    with operator(cluster, env={"EXITPLAN_ALLOWED_HOST_PATHS": str(tmp_path)}):
        cluster.create(generation_service("bare", ns, bundle_copy, pools=("gpu-b",)))  # no measurements for gpu-b
        st = wait_for(
            "planned", lambda: (s := status(cluster, ns, "bare")).get("phase") in ("Deploying", "Ready") and s
        )
        assert "recompute, 1 stage(s), threshold 1.0" in condition(st, "Planned")["message"]
        (stage,) = workers(cluster, ns, "bare").values()
        args = stage["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--mode") + 1] == "recompute"
        cluster.create(generation_service("nobundle", ns, tmp_path / "missing"))
        st = wait_for(
            "an unreadable bundle becomes a condition",
            lambda: (s := status(cluster, ns, "nobundle")).get("phase") == "Infeasible" and s,
        )
        assert "no bundle.yaml here" in st["message"] and not workers(cluster, ns, "nobundle")


# ------------------------------------------------------------------ remote bundles (bundle_info.py)

SIGNED = "https://models.example.com/decoder.tar.gz?X-Amz-Signature=secret"


def run_the_jobs_publish_step(cluster: ClusterThread, job: dict, bundle) -> None:
    """What the bundle-info Job's pod does once storage-init filled BUNDLE_DIR: its publish container's
    command and args, run for real (the CLI) against the emulated API, with the bundle at `bundle`."""
    (publish,) = job["spec"]["template"]["spec"]["containers"]
    assert publish["command"] == ["exitplan", "operator", "publish-bundle-info"]
    args = [str(bundle) if a == BUNDLE_DIR else a for a in publish["args"]]
    result = CliRunner().invoke(
        app, ["operator", "publish-bundle-info", *args, "--kubeconfig", str(cluster.kubeconfig)]
    )
    assert result.exit_code == 0, result.output
    finish_job(cluster, job, "Complete")


def finish_job(cluster: ClusterThread, job: dict, kind: str, reason: str = "", message: str = "") -> None:
    """Stand in for the Job controller: the Job's final condition."""
    cond = {"type": kind, "status": "True", "lastTransitionTime": "2025-01-01T00:00:00Z"}
    cond.update({k: v for k, v in (("reason", reason), ("message", message)) if v})
    done = {"succeeded": 1} if kind == "Complete" else {"failed": 3}
    cluster.patch(
        "Job",
        job["metadata"]["namespace"],
        job["metadata"]["name"],
        {"status": {"conditions": [cond], **done}},
        "status",
    )


def bundle_info_jobs(cluster: ClusterThread, ns: str, name: str) -> list[dict]:
    jobs = cluster.list("Job", ns, f"exitplan.io/service={name},app.kubernetes.io/component=bundle-info")
    return sorted(jobs, key=lambda j: j["metadata"]["name"])


def test_a_remote_generation_bundle_is_read_by_a_job_and_planned_from_its_configmap(cluster, bundle_copy, tmp_path):
    """The Job fetches the bundle as the pods do; its publish step writes bundle.yaml and the measurements
    into a ConfigMap, and the service is planned from it exactly as from the directory (2 stages at 0.8)."""
    ns = "remote"
    env = {"EXITPLAN_ALLOWED_HOST_PATHS": str(tmp_path), "EXITPLAN_PROFILE_RETRY_SECONDS": "0.5"}
    with operator(cluster, env=env):
        body = generation_service("far", ns, "/unused")
        body["spec"]["model"].update({"bundle": SIGNED, "bundleSha256": "a" * 64})
        svc = cluster.create(body)
        job = wait_for("the bundle-info Job", lambda: bundle_info_jobs(cluster, ns, "far"))[0]
        assert job["metadata"]["name"] == "far-bundle-info"
        inits = job["spec"]["template"]["spec"]["initContainers"]
        assert [c["name"] for c in inits] == [STORAGE_INIT] and inits[0]["args"][:2] == [SIGNED, BUNDLE_DIR]
        assert job["metadata"]["ownerReferences"][0]["uid"] == svc["metadata"]["uid"]
        st = wait_for("phase Profiling", lambda: (s := status(cluster, ns, "far")).get("phase") == "Profiling" and s)
        assert condition(st, "Progressing")["reason"] == "FetchingBundleInfo" and "Job far-bundle-info" in st["message"]
        assert "secret" not in st["message"] and not cluster.list("Deployment", ns)
        run_the_jobs_publish_step(cluster, job, bundle_copy)
        cm = cluster.get("ConfigMap", ns, "far-bundle-info")
        assert set(cm["data"]) == {"bundle.yaml", "generation-gpu-a.json"}
        assert cm["metadata"]["ownerReferences"][0]["uid"] == svc["metadata"]["uid"]
        assert "exitplan.io/service" not in cm["metadata"]["labels"]  # no plan child: never pruned
        st = wait_for(
            "planned from the ConfigMap",
            lambda: (s := status(cluster, ns, "far")).get("phase") in ("Deploying", "Ready") and s,
        )
        plan = Plan.model_validate_json(
            cluster.get("ConfigMap", ns, names.plan_configmap_name("far"))["data"]["plan.json"]
        )
        assert len(plan.splits) == 2 and set(plan.thresholds.values()) == {0.8}  # the measurements were used
        stages = workers(cluster, ns, "far")
        assert set(stages) == {names.worker_name("far", c) for c in plan.cells}
        for dep in stages.values():
            pod = dep["spec"]["template"]["spec"]
            assert pod["initContainers"][-1]["name"] == STORAGE_INIT
            args = pod["containers"][0]["args"]
            assert args[args.index("--bundle") + 1] == BUNDLE_DIR
        assert cluster.get("ConfigMap", ns, "far-bundle-info"), "applying the plan keeps the bundle info"
        assert len(bundle_info_jobs(cluster, ns, "far")) == 1
        # another bundle: a new Job reads it, the plan follows what it says
        (bundle_copy / "profiles" / "generation-gpu-a.json").unlink()
        cluster.patch("EarlyExitService", ns, "far", {"spec": {"model": {"bundleSha256": "b" * 64}}})
        second = wait_for("a Job for the new source", lambda: bundle_info_jobs(cluster, ns, "far")[1:])[0]
        assert second["metadata"]["name"] == "far-bundle-info-2"
        run_the_jobs_publish_step(cluster, second, bundle_copy)
        assert set(cluster.get("ConfigMap", ns, "far-bundle-info")["data"]) == {"bundle.yaml"}  # the stale file went
        st = wait_for(
            "re-planned without measurements",
            lambda: (
                (s := status(cluster, ns, "far"))
                and "recompute, 1 stage(s), threshold 1.0" in condition(s, "Planned").get("message", "")
                and s
            ),
        )
        assert len(workers(cluster, ns, "far")) == 1


def test_a_failed_bundle_info_job_is_a_condition_with_its_message_then_retried(cluster, tmp_path):
    ns = "badsha"
    said = "container storage-init exited 1: the tarball's sha256 is 1234, not " + "a" * 64
    env = {
        "EXITPLAN_ALLOWED_HOST_PATHS": str(tmp_path),
        "EXITPLAN_PROFILE_RETRY_SECONDS": "0.5",
        "EXITPLAN_PROFILE_ATTEMPTS": "2",
    }
    with operator(cluster, env=env):  # the runner re-raises what the operator raised, at its exit
        body = generation_service("far", ns, "/unused")
        body["spec"]["model"].update({"bundle": "s3://bundles/decoder", "bundleSecret": "s3-creds"})
        cluster.create(body)
        first = wait_for("the bundle-info Job", lambda: bundle_info_jobs(cluster, ns, "far"))[0]
        assert first["spec"]["template"]["spec"]["initContainers"][0]["envFrom"] == [
            {"secretRef": {"name": "s3-creds"}}
        ]
        finish_job(
            cluster, first, "Failed", "BackoffLimitExceeded", f"Job has reached the specified backoff limit; {said}"
        )
        second = wait_for("a second attempt after the backoff", lambda: bundle_info_jobs(cluster, ns, "far")[1:])[0]
        # the operator creates the Job, then writes the status that names it: wait for that write
        failed = wait_for(
            "the ProfilingFailed condition naming the second Job",
            lambda: (
                (c := condition(status(cluster, ns, "far"), "ProfilingFailed")).get("status") == "True"
                and f"Job {second['metadata']['name']} tries again" in c["message"]
                and c
            ),
        )
        assert failed["status"] == "True" and failed["reason"] == "BundleFetchFailed"
        assert said in failed["message"] and f"Job {second['metadata']['name']} tries again" in failed["message"]
        finish_job(
            cluster, second, "Failed", "BackoffLimitExceeded", f"Job has reached the specified backoff limit; {said}"
        )
        st = wait_for(
            "phase ProfilingFailed, attempts spent",
            lambda: (
                (s := status(cluster, ns, "far")).get("phase") == "ProfilingFailed"
                and "no more attempts" in s["message"]
                and s
            ),
        )
        assert condition(st, "ProfilingFailed")["reason"] == "BundleFetchFailed" and said in st["message"]
        assert "far-bundle-info-2 failed (attempt 2 of 2)" in st["message"]
        assert condition(st, "Progressing")["status"] == "False" and not cluster.list("Deployment", ns)
        warnings = events_where(
            cluster, ns, "far", lambda e: e.get("reason") == "BundleFetchFailed", "a BundleFetchFailed event"
        )
        assert warnings and all(e["type"] == "Warning" for e in warnings)
        assert len(bundle_info_jobs(cluster, ns, "far")) == 2  # no crash loop: nothing more is started
