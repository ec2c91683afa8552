"""The children of a classification service, built from its plan: (service, spec, plan, pools) -> manifests.

Pure: no I/O, no API calls. Owns which children a plan has and what each one runs (the router's and the
workers' command lines, the Services that connect them, the plan ConfigMap, the profiling Job); their
names and labels are names.py's, the pod around each command pod_template.py's, and a generation
service's stages generation_builders.py's. The children of one EarlyExitService `<svc>`
(DESIGN.md "The objects"):

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
| NetworkPolicy | `<svc>-net-router`, `<svc>-net-router-to-split-<S>`, `<svc>-net-split-<S>` | who reaches the service's routers and workers (network_policies.py, when the operator's settings ask) |

Every child carries the labels exitplan.io/service, exitplan.io/split, exitplan.io/bucket,
exitplan.io/pool (where they apply), the annotation exitplan.io/plan-hash, and an ownerReference
to the EarlyExitService (ownership.adopt), so deleting the service lets the garbage collector take them.
"""

from __future__ import annotations

from exitplan.api.commands import batching_args, device_args, worker_args
from exitplan.api.manifest import Manifest
from exitplan.api.plan import Cell, Plan
from exitplan.api.resources import EarlyExitServiceSpec, GPUPoolSpec
from exitplan.operator import bundle_volumes, colocation, images, pod_template
from exitplan.operator.names import (
    CONTROL_PORT,
    L_COMPONENT,
    L_POOL,
    L_SENDS_TO,
    L_SERVICE,
    L_SPLIT,
    PLAN_PATH,
    PORT,
    PROFILE_DIR,
    TOKEN_PATH,
    bundle_path,
    control_host,
    control_service_name,
    dns_name,
    managed,
    metadata,
    plan_configmap_name,
    router_name,
    selector_labels,
    split_host,
    split_service_name,
    worker_name,
)
from exitplan.operator.ownership import adopt
from exitplan.operator.pod_template import PodParts


def build_configmap(service: str, namespace: str, plan: Plan) -> Manifest:
    """The plan ConfigMap; its plan names the routers' control Service as the service's routers."""
    plan = plan.model_copy(update={"routers": [control_host(service, namespace)]})
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(plan_configmap_name(service), namespace, {L_SERVICE: service}, plan.content_hash()),
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
    parts = pod_template.on_pool(service, spec.model, pool, labels)
    first = 1 if plan.colocate else 0  # the split the routers send inputs to
    peers = ["--peers", split_host(service, namespace, first)] if first < len(plan.splits) else []
    co = ["--colocate", "--pool", pool_name, *device_args(pool), *batching_args(pool)] if plan.colocate else []
    args = [
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
    ]
    ports = [{"name": "http", "containerPort": PORT}, {"name": "control", "containerPort": CONTROL_PORT}]
    container = pod_template.container(
        "router", parts, service, namespace, command=["exitplan", "router"], args=args, ports=ports
    )
    replicas = colocation.router_replicas(spec.router.replicas, plan)
    main = {**container, **pod_template.prestop()}
    deployment = pod_template.deployment(
        router_name(service), namespace, labels, plan.layout_hash(), replicas, main, parts
    )
    deployment["spec"]["template"]["metadata"]["labels"][L_SENDS_TO] = str(first)  # what its NetworkPolicy admits
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(dns_name(service), namespace, labels, plan.layout_hash()),
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
        "metadata": metadata(control_service_name(service), namespace, labels, plan.layout_hash()),
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
                "metadata": metadata(split_service_name(service, split.index), namespace, labels, plan.layout_hash()),
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
    parts: PodParts = pod_template.on_pool(service, spec.model, pool, spread)
    args = [*worker_args(bundle_path(spec.model.bundle), PLAN_PATH, cell, PORT), "--control-token-file", TOKEN_PATH]
    args += device_args(pool) + batching_args(pool)
    if cell.split < len(plan.splits) - 1:
        args += ["--next", split_host(service, namespace, cell.split + 1)]
    ports: list[Manifest] = [{"name": "http", "containerPort": PORT}]
    container = pod_template.container(
        "worker", parts, service, namespace, command=["exitplan", "worker"], args=args, ports=ports
    )
    main = {**container, **pod_template.prestop()}
    return pod_template.deployment(
        worker_name(service, cell), namespace, labels, plan.layout_hash(), cell.replicas, main, parts
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
    adopt(children, owner=owner)
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
    security = pod_template.container_security()
    pool_images = images.IMAGES.for_pool(pool)
    parts = bundle_volumes.bundle_parts(spec.model, pool_images, security, bundle)
    volumes = [pod_template.tmp_volume("out"), pod_template.tmp_volume(), *parts.volumes]
    mounts = [{"name": "out", "mountPath": PROFILE_DIR}, {"name": "tmp", "mountPath": "/tmp"}, *parts.mounts]
    measure = {
        "name": "profile",
        **pool_images.container(),
        "command": ["exitplan", "profile"],
        "args": [bundle, "--pool", pool_name, "--out", out_file, *device_args(pool)],
        "resources": pod_template.with_bundle_storage(pod_template.resources(pool), parts.storage),
        "volumeMounts": mounts,
        "securityContext": security,
        # a failed step's last log lines become its termination message: the operator's
        # ProfilingFailed condition quotes it (operator/profiling.py)
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    publish = {
        "name": "publish",
        **pool_images.container(),
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
        "resources": pod_template.with_bundle_storage(pod_template.resources(None), parts.storage),
        "volumeMounts": mounts,
        "securityContext": security,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": profile_job_name(service, pool_name, attempt),
            "namespace": namespace,
            "labels": managed(labels),
        },
        "spec": {
            "backoffLimit": 2,
            "ttlSecondsAfterFinished": 3600,
            "template": {
                "metadata": {"labels": managed(labels)},
                "spec": {
                    "restartPolicy": "Never",
                    "initContainers": [*parts.init_containers, measure],
                    "containers": [publish],
                    "volumes": volumes,
                    "securityContext": pod_template.pod_security(),
                    "serviceAccountName": "exitplan-profiler",
                    **pod_template.node_placement(pool),
                    **pool_images.pod(),
                },
            },
        },
    }
    adopt([job], owner=owner)
    return job


def profile_job_name(service: str, pool: str, attempt: int = 0) -> str:
    """`<svc>-profile-<pool>`, then `-2`, `-3`, ... for re-measurements (Jobs do not re-run)."""
    return dns_name(service, "profile", pool, attempt + 1 if attempt else "")


def profile_name(model: str, pool: str) -> str:
    """The ModelProfile name the operator looks for: `<model>-<pool>`."""
    return dns_name(model, pool)
