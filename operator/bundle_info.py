"""What a generation service plans from, when its bundle is remote: a Job reads it where the pods would.

A generation service is planned from its bundle's bundle.yaml (blocks, exit ramps, context) and the
generation measurements kept beside it (`profiles/generation-<pool>.json`), which the operator reads
from a local path (generation_reconcile.py). For a remote bundle (pvc://, s3://, https://, oci://)
it runs instead a Job `<svc>-bundle-info` (:func:`build_job`) that gets the bundle exactly as the
service's pods do (bundle_volumes.bundle_parts: storage-init fetches it and verifies every digest),
then `exitplan operator publish-bundle-info BUNDLE_DIR` writes those small text files into ConfigMap
`<svc>-bundle-info` (:func:`configmap`; refused above a ConfigMap's 1 MiB), owned by the service and
annotated with the source it was read from (:func:`source_key`: spec.model's bundle, sha256 and
Secret). The ConfigMap carries label exitplan.io/bundle-info-of, not exitplan.io/service: it is no
plan child (apply.py prunes the service's ConfigMaps that a plan does not hold).

:func:`wait` is the operator's side. A ConfigMap of the current source: its texts are what the plan
is made from (the same parsing as from a directory: :func:`manifest_of`, :func:`measurements_of`).
Otherwise the Job runs (status phase Profiling, conditions Progressing True and Planned False with
reason FetchingBundleInfo; the timer's profiling re-check, driftloop.on_tick, looks again), or it
failed: condition ProfilingFailed True, reason BundleFetchFailed (its storage-init or bundle-image
container failed: unreachable, a wrong sha256 or digest) or BundleInfoFailed (publishing failed), with
the Job's failure and its container's termination message, a Warning event, phase ProfilingFailed.
Failed Jobs are retried as profiling Jobs are (settings.profile_attempts Jobs per source and spec
generation, settings.retry_delay apart; `-2`, `-3`, ... after the first); a new source or spec
generation tries again. One Job per service at a time: a Job of an older source finishes first.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import ValidationError

from exitplan.api import validation_problems, yaml_problem
from exitplan.api.bundle import MANIFEST, BundleError, BundleManifest, read_manifest
from exitplan.api.manifest import Manifest
from exitplan.api.resources import API_VERSION, EarlyExitServiceSpec, ModelRef
from exitplan.operator import apply as applying
from exitplan.operator import bundle_volumes, images, names, pod_template, profiling
from exitplan.operator.kube import ApiError, KubeClient, path
from exitplan.operator.ownership import adopt
from exitplan.operator.service_state import Service
from exitplan.operator.status import Phase, ServiceStatus, set_condition
from exitplan.planner.generation import GenerationProfile, ThresholdPoint, parse_measurements

COMPONENT = "bundle-info"
L_OF = "exitplan.io/bundle-info-of"
"""The ConfigMap's label: the service it was read for."""
A_SOURCE = "exitplan.io/bundle-source"
"""On the Job and the ConfigMap: :func:`source_key` of the spec.model they were made for."""
MEASUREMENTS = "generation-{pool}.json"
MAX_BYTES = 1024 * 1024
"""What a ConfigMap's data may hold (keys and values together), as the API server counts it."""
FETCHING, FETCH_FAILED, PUBLISH_FAILED = "FetchingBundleInfo", "BundleFetchFailed", "BundleInfoFailed"


def configmap_name(service: str) -> str:
    return names.dns_name(service, COMPONENT)


def job_name(service: str, attempt: int = 0) -> str:
    """`<svc>-bundle-info`, then `-2`, `-3`, ... for retries (Jobs do not re-run)."""
    return names.dns_name(service, COMPONENT, attempt + 1 if attempt else "")


def source_key(model: ModelRef) -> str:
    """Names what the bundle info was read from: the bundle URI, its sha256 and Secret."""
    raw = json.dumps([model.bundle, model.bundle_sha256 or "", model.bundle_secret or ""])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def shown(uri: str) -> str:
    """A bundle URI for messages: never a presigned URL's query (its signature)."""
    return uri.split("?", 1)[0]


# ------------------------------------------------------------------ the texts, and what they say


@dataclass(frozen=True)
class BundleTexts:
    """bundle.yaml and the generation measurements of a bundle, as text."""

    where: str
    """Where they were read (a directory, or the ConfigMap and its source): named in messages."""
    manifest: str
    measurements: dict[str, str] = field(default_factory=dict)
    """Pool -> the text of profiles/generation-<pool>.json."""


def read_dir(bundle: str | Path) -> BundleTexts:
    """The texts of a bundle directory (bundle.yaml checked as `read_manifest` does: every file it
    names is there)."""
    root = Path(bundle)
    read_manifest(root)
    measured = {}
    for file in sorted((root / "profiles").glob(MEASUREMENTS.format(pool="*"))):
        measured[file.name[len("generation-") : -len(".json")]] = file.read_text()
    return BundleTexts(str(root), (root / MANIFEST).read_text(), measured)


def manifest_of(texts: BundleTexts) -> BundleManifest:
    """The validated manifest (the same checks and messages as api.bundle.read_manifest)."""
    where = f"{texts.where}: {MANIFEST}"
    try:
        return BundleManifest.model_validate(yaml.safe_load(texts.manifest))
    except yaml.YAMLError as err:
        raise BundleError(f"{where}: not valid YAML: {yaml_problem(err)}") from err
    except ValidationError as err:
        raise BundleError(f"{where}: invalid manifest: {validation_problems(err)}") from err


def measurements_of(texts: BundleTexts, pool: str) -> tuple[GenerationProfile | None, list[ThresholdPoint]]:
    """The pool's measured profile and threshold table ((None, []) when the bundle has none), read
    as planner.generation.read_measurements reads the file."""
    text = texts.measurements.get(pool)
    if text is None:
        return None, []
    return parse_measurements(text, f"{texts.where}: profiles/{MEASUREMENTS.format(pool=pool)}")


def configmap(
    texts: BundleTexts, namespace: str, name: str, service: str = "", uid: str = "", source: str = ""
) -> Manifest:
    """The ConfigMap that carries `texts`; BundleError when they do not fit in one."""
    data = {MANIFEST: texts.manifest, **{MEASUREMENTS.format(pool=p): t for p, t in texts.measurements.items()}}
    size = sum(len(k.encode()) + len(v.encode()) for k, v in data.items())
    if size > MAX_BYTES:
        sizes = ", ".join(f"{k} {len(v.encode())} B" for k, v in data.items())
        raise BundleError(
            f"{texts.where}: bundle.yaml and the generation measurements are {size} bytes ({sizes}), more than "
            f"the {MAX_BYTES} a ConfigMap holds; keep only the measurements of the pools you serve on "
            "(profiles/generation-<pool>.json), or give the operator a bundle directory it can read"
        )
    meta: Manifest = {
        "name": name,
        "namespace": namespace,
        "labels": {**names.MANAGED, names.L_COMPONENT: COMPONENT, **({L_OF: service} if service else {})},
        "annotations": {A_SOURCE: source} if source else {},
    }
    if service and uid:  # owned by the service (no blockOwnerDeletion: the Job's identity cannot set it)
        meta["ownerReferences"] = [
            {"apiVersion": API_VERSION, "kind": "EarlyExitService", "name": service, "uid": uid, "controller": True}
        ]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


def from_configmap(cm: Manifest, bundle: str) -> BundleTexts:
    data = cm.get("data") or {}
    meta = cm["metadata"]
    where = f"ConfigMap {meta.get('namespace')}/{meta['name']} (bundle {shown(bundle)})"
    prefix, suffix = MEASUREMENTS.split("{pool}")
    measured = {
        k[len(prefix) : -len(suffix)]: v for k, v in data.items() if k.startswith(prefix) and k.endswith(suffix)
    }
    return BundleTexts(where, str(data.get(MANIFEST) or ""), measured)


async def publish(client: KubeClient, body: Manifest) -> applying.ApplyReport:
    """Create or update the ConfigMap `body` (a file the bundle no longer has is removed from it: `body`'s
    data gets a null for it)."""
    report = applying.ApplyReport()
    try:
        current = await client.get(path("ConfigMap", body["metadata"]["namespace"], body["metadata"]["name"]))
    except ApiError as err:
        if err.status != 404:
            raise
        current = {}
    stale = set(current.get("data") or {}) - set(body["data"])
    body["data"].update(dict.fromkeys(stale))  # merge patch: null removes the key
    await applying.apply_one(client, body, report)
    return report


# ------------------------------------------------------------------ the Job


def build_job(owner: Manifest, spec: EarlyExitServiceSpec, attempt: int = 0) -> Manifest:
    """The Job that fetches and verifies the bundle as the service's pods do (bundle_volumes.py) and
    publishes its bundle.yaml and generation measurements as ConfigMap `<svc>-bundle-info`."""
    service, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    labels = {**names.MANAGED, names.L_SERVICE: service, names.L_COMPONENT: COMPONENT}
    security = pod_template.container_security()
    parts = bundle_volumes.bundle_parts(spec.model, images.IMAGES, security, names.bundle_path(spec.model.bundle))
    publish = {
        "name": "publish",
        **images.IMAGES.container(),
        "command": ["exitplan", "operator", "publish-bundle-info"],
        "args": [
            parts.path,
            "--namespace",
            namespace,
            "--name",
            configmap_name(service),
            "--service",
            service,
            "--service-uid",
            str(owner["metadata"].get("uid") or ""),
            "--source",
            source_key(spec.model),
        ],
        "resources": pod_template.with_bundle_storage(bundle_volumes.INIT_RESOURCES, parts.storage),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *parts.mounts],
        "securityContext": security,
        # its last log lines become its termination message, quoted in the service's condition
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": job_name(service, attempt),
            "namespace": namespace,
            "labels": labels,
            "annotations": {A_SOURCE: source_key(spec.model)},
        },
        "spec": {
            "backoffLimit": 2,
            "ttlSecondsAfterFinished": 3600,
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "restartPolicy": "Never",
                    "initContainers": parts.init_containers,
                    "containers": [publish],
                    "volumes": [pod_template.tmp_volume(), *parts.volumes],
                    "securityContext": pod_template.pod_security(),
                    "serviceAccountName": "exitplan-profiler",
                    **images.IMAGES.pod(),
                },
            },
        },
    }
    adopt([job], owner=owner)
    return job


# ------------------------------------------------------------------ the operator's side


def _annotation(obj: Manifest, key: str) -> str:
    return str((obj["metadata"].get("annotations") or {}).get(key) or "")


def _attempt(job: Manifest) -> int:
    return int(_annotation(job, profiling.A_ATTEMPT) or 0)


async def _start(svc: Service, spec: EarlyExitServiceSpec, jobs: list[Manifest], attempt: int) -> Manifest:
    taken = {j["metadata"]["name"] for j in jobs}
    index = next(i for i in range(len(taken) + 1) if job_name(svc.name, i) not in taken)
    job = build_job(svc.body, spec, index)
    job["metadata"]["annotations"].update(
        {profiling.A_GENERATION: str(svc.generation), profiling.A_ATTEMPT: str(attempt)}
    )
    await applying.apply_one(svc.client, job, applying.ApplyReport())
    svc.event(
        "Normal",
        FETCHING,
        f"the bundle {shown(spec.model.bundle)} is remote: Job {job['metadata']['name']} fetches it and publishes "
        f"its bundle.yaml and generation measurements as ConfigMap {configmap_name(svc.name)} (attempt {attempt} "
        f"of {svc.settings.profile_attempts})",
    )
    return job


async def _write(svc: Service, status: ServiceStatus, running: bool, why: str, message: str) -> None:
    gen = svc.generation
    status.conditions = set_condition(status.conditions, "Progressing", running, why, message, gen)
    status.conditions = set_condition(status.conditions, "Planned", False, why, message, gen)
    status.phase = Phase.profiling if running else Phase.profiling_failed  # the timer re-checks both
    status.message, status.observed_generation, status.waiting_for_profiles = message, gen, []
    await svc.write_status(status)


async def _current(svc: Service, bundle: str, key: str) -> BundleTexts | None:
    try:
        cm = await svc.client.get(path("ConfigMap", svc.namespace, configmap_name(svc.name)))
    except ApiError as err:
        if err.status != 404:
            raise
        return None
    return from_configmap(cm, bundle) if _annotation(cm, A_SOURCE) == key else None


async def wait(svc: Service, spec: EarlyExitServiceSpec, status: ServiceStatus) -> BundleTexts | None:
    """The bundle's texts when ConfigMap `<svc>-bundle-info` holds them for the current source; else
    start, retry or report the Job that publishes them, write the status, and None."""
    key, gen, settings = source_key(spec.model), svc.generation, svc.settings
    if (texts := await _current(svc, spec.model.bundle, key)) is not None:
        if any(c.type == profiling.CONDITION and c.status == "True" for c in status.conditions):
            status.conditions = set_condition(
                status.conditions, profiling.CONDITION, False, "BundleInfoPublished", f"read from {texts.where}", gen
            )
        return texts
    selector = f"{names.L_SERVICE}={svc.name},{names.L_COMPONENT}={COMPONENT}"
    jobs = await svc.client.list(path("Job", svc.namespace), selector)
    mine = sorted(
        (j for j in jobs if _annotation(j, A_SOURCE) == key and _annotation(j, profiling.A_GENERATION) == str(gen)),
        key=_attempt,
    )
    running = [j for j in jobs if not profiling.finished(j)]  # one Job at a time, of any source
    attempts = max([_attempt(j) for j in mine], default=0)
    last = mine[-1] if mine else None
    due = last is None or (
        attempts < settings.profile_attempts
        and (not profiling.failed(last) or time.time() >= profiling.failed_at(last) + settings.retry_delay(attempts))
    )
    if not running and due:
        running = [await _start(svc, spec, jobs, attempts + 1)]
    now = running[-1]["metadata"]["name"] if running else ""
    if last is not None and profiling.finished(last):
        await _report_failure(svc, spec, status, last, now, attempts)
        return None
    if running and _annotation(running[-1], A_SOURCE) != key:
        message = (
            f"Job {now} still reads the bundle of an earlier spec.model; a Job for {shown(spec.model.bundle)} follows"
        )
    else:
        message = (
            f"the bundle {shown(spec.model.bundle)} is remote: Job {now} fetches and verifies it as the pods do, and "
            f"publishes its bundle.yaml and generation measurements as ConfigMap {configmap_name(svc.name)}; the "
            "service is planned from them"
        )
    await _write(svc, status, True, FETCHING, message)
    return None


async def _report_failure(
    svc: Service, spec: EarlyExitServiceSpec, status: ServiceStatus, last: Manifest, running: str, attempts: int
) -> None:
    """Condition ProfilingFailed for the newest finished Job of this source and spec generation: it
    failed (or succeeded, yet the ConfigMap of this source is not there)."""
    settings, gen = svc.settings, svc.generation
    if profiling.failed(last):
        job_reason, said = await profiling.failure(svc, last)
    else:
        job_reason, said = "ConfigMapMissing", f"it succeeded, but ConfigMap {configmap_name(svc.name)} is not there"
    bundle_step = any(f"container {c} " in said for c in (bundle_volumes.STORAGE_INIT, bundle_volumes.IMAGE_COPY))
    reason = FETCH_FAILED if bundle_step else PUBLISH_FAILED
    headline = f"bundle-info Job {last['metadata']['name']} failed"
    if running:
        tail = f"Job {running} tries again"
    elif attempts >= settings.profile_attempts:
        tail = "no more attempts: fix the bundle's source (or spec.model), then change the EarlyExitService spec"
    else:
        tail = f"the next Job follows after a {settings.retry_delay(attempts):g} s backoff"
    message = (
        f"{headline} (attempt {_attempt(last)} of {settings.profile_attempts}) reading the bundle "
        f"{shown(spec.model.bundle)}: {job_reason}: {said}; {tail}"
    )
    before = next((c.message for c in status.conditions if c.type == profiling.CONDITION and c.status == "True"), "")
    if headline not in before:  # each failed Job is reported once
        svc.event("Warning", reason, message)
    status.conditions = set_condition(status.conditions, profiling.CONDITION, True, reason, message, gen)
    await _write(svc, status, bool(running), reason, message)
