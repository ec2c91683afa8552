"""Pure manifest builders: (service, spec, plan, pools) -> plain dicts. No I/O, no API calls.

Children of one EarlyExitService `<svc>` (DESIGN.md "The objects"):

| object | name | what |
|---|---|---|
| ConfigMap | `<svc>-plan` | `plan.json` = Plan.to_json(), mounted at /etc/exitplan in every pod |
| Deployment + Service | `<svc>-router`, `<svc>` | the router; the Service (port 8080) is the cluster entry point |
| headless Service | `<svc>-control` | the routers' control port (8081): the operator's reads and pushes, the plan's `routers` (workers post feedback only there) |
| Secret | `<svc>-control-token` | the service's control token (control_token.py: created once, not a plan child), mounted in every pod |
| headless Service | `<svc>-split-<S>` | the workers of split S (router --peers, worker --next resolve it) |
| Deployment | `<svc>-s<S>-b<B>-<pool>` | one per plan cell (split, bucket, pool), absolute replica count |
| Job | `<svc>-profile-<pool>` | measures a missing ModelProfile, then publishes it |
| PodDisruptionBudget | `<svc>-router` | minAvailable 1 over 2+ router replicas (disruption.py) |

Every child carries the labels exitplan.io/service, exitplan.io/split, exitplan.io/bucket,
exitplan.io/pool (where they apply), the annotation exitplan.io/plan-hash, and an ownerReference
to the EarlyExitService (kopf.adopt), so deleting the service lets the garbage collector take them.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
from typing import Any

import kopf

from exitplan.api.bundle_source import SourceError, parse_bundle_uri
from exitplan.api.plan import Cell, Plan
from exitplan.api.resources import EarlyExitServiceSpec, GPUPoolSpec, ModelRef
from exitplan.operator import bundle_volumes, colocation
from exitplan.operator.images import Images

Manifest = dict[str, Any]

PORT = 8080
PLAN_DIR = "/etc/exitplan"
PLAN_PATH = f"{PLAN_DIR}/plan.json"
PROFILE_DIR = "/var/run/exitplan-profile"
CONTROL_PORT = 8081
"""The routers' control endpoints (/v1/...): open only to the operator and the service's own pods."""
CONTROL_DIR = "/var/run/exitplan-control"
TOKEN_KEY = "token"
TOKEN_PATH = f"{CONTROL_DIR}/{TOKEN_KEY}"
PRESTOP_SLEEP_S = 5
"""Seconds a router or worker pod waits between leaving its endpoints and its SIGTERM."""
DEFAULT_IMAGE = "ghcr.io/exitplan/exitplan:0.1.0"
IMAGE = os.environ.get("EXITPLAN_IMAGE", DEFAULT_IMAGE)
"""Container image of routers, workers and profiling Jobs (env EXITPLAN_IMAGE of the operator)."""
IMAGES = Images.from_env(IMAGE)
"""IMAGE with its pull policy and pull Secrets (images.py); a GPUPool may override them for its pods."""

L_SERVICE, L_SPLIT, L_BUCKET, L_POOL = (
    "exitplan.io/service",
    "exitplan.io/split",
    "exitplan.io/bucket",
    "exitplan.io/pool",
)
L_COMPONENT = "app.kubernetes.io/component"
A_PLAN_HASH = "exitplan.io/plan-hash"
MANAGED = {"app.kubernetes.io/name": "exitplan", "app.kubernetes.io/managed-by": "exitplan-operator"}


def dns_name(*parts: object) -> str:
    """A DNS-1123 label from parts: lowercase, dashes, at most 63 chars (long names end in a hash)."""
    raw = "-".join(str(p) for p in parts if str(p) != "")
    name = re.sub(r"[^a-z0-9-]+", "-", raw.lower()).strip("-")
    if len(name) > 63:
        digest = hashlib.sha256(raw.encode()).hexdigest()[:6]
        name = f"{name[:56].rstrip('-')}-{digest}"
    return name


def plan_configmap_name(service: str) -> str:
    return dns_name(service, "plan")


def router_name(service: str) -> str:
    return dns_name(service, "router")


def control_service_name(service: str) -> str:
    return dns_name(service, "control")


def control_secret_name(service: str) -> str:
    return dns_name(service, "control-token")


def control_host(service: str, namespace: str) -> str:
    """host:port of the routers' control endpoints (a headless Service: every router pod)."""
    return f"{control_service_name(service)}.{namespace}.svc:{CONTROL_PORT}"


def split_service_name(service: str, split: int) -> str:
    return dns_name(service, "split", split)


def worker_name(service: str, cell: Cell) -> str:
    return dns_name(service, f"s{cell.split}", f"b{cell.bucket}", cell.pool)


def profile_job_name(service: str, pool: str, attempt: int = 0) -> str:
    """`<svc>-profile-<pool>`, then `-2`, `-3`, ... for re-measurements (Jobs do not re-run)."""
    return dns_name(service, "profile", pool, attempt + 1 if attempt else "")


def split_host(service: str, namespace: str, split: int) -> str:
    """host:port of the headless Service of a split (what --peers / --next name)."""
    return f"{split_service_name(service, split)}.{namespace}.svc:{PORT}"


def bundle_path(uri: str) -> str:
    """The bundle directory a pod reads: file:// URIs become paths; an absolute path is normalised
    (`/opt/b/../../etc` is `/etc`: what a hostPath would mount, and what the operator's allowed
    host-path prefixes are checked against, operator/guards.py); a remote bundle (pvc://, s3://,
    https://, oci://) is read at bundle_volumes.BUNDLE_DIR."""
    try:
        if parse_bundle_uri(uri).remote:
            return bundle_volumes.BUNDLE_DIR
    except SourceError:
        pass  # refused by the spec's validation; nothing is built for it
    path = uri[len("file://") :] if uri.startswith("file://") else uri
    return normalize_host_path(path) if path.startswith("/") else path


def normalize_host_path(path: str) -> str:
    """An absolute path with `.`, `..` and repeated slashes resolved lexically (the operator cannot
    see the node's symlinks; Kubernetes refuses hostPaths with `..` anyway)."""
    return "/" + posixpath.normpath(path).lstrip("/")


def selector_labels(service: str, component: str, cell: Cell | None = None, split: int | None = None) -> dict[str, str]:
    labels = {L_SERVICE: service, L_COMPONENT: component}
    if cell is not None:
        labels.update({L_SPLIT: str(cell.split), L_BUCKET: str(cell.bucket), L_POOL: cell.pool})
    elif split is not None:
        labels[L_SPLIT] = str(split)
    return labels


def _meta(name: str, labels: dict[str, str], plan_hash: str) -> Manifest:
    return {"name": name, "labels": {**MANAGED, **labels}, "annotations": {A_PLAN_HASH: plan_hash}}


def _security() -> tuple[Manifest, Manifest]:
    pod = {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "fsGroup": 10001,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    container = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    return pod, container


def _probes() -> dict[str, Manifest]:
    def probe(path: str, period: int, failures: int) -> Manifest:
        return {
            "httpGet": {"path": path, "port": "http"},
            "periodSeconds": period,
            "failureThreshold": failures,
            "timeoutSeconds": 2,
        }

    return {
        "livenessProbe": {**probe("/v2/health/live", 10, 3), "initialDelaySeconds": 5},
        "readinessProbe": probe("/v2/health/ready", 2, 2),
    }


def _prestop() -> dict[str, Manifest]:
    """Routers and workers sleep PRESTOP_SLEEP_S before their SIGTERM: the pod is already out of its
    Service's endpoints (and a split's DNS, which senders re-resolve every 2 s), so by the time the
    process drains (worker_image/serve.py: readiness off, in-flight requests answered, at most 20 s)
    no new connection is on its way to it. terminationGracePeriodSeconds (30) covers both."""
    return {"lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_S)]}}}}


def _volumes(service: str, model: ModelRef, images: Images) -> tuple[list[Manifest], list[Manifest], Manifest]:
    """A router's or worker's volumes, its container's mounts, and what its pod spec adds: the
    bundle's init containers (bundle_volumes.py) and the image pull Secrets."""
    volumes = [
        {"name": "plan", "configMap": {"name": plan_configmap_name(service)}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "control-token", "secret": {"secretName": control_secret_name(service), "defaultMode": 0o440}},
    ]
    mounts = [
        {"name": "plan", "mountPath": PLAN_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "control-token", "mountPath": CONTROL_DIR, "readOnly": True},
    ]
    parts = bundle_volumes.bundle_parts(model, images, _security()[1], bundle_path(model.bundle))
    pod: Manifest = {"initContainers": parts.init_containers} if parts.init_containers else {}
    return volumes + parts.volumes, mounts + parts.mounts, {**pod, **images.pod()}


def _env(service: str, namespace: str) -> list[Manifest]:
    return [
        {"name": "EXITPLAN_SERVICE", "value": service},
        {"name": "EXITPLAN_NAMESPACE", "value": namespace},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]


def _resources(pool: GPUPoolSpec | None) -> Manifest:
    cpu, memory = (pool.cpu, pool.memory) if pool else ("1", "1Gi")
    out: Manifest = {"requests": {"cpu": cpu, "memory": memory}, "limits": {"memory": memory}}
    if pool is not None and pool.gpu_resource:
        out["requests"][pool.gpu_resource] = 1
        out["limits"][pool.gpu_resource] = 1
    return out


def _placement(pool: GPUPoolSpec | None, spread: dict[str, str]) -> Manifest:
    out: Manifest = {
        "affinity": {
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "podAffinityTerm": {
                            "topologyKey": "kubernetes.io/hostname",
                            "labelSelector": {"matchLabels": spread},
                        },
                    }
                ]
            }
        }
    }
    if pool is not None:
        if pool.node_selector:
            out["nodeSelector"] = dict(pool.node_selector)
        if pool.tolerations:
            out["tolerations"] = [t.dump() for t in pool.tolerations]
    return out


def _on_pool(service: str, model: ModelRef, pool: GPUPoolSpec | None, spread: dict[str, str]) -> tuple:
    """A pod on `pool` (None: none): image, resources, volumes, mounts, pod additions (spread over `spread`)."""
    images = IMAGES.for_pool(pool)
    volumes, mounts, pod_extra = _volumes(service, model, images)
    return images.container(), _resources(pool), volumes, mounts, {**_placement(pool, spread), **pod_extra}


def _deployment(
    name: str,
    namespace: str,
    labels: dict[str, str],
    plan_hash: str,
    replicas: int,
    container: Manifest,
    pod_extra: Manifest,
    volumes: list[Manifest],
) -> Manifest:
    pod_security, _ = _security()
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {**_meta(name, labels, plan_hash), "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": dict(labels)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {
                    "labels": {**MANAGED, **labels},
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(PORT),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": {
                    "containers": [container],
                    "volumes": volumes,
                    "securityContext": pod_security,
                    "terminationGracePeriodSeconds": 30,
                    "automountServiceAccountToken": False,
                    **pod_extra,
                },
            },
        },
    }


def build_configmap(service: str, namespace: str, plan: Plan) -> Manifest:
    """The plan ConfigMap; its plan names the routers' control Service as the service's routers."""
    plan = plan.model_copy(update={"routers": [control_host(service, namespace)]})
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            **_meta(plan_configmap_name(service), {L_SERVICE: service}, plan.content_hash()),
            "namespace": namespace,
        },
        "data": {"plan.json": plan.to_json()},
    }


def router_settings(spec: EarlyExitServiceSpec) -> list[str]:
    """The router flags that carry the service's SLO, accuracy budget and router settings; the
    router's observation window lasts one drift period (the drift loop reads the window in progress
    several times a period and keeps what is new, see driftloop.py)."""
    r = spec.router
    args = [
        "--slo-ms",
        f"{spec.slo.latency_ms:g}",
        "--accuracy-budget",
        f"{spec.accuracy.max_drop:g}",
        "--shadow-fraction",
        f"{spec.accuracy.shadow_fraction:g}",
        "--queue-lambda",
        f"{r.queue_lambda:g}",
        "--queue-alpha",
        f"{r.queue_alpha:g}",
        "--peek-depth",
        str(r.peek_depth),
        "--max-body-bytes",
        str(r.max_body_bytes),
        "--max-inflight",
        str(r.max_queue),
        "--window-seconds",
        f"{spec.planner.period_seconds:g}",
    ]
    return args + (["--truncate"] if r.truncate else [])


def build_router(
    service: str, namespace: str, spec: EarlyExitServiceSpec, plan: Plan, pools: dict[str, GPUPoolSpec] | None = None
) -> list[Manifest]:
    """The router Deployment and its Service (the entry point); a co-located plan's on split 0's pool."""
    labels = selector_labels(service, "router")
    pool_name, pool = colocation.split_zero_pool(plan, pools) if plan.colocate else ("", None)
    image, resources, volumes, mounts, pod_extra = _on_pool(service, spec.model, pool, labels)
    _, security = _security()
    first = 1 if plan.colocate else 0  # the split the routers send inputs to
    peers = ["--peers", split_host(service, namespace, first)] if first < len(plan.splits) else []
    co = ["--colocate", "--pool", pool_name] if plan.colocate else []  # the runtime flags a worker gets
    container = {
        "name": "router",
        **image,
        "command": ["exitplan", "router"],
        "args": [
            "--bundle",
            bundle_path(spec.model.bundle),
            "--plan",
            PLAN_PATH,
            "--port",
            str(PORT),
            *peers,
            "--control-port",
            str(CONTROL_PORT),
            "--control-token-file",
            TOKEN_PATH,
            *router_settings(spec),
            *co,
        ],
        "ports": [{"name": "http", "containerPort": PORT}, {"name": "control", "containerPort": CONTROL_PORT}],
        "env": _env(service, namespace),
        "resources": resources,
        "volumeMounts": mounts,
        "securityContext": security,
        **_probes(),
        **_prestop(),
    }
    deployment = _deployment(
        router_name(service),
        namespace,
        labels,
        plan.content_hash(),
        colocation.router_replicas(spec.router.replicas, plan),
        container,
        pod_extra,
        volumes,
    )
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {**_meta(dns_name(service), labels, plan.content_hash()), "namespace": namespace},
        "spec": {
            "type": "ClusterIP",
            "selector": labels,
            "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }
    return [deployment, svc]


def build_control_service(service: str, namespace: str, plan: Plan) -> Manifest:
    """The headless Service of the routers' control port: its DNS name resolves to every router pod
    (the plan's `routers`, where workers may post feedback), and the operator reaches the routers
    there when it cannot list their pods."""
    labels = selector_labels(service, "router")
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {**_meta(control_service_name(service), labels, plan.content_hash()), "namespace": namespace},
        "spec": {
            "clusterIP": "None",
            "selector": labels,
            "publishNotReadyAddresses": True,
            "ports": [{"name": "control", "port": CONTROL_PORT, "targetPort": "control", "protocol": "TCP"}],
        },
    }


def build_split_services(service: str, namespace: str, plan: Plan) -> list[Manifest]:
    """One headless Service per split (but a co-located plan's split 0), selecting its workers."""
    out = []
    for split in plan.splits[1 if plan.colocate else 0 :]:
        labels = selector_labels(service, "worker", split=split.index)
        out.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {
                    **_meta(split_service_name(service, split.index), labels, plan.content_hash()),
                    "namespace": namespace,
                },
                "spec": {
                    "clusterIP": "None",
                    "selector": labels,
                    "publishNotReadyAddresses": False,
                    "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}],
                },
            }
        )
    return out


def build_worker(
    service: str, namespace: str, spec: EarlyExitServiceSpec, plan: Plan, cell: Cell, pool: GPUPoolSpec
) -> Manifest:
    """The Deployment of one plan cell: split `cell.split`, bucket `cell.bucket`, on `cell.pool`."""
    labels = selector_labels(service, "worker", cell)
    spread = {L_SERVICE: service, L_SPLIT: str(cell.split)}
    image, resources, volumes, mounts, pod_extra = _on_pool(service, spec.model, pool, spread)
    _, security = _security()
    args = [
        "--bundle",
        bundle_path(spec.model.bundle),
        "--plan",
        PLAN_PATH,
        "--split",
        str(cell.split),
        "--bucket",
        str(cell.bucket),
        "--pool",
        cell.pool,
        "--port",
        str(PORT),
        "--control-token-file",
        TOKEN_PATH,
    ]
    if cell.split < len(plan.splits) - 1:
        args += ["--next", split_host(service, namespace, cell.split + 1)]
    container = {
        "name": "worker",
        **image,
        "command": ["exitplan", "worker"],
        "args": args,
        "ports": [{"name": "http", "containerPort": PORT}],
        "env": _env(service, namespace),
        "resources": resources,
        "volumeMounts": mounts,
        "securityContext": security,
        **_probes(),
        **_prestop(),
    }
    return _deployment(
        worker_name(service, cell),
        namespace,
        labels,
        plan.content_hash(),
        cell.replicas,
        container,
        pod_extra,
        volumes,
    )


def build_children(
    owner: Manifest, spec: EarlyExitServiceSpec, plan: Plan, pools: dict[str, GPUPoolSpec]
) -> list[Manifest]:
    """Every child of a planned service, adopted by `owner` (the EarlyExitService body).

    Order matters for apply: the ConfigMap first (pods mount it), then workers from the last
    split backwards, Services, and the router last, so nothing routes to a hop not yet created.
    """
    service = owner["metadata"]["name"]
    namespace = owner["metadata"]["namespace"]
    missing = sorted({c.pool for c in plan.cells} - set(pools))
    if missing:
        raise ValueError(f"plan places cells on pools {missing} that are not given")
    workers = [
        build_worker(service, namespace, spec, plan, cell, pools[cell.pool])
        for cell in sorted(plan.cells, key=lambda c: (-c.split, c.bucket, c.pool))
        if not (plan.colocate and cell.split == 0)
    ]
    router, router_svc = build_router(service, namespace, spec, plan, pools)
    children = [
        build_configmap(service, namespace, plan),
        *workers,
        *build_split_services(service, namespace, plan),
        build_control_service(service, namespace, plan),
        router_svc,
        router,
    ]
    kopf.adopt(children, owner=owner)
    return children


def build_profile_job(
    owner: Manifest, spec: EarlyExitServiceSpec, pool_name: str, pool: GPUPoolSpec, profile_name: str, attempt: int = 0
) -> Manifest:
    """A Job on `pool` that measures the bundle (`exitplan profile`) and publishes the result as
    ModelProfile `profile_name` (`exitplan operator publish-profile`) in the owner's namespace."""
    service = owner["metadata"]["name"]
    namespace = owner["metadata"]["namespace"]
    bundle = bundle_path(spec.model.bundle)
    out_file = f"{PROFILE_DIR}/profile.yaml"
    labels = {L_SERVICE: service, L_POOL: pool_name, L_COMPONENT: "profiler"}
    pod_security, security = _security()
    images = IMAGES.for_pool(pool)
    parts = bundle_volumes.bundle_parts(spec.model, images, security, bundle)
    volumes = [{"name": "out", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}, *parts.volumes]
    mounts = [{"name": "out", "mountPath": PROFILE_DIR}, {"name": "tmp", "mountPath": "/tmp"}, *parts.mounts]
    measure = {
        "name": "profile",
        **images.container(),
        "command": ["exitplan", "profile"],
        "args": [bundle, "--pool", pool_name, "--out", out_file],
        "resources": _resources(pool),
        "volumeMounts": mounts,
        "securityContext": security,
        # a failed step's last log lines become its termination message: the operator's
        # ProfilingFailed condition quotes it (operator/profiling.py)
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    publish = {
        "name": "publish",
        **images.container(),
        "command": ["exitplan", "operator", "publish-profile"],
        "args": [
            out_file,
            "--namespace",
            namespace,
            "--name",
            profile_name,
            "--model",
            spec.model.name,
            "--pool",
            pool_name,
        ],
        "resources": _resources(None),
        "volumeMounts": mounts,
        "securityContext": security,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    placement = _placement(pool, labels)
    placement.pop("affinity")
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": profile_job_name(service, pool_name, attempt),
            "namespace": namespace,
            "labels": {**MANAGED, **labels},
        },
        "spec": {
            "backoffLimit": 2,
            "ttlSecondsAfterFinished": 3600,
            "template": {
                "metadata": {"labels": {**MANAGED, **labels}},
                "spec": {
                    "restartPolicy": "Never",
                    "initContainers": [*parts.init_containers, measure],
                    "containers": [publish],
                    "volumes": volumes,
                    "securityContext": pod_security,
                    "serviceAccountName": "exitplan-profiler",
                    **placement,
                    **images.pod(),
                },
            },
        },
    }
    kopf.adopt([job], owner=owner)
    return job


def profile_name(model: str, pool: str) -> str:
    """The ModelProfile name the operator looks for: `<model>-<pool>`."""
    return dns_name(model, pool)
