"""The parts of a pod that bring it its bundle, for each source `spec.model.bundle` names
(exitplan.api.bundle_source): pure, like pod_template.py, which puts them into every router, worker and
stage pod (and builders.py into the profiling Job).

| source | volume `bundle` | init containers | the pod reads |
|---|---|---|---|
| a path, file:// | hostPath (the operator's allowed prefixes only: guards.py) | none | the path |
| pvc://CLAIM/PATH | the claim, read-only, subPath PATH | storage-init --verify-only | BUNDLE_DIR |
| s3://, https://, http:// | emptyDir | storage-init: fetch, verify | BUNDLE_DIR |
| oci://IMAGE | emptyDir | bundle-image (IMAGE: `cp -R /bundle/. BUNDLE_DIR`), storage-init --verify-only | BUNDLE_DIR |

storage-init is `exitplan storage-init URI BUNDLE_DIR` in the pod's own image (storage/initializer.py):
it fetches the bundle and verifies every file against bundle.yaml's digests; when it cannot, it exits
1 with a one-line reason as its termination message, the pod stays in Init (the kubelet retries with
back-off) and the operator reports the service Degraded, reason BundleFetchFailed (bundle_health.py).
storage-init unpacks within limits (storage/limits.py: size, members, compression ratio), the
size being spec.model.bundleSize or the operator's default; the bundle's emptyDir gets a sizeLimit from
that bound (twice it for a tarball, which unpacks beside its download) and the containers
ephemeral-storage limits (requests too when bundleSize is stated: BundleParts.storage).
The main containers mount the bundle read-only. An s3:// bundle's Secret (spec.model.bundleSecret)
reaches only storage-init, as its environment (envFrom).

oci:// needs a bundle image with `cp` and the bundle at /bundle, readable by uid 10001, e.g.
`FROM busybox:1.37` + `COPY --chmod=0755 minilm/ /bundle/`. Kubernetes' image volumes (`volumes[].image`,
beta from 1.33) would mount such an image without the copy; the operator does not use them yet, since
not every cluster it supports (1.29 and later) has them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from exitplan.api.bundle_source import HTTP, IMAGE_BUNDLE_DIR, LOCAL, OCI, PVC, BundleSource, parse_bundle_uri
from exitplan.api.manifest import Manifest
from exitplan.api.resources import ModelRef
from exitplan.operator.images import Images
from exitplan.storage.limits import ArchiveLimits

BUNDLE_DIR = "/var/run/exitplan-bundle"
"""Where a pod reads a remote bundle (an emptyDir storage-init fills, or the claim's directory)."""
VOLUME = "bundle"
STORAGE_INIT = "storage-init"
IMAGE_COPY = "bundle-image"
INIT_RESOURCES = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
MiB = 1024 * 1024
SLACK = 64 * MiB
"""Beside the bundle in its volume: the download's partial file, the fetch marker."""
LIMITS = ArchiveLimits.from_env()
"""What storage-init may unpack (storage/limits.py): the operator's env (the chart's operator.extraEnv),
passed to every storage-init; spec.model.bundleSize replaces max_bytes for its service."""


def mib(n: int) -> str:
    """`n` bytes as a Kubernetes quantity, rounded up to whole MiB."""
    return f"{-(-n // MiB)}Mi"


@dataclass
class BundleParts:
    path: str
    """The bundle directory the pod's commands are given (`--bundle`)."""
    volumes: list[Manifest] = field(default_factory=list)
    mounts: list[Manifest] = field(default_factory=list)
    """The main containers' (read-only)."""
    init_containers: list[Manifest] = field(default_factory=list)
    storage: tuple[int, int] = (0, 0)
    """Ephemeral storage the bundle takes in the pod, in bytes: (request, limit) — its emptyDir's."""


def bundle_bytes(model: ModelRef) -> int:
    """The most a remote bundle may unpack to: spec.model.bundleSize, else the operator's default limit."""
    return model.bundle_size or LIMITS.max_bytes


def volume_bytes(model: ModelRef, source: BundleSource) -> int:
    """The bundle emptyDir's sizeLimit: the bundle, and while it unpacks a tarball its download beside it."""
    return bundle_bytes(model) * (2 if source.tarball else 1) + SLACK


def source_of(model: ModelRef) -> BundleSource:
    return parse_bundle_uri(model.bundle)


def _storage_init(model: ModelRef, source: BundleSource, images: Images, security: Manifest) -> Manifest:
    verify_only = source.kind in (PVC, OCI)
    args = [model.bundle, BUNDLE_DIR]
    if verify_only:
        args.append("--verify-only")
    if model.bundle_sha256:
        args += ["--sha256", model.bundle_sha256]
    if not verify_only:
        limits = ["--max-bytes", str(bundle_bytes(model)), "--max-files", str(LIMITS.max_files)]
        args += [*limits, "--max-ratio", f"{LIMITS.max_ratio:g}"]
    if source.kind == HTTP and source.location.startswith("http://"):
        args.append("--allow-http")  # the spec says http:// on purpose; the sha256 still pins the content
    mount: Manifest = {"name": VOLUME, "mountPath": BUNDLE_DIR, "readOnly": verify_only}
    if source.kind == PVC and source.path:
        mount["subPath"] = source.path
    container: Manifest = {
        "name": STORAGE_INIT,
        **images.container(),
        "command": ["exitplan", "storage-init"],
        "args": args,
        "resources": init_resources(model, source),
        "volumeMounts": [mount],
        "securityContext": security,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if model.bundle_secret:
        container["envFrom"] = [{"secretRef": {"name": model.bundle_secret}}]
    return container


def init_resources(model: ModelRef, source: BundleSource) -> Manifest:
    """A bundle init container's resources: it fills the bundle's emptyDir (its ephemeral storage)."""
    size = volume_bytes(model, source)
    return with_storage(INIT_RESOURCES, (size if model.bundle_size else SLACK, size + SLACK))


def _image_copy(model: ModelRef, source: BundleSource, images: Images, security: Manifest) -> Manifest:
    return {
        "name": IMAGE_COPY,
        "image": source.location,
        "imagePullPolicy": images.pull_policy,
        "command": ["cp", "-R", f"{IMAGE_BUNDLE_DIR}/.", BUNDLE_DIR],
        "resources": init_resources(model, source),
        "volumeMounts": [{"name": VOLUME, "mountPath": BUNDLE_DIR}],
        "securityContext": security,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def with_storage(resources: Manifest, storage: tuple[int, int]) -> Manifest:
    """`resources` with ephemeral-storage (request, limit) in bytes added (a zero request: none)."""
    request, limit = storage
    requests = {**resources.get("requests", {}), **({"ephemeral-storage": mib(request)} if request else {})}
    return {"requests": requests, "limits": {**resources.get("limits", {}), "ephemeral-storage": mib(limit)}}


def bundle_parts(model: ModelRef, images: Images, security: Manifest, host_path: str) -> BundleParts:
    """Volumes, main-container mounts and init containers for the bundle; `host_path` is the normalised
    path of a local bundle (names.bundle_path), `images` the pod's image settings, `security` the
    containers' securityContext."""
    source = source_of(model)
    if source.kind == LOCAL:
        parts = BundleParts(host_path)
        if host_path.startswith("/"):  # a node-local bundle directory (kind extraMounts, a shared disk)
            parts.volumes.append({"name": VOLUME, "hostPath": {"path": host_path, "type": "Directory"}})
            parts.mounts.append({"name": VOLUME, "mountPath": host_path, "readOnly": True})
        return parts
    parts = BundleParts(BUNDLE_DIR)
    mount: Manifest = {"name": VOLUME, "mountPath": BUNDLE_DIR, "readOnly": True}
    if source.kind == PVC:
        parts.volumes.append(
            {"name": VOLUME, "persistentVolumeClaim": {"claimName": source.location, "readOnly": True}}
        )
        if source.path:
            mount["subPath"] = source.path
    else:
        size = volume_bytes(model, source)
        parts.volumes.append({"name": VOLUME, "emptyDir": {"sizeLimit": mib(size)}})
        parts.storage = (model.bundle_size + SLACK if model.bundle_size else 0, size)
    parts.mounts.append(mount)
    if source.kind == OCI:
        parts.init_containers.append(_image_copy(model, source, images, security))
    parts.init_containers.append(_storage_init(model, source, images, security))
    return parts
