"""Helpers shared by the chart, RBAC and dashboard tests: render charts/exitplan offline with
helm-python-sdk (Helm's own Go code, no cluster, no helm binary) and parse what it renders.

This module holds no tests itself.
"""

from __future__ import annotations

import copy
import functools
import shutil
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "exitplan"
RELEASE, NAMESPACE = "exitplan", "exitplan-system"

PROMETHEUS_PEER = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
}
CLIENT_PEER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "clients"}}}

ALL_ON: dict[str, Any] = {
    "operator": {
        "replicas": 3,
        "verbose": True,
        "podAnnotations": {"example.com/team": "ml"},
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "control", "effect": "NoSchedule"}],
        "priorityClassName": "system-cluster-critical",
        "imagePullSecrets": [{"name": "regcred"}],
        "image": {"repository": "registry.example.com/exitplan-operator", "digest": "sha256:" + "0f" * 32},
        "podLabels": {"example.com/team": "ml"},
        "extraArgs": ["--profile-attempts", "5"],
        "extraEnv": [{"name": "EXITPLAN_EXTRA", "value": "1"}],
        "topologySpreadConstraints": [
            {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway"}
        ],
        "podDisruptionBudget": {"enabled": True, "maxUnavailable": 1},
    },
    "crds": {"enabled": True, "keep": False},
    "leaderElection": {"enabled": True, "installPeeringCRD": True},
    "namespaces": {"services": ["default", "ml-serving"]},
    "metrics": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "podMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "prometheusRule": {"enabled": True},
    },
    "networkPolicy": {
        "enabled": True,
        "maxSplits": 4,
        "metricsFrom": [PROMETHEUS_PEER],
        "routerIngressFrom": [CLIENT_PEER],
    },
    "dashboards": {"enabled": True, "namespace": "monitoring"},
    "serviceAccount": {"create": True, "annotations": {"example.com/role": "operator"}},
}
"""Every toggle on (cluster-wide mode)."""

RESTRICTED: dict[str, Any] = {
    "namespaces": {"services": ["team-a", "team-b"], "restrictWatch": True},
    "networkPolicy": {"enabled": True},
}
"""The operator restricted to two namespaces (namespaced Roles), policies on."""

VARIANTS: dict[str, dict[str, Any]] = {"defaults": {}, "all-on": ALL_ON, "restricted": RESTRICTED}


@functools.lru_cache(maxsize=1)
def chart() -> Any:
    import helm_python

    helm_python.disable_logging()
    return helm_python.Chart.load(CHART)


def render_raw(values: dict[str, Any] | None = None, namespace: str = NAMESPACE) -> dict[str, str]:
    """Template path -> rendered text (NOTES.txt included), as `helm template` renders it."""
    return chart().render(copy.deepcopy(values or {}), name=RELEASE, namespace=namespace, is_install=True)


def _objects(rendered: dict[str, str]) -> list[dict[str, Any]]:
    out = []
    for name, text in sorted(rendered.items()):
        if name.endswith("NOTES.txt"):
            continue
        out.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return out


@functools.lru_cache(maxsize=16)
def _render_cached(key: str) -> tuple[dict[str, Any], ...]:
    return tuple(_objects(render_raw(yaml.safe_load(key))))


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The rendered objects (the CRDs too: they are templates, templates/crds.yaml)."""
    return copy.deepcopy(list(_render_cached(yaml.safe_dump(values or {}, sort_keys=True))))


def chart_copy(dest: Path) -> Path:
    """A copy of the chart to edit (links dereferenced, as `helm package` stores them)."""
    return Path(shutil.copytree(CHART, dest / CHART.name))


def render_dir(chart_dir: Path, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The objects a chart directory renders (as `render` does for charts/exitplan)."""
    import helm_python

    loaded = helm_python.Chart.load(chart_dir)
    try:
        return _objects(loaded.render(copy.deepcopy(values or {}), name=RELEASE, namespace=NAMESPACE, is_install=True))
    finally:
        loaded.close()


def crd_objects(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """exitplan's own CRDs as the chart renders them (kopf's peering CRD left out)."""
    return [o for o in of_kind(render(values), "CustomResourceDefinition") if o["spec"]["group"] == "exitplan.io"]


def of_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict[str, Any]], kind: str, name: str | None = None, namespace: str | None = None) -> dict[str, Any]:
    found = [
        o
        for o in of_kind(objs, kind)
        if (name is None or o["metadata"]["name"] == name)
        and (namespace is None or o["metadata"].get("namespace") == namespace)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''} in {namespace or 'any namespace'}, found {len(found)}"
    return found[0]


def operator_pod(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objs, "StatefulSet")["spec"]["template"]


def operator_settings(objs: list[dict[str, Any]]) -> Any:
    """The operator's settings (guards.Settings) from the env the chart gives its container."""
    from exitplan.operator import guards

    env = operator_pod(objs)["spec"]["containers"][0]["env"]
    return guards.Settings.from_env({e["name"]: e["value"] for e in env if "value" in e})


def build_children(
    splits: int = 5, colocate: bool = False, chart_objs: list[dict[str, Any]] | None = None, name: str = "minilm"
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Children of a real plan built by the operator's own builders (and a profiling Job); `colocate`: the
    routers run split 0 themselves; `chart_objs`: a rendered chart whose operator settings decide the
    service's own NetworkPolicies (operator/network_policies.py), added to the children."""
    from exitplan.api.plan import Cell, Plan, SplitPlan
    from exitplan.api.resources import EarlyExitServiceSpec, GPUPoolSpec
    from exitplan.operator import builders, network_policies

    spec = EarlyExitServiceSpec.model_validate(
        {
            "model": {"name": "minilm", "bundle": "/var/lib/exitplan/bundles/minilm"},
            "slo": {"latencyMs": 100},
            "pools": [{"name": "gpu-a"}],
        }
    )
    plan = Plan(
        service=name,
        model="minilm",
        splits=[SplitPlan(index=i, first_block=i, last_block=i) for i in range(splits)],
        buckets=[128],
        cells=[Cell(split=i, bucket=128, pool="gpu-a", replicas=1, batch_size=8) for i in range(splits)],
        colocate=colocate,
    )
    owner = {
        "apiVersion": "exitplan.io/v1alpha1",
        "kind": "EarlyExitService",
        "metadata": {"name": name, "namespace": "default", "uid": f"0000-{name}"},
    }
    pools = {"gpu-a": GPUPoolSpec(capacity=8)}
    children = builders.build_children(owner, spec, plan, pools)
    job = builders.build_profile_job(owner, spec, "gpu-a", pools["gpu-a"], builders.profile_name("minilm", "gpu-a"))
    if chart_objs is not None:
        children = network_policies.with_network_policies(owner, plan, operator_settings(chart_objs), children)
    return children, job
