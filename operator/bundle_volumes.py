"""The parts of a pod that bring it its bundle, for each source `spec.model.bundle` names
(exitplan.api.bundle_source): pure, like builders.py, which puts them into every router, worker and
profiling pod.

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
The main containers mount the bundle read-only. An s3:// bundle's Secret (spec.model.bundleSecret)
reaches only storage-init, as its environment (envFrom).

oci:// needs a bundle image with `cp` and the bundle at /bundle, readable by uid 10001, e.g.
`FROM busybox:1.37` + `COPY --chmod=0755 minilm/ /bundle/`. Kubernetes' image volumes (`volumes[].image`,
beta from 1.33) would mount such an image without the copy; the operator does not use them yet, since
not every cluster it supports (1.29 and later) has them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from exitplan.api.bundle_source import HTTP, IMAGE_BUNDLE_DIR, LOCAL, OCI, PVC, BundleSource, parse_bundle_uri
from exitplan.api.resources import ModelRef
from exitplan.operator.images import Images

Manifest = dict[str, Any]

BUNDLE_DIR = "/var/run/exitplan-bundle"
"""Where a pod reads a remote bundle (an emptyDir storage-init fills, or the claim's directory)."""
VOLUME = "bundle"
STORAGE_INIT = "storage-init"
IMAGE_COPY = "bundle-image"
INIT_RESOURCES = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}


@dataclass
class BundleParts:
    path: str
    """The bundle directory the pod's commands are given (`--bundle`)."""
    volumes: list[Manifest] = field(default_factory=list)
    mounts: list[Manifest] = field(default_factory=list)
    """The main containers' (read-only)."""
    init_containers: list[Manifest] = field(default_factory=list)


def source_of(model: ModelRef) -> BundleSource:
    return parse_bundle_uri(model.bundle)


def _storage_init(model: ModelRef, source: BundleSource, images: Images, security: Manifest) -> Manifest:
    verify_only = source.kind in (PVC, OCI)
    args = [model.bundle, BUNDLE_DIR]
    if verify_only:
        args.append("--verify-only")
    if model.bundle_sha256:
        args += ["--sha256", model.bundle_sha256]
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
        "resources": INIT_RESOURCES,
        "volumeMounts": [mount],
        "securityContext": security,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if model.bundle_secret:
        container["envFrom"] = [{"secretRef": {"name": model.bundle_secret}}]
    return container


def _image_copy(source: BundleSource, images: Images, security: Manifest) -> Manifest:
    return {
        "name": IMAGE_COPY,
        "image": source.location,
        "imagePullPolicy": images.pull_policy,
        "command": ["cp", "-R", f"{IMAGE_BUNDLE_DIR}/.", BUNDLE_DIR],
        "resources": INIT_RESOURCES,
        "volumeMounts": [{"name": VOLUME, "mountPath": BUNDLE_DIR}],
        "securityContext": security,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def bundle_parts(model: ModelRef, images: Images, security: Manifest, host_path: str) -> BundleParts:
    """Volumes, main-container mounts and init containers for the bundle; `host_path` is the normalised
    path of a local bundle (builders.bundle_path), `images` the pod's image settings, `security` the
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
        parts.volumes.append({"name": VOLUME, "emptyDir": {}})
    parts.mounts.append(mount)
    if source.kind == OCI:
        parts.init_containers.append(_image_copy(source, images, security))
    parts.init_containers.append(_storage_init(model, source, images, security))
    return parts
