"""`exitplan apply -f FILE`: create or update the resources of YAML files (GPUPools, EarlyExitServices,
ModelProfiles, core objects) in the cluster of a kubeconfig, as `kubectl apply` would, with one
difference: an EarlyExitService whose `spec.model.bundle` is a relative path gets it resolved here,
once, against the current folder (the way `exitplan up` reads the same file). The operator refuses a
relative path (no pod can resolve it: its working folder is not yours), so this is how a file written
for `exitplan up`, such as examples/minilm-local.yaml, runs on `exitplan dev-cluster`, whose pods run
on this machine. On a real cluster the resolved path must exist on the nodes and be allowed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import typer

from exitplan.cli_common import fail

HELP_FILE = "A YAML file of resources (repeatable; '-' reads standard input)."
HELP_KUBECONFIG = "Kubeconfig to use (default: $KUBECONFIG, then ~/.kube/config)."
HELP_NAMESPACE = "Namespace of namespaced resources that name none (default: the context's, else default)."


def resolve_bundle(doc: dict[str, Any], cwd: Path) -> str | None:
    """Rewrite an EarlyExitService's relative bundle path (or `file://` relative path) as the absolute
    path under `cwd`; the new path, or None when nothing changed."""
    from exitplan.api.bundle_source import SourceError, parse_bundle_uri

    if doc.get("kind") != "EarlyExitService":
        return None
    model = (doc.get("spec") or {}).get("model") or {}
    given = model.get("bundle")
    if not isinstance(given, str):
        return None
    try:
        if parse_bundle_uri(given).remote:
            return None
    except SourceError:
        return None  # the server's validation names it
    path = given[len("file://") :] if given.startswith("file://") else given
    if path.startswith("/"):
        return None
    model["bundle"] = os.path.normpath(cwd / path)  # lexically, as the operator checks its allowed prefixes
    return str(model["bundle"])


def context_namespace(kubeconfig: str | None) -> str:
    """The namespace of the kubeconfig's current context ('default' when it names none)."""
    from kubernetes import config as kconfig

    try:
        _, active = kconfig.list_kube_config_contexts(config_file=kubeconfig)
    except kconfig.ConfigException:
        return "default"
    return str((active or {}).get("context", {}).get("namespace") or "default")


def read_docs(files: list[str]) -> list[dict[str, Any]]:
    import sys

    import yaml

    docs: list[dict[str, Any]] = []
    for name in files:
        text = sys.stdin.read() if name == "-" else Path(name).read_text()
        for doc in yaml.safe_load_all(text):
            if doc is None:
                continue
            if not isinstance(doc, dict) or not doc.get("kind") or not (doc.get("metadata") or {}).get("name"):
                fail(f"{name}: every document must be a resource with kind and metadata.name")
            docs.append(doc)
    return docs


async def apply_docs(docs: list[dict[str, Any]], kubeconfig: str | None, namespace: str) -> list[str]:
    """Create each resource, or merge-patch it where it exists; one line per resource."""
    from exitplan.operator.kube import KINDS, ApiError, KubeClient, object_path

    lines = []
    async with KubeClient.from_config(kubeconfig) as client:
        for doc in docs:
            kind, meta = doc["kind"], doc["metadata"]
            if kind not in KINDS:
                fail(f"{kind} {meta['name']}: exitplan apply takes {sorted(KINDS)}; use kubectl for the rest")
            if KINDS[kind][2]:
                meta["namespace"] = meta.get("namespace") or namespace
            try:
                await client.create(doc)
                verb = "created"
            except ApiError as err:
                if err.status != 409:
                    fail(f"{kind} {meta['name']}: {err.message}")
                patch = {k: v for k, v in doc.items() if k not in ("status", "apiVersion", "kind")}
                await client.merge_patch(object_path(doc), patch)
                verb = "configured"
            lines.append(f"{kind.lower()}/{meta['name']} {verb}")
    return lines


def command(
    filename: list[str] = typer.Option(..., "--filename", "-f", help=HELP_FILE),
    kubeconfig: Path = typer.Option(None, help=HELP_KUBECONFIG),
    namespace: str = typer.Option("", "--namespace", "-n", help=HELP_NAMESPACE),
) -> None:
    """Create or update resources from YAML files, as kubectl apply does; a service's relative
    spec.model.bundle is resolved against the current folder first (for pods on this machine:
    exitplan dev-cluster)."""
    import asyncio

    config = str(kubeconfig) if kubeconfig is not None else os.environ.get("KUBECONFIG") or None
    if config is not None and not Path(config).exists():
        fail(f"kubeconfig {config} does not exist; run `exitplan dev-cluster` or name one kubectl can use")
    docs = read_docs(filename)
    for doc in docs:
        resolved = resolve_bundle(doc, Path.cwd())
        if resolved is not None:
            typer.echo(f"{doc['kind'].lower()}/{doc['metadata']['name']}: spec.model.bundle resolved to {resolved}")
    for line in asyncio.run(apply_docs(docs, config, namespace or context_namespace(config))):
        typer.echo(line)
