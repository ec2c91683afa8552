"""The operator's guard rails, against the emulated API server with the operator under kopf in this
process (test_operator_support), and the dev-cluster's pod runner where a Job has to really run:

- bundle host paths: only under the prefixes the operator allows (normalised; `..` cannot escape);
  a refused path is a condition and one Warning event, never a Deployment or a retry loop;
- pool capacity is shared: services never hold more replicas on a GPUPool than its capacity, one
  that does not fit is PlanInfeasible (PoolCapacity) with the numbers, and plans once room frees;
- spec.planner.maxReplicas caps what a huge pool would otherwise give one service;
- a failing profiling Job ends in ProfilingFailed (its reason and output) after a bounded number of
  Jobs with backoff and Warning events; a spec change tries again.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import click
import pytest
import typer
import yaml
from test_chart_support import ROOT, operator_pod, render
from test_operator_support import (
    ClusterThread,
    condition,
    install_profiles,
    load_docs,
    operator,
    pool,
    service,
    status,
    wait_for,
    workers,
)

from exitplan.api.resources import EarlyExitServiceSpec, GPUPoolSpec, ModelProfileSpec
from exitplan.operator import builders, capacity, crdgen, drift, guards, names, profiling
from exitplan.worker_image import device


@pytest.fixture
def cluster(tmp_path):
    with ClusterThread(tmp_path) as c:
        c.create(pool("gpu-a", 4, 3.0))
        c.create(pool("gpu-b", 6, 1.0))
        yield c


def spec_of(bundle: str) -> EarlyExitServiceSpec:
    return EarlyExitServiceSpec.model_validate(service("s", "ns", model={"name": "m", "bundle": bundle})["spec"])


def infeasible(cluster: ClusterThread, ns: str, name: str, reason: str) -> dict:
    st = status(cluster, ns, name)
    cond = condition(st, "PlanInfeasible")
    return st if cond.get("status") == "True" and cond.get("reason") == reason else {}


def deployed(cluster: ClusterThread, ns: str, name: str) -> dict:
    st = status(cluster, ns, name)
    return st if st.get("plan") and st.get("phase") in ("Deploying", "Ready") else {}


def warnings(cluster: ClusterThread, ns: str, name: str, reason: str) -> list[dict]:
    return [e for e in cluster.events(ns, name) if e["type"] == "Warning" and e["reason"] == reason]


def one_warning(cluster: ClusterThread, ns: str, name: str, reason: str) -> dict:
    """The one Warning of `reason` on the service: events are posted in the background, after the status
    that reports the same thing, so a test that has seen the status waits for the event."""
    (event,) = wait_for(f"a {reason} Warning on {ns}/{name}", lambda: warnings(cluster, ns, name, reason))
    return event


# ------------------------------------------------------------------ bundle host paths


@pytest.mark.parametrize(
    "bundle, allowed, verdict",
    [
        ("/etc", (), "refused"),
        ("/opt/b/minilm", ("/opt/b",), "allowed"),
        ("/opt/b", ("/opt/b/",), "allowed"),
        ("/opt/b/../../etc", ("/opt/b",), "refused"),
        ("/opt/b/x/../../b/./m", ("/opt/b",), "allowed"),
        ("file:///opt/b/../etc", ("/opt/b",), "refused"),
        ("//opt//b//m", ("/opt/b",), "allowed"),
        ("/opt/bx/m", ("/opt/b",), "refused"),
        ("/var/lib/kubelet", ("/",), "allowed"),
        ("models/minilm", ("/",), "relative"),
        ("file://models/minilm", ("/",), "relative"),
        ("s3://bucket/minilm", (), "not a host path"),
    ],
)
def test_host_path_policy_normalises_and_matches_whole_components(bundle, allowed, verdict):
    settings = guards.Settings(allowed_host_paths=tuple(names.normalize_host_path(p) for p in allowed))
    spec = spec_of(bundle)
    refusal = guards.bundle_refusal(spec, settings)
    assert (refusal is not None) == (verdict in ("refused", "relative")), refusal
    assert (guards.host_path(spec) is None) == (verdict in ("not a host path", "relative"))
    if verdict == "refused":
        assert names.bundle_path(bundle) in refusal and "operator.allowedHostPathPrefixes" in refusal
    if verdict == "relative":  # even where every host path is allowed: no pod can resolve it
        assert f"spec.model.bundle {bundle} is a relative path" in refusal
        assert "absolute path" in refusal and "exitplan apply" in refusal


def test_a_relative_bundle_path_is_refused_naming_the_field_and_the_fix(cluster):
    ns = "relative"
    install_profiles(cluster, ns)
    with operator(cluster):  # allows /models
        cluster.create(service("rel", ns, model={"name": "minilm", "bundle": "artifacts/bundles/minilm"}))
        st = wait_for("the relative path refused", lambda: infeasible(cluster, ns, "rel", guards.REFUSED))
        message = condition(st, "PlanInfeasible")["message"]
        assert message.startswith("spec.model.bundle artifacts/bundles/minilm is a relative path")
        assert "absolute path under an allowed prefix (['/models'])" in message and "exitplan apply" in message
        event = one_warning(cluster, ns, "rel", guards.REFUSED)
        assert event["message"] == message
        for kind in ("Deployment", "ConfigMap", "Job", "Service"):
            assert cluster.list(kind, ns, "exitplan.io/service=rel") == []
        cluster.patch("EarlyExitService", ns, "rel", {"spec": {"model": {"bundle": "/models/minilm"}}})
        wait_for("planned once the path is absolute and allowed", lambda: deployed(cluster, ns, "rel"))


def test_settings_come_from_the_env_the_operator_command_sets():
    settings = guards.Settings.from_env(
        {
            guards.ENV_ALLOWED: "/srv/bundles/, /mnt//shared:relative,/srv/bundles",
            guards.ENV_NAMESPACES: "team-a,team-b",
            guards.ENV_PROFILE_ATTEMPTS: "2",
            guards.ENV_PROFILE_RETRY: "5",
            guards.ENV_DRIFT_READS: "4",
        }
    )
    assert settings.drift_reads == 4
    assert guards.Settings().drift_reads == drift.CHECKS_PER_PERIOD == 2  # the default: two reads a period
    for given, kept in (("0", 1), ("99", drift.MAX_CHECKS_PER_PERIOD)):  # bounded as `--drift-reads` bounds it
        assert guards.Settings.from_env({guards.ENV_DRIFT_READS: given}).drift_reads == kept
    assert settings.allowed_host_paths == ("/srv/bundles", "/mnt/shared")  # normalised, deduplicated, absolute only
    assert settings.namespaces == ("team-a", "team-b")
    assert [settings.retry_delay(n) for n in (1, 2, 3)] == [5.0, 10.0, 20.0]
    assert guards.Settings.from_env({}) == guards.Settings()  # nothing allowed by default


def test_refused_host_paths_become_a_condition_and_one_event_and_nothing_runs(cluster):
    ns = "paths"
    install_profiles(cluster, ns)
    with operator(cluster):  # allows /models (test_operator_support.ALLOWED_HOST_PATHS)
        for name, bundle in (("etc", "/etc"), ("escape", "/models/../etc"), ("sibling", "/modelsx/minilm")):
            cluster.create(service(name, ns, model={"name": "minilm", "bundle": bundle}))
        allowed = {"name": "minilm", "bundle": "/models/x/../minilm"}
        cluster.create(service("fine", ns, model=allowed, pools=[{"name": "gpu-a"}]))  # leaves gpu-b to "etc"
        for name, shown in (("etc", "/etc"), ("escape", "(that is /etc)"), ("sibling", "/modelsx/minilm")):
            st = wait_for(f"{name} refused", lambda n=name: infeasible(cluster, ns, n, guards.REFUSED))
            message = condition(st, "PlanInfeasible")["message"]
            assert shown in message and "['/models']" in message and "--allow-host-path" in message
            assert st["phase"] == "Infeasible"
        # The allowed one is planned and mounts the normalised path.
        wait_for("the allowed bundle is deployed", lambda: deployed(cluster, ns, "fine"))
        for dep in workers(cluster, ns, "fine").values():
            volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
            assert volumes["bundle"]["hostPath"]["path"] == "/models/minilm"
        # Refused: no child at all, one Warning naming the path, no kopf retries.
        for name in ("etc", "escape", "sibling"):
            for kind in ("Deployment", "ConfigMap", "Job", "Service"):
                assert cluster.list(kind, ns, f"exitplan.io/service={name}") == []
            event = one_warning(cluster, ns, name, guards.REFUSED)
            assert "/etc" in event["message"] or "/modelsx/minilm" in event["message"]
            annotations = cluster.get("EarlyExitService", ns, name)["metadata"].get("annotations", {})
            assert not any("retry" in v for v in annotations.values() if isinstance(v, str))
        # Fixing the spec plans the service.
        cluster.patch("EarlyExitService", ns, "etc", {"spec": {"model": {"bundle": "/models/minilm"}}})
        st = wait_for("planned once the bundle is allowed", lambda: deployed(cluster, ns, "etc"))
        assert condition(st, "PlanInfeasible")["status"] == "False"


def test_the_operator_setting_decides_which_prefixes_are_allowed(cluster):
    ns = "prefix"
    install_profiles(cluster, ns)
    with operator(cluster, env={guards.ENV_ALLOWED: "/srv/bundles"}):
        cluster.create(service("srv", ns, model={"name": "minilm", "bundle": "/srv/bundles/minilm"}))
        cluster.create(service("models", ns))  # /models/minilm: allowed by default in these tests, not here
        wait_for("the bundle under the allowed prefix is deployed", lambda: deployed(cluster, ns, "srv"))
        st = wait_for("the other prefix is refused", lambda: infeasible(cluster, ns, "models", guards.REFUSED))
        assert "/models/minilm" in st["message"] and "['/srv/bundles']" in st["message"]
        assert workers(cluster, ns, "models") == {}


def test_chart_value_passes_the_allowed_prefixes_to_the_operator_command():
    def parsed(values: dict) -> dict:
        from exitplan.cli import app

        args = [a.replace("$(POD_INDEX)", "0") for a in operator_pod(render(values))["spec"]["containers"][0]["args"]]
        root = typer.main.get_command(app)
        ctx = click.Context(root, info_name="exitplan")
        cmd = root.get_command(ctx, args[0])
        return cmd.make_context(args[0], list(args[1:]), parent=ctx).params

    assert parsed({})["allow_host_path"] == []  # none by default
    assert parsed({})["drift_reads"] == drift.CHECKS_PER_PERIOD  # the chart's default is the operator's
    assert parsed({"operator": {"driftReadsPerPeriod": 4}})["drift_reads"] == 4
    prefixes = ["/var/lib/exitplan/bundles", "/mnt/models"]
    assert parsed({"operator": {"allowedHostPathPrefixes": prefixes}})["allow_host_path"] == prefixes
    # The kind end-to-end allows the directory its service's bundle is mounted from.
    e2e = yaml.safe_load((ROOT / "e2e" / "cluster" / "values.yaml").read_text())
    allowed = parsed(e2e)["allow_host_path"]
    svc = yaml.safe_load((ROOT / "e2e" / "cluster" / "manifests" / "service.yaml").read_text())
    spec = EarlyExitServiceSpec.model_validate(svc["spec"])
    assert guards.bundle_refusal(spec, guards.Settings(allowed_host_paths=tuple(allowed))) is None
    assert guards.bundle_refusal(spec, guards.Settings()) is not None


# ------------------------------------------------------------------ pool capacity and maxReplicas


def publish_profile_as(cluster: ClusterThread, namespace: str, pool_name: str, source: str = "gpu-b") -> None:
    """The synthetic profile of pool `source`, published for `pool_name`."""
    doc = next(d for d in load_docs("profiles.yaml") if d["spec"]["pool"] == source)
    body = {"name": f"minilm-{pool_name}", "namespace": namespace}
    cluster.create({**doc, "metadata": body, "spec": {**doc["spec"], "pool": pool_name}})


def held_on(cluster: ClusterThread, pool_name: str) -> dict[str, int]:
    """Worker replicas per service on a pool, from the Deployments (what would run)."""
    out: dict[str, int] = {}
    for dep in cluster.list("Deployment", None, f"exitplan.io/pool={pool_name}"):
        who = dep["metadata"]["labels"]["exitplan.io/service"]
        out[who] = out.get(who, 0) + dep["spec"]["replicas"]
    return out


def test_services_on_one_pool_never_exceed_its_capacity(cluster):
    ns = "cap"
    cluster.create(pool("shared", 3, 1.0))
    publish_profile_as(cluster, ns, "shared")
    one_bucket = {"rps": 200, "lengthBuckets": [128]}
    on_shared = {"pools": [{"name": "shared"}], "workload": one_bucket}
    with operator(cluster):
        small = {"objective": "min-cost"}
        cluster.create(service("small", ns, planner=small, **{**on_shared, "workload": {**one_bucket, "rps": 10}}))
        wait_for("the small service planned", lambda: deployed(cluster, ns, "small"))
        assert held_on(cluster, "shared") == {"small": 1}
        # Two max-goodput services at once: the first to plan takes what is left, the other does not fit.
        cluster.create(service("big", ns, **on_shared))
        cluster.create(service("late", ns, **on_shared))
        wait_for(
            "one planned, one refused for capacity",
            lambda: (
                sorted(bool(infeasible(cluster, ns, n, capacity.REASON)) for n in ("big", "late")) == [False, True]
                and any(deployed(cluster, ns, n) for n in ("big", "late"))
            ),
        )
        first, second = ("big", "late") if deployed(cluster, ns, "big") else ("late", "big")
        assert held_on(cluster, "shared") == {"small": 1, first: 2}  # max-goodput filled exactly what was left
        st = infeasible(cluster, ns, second, capacity.REASON)
        message = condition(st, "PlanInfeasible")["message"]
        for part in ("pool shared: capacity 3", "held by other services 3", f"{ns}/small: 1", f"{ns}/{first}: 2"):
            assert part in message, message
        assert "left 0" in message and "needs 1 replica(s) (shared: 1) for 200 req/s" in message
        assert workers(cluster, ns, second) == {}
        event = one_warning(cluster, ns, second, capacity.REASON)
        assert event["message"] == message
        # Room frees when the first goes: the second plans into it (its timer looks again).
        cluster.delete("EarlyExitService", ns, first)
        wait_for("the refused service plans once capacity frees", lambda: deployed(cluster, ns, second))
        wait_for("the deleted service's workers are gone", lambda: first not in held_on(cluster, "shared"))
        assert held_on(cluster, "shared") == {"small": 1, second: 2}
        assert len(warnings(cluster, ns, second, capacity.REASON)) == 1  # the re-checks posted nothing new


def test_a_pool_without_capacity_is_reported_at_once_without_a_profiling_job(cluster):
    ns = "empty"
    cluster.create(pool("empty", 0, 1.0))
    with operator(cluster):
        cluster.create(service("nothing", ns, pools=[{"name": "empty"}]))
        cluster.create(service("capped", ns, pools=[{"name": "gpu-a", "maxGpus": 0}]))
        for name, why in (("nothing", "(empty: capacity 0)"), ("capped", "(gpu-a: capacity 4, spec.pools maxGpus 0)")):
            st = wait_for(f"{name} refused for capacity", lambda n=name: infeasible(cluster, ns, n, capacity.REASON))
            message = condition(st, "PlanInfeasible")["message"]
            assert why in message and "no profiling Job runs" in message and "spec.capacity" in message, message
            assert st["phase"] == "Infeasible" and not st.get("waitingForProfiles")
            event = one_warning(cluster, ns, name, capacity.REASON)
            assert event["message"] == message
        assert cluster.list("Job", ns) == []  # no ModelProfile exists, and still no Job measures the pools
        # Capacity added: the service goes on to profile its pool.
        cluster.patch("GPUPool", None, "empty", {"spec": {"capacity": 2}})
        wait_for("a profiling Job once the pool has capacity", lambda: cluster.list("Job", ns))
        assert condition(status(cluster, ns, "nothing"), "PlanInfeasible")["status"] == "False"


def test_max_replicas_caps_what_a_huge_pool_would_give(cluster):
    ns = "huge"
    cluster.create(pool("huge", 100000, 1.0))
    publish_profile_as(cluster, ns, "huge")
    ten = {"pools": [{"name": "huge"}], "workload": {"rps": 10, "lengthBuckets": [32, 128]}}
    with operator(cluster):
        cluster.create(service("capped", ns, planner={"maxReplicas": 5}, **ten))
        cluster.create(service("default", ns, **ten))
        for name, cap in (("capped", 5), ("default", 64)):
            st = wait_for(f"{name} planned", lambda n=name: deployed(cluster, ns, n))
            assert st["plan"]["replicas"] == cap  # max-goodput spends up to the cap, not the pool's 100000
            assert sum(d["spec"]["replicas"] for d in workers(cluster, ns, name).values()) == cap
    crd = crdgen.build_crd("EarlyExitService")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    planner = crd["properties"]["spec"]["properties"]["planner"]["properties"]
    assert planner["maxReplicas"]["default"] == 64 and "100000-replica" in planner["maxReplicas"]["description"]


def test_max_replicas_caps_the_planner_across_pools_and_replans():
    from exitplan.api.observations import Observations
    from exitplan.planner import plan_service

    profiles = {
        name: ModelProfileSpec.model_validate({**d["spec"], "pool": name})
        for name, d in zip(("p", "q"), [load_docs("profiles.yaml")[0]] * 2)
    }
    pools = {name: GPUPoolSpec(capacity=100000, cost_per_hour=1.0) for name in profiles}
    body = service("s", "ns", pools=[{"name": "p"}, {"name": "q"}], planner={"maxReplicas": 7})["spec"]
    spec = EarlyExitServiceSpec.model_validate(body)
    first = plan_service("s", spec, pools, profiles)
    assert sum(c.replicas for c in first.plan.cells) == 7
    window = Observations(
        service="s",
        model="minilm",
        since=0,
        until=60,
        requests=100,
        length_buckets=[32, 128],
        length_histogram=[90, 10],
    )
    again = plan_service("s", spec, pools, profiles, observations=window, previous=first.plan, reason="length-drift")
    assert sum(c.replicas for c in again.plan.cells) <= 7


# ------------------------------------------------------------------ a failing profiling Job


@pytest.fixture
def pod_runner(cluster, tmp_path):
    """The dev-cluster's pod runner on the cluster's loop: it runs Jobs as local processes."""
    from exitplan.devcluster.pods import PodRunner

    async def make() -> tuple[PodRunner, asyncio.Event]:
        return PodRunner(cluster.client, tmp_path / "work", cluster.kubeconfig), asyncio.Event()

    runner, stop = cluster.run(make())
    task = asyncio.run_coroutine_threadsafe(runner.run(stop), cluster.loop)
    yield runner
    cluster.loop.call_soon_threadsafe(stop.set)
    task.result(timeout=60)


def jobs_of(cluster: ClusterThread, ns: str, name: str) -> list[dict]:
    return cluster.list("Job", ns, f"exitplan.io/service={name},app.kubernetes.io/component=profiler")


def test_a_failing_profiling_job_ends_in_profiling_failed_after_bounded_attempts(cluster, pod_runner, tmp_path):
    ns = "profail"
    bundle = tmp_path / "bundles" / "empty"  # a directory without bundle.yaml: `exitplan profile` fails on it
    bundle.mkdir(parents=True)
    settings = {guards.ENV_ALLOWED: str(tmp_path / "bundles"), guards.ENV_PROFILE_ATTEMPTS: "2"}
    settings[guards.ENV_PROFILE_RETRY] = "1"
    cluster.create(pool("cpu-b", 6, 1.0, gpu=""))  # a GPU pool's Job would refuse this machine's CPU first
    with operator(cluster, env=settings):
        cluster.create(
            service("broken", ns, model={"name": "minilm", "bundle": str(bundle)}, pools=[{"name": "cpu-b"}])
        )
        st = wait_for(
            "ProfilingFailed after the second Job",
            lambda: (
                (s := status(cluster, ns, "broken")).get("phase") == "ProfilingFailed"
                and "no more attempts" in s.get("message", "")
                and s
            ),
        )
        cond = condition(st, profiling.CONDITION)
        assert cond["status"] == "True" and cond["reason"] == "BackoffLimitExceeded"
        # the Job's failure and what the failed step said (its log's tail)
        assert "container profile exited 2" in cond["message"] and "no bundle.yaml here" in cond["message"]
        assert condition(st, "Progressing")["status"] == "False" and st["profileAttempts"] == {"cpu-b": 2}
        jobs = jobs_of(cluster, ns, "broken")
        assert len(jobs) == 2 and all(profiling.failed(j) for j in jobs)
        assert all(j["spec"]["backoffLimit"] == 2 and j["status"]["failed"] == 3 for j in jobs)  # 3 pods each
        failed_events = wait_for(  # one per failed Job (posted in the background)
            "two failed-profiling Warnings",
            lambda: w if len(w := warnings(cluster, ns, "broken", profiling.CONDITION)) >= 2 else None,
        )
        assert len(failed_events) == 2
        assert sorted("attempt 1 of 2" in e["message"] for e in failed_events) == [False, True]
        assert any("no more attempts" in e["message"] for e in failed_events)
        assert len(warnings(cluster, ns, "broken", "ProfilingRetry")) == 1
        # Bounded: give an operator that retried forever several backoff periods (not a timing assertion).
        time.sleep(6 * float(settings[guards.ENV_PROFILE_RETRY]))
        assert len(jobs_of(cluster, ns, "broken")) == 2
        assert len(warnings(cluster, ns, "broken", profiling.CONDITION)) == 2
        assert status(cluster, ns, "broken")["phase"] == "ProfilingFailed"
        # A spec change (a new generation) tries again, with a fresh count.
        cluster.patch("EarlyExitService", ns, "broken", {"spec": {"workload": {"rps": 100}}})
        third = wait_for(
            "a new Job for the new generation",
            lambda: [
                j for j in jobs_of(cluster, ns, "broken") if j["metadata"]["annotations"][profiling.A_GENERATION] == "2"
            ],
        )
        assert [j["metadata"]["name"] for j in third] == [builders.profile_job_name("broken", "cpu-b", 2)]
        assert not Path(bundle / "bundle.yaml").exists()


@pytest.mark.skipif(device.DRIVER_NODE.exists(), reason="this machine has an NVIDIA driver: the refusal needs none")
def test_a_profiling_job_on_a_gpu_pool_without_a_gpu_says_provider_unavailable(cluster, pod_runner, digits_bundle):
    """The profiling Job of a pool with a gpuResource runs `exitplan profile --device gpu`: on a node that
    cannot run the CUDA provider it refuses to measure the CPU in its place, and ProfilingFailed's reason
    says ProviderUnavailable with the cause."""
    ns = "profgpu"
    settings = {guards.ENV_ALLOWED: str(digits_bundle.parent), guards.ENV_PROFILE_ATTEMPTS: "1"}
    with operator(cluster, env=settings):
        cluster.create(
            service(
                "gpuless", ns, model={"name": "digits-cnn", "bundle": str(digits_bundle)}, pools=[{"name": "gpu-b"}]
            )
        )
        st = wait_for(
            "ProfilingFailed from the refusing Job",
            lambda: (s := status(cluster, ns, "gpuless")).get("phase") == "ProfilingFailed" and s,
        )
        cond = condition(st, profiling.CONDITION)
        assert cond["reason"] == "ProviderUnavailable" and "/dev/nvidiactl" in cond["message"]
        (job,) = jobs_of(cluster, ns, "gpuless")
        pod = job["spec"]["template"]["spec"]
        (measure,) = [c for c in pod.get("initContainers", []) + pod["containers"] if c["name"] == "profile"]
        assert measure["args"][-2:] == ["--device", "gpu"]
