"""The operator's guard rails that do not depend on a cluster: its settings, and which bundle host
paths it lets a service mount.

A bundle given as an absolute path (`spec.model.bundle: /var/lib/bundles/minilm`, or `file://...`) is
mounted into every router, worker and profiling pod as a hostPath volume: the node's directory. Anyone
who may create an EarlyExitService could otherwise mount the node's `/etc` or `/var/lib/kubelet`.
So the operator mounts host paths only under the prefixes its administrator allows (env
EXITPLAN_ALLOWED_HOST_PATHS, `exitplan operator --allow-host-path`, chart value
`operator.allowedHostPathPrefixes`; none by default). The path is normalised first (names.bundle_path:
`/opt/b/../../etc` is `/etc`), and a prefix matches whole path components (`/opt/b` allows `/opt/b` and
`/opt/b/x`, not `/opt/bx`). A relative path is refused too: a pod's working folder is not the one the path was
written in (`exitplan apply` resolves one against the current folder, once, before it reaches the
API). A refused path makes the service PlanInfeasible (reason BundleRefused) with a Warning event
naming spec.model.bundle and the fix; nothing is created and nothing is retried until the spec changes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from exitplan.api.bundle_source import parse_bundle_uri
from exitplan.api.resources import EarlyExitServiceSpec, GPUPoolSpec
from exitplan.operator import drift, names

ENV_ALLOWED = "EXITPLAN_ALLOWED_HOST_PATHS"
ENV_NAMESPACES = "EXITPLAN_NAMESPACES"
ENV_PROFILE_ATTEMPTS = "EXITPLAN_PROFILE_ATTEMPTS"
ENV_PROFILE_RETRY = "EXITPLAN_PROFILE_RETRY_SECONDS"
ENV_DRIFT_READS = "EXITPLAN_DRIFT_READS"
ENV_TICK = "EXITPLAN_TICK_SECONDS"
ENV_NETWORK_POLICIES = "EXITPLAN_NETWORK_POLICIES"
ENV_OPERATOR_NAMESPACE = "EXITPLAN_OPERATOR_NAMESPACE"
ENV_OPERATOR_LABELS = "EXITPLAN_OPERATOR_LABELS"
OPERATOR_LABELS = (("app.kubernetes.io/name", "exitplan"), ("app.kubernetes.io/component", "operator"))
"""The operator pods' labels when EXITPLAN_OPERATOR_LABELS is unset (the chart sets its selector labels)."""
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
    drift_reads: int = drift.CHECKS_PER_PERIOD
    """Reads of each service's routers per spec.planner.periodSeconds (1 to drift.MAX_CHECKS_PER_PERIOD; at most one
    per timer tick): more detect a shift sooner (driftloop.py) at more of the operator's CPU per period."""
    tick_seconds: float = 5.0
    """Seconds between two ticks of a service's drift loop (`exitplan operator --tick`; handlers.ticks)."""
    network_policies: bool = False
    """Give every service its own NetworkPolicies (network_policies.py; chart value
    networkPolicy.perService). Off unless set: they isolate the pods, and the chart's namespace-wide
    policies open what is not per service (DNS, metrics, the bundle store)."""
    operator_namespace: str = ""
    """The operator's namespace, whose pods the routers' control port admits (empty: the service's)."""
    operator_labels: tuple[tuple[str, str], ...] = OPERATOR_LABELS
    """The operator pods' labels (`k=v,k=v` in the env): the routers' control port admits them."""

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ if env is None else env)
        prefixes = [names.normalize_host_path(p) for p in split_list(env.get(ENV_ALLOWED, "")) if p.startswith("/")]
        return cls(
            allowed_host_paths=tuple(dict.fromkeys(prefixes)),
            namespaces=tuple(p for p in (n.strip() for n in env.get(ENV_NAMESPACES, "").split(",")) if p),
            profile_attempts=max(1, int(env.get(ENV_PROFILE_ATTEMPTS) or cls.profile_attempts)),
            profile_retry_seconds=max(0.1, float(env.get(ENV_PROFILE_RETRY) or cls.profile_retry_seconds)),
            drift_reads=min(drift.MAX_CHECKS_PER_PERIOD, max(1, int(env.get(ENV_DRIFT_READS) or cls.drift_reads))),
            tick_seconds=max(0.0001, float(env.get(ENV_TICK) or cls.tick_seconds)),
            network_policies=env.get(ENV_NETWORK_POLICIES, "").strip().lower() in ("1", "true", "yes", "on"),
            operator_namespace=env.get(ENV_OPERATOR_NAMESPACE, "").strip(),
            operator_labels=label_pairs(env.get(ENV_OPERATOR_LABELS, "")) or OPERATOR_LABELS,
        )

    def retry_delay(self, failures: int) -> float:
        """Seconds to wait after `failures` failed Jobs before the next one (exponential, at most an hour)."""
        return min(3600.0, self.profile_retry_seconds * 2.0 ** max(0, failures - 1))


def label_pairs(value: str) -> tuple[tuple[str, str], ...]:
    """`k=v,k=v` as (key, value) pairs; ValueError naming the env variable for an item without `=`."""
    items = [item.strip() for item in value.split(",") if item.strip()]
    bad = [item for item in items if "=" not in item or not item.split("=", 1)[0].strip()]
    if bad:
        raise ValueError(f"{ENV_OPERATOR_LABELS} takes key=value pairs separated by commas, got {bad}")
    return tuple((k.strip(), v.strip()) for k, v in (item.split("=", 1) for item in items))


def under(path: str, prefix: str) -> bool:
    """`path` is `prefix` or inside it (whole path components; both normalised)."""
    return prefix == "/" or path == prefix or path.startswith(prefix.rstrip("/") + "/")


def host_path(spec: EarlyExitServiceSpec) -> str | None:
    """The node directory the service's pods would mount (None: the bundle is not a host path; remote
    sources, pvc:// s3:// https:// oci://, mount no node directory)."""
    if parse_bundle_uri(spec.model.bundle).remote:
        return None
    path = names.bundle_path(spec.model.bundle)
    return path if path.startswith("/") else None


def relative_path(spec: EarlyExitServiceSpec) -> bool:
    """The bundle is a relative path (`artifacts/bundles/minilm`, `file://models/x`): a pod's working
    folder is not the folder it was written in, so no pod can resolve it."""
    if parse_bundle_uri(spec.model.bundle).remote:
        return False
    return not names.bundle_path(spec.model.bundle).startswith("/")


def relative_refusal(given: str, settings: Settings) -> str:
    """What a relative bundle path is refused with: the field, why, and what to write instead."""
    where = (
        f"an absolute path under an allowed prefix ({list(settings.allowed_host_paths)})"
        if settings.allowed_host_paths
        else "an absolute path under a prefix the operator allows (it allows none now)"
    )
    return (
        f"spec.model.bundle {given} is a relative path: the pods cannot resolve it (their working folder "
        f"is not the one it was written in). Write {where}, or a remote source (pvc://, s3://, https://, "
        f"oci://); `exitplan apply -f FILE` resolves a relative path against the current folder once, "
        f"for pods that run on this machine (exitplan dev-cluster)"
    )


def bundle_refusal(spec: EarlyExitServiceSpec, settings: Settings) -> str | None:
    """Why the service's bundle may not be mounted (None: it may): a message that names the field,
    the path and what to write instead (a relative path, which no pod can resolve) or how to allow
    it (a path outside the allowed prefixes)."""
    if relative_path(spec):
        return relative_refusal(spec.model.bundle, settings)
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


def capacity_refusal(pools: Mapping[str, GPUPoolSpec], own: Mapping[str, int]) -> str | None:
    """Why the service can run nothing at all (None: some pool has room for it): every pool it names
    has no capacity for it, its own `capacity` 0 or the service's `maxGpus` 0 (`pools`: capacities
    already capped by maxGpus; `own`: each pool's own). Reported at once, reason PoolCapacity, before
    any profiling Job: a Job measures a pool for plans that could place nothing on it."""
    if not pools or any(pool.capacity > 0 for pool in pools.values()):
        return None
    why = [
        f"{name}: capacity {own.get(name, 0)}" + (f", spec.pools maxGpus {pool.capacity}" if own.get(name) else "")
        for name, pool in pools.items()
    ]
    return (
        f"no pool in spec.pools has capacity for this service ({'; '.join(why)}), so no plan can place a "
        f"worker and no profiling Job runs. Raise the GPUPool's spec.capacity (kubectl patch gpupool NAME "
        f'--type merge -p \'{{"spec": {{"capacity": N}}}}\'), the service\'s maxGpus, or name a pool with '
        f"capacity in spec.pools; it plans as soon as one has room"
    )
