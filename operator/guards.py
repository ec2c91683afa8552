"""The operator's guard rails that do not depend on a cluster: its settings, and which bundle host
paths it lets a service mount.

A bundle given as an absolute path (`spec.model.bundle: /var/lib/bundles/minilm`, or `file://...`) is
mounted into every router, worker and profiling pod as a hostPath volume: the node's directory. Anyone
who may create an EarlyExitService could otherwise mount the node's `/etc` or `/var/lib/kubelet`.
So the operator mounts host paths only under the prefixes its administrator allows (env
EXITPLAN_ALLOWED_HOST_PATHS, `exitplan operator --allow-host-path`, chart value
`operator.allowedHostPathPrefixes`; none by default). The path is normalised first (builders.bundle_path:
`/opt/b/../../etc` is `/etc`), and a prefix matches whole path components (`/opt/b` allows `/opt/b` and
`/opt/b/x`, not `/opt/bx`). A refused path makes the service PlanInfeasible (reason BundleRefused)
with a Warning event; nothing is created and nothing is retried until the spec changes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from exitplan.api.bundle_source import parse_bundle_uri
from exitplan.api.resources import EarlyExitServiceSpec
from exitplan.operator import builders

ENV_ALLOWED = "EXITPLAN_ALLOWED_HOST_PATHS"
ENV_NAMESPACES = "EXITPLAN_NAMESPACES"
ENV_PROFILE_ATTEMPTS = "EXITPLAN_PROFILE_ATTEMPTS"
ENV_PROFILE_RETRY = "EXITPLAN_PROFILE_RETRY_SECONDS"
REFUSED = "BundleRefused"
"""The reason of the PlanInfeasible condition and of the Warning event of a refused bundle path."""


def split_list(value: str) -> list[str]:
    """A comma- or colon-separated setting as its non-empty items."""
    return [item.strip() for item in re.split(r"[,:]", value) if item.strip()]


@dataclass(frozen=True)
class Settings:
    """What the operator's administrator decides (env, set by `exitplan operator`'s options)."""

    allowed_host_paths: tuple[str, ...] = ()
    """Normalised absolute prefixes under which a bundle may be a host path (empty: none)."""
    namespaces: tuple[str, ...] = ()
    """The namespaces the operator serves (empty: all). Pool capacity is accounted over their services."""
    profile_attempts: int = 3
    """Profiling Jobs per pool and spec generation before the operator gives up (ProfilingFailed)."""
    profile_retry_seconds: float = 30.0
    """Wait after the first failed profiling Job; doubled after each further failure."""

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ if env is None else env)
        prefixes = [builders.normalize_host_path(p) for p in split_list(env.get(ENV_ALLOWED, "")) if p.startswith("/")]
        return cls(
            allowed_host_paths=tuple(dict.fromkeys(prefixes)),
            namespaces=tuple(p for p in (n.strip() for n in env.get(ENV_NAMESPACES, "").split(",")) if p),
            profile_attempts=max(1, int(env.get(ENV_PROFILE_ATTEMPTS) or cls.profile_attempts)),
            profile_retry_seconds=max(0.1, float(env.get(ENV_PROFILE_RETRY) or cls.profile_retry_seconds)),
        )

    def retry_delay(self, failures: int) -> float:
        """Seconds to wait after `failures` failed Jobs before the next one (exponential, at most an hour)."""
        return min(3600.0, self.profile_retry_seconds * 2 ** max(0, failures - 1))


def under(path: str, prefix: str) -> bool:
    """`path` is `prefix` or inside it (whole path components; both normalised)."""
    return prefix == "/" or path == prefix or path.startswith(prefix.rstrip("/") + "/")


def host_path(spec: EarlyExitServiceSpec) -> str | None:
    """The node directory the service's pods would mount (None: the bundle is not a host path; remote
    sources, pvc:// s3:// https:// oci://, mount no node directory)."""
    if parse_bundle_uri(spec.model.bundle).remote:
        return None
    path = builders.bundle_path(spec.model.bundle)
    return path if path.startswith("/") else None


def bundle_refusal(spec: EarlyExitServiceSpec, settings: Settings) -> str | None:
    """Why the service's bundle may not be mounted (None: it may): a message that names the path
    and how to allow it."""
    path = host_path(spec)
    if path is None or any(under(path, prefix) for prefix in settings.allowed_host_paths):
        return None
    given = spec.model.bundle
    shown = path if given in (path, f"file://{path}") else f"{given} (that is {path})"
    allowed = (
        f"the allowed prefixes are {list(settings.allowed_host_paths)}"
        if settings.allowed_host_paths
        else "this operator allows no host paths"
    )
    return (
        f"spec.model.bundle {shown} is a host path: its pods would mount that directory of the node, and "
        f"{allowed}. Put the bundle under an allowed prefix, or have the cluster administrator allow the "
        f"path's prefix (chart value operator.allowedHostPathPrefixes; `exitplan operator --allow-host-path "
        f"PREFIX`; env {ENV_ALLOWED})"
    )
