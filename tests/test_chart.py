"""The Helm chart charts/exitplan, rendered offline with helm-python-sdk (Helm's Go SDK).

What must hold: it renders with the defaults and with every toggle on, lints clean, every object
validates strictly (kubernetes-validate) for Kubernetes 1.29 through the newest bundled version,
bad values fail `helm install` naming the key, the CRDs are templates rendered from the generated
crds/*.yaml (labelled, kept on uninstall, changed by an upgrade), the operator pod has secure
defaults and arguments the real CLI accepts, its template no chart version, and the
NetworkPolicies allow exactly the data plane's paths.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from netpol_eval import Pod, allowed, selects
from packaging.version import Version
from test_chart_support import (
    ALL_ON,
    CHART,
    NAMESPACE,
    PROMETHEUS_PEER,
    RESTRICTED,
    ROOT,
    VARIANTS,
    build_children,
    chart,
    chart_copy,
    crd_objects,
    of_kind,
    one,
    operator_pod,
    operator_settings,
    render,
    render_dir,
    render_raw,
)

helm_python = pytest.importorskip("helm_python", reason="helm-python-sdk is in the dev extra: pip install -e '.[dev]'")
kv = pytest.importorskip("kubernetes_validate.utils", reason="kubernetes-validate is in the dev extra")

MIN_KUBE = Version("1.29")
PER_NAMESPACE = {**ALL_ON, "networkPolicy": {**ALL_ON["networkPolicy"], "perService": False}}
"""ALL_ON with the chart's per-namespace policies instead of the operator's per-service ones."""
ALL_ON_METRICS_PORT = 9464
"""The operator's metrics port in ALL_ON: the chart's default, which is the CLI's (test below)."""


# ------------------------------------------------------------------ rendering and linting


def test_defaults_render_the_operator_rbac_profiler_and_dashboards() -> None:
    objs = render()
    kinds = sorted({o["kind"] for o in objs})
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
        "CustomResourceDefinition",
        "NetworkPolicy",
        "Role",
        "RoleBinding",
        "Service",
        "ServiceAccount",
        "StatefulSet",
    ]
    sts = one(objs, "StatefulSet", "exitplan-operator", NAMESPACE)
    assert sts["spec"]["replicas"] == 1
    assert sorted(o["metadata"]["name"] for o in of_kind(objs, "CustomResourceDefinition")) == [
        "clusterkopfpeerings.kopf.dev",
        "earlyexitservices.exitplan.io",
        "gpupools.exitplan.io",
        "modelprofiles.exitplan.io",
    ]
    assert not of_kind(objs, "PodDisruptionBudget")  # one replica: a budget would block node drains
    # gated off by default (the NetworkPolicies are on: test_default_network_policies_...)
    for kind in ("ServiceMonitor", "PodMonitor"):
        assert not of_kind(objs, kind)
    # the profiler identity lands in the default service namespace
    assert one(objs, "ServiceAccount", "exitplan-profiler", "default")
    dashboards = of_kind(objs, "ConfigMap")  # one per dashboards/*.json
    assert len(dashboards) == len(list((CHART / "dashboards").glob("*.json"))) >= 2
    assert all(d["metadata"]["labels"]["grafana_dashboard"] == "1" for d in dashboards)
    assert not of_kind(objs, "PrometheusRule")


def test_every_toggle_on_renders_monitors_policies_and_peering() -> None:
    objs = render(ALL_ON)
    sm = one(objs, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    assert sm["spec"]["endpoints"][0]["honorLabels"] is True  # keeps the metrics' own `service` label
    pm = one(objs, "PodMonitor")
    assert pm["spec"]["namespaceSelector"]["matchNames"] == ["default", "ml-serving"]
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "http"
    rule = one(objs, "PrometheusRule")  # the alerts (tests/test_prometheus_rules.py)
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack" and rule["spec"]["groups"]
    # per namespace: deny, clients, DNS, metrics (each service's own: the operator's); plus the operator's
    names = sorted(
        o["metadata"]["name"] for o in of_kind(objs, "NetworkPolicy") if o["metadata"]["namespace"] == "default"
    )
    assert names == sorted(
        [
            "exitplan-data-plane-deny",
            "exitplan-router-clients",
            "exitplan-data-plane-dns",
            "exitplan-data-plane-metrics",
        ]
    )
    assert one(objs, "NetworkPolicy", "exitplan-operator", NAMESPACE)
    assert one(objs, "StatefulSet")["spec"]["replicas"] == 3
    pdb = one(objs, "PodDisruptionBudget", "exitplan-operator", NAMESPACE)["spec"]
    assert pdb["maxUnavailable"] == 1 and selects(pdb["selector"], operator_pod(objs)["metadata"]["labels"])
    assert {o["metadata"]["namespace"] for o in of_kind(objs, "ConfigMap")} == {"monitoring"}
    assert {o["metadata"]["namespace"] for o in of_kind(objs, "ServiceAccount")} == {NAMESPACE, "default", "ml-serving"}


def test_toggles_off_render_only_the_operator() -> None:
    objs = render(
        {
            "rbac": {"create": False},
            "serviceAccount": {"create": False, "name": "ops"},
            "profiler": {"create": False},
            "dashboards": {"enabled": False},
            "leaderElection": {"enabled": False},
            "crds": {"enabled": False},
            "networkPolicy": {"enabled": False},
        }
    )
    assert sorted(o["kind"] for o in objs) == ["Service", "StatefulSet"]
    pod = operator_pod(objs)
    assert pod["spec"]["serviceAccountName"] == "ops"
    assert "--peering" not in pod["spec"]["containers"][0]["args"]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_lint_is_clean(variant: str) -> None:
    report = helm_python.lint(CHART, VARIANTS[variant], strict=True, namespace=NAMESPACE, kube_version="v1.29.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], problems or report["errors"]


# ------------------------------------------------------------------ strict validation, 1.29 .. newest


@functools.cache
def _schema(filename: str, version: str) -> Any:
    return _original_schema_contents(filename, version)


_original_schema_contents = kv.schema_contents


def kube_versions() -> list[str]:
    return sorted({v for v in kv.all_versions() if Version(v) >= MIN_KUBE}, key=Version)


def validate(obj: dict[str, Any], version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv, "schema_contents", _schema)  # the same files, read once
    kv.validate(obj, version, strict=True)


# The two prometheus-operator kinds have no schema in kubernetes-validate: their fields used here are
# checked against the monitoring.coreos.com/v1 API (the subset the chart writes, unknown keys refused).
_MONITOR_ENDPOINT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["port"],
    "properties": {
        "port": {"type": "string"},
        "path": {"type": "string"},
        "honorLabels": {"type": "boolean"},
        "interval": {"type": "string", "pattern": "^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"},
        "relabelings": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "sourceLabels": {
                        "type": "array",
                        "items": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"},
                    },
                    "targetLabel": {"type": "string"},
                    "action": {"enum": ["replace", "keep", "drop", "labelmap", "labeldrop", "labelkeep"]},
                    "regex": {"type": "string"},
                    "replacement": {"type": "string"},
                    "separator": {"type": "string"},
                },
            },
        },
    },
}
_RULE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["expr"],
    "oneOf": [{"required": ["record"]}, {"required": ["alert"]}],
    "properties": {
        "record": {"type": "string"},
        "alert": {"type": "string"},
        "expr": {"type": "string", "minLength": 1},
        "for": {"type": "string", "pattern": "^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?)$"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}
_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["key", "operator"],
                "additionalProperties": False,
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}
MONITOR_SCHEMAS = {
    "ServiceMonitor": {
        "selector": _SELECTOR,
        "endpoints": {"type": "array", "minItems": 1, "items": _MONITOR_ENDPOINT},
    },
    "PodMonitor": {
        "selector": _SELECTOR,
        "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": _MONITOR_ENDPOINT},
    },
    "PrometheusRule": {
        "groups": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "rules"],
                "properties": {
                    "name": {"type": "string"},
                    "interval": {"type": "string"},
                    "rules": {"type": "array", "items": _RULE},
                },
            },
        }
    },
}


def validate_monitor(obj: dict[str, Any]) -> None:
    import jsonschema

    spec_props = {
        **MONITOR_SCHEMAS[obj["kind"]],
        "namespaceSelector": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}},
        },
    }
    schema = {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": obj["kind"]},
            "metadata": {"type": "object", "required": ["name", "namespace"]},
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["groups" if obj["kind"] == "PrometheusRule" else "selector"],
                "properties": spec_props,
            },
        },
    }
    jsonschema.validate(obj, schema)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_object_validates_strictly_for_each_kubernetes_version(
    variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    objs = render(VARIANTS[variant])
    assert len(crd_objects(VARIANTS[variant])) == 3
    versions = kube_versions()
    assert versions[0] == "1.29.0" and Version(versions[-1]) >= Version("1.37"), versions
    checked = 0
    for obj in objs:
        if obj["kind"] in MONITOR_SCHEMAS:
            validate_monitor(obj)
            continue
        for version in versions:
            try:
                validate(obj, version, monkeypatch)
            except kv.ValidationError as err:
                path = ".".join(str(p) for p in err.path)
                pytest.fail(
                    f"{obj['kind']}/{obj['metadata']['name']} invalid for Kubernetes {version}: {path}: {err.message}"
                )
            checked += 1
    assert checked >= len(versions) * 10


def test_strict_validation_catches_a_bad_object(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: an unknown container field and a string port are refused."""
    sts = one(render(), "StatefulSet")
    sts["spec"]["template"]["spec"]["containers"][0]["runAsRoot"] = True
    with pytest.raises(kv.ValidationError):
        validate(sts, "1.29.0", monkeypatch)
    svc = one(render(), "Service")
    svc["spec"]["ports"][0]["port"] = "nine"
    with pytest.raises(kv.ValidationError):
        validate(svc, "1.37.0", monkeypatch)
    monitor = one(render(ALL_ON), "PodMonitor")
    monitor["spec"]["podMetricsEndpoint"] = monitor["spec"].pop("podMetricsEndpoints")
    import jsonschema

    with pytest.raises(jsonschema.ValidationError):
        validate_monitor(monitor)


# ------------------------------------------------------------------ bad values fail with the key named


BAD_VALUES = [
    ({"operator": {"replicas": "three"}}, "/operator/replicas"),
    ({"operator": {"replicaz": 2}}, "replicaz"),
    ({"operator": {"replicas": 3}, "leaderElection": {"enabled": False}}, "/leaderElection/enabled"),
    ({"operator": {"image": {"repository": "r", "pullPolicy": "Sometimes"}}}, "/operator/image/pullPolicy"),
    ({"operator": {"metricsPort": 80}}, "/operator/metricsPort"),
    (
        {"operator": {"securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": False}}},
        "/operator/securityContext/readOnlyRootFilesystem",
    ),
    ({"operator": {"podSecurityContext": {"runAsNonRoot": False}}}, "/operator/podSecurityContext/runAsNonRoot"),
    ({"namespaces": {"services": ["Team_A"]}}, "/namespaces/services/0"),
    ({"namespaces": {"services": ["a"], "restrictWatch": True}, "operator": {"replicas": 2}}, "/operator/replicas"),
    ({"networkPolicy": {"maxSplits": 0}}, "/networkPolicy/maxSplits"),
    ({"metrics": {"podMonitor": {"interval": "often"}}}, "/metrics/podMonitor/interval"),
    ({"dashboards": {"labelValue": 1}}, "/dashboards/labelValue"),
    ({"crds": {"keep": "yes"}}, "/crds/keep"),
    ({"operator": {"image": {"repository": "r", "digest": "latest"}}}, "/operator/image/digest"),
    ({"operator": {"extraEnv": [{"value": "x"}]}}, "/operator/extraEnv/0"),
    ({"operator": {"podDisruptionBudget": {"maxUnavailable": 0}}}, "/operator/podDisruptionBudget/maxUnavailable"),
]


@pytest.mark.parametrize(("values", "key"), BAD_VALUES, ids=[k for _, k in BAD_VALUES])
def test_bad_values_fail_helm_install_naming_the_key(values: dict[str, Any], key: str) -> None:
    """`helm install --dry-run=client` (Helm's install action, nothing reaches a cluster) refuses them."""
    config = helm_python.Config(storage_driver="memory", namespace=NAMESPACE)
    try:
        with pytest.raises(helm_python.HelmError) as err:
            config.install(chart(), "exitplan", values, namespace=NAMESPACE, dry_run="client")
    finally:
        config.close()
    assert key in str(err.value), str(err.value)
    with pytest.raises(helm_python.HelmValuesError, match=key.split("/")[-1]):
        render_raw(values)


def test_good_values_install_in_dry_run() -> None:
    config = helm_python.Config(storage_driver="memory", namespace=NAMESPACE)
    try:
        release = config.install(chart(), "exitplan", ALL_ON, namespace=NAMESPACE, dry_run="client")
    finally:
        config.close()
    assert "kind: StatefulSet" in release["manifest"]
    assert "exitplan" in release["notes"]


def test_network_policy_refuses_a_podmonitor_it_would_block() -> None:
    values = {"networkPolicy": {"enabled": True}, "metrics": {"podMonitor": {"enabled": True}}}
    with pytest.raises(helm_python.HelmRenderError, match="networkPolicy.metricsFrom"):
        render_raw(values)


# ------------------------------------------------------------------ CRDs: tests/test_chart_crds.py


# ------------------------------------------------------------------ the operator pod


def test_operator_pod_has_secure_defaults() -> None:
    for variant in VARIANTS.values():
        pod = operator_pod(render(variant))["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in pod["containers"]:
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"] == {"drop": ["ALL"]}
            assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
            assert container["readinessProbe"]["httpGet"]["port"] == "metrics"
            assert container["livenessProbe"]["httpGet"] == {
                "path": "/healthz",
                "port": "health",
            }  # the operator's liveness endpoint (operator/http_ports.py)
        assert not any("hostPath" in v for v in pod["volumes"])


def _parse_cli(args: list[str]) -> dict[str, Any]:
    """Parse `exitplan <args>` with the real typer/click command tree (nothing runs)."""
    import click
    import typer

    from exitplan.cli import app

    root = typer.main.get_command(app)
    ctx = click.Context(root, info_name="exitplan")
    cmd = root.get_command(ctx, args[0])
    assert cmd is not None, f"`exitplan {args[0]}` is not a command"
    sub = cmd.make_context(args[0], list(args[1:]), parent=ctx)
    return {"command": args[0], **sub.params}


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    out = []
    for arg in args:
        for key, value in env.items():
            arg = arg.replace(f"$({key})", value)
        out.append(arg)
    return out


def test_operator_args_are_accepted_by_the_cli() -> None:
    pod = operator_pod(render(ALL_ON))["spec"]["containers"][0]
    assert pod["command"] == ["exitplan"]
    env = {e["name"]: e for e in pod["env"]}
    # $(POD_INDEX) comes from the StatefulSet pod-index label: replica 2 gets priority 2
    assert env["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    params = _parse_cli(_expand(pod["args"], {"POD_INDEX": "2"}))
    assert params["command"] == "operator"
    assert (params["peering"], params["priority"], params["metrics_port"], params["verbose"]) == (
        "exitplan",
        2,
        ALL_ON_METRICS_PORT,
        True,
    )
    assert params["profile_attempts"] == 5  # operator.extraArgs, appended
    assert {"name": "EXITPLAN_EXTRA", "value": "1"} in pod["env"]  # operator.extraEnv
    assert pod["image"] == "registry.example.com/exitplan-operator@sha256:" + "0f" * 32  # the digest, not a tag
    assert params["namespace"] == []  # cluster-wide
    restricted = operator_pod(render(RESTRICTED))["spec"]["containers"][0]
    params = _parse_cli(restricted["args"])
    assert params["namespace"] == ["team-a", "team-b"]
    assert params["peering"] == ""  # kopf's namespaced peering is not what the operator creates: standalone


def test_operator_gets_the_data_plane_image_through_the_env_the_builders_read() -> None:
    pod = operator_pod(render({"dataPlane": {"image": {"repository": "registry.local/exitplan-worker", "tag": "e2e"}}}))
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    code = "from exitplan.operator import images; print(images.IMAGE)"
    got = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "EXITPLAN_IMAGE": env["EXITPLAN_IMAGE"]},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert got == "registry.local/exitplan-worker:e2e"


def test_metrics_port_is_not_prometheus_and_is_the_cli_and_image_default() -> None:
    """The operator's /metrics port: one number in the chart, `exitplan operator`'s default and the
    operator image's EXPOSE, and not 9090 (Prometheus's own port)."""
    chart_default = yaml.safe_load((CHART / "values.yaml").read_text())["operator"]["metricsPort"]
    cli_default = _parse_cli(["operator"])["metrics_port"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    operator_stage = dockerfile.split("AS operator\n", 1)[1].split("\nFROM ", 1)[0]
    assert chart_default == cli_default == ALL_ON_METRICS_PORT != 9090
    assert f"EXPOSE {chart_default}" in operator_stage
    pod = operator_pod(render())["spec"]["containers"][0]
    assert {p["name"]: p["containerPort"] for p in pod["ports"]}["metrics"] == chart_default
    assert one(render(), "Service")["spec"]["ports"][0]["port"] == chart_default


def test_pod_template_carries_no_chart_version(tmp_path: Path) -> None:
    """A chart bump that changes nothing else leaves the operator's pod template as it was (no
    restart), while the StatefulSet's own labels name the new chart version."""
    copy = chart_copy(tmp_path)
    meta = yaml.safe_load((copy / "Chart.yaml").read_text())
    old_version = meta["version"]
    meta["version"] = "9.8.7"
    (copy / "Chart.yaml").write_text(yaml.safe_dump(meta))
    before, after = render(ALL_ON), render_dir(copy, ALL_ON)
    assert operator_pod(after) == operator_pod(before)
    assert one(after, "StatefulSet")["metadata"]["labels"]["helm.sh/chart"] == "exitplan-9.8.7"
    assert one(before, "StatefulSet")["metadata"]["labels"]["helm.sh/chart"] == f"exitplan-{old_version}"
    for variant in VARIANTS.values():
        labels = operator_pod(render(variant))["metadata"]["labels"]
        assert "helm.sh/chart" not in labels and "app.kubernetes.io/version" not in labels
        assert not any(old_version in v for v in labels.values()), labels


def test_operator_pod_labels_spread_and_budget() -> None:
    objs = render(ALL_ON)
    pod = operator_pod(objs)
    assert pod["metadata"]["labels"]["example.com/team"] == "ml"  # operator.podLabels
    # podLabels cannot take the pods out of their StatefulSet's selector
    hijack = render({"operator": {"podLabels": {"app.kubernetes.io/component": "other"}}})
    sts = one(hijack, "StatefulSet")
    assert selects(sts["spec"]["selector"], sts["spec"]["template"]["metadata"]["labels"])
    (spread,) = pod["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["labelSelector"]["matchLabels"] == one(objs, "StatefulSet")["spec"]["selector"]["matchLabels"]
    own = {"matchLabels": {"app": "mine"}}
    mine = {"maxSkew": 2, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule"}
    kept = render({"operator": {"topologySpreadConstraints": [{**mine, "labelSelector": own}]}})
    assert operator_pod(kept)["spec"]["topologySpreadConstraints"] == [{**mine, "labelSelector": own}]
    assert "topologySpreadConstraints" not in operator_pod(render())["spec"]
    # a budget only with more than one replica, and only when enabled
    assert not of_kind(
        render({"operator": {"replicas": 3, "podDisruptionBudget": {"enabled": False}}}), "PodDisruptionBudget"
    )
    two = render({"operator": {"replicas": 2, "podDisruptionBudget": {"maxUnavailable": 1}}})
    assert one(two, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1


def test_image_digests_override_the_tags() -> None:
    digest = "sha256:" + "ab" * 32
    objs = render(
        {
            "operator": {"image": {"repository": "r.example/op", "tag": "1.2.3", "digest": digest}},
            "dataPlane": {"image": {"repository": "r.example/worker", "tag": "1.2.3", "digest": digest}},
        }
    )
    container = operator_pod(objs)["spec"]["containers"][0]
    assert container["image"] == f"r.example/op@{digest}"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["EXITPLAN_IMAGE"] == f"r.example/worker@{digest}"
    tagged = operator_pod(render({"operator": {"image": {"repository": "r.example/op", "tag": "1.2.3"}}}))
    assert tagged["spec"]["containers"][0]["image"] == "r.example/op:1.2.3"


# ------------------------------------------------------------------ the data plane the operator builds


def test_profiler_service_account_is_the_one_the_operator_names() -> None:
    _, job = build_children()
    sa = job["spec"]["template"]["spec"]["serviceAccountName"]
    objs = render()
    assert one(objs, "ServiceAccount", sa, "default")
    binding = one(objs, "RoleBinding", sa, "default")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": "default"}]


def test_podmonitor_selects_the_routers_and_workers_the_operator_builds() -> None:
    from exitplan.operator import names

    children, job = build_children()
    monitor = one(render(ALL_ON), "PodMonitor")["spec"]
    pods = [d["spec"]["template"] for d in children if d["kind"] == "Deployment"]
    assert all(selects(monitor["selector"], p["metadata"]["labels"]) for p in pods)
    assert not selects(monitor["selector"], job["spec"]["template"]["metadata"]["labels"])
    for p in pods:
        ports = {port["name"]: port["containerPort"] for port in p["spec"]["containers"][0]["ports"]}
        assert ports[monitor["podMetricsEndpoints"][0]["port"]] == names.PORT


# ------------------------------------------------------------------ NetworkPolicies, evaluated


def test_per_namespace_policies_allow_exactly_the_data_plane_paths() -> None:
    """networkPolicy.perService false: the chart's own policies per namespace (any service's pods match)."""
    from exitplan.operator import names

    children, job = build_children(splits=5)  # ALL_ON covers splits 0..3: split 4 must stay denied
    objs = render(PER_NAMESPACE)
    policies = of_kind(objs, "NetworkPolicy")
    port = names.PORT
    workers = {}
    router = None
    for dep in (d for d in children if d["kind"] == "Deployment"):
        labels = dep["spec"]["template"]["metadata"]["labels"]
        pod = Pod(dep["metadata"]["name"], "default", labels)
        if labels[names.L_COMPONENT] == "router":
            router = pod
        else:
            workers[int(labels[names.L_SPLIT])] = pod
    assert router is not None and sorted(workers) == [0, 1, 2, 3, 4]
    op_labels = operator_pod(objs)["metadata"]["labels"]
    operator = Pod("exitplan-operator-0", NAMESPACE, op_labels)
    profiler = Pod("minilm-profile", "default", job["spec"]["template"]["metadata"]["labels"])
    prometheus = Pod("prometheus-0", "monitoring", PROMETHEUS_PEER["podSelector"]["matchLabels"])
    client = Pod("curl", "clients", {"app": "curl"})
    stranger = Pod("intruder", "default", {"app": "other"})
    dns = Pod("coredns", "kube-system", {"k8s-app": "kube-dns"})

    assert allowed(policies, router, workers[0], port)  # router -> split 0
    assert allowed(policies, router, workers[1], port)  # ... and split 1 (a router that runs split 0 itself)
    for s in range(2, 5):
        assert not allowed(policies, router, workers[s], port)  # ... and no further
    for s in range(0, 3):
        assert allowed(policies, workers[s], workers[s + 1], port)  # split S -> S+1
        assert not allowed(policies, workers[s + 1], workers[s], port)  # never backwards
    assert not allowed(policies, workers[0], workers[2], port)  # no skipping a split
    assert not allowed(policies, workers[3], workers[4], port)  # past maxSplits: denied
    control = names.CONTROL_PORT
    for s in range(0, 4):
        assert allowed(policies, workers[s], router, control)  # shadow feedback, on the control port
        assert not allowed(policies, workers[s], router, port)
        assert allowed(policies, workers[s], dns, 53, "UDP")  # split Services by name
        assert not allowed(policies, stranger, workers[s], port)
        assert not allowed(policies, client, workers[s], port)
        assert allowed(policies, prometheus, workers[s], port)  # metricsFrom
    assert allowed(policies, client, router, port)  # routerIngressFrom
    assert not allowed(policies, stranger, router, port)
    assert allowed(policies, operator, router, control)  # observations, feedback, thresholds
    assert not allowed(policies, client, router, control)  # the control port: operator and own pods only
    assert not allowed(policies, stranger, router, control)
    assert not allowed(policies, prometheus, router, control)
    assert not allowed(policies, workers[4], router, control)  # past maxSplits: denied
    assert allowed(policies, prometheus, operator, ALL_ON_METRICS_PORT)
    assert not allowed(policies, stranger, operator, ALL_ON_METRICS_PORT)
    assert not allowed(policies, router, stranger, port)  # router egress: the splits it sends to only
    # the profiling Job is not a router or worker: its API calls are not blocked
    assert allowed(policies, profiler, Pod("apiserver", "default", {"component": "kube-apiserver"}), 443)


def _pods_of(children: list[dict[str, Any]], namespace: str = "default") -> tuple[Pod, dict[int, Pod]]:
    """The router pod and the worker pod of each split, with the labels the operator gives them."""
    from exitplan.operator import names

    router, workers = None, {}
    for dep in (d for d in children if d["kind"] == "Deployment"):
        labels = dep["spec"]["template"]["metadata"]["labels"]
        pod = Pod(dep["metadata"]["name"], namespace, labels)
        if labels[names.L_COMPONENT] == "router":
            router = pod
        else:
            workers[int(labels[names.L_SPLIT])] = pod
    assert router is not None
    return router, workers


def test_per_service_policies_admit_one_services_paths_and_no_other_service() -> None:
    """Issue 28 item 3, the default (networkPolicy.perService): the chart's policies with the ones the
    operator, run with the env the chart gives it, builds for two services of one namespace."""
    from exitplan.operator import names

    objs = render(ALL_ON)
    assert operator_settings(objs).network_policies
    children, job = build_children(splits=5, chart_objs=objs)  # no maxSplits: every split is covered
    others, _ = build_children(splits=2, chart_objs=objs, name="other")
    policies = of_kind(objs, "NetworkPolicy") + of_kind(children, "NetworkPolicy") + of_kind(others, "NetworkPolicy")
    router, workers = _pods_of(children)
    other_router, other_workers = _pods_of(others)
    port, control = names.PORT, names.CONTROL_PORT
    operator = Pod("exitplan-operator-0", NAMESPACE, operator_pod(objs)["metadata"]["labels"])
    prometheus = Pod("prometheus-0", "monitoring", PROMETHEUS_PEER["podSelector"]["matchLabels"])
    client, stranger = Pod("curl", "clients", {"app": "curl"}), Pod("intruder", "default", {"app": "other"})
    dns = Pod("coredns", "kube-system", {"k8s-app": "kube-dns"})

    assert allowed(policies, router, workers[0], port)  # router -> split 0
    for s in range(1, 5):
        assert not allowed(policies, router, workers[s], port)  # ... only: it runs no split 0 itself
    for s in range(0, 4):
        assert allowed(policies, workers[s], workers[s + 1], port)  # split S -> S+1
        assert not allowed(policies, workers[s + 1], workers[s], port)  # never backwards
    assert not allowed(policies, workers[0], workers[2], port)  # no skipping a split
    for s in range(0, 5):
        assert allowed(policies, workers[s], router, control)  # shadow feedback, on the control port
        assert not allowed(policies, workers[s], router, port)
        assert allowed(policies, workers[s], dns, 53, "UDP")
        assert allowed(policies, prometheus, workers[s], port)  # metricsFrom
        for intruder in (stranger, client, other_router, *other_workers.values()):
            assert not allowed(policies, intruder, workers[s], port)  # not another service's pods
    assert allowed(policies, client, router, port) and not allowed(policies, stranger, router, port)
    assert allowed(policies, operator, router, control)  # observations, thresholds
    for intruder in (client, stranger, prometheus, other_router, *other_workers.values()):
        assert not allowed(policies, intruder, router, control)
    assert not allowed(policies, router, other_workers[0], port)  # nor to another service's pods
    assert not allowed(policies, workers[0], other_workers[1], port)
    assert allowed(policies, other_router, other_workers[0], port)  # the other service keeps its own paths
    assert not allowed(policies, router, stranger, port)
    assert allowed(policies, job_pod(job), Pod("apiserver", "default", {"component": "kube-apiserver"}), 443)


def job_pod(job: dict[str, Any]) -> Pod:
    """The profiling Job's pod: not a router or worker, so no data-plane policy isolates it."""
    return Pod("minilm-profile", "default", job["spec"]["template"]["metadata"]["labels"])


def test_default_network_policies_are_on_and_a_colocated_router_reaches_split_1() -> None:
    """Issue 28 item 3: `networkPolicy.enabled` and `perService` are true by default, and a router reaches
    every split it sends to: split 0, or split 1 when it runs split 0 itself."""
    from exitplan.operator import names

    values = yaml.safe_load((CHART / "values.yaml").read_text())["networkPolicy"]
    assert values["enabled"] is True and values["perService"] is True
    objs = render()
    children, _ = build_children(splits=3, colocate=True, chart_objs=objs)
    policies = of_kind(objs, "NetworkPolicy") + of_kind(children, "NetworkPolicy")
    router, workers = _pods_of(children)
    assert sorted(workers) == [1, 2]  # split 0 runs in the router
    port, control = names.PORT, names.CONTROL_PORT
    assert allowed(policies, router, workers[1], port)  # the colocated router -> split 1
    assert not allowed(policies, router, workers[2], port)
    assert allowed(policies, workers[1], workers[2], port)
    assert not allowed(policies, workers[2], workers[1], port)
    for s in (1, 2):
        assert allowed(policies, workers[s], router, control)  # shadow feedback
        assert not allowed(policies, Pod("intruder", "default", {"app": "other"}), workers[s], port)
    assert allowed(policies, Pod("curl", "clients", {}), router, port)  # routerIngressFrom empty: everyone
    assert not allowed(policies, Pod("curl", "clients", {}), router, control)
    operator = Pod("exitplan-operator-0", NAMESPACE, operator_pod(objs)["metadata"]["labels"])
    assert allowed(policies, operator, router, control)


def test_per_service_off_leaves_the_operator_without_policies_and_the_chart_with_the_paths() -> None:
    """perService false, or the policies off: the operator builds none (EXITPLAN_NETWORK_POLICIES false)."""
    for values in (PER_NAMESPACE, {"networkPolicy": {"enabled": False}}):
        objs = render(values)
        assert not operator_settings(objs).network_policies
        children, _ = build_children(splits=2, chart_objs=objs)
        assert not of_kind(children, "NetworkPolicy")
    assert any(
        p["metadata"]["name"] == "exitplan-worker-split-0" for p in of_kind(render(PER_NAMESPACE), "NetworkPolicy")
    )


def test_router_is_open_to_everyone_when_no_ingress_peers_are_named() -> None:
    objs = render({"networkPolicy": {"enabled": True}})
    children, _ = build_children(splits=2, chart_objs=objs)
    policies = of_kind(objs, "NetworkPolicy") + of_kind(children, "NetworkPolicy")
    router, workers = _pods_of(children)
    assert allowed(policies, Pod("curl", "anywhere", {}), router, 8080)
    assert not allowed(policies, Pod("curl", "anywhere", {}), router, 8081)  # the control port is not
    assert allowed(policies, workers[0], router, 8081)  # the service's own workers are (shadow feedback)


# ------------------------------------------------------------------ dashboards shipped as ConfigMaps


def test_dashboards_ship_as_labelled_configmaps() -> None:
    files = sorted((CHART / "dashboards").glob("*.json"))
    assert files
    objs = render({"dashboards": {"label": "grafana.example/dashboard", "labelValue": "yes", "folder": "ml"}})
    maps = of_kind(objs, "ConfigMap")
    assert len(maps) == len(files)
    for path in files:
        cm = next(m for m in maps if path.name in m["data"])
        assert cm["metadata"]["labels"]["grafana.example/dashboard"] == "yes"
        assert cm["metadata"]["annotations"]["grafana_folder"] == "ml"
        assert cm["data"][path.name] == path.read_text().rstrip("\n")


def test_values_file_documents_every_value() -> None:
    """Every leaf of values.yaml has a comment line right above its key (or its parent's)."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "-")) or ":" not in stripped or stripped.endswith(":"):
            continue  # comments, list items and parent keys; leaves are checked
        indent = len(line) - len(line.lstrip())
        j = i - 1
        while (
            j >= 0
            and lines[j].strip()
            and not lines[j].strip().startswith("#")
            and len(lines[j]) - len(lines[j].lstrip()) >= indent
            and ":" in lines[j]
            and not lines[j].rstrip().endswith(":")
        ):
            j -= 1  # a run of sibling keys under one comment (e.g. labelValue after label)
        if j < 0 or not (lines[j].strip().startswith("#") or lines[j].rstrip().endswith(":")):
            undocumented.append(stripped)
    assert undocumented == [], undocumented
    schema_keys = set(chart().schema["properties"])
    assert set(yaml.safe_load((CHART / "values.yaml").read_text())) == schema_keys


# ------------------------------------------------------------------ the kind end-to-end's inputs


def test_e2e_cluster_inputs_fit_the_chart_the_api_and_the_kind_nodes() -> None:
    """e2e/cluster runs only where Docker and kind are; its inputs are checked here: the chart values
    render, the GPUPool and EarlyExitService parse with the typed models, and the pool's nodes and
    the bundle path are the ones kind.yaml creates."""
    from exitplan.api.resources import EarlyExitService, GPUPool

    here = ROOT / "e2e" / "cluster"
    values = yaml.safe_load((here / "values.yaml").read_text())
    objs = render(values)
    pod = operator_pod(objs)["spec"]["containers"][0]
    assert pod["image"] == "exitplan-operator:e2e" and pod["imagePullPolicy"] == "Never"
    pool = GPUPool.model_validate(yaml.safe_load((here / "manifests" / "gpupool.yaml").read_text()))
    service = EarlyExitService.model_validate(yaml.safe_load((here / "manifests" / "service.yaml").read_text()))
    assert [p.name for p in service.spec.pools] == [pool.metadata["name"]]
    assert service.metadata["namespace"] in values["namespaces"]["services"]
    assert one(objs, "ServiceAccount", "exitplan-profiler", service.metadata["namespace"])
    kind = yaml.safe_load((here / "kind.yaml").read_text())
    workers = [n for n in kind["nodes"] if n["role"] == "worker"]
    assert len(workers) >= pool.spec.capacity
    for node in workers:
        assert pool.spec.node_selector.items() <= node["labels"].items()
        assert [m["containerPath"] for m in node["extraMounts"]] == [service.spec.model.bundle]
    run = (here / "run.sh").read_text()
    assert "--target operator" in run and "--target worker-cpu" in run
    assert os.access(here / "run.sh", os.X_OK)
