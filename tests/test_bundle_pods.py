"""Bundle sources on the operator's side (issue 16): each URI form of spec.model.bundle gives the router,
worker, stage and profiling pods the volume and init containers it needs (valid for every Kubernetes
version the chart supports, kubernetes-validate strict); the CRD refuses what the typed spec refuses;
a pod whose storage-init fails makes the service Degraded with the reason it left, never a crash loop
of the operator."""

from __future__ import annotations

import copy

import kubernetes_validate.utils as kv
import pytest
from packaging.version import Version
from pydantic import ValidationError
from test_operator_support import (
    ClusterThread,
    condition,
    events_where,
    install_profiles,
    operator,
    pool,
    service,
    status,
    wait_for,
    workers,
)

from exitplan.api.plan import Cell, Plan, SplitPlan
from exitplan.api.resources import EarlyExitService, EarlyExitServiceSpec, GPUPoolSpec, Task
from exitplan.devcluster.schema import Validator
from exitplan.operator import builders, bundle_health, bundle_info, crdgen, generation_builders, guards
from exitplan.operator.bundle_volumes import BUNDLE_DIR, IMAGE_COPY, STORAGE_INIT

SHA = "a" * 64
MiB = 1024 * 1024
SOURCES = {
    "host": {"bundle": "/models/digits"},
    "pvc": {"bundle": "pvc://models/digits/v1"},
    "s3": {"bundle": "s3://bundles/digits", "bundleSecret": "s3-creds"},
    "s3-tarball": {"bundle": "s3://bundles/digits.tar.gz", "bundleSecret": "s3-creds", "bundleSha256": SHA},
    "https": {"bundle": "https://models.example.com/digits.tar.gz?sig=x", "bundleSha256": SHA},
    "http": {"bundle": "http://models.internal/digits.tar.gz", "bundleSha256": SHA},
    "oci": {"bundle": "oci://ghcr.io/acme/digits-bundle:1.0"},
    "https-sized": {"bundle": "https://models.example.com/big.tar.gz", "bundleSha256": SHA, "bundleSize": 300 * MiB},
}
OWNER = {
    "apiVersion": "exitplan.io/v1alpha1",
    "kind": "EarlyExitService",
    "metadata": {"name": "digits", "namespace": "default", "uid": "1234-uid"},
}
POOLS = {"cpu": GPUPoolSpec(capacity=4, gpu_resource="")}
PLAN = Plan(
    service="digits",
    model="digits",
    splits=[SplitPlan(index=0, first_block=0, last_block=1), SplitPlan(index=1, first_block=2, last_block=2)],
    buckets=[1],
    cells=[Cell(split=s, bucket=1, pool="cpu", replicas=1, batch_size=8) for s in (0, 1)],
)


def spec(kind: str, task: Task = Task.image_classification) -> EarlyExitServiceSpec:
    return EarlyExitServiceSpec.model_validate(
        {
            "model": {"name": "digits", "task": task.value, **SOURCES[kind]},
            "slo": {"latencyMs": 100},
            "pools": [{"name": "cpu"}],
        }
    )


def objects(kind: str) -> list[dict]:
    """The service's Deployments and its profiling Job."""
    children = builders.build_children(OWNER, spec(kind), PLAN, POOLS)
    job = builders.build_profile_job(OWNER, spec(kind), "cpu", POOLS["cpu"], "digits-cpu")
    return [c for c in children if c["kind"] == "Deployment"] + [job]


def pod_of(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def main_containers(pod: dict) -> list[dict]:
    """The containers that read the bundle (the profiling Job's measuring step is an init container)."""
    return [c for c in pod.get("initContainers", []) + pod["containers"] if c["name"] not in (STORAGE_INIT, IMAGE_COPY)]


def bundle_arg(container: dict) -> str | None:
    args = container.get("args", [])
    if container["command"] == ["exitplan", "profile"]:
        return args[0]
    return args[args.index("--bundle") + 1] if "--bundle" in args else None


@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_every_pod_gets_the_bundle_its_source_needs(kind):
    model = SOURCES[kind]
    for obj in objects(kind):
        pod = pod_of(obj)
        inits = {c["name"]: c for c in pod.get("initContainers", [])}
        volume = next(v for v in pod["volumes"] if v["name"] == "bundle")
        readers = [c for c in main_containers(pod) if bundle_arg(c)]
        assert readers, obj["metadata"]["name"]
        if kind == "host":
            assert STORAGE_INIT not in inits and volume["hostPath"]["path"] == "/models/digits"
            assert all(bundle_arg(c) == "/models/digits" for c in readers)
            continue
        init = inits[STORAGE_INIT]
        assert init["command"] == ["exitplan", "storage-init"] and init["args"][:2] == [model["bundle"], BUNDLE_DIR]
        assert init["terminationMessagePolicy"] == "FallbackToLogsOnError"
        for reader in readers:
            assert bundle_arg(reader) == BUNDLE_DIR
            (mount,) = [m for m in reader["volumeMounts"] if m["name"] == "bundle"]
            assert mount["mountPath"] == BUNDLE_DIR and mount["readOnly"] is True
            assert "envFrom" not in reader  # the store's credentials reach only storage-init
        names = [c["name"] for c in pod.get("initContainers", [])]
        # storage-init runs last of the bundle's init containers: before the Job's measuring step
        assert names.index(STORAGE_INIT) == len(names) - (2 if obj["kind"] == "Job" else 1)
        if obj["kind"] == "Job":
            assert names[-1] == "profile"
        if kind == "pvc":
            assert volume == {"name": "bundle", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}
            assert all(m["subPath"] == "digits/v1" for c in readers for m in c["volumeMounts"] if m["name"] == "bundle")
            assert "--verify-only" in init["args"] and init["volumeMounts"][0]["readOnly"] is True
        else:
            assert set(volume) == {"name", "emptyDir"} and set(volume["emptyDir"]) == {"sizeLimit"}
        if kind.startswith("s3"):
            assert init["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
        else:
            assert "envFrom" not in init
        assert ("--sha256" in init["args"]) == ("bundleSha256" in model)
        if "bundleSha256" in model:
            assert init["args"][init["args"].index("--sha256") + 1] == SHA
        assert ("--allow-http" in init["args"]) == (kind == "http")
        if kind == "oci":
            copier = inits[IMAGE_COPY]
            assert names.index(IMAGE_COPY) < names.index(STORAGE_INIT)
            assert copier["image"] == "ghcr.io/acme/digits-bundle:1.0"
            assert copier["command"] == ["cp", "-R", "/bundle/.", BUNDLE_DIR] and "--verify-only" in init["args"]
        else:
            assert IMAGE_COPY not in inits


def test_a_generation_stage_fetches_its_bundle_too():
    stage = generation_builders.build_stage(
        "tweets", "default", spec("s3", Task.text_generation), PLAN, PLAN.cells[0], POOLS["cpu"]
    )
    pod = pod_of(stage)
    assert [c["name"] for c in pod["initContainers"]] == [STORAGE_INIT]
    assert bundle_arg(pod["containers"][0]) == BUNDLE_DIR


@pytest.mark.parametrize("kind", sorted(set(SOURCES) - {"host"}))
def test_a_generation_service_gets_the_classification_workers_bundle_parts(kind, kube_versions):
    """Every stage and the router of a generation service: the storage-init container and bundle volume
    a classification worker of the same source gets (bundle_volumes.py's, not a copy), valid strictly."""
    gen = spec(kind, Task.text_generation)
    worker = pod_of(builders.build_worker("digits", "default", gen, PLAN, PLAN.cells[0], POOLS["cpu"]))
    children = generation_builders.build_children(OWNER, gen, PLAN, POOLS)
    deployments = [c for c in children if c["kind"] == "Deployment"]
    assert len(deployments) == 3  # a stage per split, the router
    want_volume = next(v for v in worker["volumes"] if v["name"] == "bundle")
    for dep in deployments:
        pod = pod_of(dep)
        assert pod["initContainers"] == worker["initContainers"]
        assert pod["initContainers"][-1]["name"] == STORAGE_INIT
        assert pod["initContainers"][-1]["args"][:2] == [SOURCES[kind]["bundle"], BUNDLE_DIR]
        assert next(v for v in pod["volumes"] if v["name"] == "bundle") == want_volume
        (main,) = pod["containers"]
        assert bundle_arg(main) == BUNDLE_DIR and "envFrom" not in main
        (mount,) = [m for m in main["volumeMounts"] if m["name"] == "bundle"]
        assert mount["mountPath"] == BUNDLE_DIR and mount["readOnly"] is True
        for version in kube_versions:
            kv.validate(dep, version, strict=True)


@pytest.mark.parametrize("kind", sorted(set(SOURCES) - {"host"}))
def test_the_bundle_info_job_fetches_like_the_pods_then_publishes(kind, kube_versions):
    """A remote generation bundle's bundle-info Job: the stages' own bundle parts (storage-init, volume),
    then `exitplan operator publish-bundle-info BUNDLE_DIR` into ConfigMap <svc>-bundle-info, valid strictly."""
    gen = spec(kind, Task.text_generation)
    job = bundle_info.build_job(OWNER, gen)
    stage = pod_of(generation_builders.build_stage("digits", "default", gen, PLAN, PLAN.cells[0], POOLS["cpu"]))
    pod = pod_of(job)
    assert (
        job["metadata"]["name"] == "digits-bundle-info" and bundle_info.job_name("digits", 1) == "digits-bundle-info-2"
    )
    assert pod["initContainers"] == stage["initContainers"]  # fetched and verified exactly as the stages do
    assert pod["initContainers"][-1]["name"] == STORAGE_INIT
    assert next(v for v in pod["volumes"] if v["name"] == "bundle") == next(
        v for v in stage["volumes"] if v["name"] == "bundle"
    )
    (publish,) = pod["containers"]
    assert publish["command"] == ["exitplan", "operator", "publish-bundle-info"]
    args = publish["args"]
    assert args[0] == BUNDLE_DIR and args[args.index("--name") + 1] == "digits-bundle-info"
    assert args[args.index("--namespace") + 1] == "default" and args[args.index("--service-uid") + 1] == "1234-uid"
    assert args[args.index("--source") + 1] == bundle_info.source_key(gen.model)
    assert publish["terminationMessagePolicy"] == "FallbackToLogsOnError" and "envFrom" not in publish
    (mount,) = [m for m in publish["volumeMounts"] if m["name"] == "bundle"]
    assert mount["mountPath"] == BUNDLE_DIR and mount["readOnly"] is True
    assert pod["serviceAccountName"] == "exitplan-profiler" and pod["restartPolicy"] == "Never"
    assert job["metadata"]["ownerReferences"][0]["uid"] == "1234-uid"
    assert job["metadata"]["annotations"][bundle_info.A_SOURCE] == bundle_info.source_key(gen.model)
    for version in kube_versions:
        kv.validate(job, version, strict=True)
    broken = copy.deepcopy(job)
    pod_of(broken)["containers"][0]["volumeMounts"][0]["readonly"] = True
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, kube_versions[-1], strict=True)


def test_the_bundle_source_key_follows_what_the_pods_fetch():
    """A new URI, sha256 or Secret is another source (a new Job reads it); the SLO is not."""
    base = spec("s3-tarball", Task.text_generation).model
    keys = {
        bundle_info.source_key(base.model_copy(update=change))
        for change in ({}, {"bundle": "s3://bundles/v2.tar.gz"}, {"bundle_sha256": "b" * 64}, {"bundle_secret": "x"})
    }
    assert len(keys) == 4
    assert bundle_info.source_key(spec("s3-tarball", Task.text_generation).model) == bundle_info.source_key(base)


GiB = 1024 * MiB
STORAGE = "ephemeral-storage"


@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_every_emptydir_has_a_size_limit_and_every_container_ephemeral_storage(kind):
    """Issue 28 item 6: no unbounded emptyDir; the bundle's volume is sized from spec.model.bundleSize
    (twice it, plus 64 Mi, for a tarball that unpacks beside its download), else from the operator's
    default limit (20 GiB); storage-init refuses anything bigger, with the same figure."""
    stated = SOURCES[kind].get("bundleSize")
    for obj in objects(kind):
        pod = pod_of(obj)
        for volume in pod["volumes"]:
            if "emptyDir" in volume:
                assert volume["emptyDir"]["sizeLimit"].endswith("Mi"), (obj["metadata"]["name"], volume)
        containers = pod.get("initContainers", []) + pod["containers"]
        for container in containers:
            assert STORAGE in container["resources"]["limits"], (obj["metadata"]["name"], container["name"])
        if kind in ("host", "pvc"):
            continue
        volume = next(v for v in pod["volumes"] if v["name"] == "bundle")
        init = next(c for c in containers if c["name"] == STORAGE_INIT)
        bound = stated or 20 * GiB
        tarball = kind in ("https", "http", "s3-tarball", "https-sized")
        assert volume["emptyDir"]["sizeLimit"] == f"{(bound * (2 if tarball else 1) + 64 * MiB) // MiB}Mi"
        if kind != "oci":
            assert init["args"][init["args"].index("--max-bytes") + 1] == str(bound)
            assert {"--max-files", "--max-ratio"} <= set(init["args"])
        for reader in main_containers(pod):
            requests = reader["resources"]["requests"]
            if stated:  # the stated size is requested: the scheduler places the pod where it fits
                assert requests[STORAGE] == f"{(stated + 64 * MiB + 256 * MiB) // MiB}Mi"
            else:
                assert requests[STORAGE] == "256Mi"
    if kind == "https-sized":
        print(f"{kind}: bundle 300 MiB -> emptyDir sizeLimit {volume['emptyDir']['sizeLimit']}, reader {requests}")


@pytest.fixture(scope="module")
def kube_versions() -> list[str]:
    versions = sorted((v for v in kv.all_versions() if Version(v) >= Version("1.29")), key=Version)
    return [versions[0], versions[-1]]


@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_the_pods_validate_strictly(kind, kube_versions):
    for obj in objects(kind):
        for version in kube_versions:
            kv.validate(obj, version, strict=True)


def test_strict_validation_catches_a_bad_init_container(kube_versions):
    job = objects("s3")[-1]
    pod_of(job)["initContainers"][0]["envFrom"] = [{"secretReff": {"name": "s3-creds"}}]
    with pytest.raises(kv.ValidationError):
        kv.validate(job, kube_versions[-1], strict=True)


def test_remote_bundles_are_not_host_paths():
    settings = guards.Settings()  # no host path allowed
    for kind in SOURCES:
        refusal = guards.bundle_refusal(spec(kind), settings)
        assert (refusal is not None) == (kind == "host"), kind


# ------------------------------------------------------------------ the spec and the CRD agree


VALID_MODELS = [SOURCES[k] for k in SOURCES] + [
    {"bundle": "file:///models/digits"},
    {"bundle": "relative/dir"},
    {"bundle": "s3://bundles/x.tgz", "bundleSha256": SHA},
]
INVALID_MODELS = [
    ({"bundle": "https://models.example.com/digits.tar.gz"}, "bundleSha256 is required"),
    ({"bundle": "http://models.example.com/digits.tar.gz"}, "bundleSha256 is required"),
    ({"bundle": "s3://bundles/digits", "bundleSha256": SHA}, "tarball bundles only"),
    ({"bundle": "/models/digits", "bundleSha256": SHA}, "tarball bundles only"),
    ({"bundle": "https://models.example.com/d.tar.gz", "bundleSha256": SHA, "bundleSecret": "s"}, "s3:// bundles only"),
    ({"bundle": "ftp://models.example.com/d.tar.gz"}, "unknown scheme"),
    ({"bundle": "s3://bundles/digits", "bundleSha256": "abc"}, "pattern"),
    ({"bundle": "s3://bundles/digits", "bundleSecret": "Not_A_Name"}, "pattern"),
]


def _ees(model: dict) -> dict:
    return {
        "apiVersion": "exitplan.io/v1alpha1",
        "kind": "EarlyExitService",
        "metadata": {"name": "x"},
        "spec": {"model": {"name": "digits", **model}, "slo": {"latencyMs": 100}, "pools": [{"name": "cpu"}]},
    }


@pytest.fixture(scope="module")
def ees_validator() -> Validator:
    return Validator(crdgen.build_crd("EarlyExitService")["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


@pytest.mark.parametrize("model", VALID_MODELS)
def test_valid_bundle_fields_pass_both(model, ees_validator):
    EarlyExitService.model_validate(_ees(model))
    assert ees_validator.problems(_ees(model)) == []


@pytest.mark.parametrize("model,said", INVALID_MODELS)
def test_invalid_bundle_fields_fail_both(model, said, ees_validator):
    with pytest.raises(ValidationError, match=said):
        EarlyExitService.model_validate(_ees(model))
    assert ees_validator.problems(_ees(model)), f"the CRD accepts {model}, the typed spec refuses it"


# ------------------------------------------------------------------ failures become conditions


def init_status(name: str, state: dict, last: dict | None = None, image: str = "exitplan:test") -> dict:
    return {"name": name, "image": image, "state": state, "lastState": last or {}, "ready": False, "restartCount": 1}


FAILED = {
    "terminated": {
        "exitCode": 1,
        "reason": "Error",
        "message": "s3://bundles/digits: bundle file blocks/block1.onnx has sha256 0f..., bundle.yaml records 9a...",
    }
}


def test_pod_failures_read_what_the_kubelet_reports():
    def pod(name: str, *statuses: dict) -> dict:
        return {"metadata": {"name": name}, "status": {"initContainerStatuses": list(statuses)}}

    found = bundle_health.pod_failures(
        [
            pod("a", init_status(STORAGE_INIT, FAILED)),  # Init:Error
            pod("b", init_status(STORAGE_INIT, {"waiting": {"reason": "CrashLoopBackOff"}}, FAILED)),
            pod("c", init_status(STORAGE_INIT, {"running": {}}, FAILED)),  # retrying: the last failure still says why
            pod("d", init_status(STORAGE_INIT, {"terminated": {"exitCode": 0, "reason": "Completed"}}, FAILED)),
            pod("e", init_status(IMAGE_COPY, {"waiting": {"reason": "ImagePullBackOff", "message": "not found"}})),
            pod("f", init_status("other", FAILED)),
        ]
    )
    assert [f.split(":")[0] for f in found] == ["pod a", "pod b", "pod c", "pod e"]
    assert all("blocks/block1.onnx" in f for f in found[:3]) and "cannot pull image" in found[3]


def test_a_failing_storage_init_makes_the_service_degraded_and_recovers(tmp_path):
    """The operator under kopf against the emulated API server; the pods' statuses are what a kubelet
    reports for an init container that exits 1 with storage-init's termination message."""
    with ClusterThread(tmp_path) as cluster:
        cluster.create(pool("gpu-a", 4, 3.0))
        cluster.create(pool("gpu-b", 6, 1.0))
        ns = "remote"
        install_profiles(cluster, ns)
        model = {"name": "minilm", "bundle": "s3://bundles/minilm", "bundleSecret": "s3-creds"}
        with operator(cluster):
            cluster.create(service("minilm", ns, model=model))
            wait_for("applied", lambda: status(cluster, ns, "minilm").get("phase") == "Deploying")
            (name, dep) = sorted(workers(cluster, ns, "minilm").items())[0]
            template = dep["spec"]["template"]
            assert template["spec"]["initContainers"][0]["name"] == STORAGE_INIT
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"{name}-x1", "namespace": ns, "labels": template["metadata"]["labels"]},
                "spec": copy.deepcopy(template["spec"]),
            }
            cluster.create(pod)
            failing = {"phase": "Pending", "initContainerStatuses": [init_status(STORAGE_INIT, FAILED)]}
            cluster.patch("Pod", ns, pod["metadata"]["name"], {"status": failing}, "status")
            st = wait_for(
                "Degraded: BundleFetchFailed",
                lambda: (
                    (s := status(cluster, ns, "minilm"))
                    and condition(s, "Degraded").get("reason") == "BundleFetchFailed"
                    and s
                ),
            )
            message = condition(st, "Degraded")["message"]
            assert st["phase"] == "Degraded" and condition(st, "Degraded")["status"] == "True"
            assert (
                "blocks/block1.onnx" in message
                and pod["metadata"]["name"] in message
                and "s3://bundles/minilm" in message
            )
            events = events_where(
                cluster, ns, "minilm", lambda e: e["reason"] == "BundleFetchFailed", "a BundleFetchFailed event"
            )
            assert events and events[0]["type"] == "Warning"
            fetched = {
                "phase": "Running",
                "initContainerStatuses": [init_status(STORAGE_INIT, {"terminated": {"exitCode": 0}})],
            }
            cluster.patch("Pod", ns, pod["metadata"]["name"], {"status": fetched}, "status")
            st = wait_for(
                "recovered",
                lambda: (
                    (s := status(cluster, ns, "minilm")) and condition(s, "Degraded").get("status") == "False" and s
                ),
            )
            assert condition(st, "Degraded")["reason"] == "BundleFetched" and st["phase"] != "Degraded"


def test_the_network_policies_let_storage_init_reach_the_bundle_store(kube_versions):
    from test_chart_support import render

    values = {
        "networkPolicy": {
            "enabled": True,
            "bundleStoreTo": [{"ipBlock": {"cidr": "10.0.5.0/24"}}],
            "bundleStorePorts": [443, 9000],
        }
    }
    (policy,) = [
        o for o in render(values) if o["kind"] == "NetworkPolicy" and o["metadata"]["name"].endswith("bundle-store")
    ]
    assert policy["spec"]["policyTypes"] == ["Egress"]
    assert policy["spec"]["egress"] == [
        {
            "to": [{"ipBlock": {"cidr": "10.0.5.0/24"}}],
            "ports": [{"port": 443, "protocol": "TCP"}, {"port": 9000, "protocol": "TCP"}],
        }
    ]
    selector = policy["spec"]["podSelector"]
    for dep in objects("s3")[:-1]:  # the router and the workers the operator builds: selected
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert selector["matchLabels"].items() <= labels.items()
        assert labels["app.kubernetes.io/component"] in selector["matchExpressions"][0]["values"]
    for version in kube_versions:
        kv.validate(policy, version, strict=True)
    closed = render({"networkPolicy": {"enabled": True}})
    assert not [o for o in closed if o["metadata"]["name"].endswith("bundle-store")]
