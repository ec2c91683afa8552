"""Layer contracts (DESIGN.md "Where the code lives"), checked on every import statement of the source.

import-linter cannot see this layout (its graph builder walks the root package's folder, and our
sub-packages live in their own top-level folders through setuptools' package-dir mapping), so the
same contracts are enforced here with the standard library's parser.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ast_source
import pytest

REPO = Path(__file__).resolve().parents[1]
FOLDERS = {
    "exitplan": "exitplan",
    "api": "exitplan.api",
    "planner": "exitplan.planner",
    "operator": "exitplan.operator",
    "worker_image": "exitplan.worker_image",
    "prepare": "exitplan.prepare",
    "client": "exitplan.client",
    "localrun": "exitplan.localrun",
    "devcluster": "exitplan.devcluster",
    "storage": "exitplan.storage",
}
HEAVY = ("kopf", "kubernetes", "torch", "transformers")
HTTP = ("aiohttp", "urllib", "http", "httptools", "requests", "socket")

# layer -> (allowed exitplan modules (prefixes), forbidden third-party top-level names)
CONTRACTS = {
    # typed contracts only
    "exitplan.api": (("exitplan.api",), ("aiohttp", "numpy", "onnxruntime") + HEAVY),
    # pure planning: no Kubernetes, no HTTP, no inference runtime
    "exitplan.planner": (("exitplan.api", "exitplan.planner"), ("onnxruntime",) + HTTP + HEAVY),
    # the data plane takes only the dispatch policy from the planner
    "exitplan.worker_image": (("exitplan.api", "exitplan.worker_image", "exitplan.planner.dispatch"), HEAVY),
    "exitplan.client": (
        ("exitplan.api", "exitplan.client", "exitplan.planner.traces", "exitplan.worker_image.bundle_runtime"),
        HEAVY,
    ),
    # the operator: never the CLI, the local process runner or the dev cluster; of the data plane only
    # the client side of its control endpoints (one router's, every router's of a service, and the versioned
    # threshold set they answer and take) and the guard its own ports share with every exitplan server; of
    # storage, the limits its storage-init is given
    "exitplan.operator": (
        (
            "exitplan.api",
            "exitplan.planner",
            "exitplan.operator",
            "exitplan.worker_image.control_client",
            "exitplan.worker_image.router_fleet",
            "exitplan.worker_image.threshold_set",
            "exitplan.worker_image.server_guard",
            "exitplan.worker_image.server_limits",
            "exitplan.storage.limits",
        ),
        ("torch", "transformers"),
    ),
    "exitplan.prepare": (
        (
            "exitplan.api",
            "exitplan.planner",
            "exitplan.prepare",
            "exitplan.worker_image.bundle_runtime",
            "exitplan.worker_image.generate.decoder",
        ),
        ("kopf", "kubernetes", "aiohttp"),
    ),
    # `exitplan up`'s process runner: what a pod would run, started as local processes
    "exitplan.localrun": (
        ("exitplan.api", "exitplan.planner", "exitplan.worker_image", "exitplan.client", "exitplan.localrun"),
        ("kopf", "kubernetes"),
    ),
    # bundle storage: fetch, verify, push (the storage-init container, `exitplan bundle`)
    "exitplan.storage": (("exitplan.api", "exitplan.storage"), ("aiohttp", "numpy", "onnxruntime") + HEAVY),
    # the emulated cluster: its API server, the local pod runner; the operator's API client and
    # CRD generator to install CRDs, and how to start the CLI's pod commands
    "exitplan.devcluster": (
        (
            "exitplan.api",
            "exitplan.devcluster",
            "exitplan.operator.kube",
            "exitplan.operator.crdgen",
            "exitplan.localrun.deployment",
        ),
        ("torch", "transformers"),
    ),
}
USED_ONLY_BY_CLI = ("exitplan.devcluster",)
"""Packages that only the CLI (and tests) may import."""


def imports_of(source: str, module: str, is_package: bool) -> list[str]:
    """Absolute names of everything `source` (the code of `module`) imports, relative imports resolved."""
    found = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast_source.parse(source)):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append(target)
            found.extend(f"{target}.{alias.name}" for alias in node.names)
    return found


def violations(layer: str, module: str, names: list[str]) -> list[str]:
    allowed, forbidden = CONTRACTS[layer]
    bad = []
    for name in names:
        if name.startswith("exitplan"):
            if name == "exitplan":
                continue
            if not any(name == a or name.startswith(a + ".") or a.startswith(name + ".") for a in allowed):
                bad.append(f"{module} imports {name}")
        elif name.split(".")[0] in forbidden:
            bad.append(f"{module} imports {name}")
    return bad


def layer_sources():
    """(package, module, path) of every source file, sub-packages included."""
    for folder, package in FOLDERS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield package, ".".join([package, *parts]), path


def test_every_source_folder_is_checked():
    """A new top-level folder of Python code gets a contract (or is named here as not a layer)."""
    not_layers = {"tests", "e2e", "bench", "tools", "examples", "charts", "crds"}
    folders = {p.parent.relative_to(REPO).parts[0] for p in REPO.glob("*/**/*.py") if not p.parts[-2].startswith(".")}
    unknown = sorted(f for f in folders - set(FOLDERS) - not_layers if not f.startswith("."))
    assert not unknown, f"folders of code with no layer contract: {unknown}"


@pytest.mark.parametrize("layer", sorted(CONTRACTS))
def test_layer_imports_only_what_its_contract_allows(layer):
    problems = []
    for package, module, path in layer_sources():
        if package != layer:
            continue
        names = imports_of(path.read_text(), module, path.stem == "__init__")
        problems.extend(violations(layer, module, names))
    assert not problems, "\n".join(problems)


def test_the_checker_catches_violations():
    names = imports_of(
        "import kubernetes\nfrom ..operator import reconcile\nfrom .dispatch import choose_bucket\n",
        "exitplan.planner.e3",
        False,
    )
    assert "exitplan.operator" in names and "exitplan.planner.dispatch" in names
    found = violations("exitplan.planner", "exitplan.planner.e3", names)
    assert any("kubernetes" in v for v in found) and any("exitplan.operator" in v for v in found)
    worker = imports_of(
        "from exitplan.planner.e3 import solve\nfrom exitplan.planner.dispatch import least_loaded\n",
        "exitplan.worker_image.classify.router",
        False,
    )
    found = violations("exitplan.worker_image", "exitplan.worker_image.classify.router", worker)
    assert found and all("exitplan.planner.e3" in v for v in found)
    sneaky = imports_of("from exitplan.planner import plan_service\n", "exitplan.worker_image.classify.router", False)
    assert violations("exitplan.worker_image", "exitplan.worker_image.classify.router", sneaky)


def test_the_dev_cluster_is_used_only_by_the_cli_and_tests():
    problems = []
    for package, module, path in layer_sources():
        if package in ("exitplan", *USED_ONLY_BY_CLI):
            continue
        for name in imports_of(path.read_text(), module, path.stem == "__init__"):
            if any(name == p or name.startswith(p + ".") for p in USED_ONLY_BY_CLI):
                problems.append(f"{module} imports {name}")
    assert not problems, "\n".join(problems)


def test_the_cli_package_holds_only_the_cli():
    """exitplan/ is the CLI: `cli.py`, what its commands share (`cli_*.py`), one `cmd_*.py` per command,
    nothing the other rooms import."""
    names = sorted(p.name for p in (REPO / "exitplan").glob("*.py"))
    assert all(n in ("__init__.py", "__main__.py") or n.startswith(("cli", "cmd_")) for n in names), names
