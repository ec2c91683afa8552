"""What a service's children are called and how they are labelled: pure, no I/O.

Owns the DNS names of every child (builders.py's table), the labels and the annotation they carry,
the ports the pods listen on and the paths inside the pods (the plan, the control token, the bundle).
Every module that builds, finds or reads a child takes its name and labels from here, so a name is
spelled in one place.
"""

from __future__ import annotations

import hashlib
import posixpath
import re

from exitplan.api.bundle_source import SourceError, parse_bundle_uri
from exitplan.api.manifest import Manifest
from exitplan.api.plan import Cell
from exitplan.operator import bundle_volumes

PORT = 8080
"""The inference port of routers, workers and stages (the Service's port, the hop route's)."""
CONTROL_PORT = 8081
"""The routers' control endpoints (/v1/...): open only to the operator and the service's own pods."""
PLAN_DIR = "/etc/exitplan"
PLAN_PATH = f"{PLAN_DIR}/plan.json"
PROFILE_DIR = "/var/run/exitplan-profile"
CONTROL_DIR = "/var/run/exitplan-control"
TOKEN_KEY = "token"
TOKEN_PATH = f"{CONTROL_DIR}/{TOKEN_KEY}"

L_SERVICE, L_SPLIT, L_BUCKET, L_POOL = (
    "exitplan.io/service",
    "exitplan.io/split",
    "exitplan.io/bucket",
    "exitplan.io/pool",
)
L_COMPONENT = "app.kubernetes.io/component"
A_PLAN_HASH = "exitplan.io/plan-hash"
MANAGED = {"app.kubernetes.io/name": "exitplan", "app.kubernetes.io/managed-by": "exitplan-operator"}
L_INSTANCE = "app.kubernetes.io/instance"
"""The EarlyExitService a child and its pods belong to (the recommended label; never in a selector, which
a Deployment cannot change)."""
L_SENDS_TO = "exitplan.io/sends-to"
"""On router pods: the split they send inputs to (0, or 1 when they run split 0 themselves). The
service's NetworkPolicies admit a router to that split only (network_policies.py); never in a selector."""


def managed(labels: dict[str, str]) -> dict[str, str]:
    """`labels` with the managed-by labels, and the instance label where they name a service."""
    instance = {L_INSTANCE: labels[L_SERVICE]} if L_SERVICE in labels else {}
    return {**MANAGED, **instance, **labels}


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


def metadata(name: str, namespace: str, labels: dict[str, str], plan_hash: str) -> Manifest:
    """A child's metadata: its name, the managed-by labels with `labels`, the plan-hash annotation."""
    return {
        "name": name,
        "labels": managed(labels),
        "annotations": {A_PLAN_HASH: plan_hash},
        "namespace": namespace,
    }


def selector_labels(service: str, component: str, cell: Cell | None = None, split: int | None = None) -> dict[str, str]:
    labels = {L_SERVICE: service, L_COMPONENT: component}
    if cell is not None:
        labels.update({L_SPLIT: str(cell.split), L_BUCKET: str(cell.bucket), L_POOL: cell.pool})
    elif split is not None:
        labels[L_SPLIT] = str(split)
    return labels
