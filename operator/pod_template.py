"""The pod template every router, worker, generation stage and operator Job is built from: pure, no I/O.

Owns what the pods of a service share, whatever they run: the secure defaults (non-root, no privilege
escalation, a read-only root filesystem, every capability dropped), the health probes and the
preStop drain, the environment, the resources and placement a GPUPool gives, the volumes (the plan,
the control token, the bundle: bundle_volumes.py) and the Deployment around a container. The
children builders (builders.py, generation_builders.py, bundle_info.py's Job) put a command into it.
"""

from __future__ import annotations

from dataclasses import dataclass

from exitplan.api.manifest import Manifest
from exitplan.api.resources import GPUPoolSpec, ModelRef
from exitplan.operator import bundle_volumes, images
from exitplan.operator.images import Images
from exitplan.operator.names import (
    CONTROL_DIR,
    PLAN_DIR,
    PORT,
    bundle_path,
    control_secret_name,
    managed,
    metadata,
    plan_configmap_name,
)

PRESTOP_SLEEP_S = 5
"""Seconds a router or worker pod waits between leaving its endpoints and its SIGTERM."""
RUN_AS = 10001
"""The uid, gid and fsGroup of every pod (the image's user)."""


@dataclass(frozen=True)
class PodParts:
    """What a router's, worker's or stage's pod on a pool gets besides its command."""

    image: Manifest
    """The container's `image` and `imagePullPolicy` (the pool's, else the operator's)."""
    resources: Manifest
    volumes: list[Manifest]
    mounts: list[Manifest]
    """The main container's volume mounts."""
    pod_extra: Manifest
    """What the pod spec adds: placement, the bundle's init containers, the image pull Secrets."""


def pod_security() -> Manifest:
    """A pod's securityContext."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "fsGroup": RUN_AS,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security() -> Manifest:
    """A container's securityContext (init containers' too)."""
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}


STARTUP_SECONDS = 600
"""How long a serving container may take to start (load its bundle, warm up) before the kubelet
restarts it: its startupProbe's period x failureThreshold. The liveness probe counts only after it."""


def probes() -> Manifest:
    """The startup, liveness and readiness probes of a serving container (the V2 health routes): the
    startup probe gives a large model STARTUP_SECONDS to load before liveness can restart it."""

    def probe(path: str, period: int, failures: int) -> Manifest:
        return {
            "httpGet": {"path": path, "port": "http"},
            "periodSeconds": period,
            "failureThreshold": failures,
            "timeoutSeconds": 2,
        }

    return {
        "startupProbe": probe("/v2/health/live", 5, STARTUP_SECONDS // 5),
        "livenessProbe": probe("/v2/health/live", 10, 3),
        "readinessProbe": probe("/v2/health/ready", 2, 2),
    }


def prestop() -> Manifest:
    """Routers and workers sleep PRESTOP_SLEEP_S before their SIGTERM: the pod is already out of its
    Service's endpoints (and a split's DNS, which senders re-resolve every 2 s), so by the time the
    process drains (worker_image/serve.py: readiness off, in-flight requests answered, at most 20 s)
    no new connection is on its way to it. terminationGracePeriodSeconds (30) covers both."""
    return {"lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_S)]}}}}


def env(service: str, namespace: str) -> list[Manifest]:
    """A serving container's environment: the service it belongs to and the pod's own name and IP."""
    return [
        {"name": "EXITPLAN_SERVICE", "value": service},
        {"name": "EXITPLAN_NAMESPACE", "value": namespace},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]


def resources(pool: GPUPoolSpec | None) -> Manifest:
    """A container's requests and limits on `pool` (its CPU, memory and one GPU; None: 1 CPU, 1 Gi)."""
    cpu, memory = (pool.cpu, pool.memory) if pool else ("1", "1Gi")
    requests: Manifest = {"cpu": cpu, "memory": memory}
    limits: Manifest = {"memory": memory}
    if pool is not None and pool.gpu_resource:
        requests[pool.gpu_resource] = 1
        limits[pool.gpu_resource] = 1
    return {"requests": requests, "limits": limits}


TMP_LIMIT = 2 * 1024**3
"""The sizeLimit of a pod's /tmp emptyDir (the root filesystem is read-only)."""
BASE_STORAGE = (256 * 1024**2, TMP_LIMIT + 256 * 1024**2)
"""Ephemeral storage (request, limit) in bytes a serving container takes besides the bundle: /tmp, its logs."""


def tmp_volume(name: str = "tmp") -> Manifest:
    """An emptyDir for scratch files, bounded (its usage counts against the pod's ephemeral storage)."""
    return {"name": name, "emptyDir": {"sizeLimit": bundle_volumes.mib(TMP_LIMIT)}}


def with_bundle_storage(resources: Manifest, bundle: tuple[int, int]) -> Manifest:
    """A serving container's `resources` with ephemeral-storage: BASE_STORAGE and the bundle's volume
    (bundle_volumes.BundleParts.storage), so that the kubelet schedules and bounds what the pod writes."""
    storage = (BASE_STORAGE[0] + bundle[0], BASE_STORAGE[1] + bundle[1])
    return bundle_volumes.with_storage(resources, storage)


def node_placement(pool: GPUPoolSpec | None) -> Manifest:
    """The pool's nodeSelector and tolerations (nothing without a pool)."""
    out: Manifest = {}
    if pool is not None:
        if pool.node_selector:
            out["nodeSelector"] = dict(pool.node_selector)
        if pool.tolerations:
            out["tolerations"] = [t.dump() for t in pool.tolerations]
    return out


def placement(pool: GPUPoolSpec | None, spread: dict[str, str]) -> Manifest:
    """The pool's nodes, and replicas of `spread` (a label selector) spread over hosts where they can be."""
    term = {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": spread}}
    preferred = [{"weight": 100, "podAffinityTerm": term}]
    affinity = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": preferred}}
    return {"affinity": affinity, **node_placement(pool)}


def _volumes(
    service: str, model: ModelRef, pod_images: Images
) -> tuple[list[Manifest], list[Manifest], Manifest, tuple[int, int]]:
    """A router's or worker's volumes, its container's mounts, what its pod spec adds (the bundle's init
    containers, bundle_volumes.py, and the image pull Secrets) and the bundle's ephemeral storage."""
    volumes: list[Manifest] = [
        {"name": "plan", "configMap": {"name": plan_configmap_name(service)}},
        tmp_volume(),
        {"name": "control-token", "secret": {"secretName": control_secret_name(service), "defaultMode": 0o440}},
    ]
    mounts: list[Manifest] = [
        {"name": "plan", "mountPath": PLAN_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "control-token", "mountPath": CONTROL_DIR, "readOnly": True},
    ]
    parts = bundle_volumes.bundle_parts(model, pod_images, container_security(), bundle_path(model.bundle))
    pod: Manifest = {"initContainers": parts.init_containers} if parts.init_containers else {}
    return volumes + parts.volumes, mounts + parts.mounts, {**pod, **pod_images.pod()}, parts.storage


def on_pool(service: str, model: ModelRef, pool: GPUPoolSpec | None, spread: dict[str, str]) -> PodParts:
    """A serving pod on `pool` (None: on none): its image, resources, volumes and mounts, and its
    placement (replicas of `spread` spread over hosts)."""
    pod_images = images.IMAGES.for_pool(pool)
    volumes, mounts, pod_extra, storage = _volumes(service, model, pod_images)
    return PodParts(
        pod_images.container(),
        with_bundle_storage(resources(pool), storage),
        volumes,
        mounts,
        {**placement(pool, spread), **pod_extra},
    )


def container(
    name: str,
    parts: PodParts,
    service: str,
    namespace: str,
    *,
    command: list[str],
    args: list[str],
    ports: list[Manifest],
) -> Manifest:
    """A serving container of the service: `command` with `args`, listening on `ports` (the first one
    named http, which the probes ask), with the parts' image, resources and mounts and the secure defaults."""
    return {
        "name": name,
        **parts.image,
        "command": command,
        "args": args,
        "ports": ports,
        "env": env(service, namespace),
        "resources": parts.resources,
        "volumeMounts": parts.mounts,
        "securityContext": container_security(),
        **probes(),
    }


def deployment(
    name: str, namespace: str, labels: dict[str, str], plan_hash: str, replicas: int, main: Manifest, parts: PodParts
) -> Manifest:
    """The Deployment of `replicas` pods running the container `main` (rolled one at a time, never
    below `replicas` ready), scraped by Prometheus on the http port."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(name, namespace, labels, plan_hash),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": dict(labels)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {
                    "labels": managed(labels),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(PORT),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": {
                    "containers": [main],
                    "volumes": parts.volumes,
                    "securityContext": pod_security(),
                    "terminationGracePeriodSeconds": 30,
                    "automountServiceAccountToken": False,
                    **parts.pod_extra,
                },
            },
        },
    }
