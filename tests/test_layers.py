"""Layer contracts (DESIGN.md "Where the code lives"), checked on every import statement of the source.

import-linter cannot see this layout (its graph builder walks the root package's folder, and our
sub-packages live in their own top-level folders through setuptools' package-dir mapping), so the
same contracts are enforced here with the standard library's parser.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FOLDERS = {
    "api": "exitplan.api",
    "planner": "exitplan.planner",
    "operator": "exitplan.operator",
    "worker_image": "exitplan.worker",
    "prepare": "exitplan.prepare",
    "client": "exitplan.client",
}
HEAVY = ("kopf", "kubernetes", "torch", "transformers")

# layer -> (allowed exitplan modules (prefixes), forbidden third-party top-level names)
CONTRACTS = {
    "exitplan.api": (("exitplan.api",), ("aiohttp", "numpy", "onnxruntime") + HEAVY),
    "exitplan.planner": (("exitplan.api", "exitplan.planner"), ("aiohttp", "onnxruntime") + HEAVY),
    "exitplan.worker": (("exitplan.api", "exitplan.worker", "exitplan.planner.dispatch"), HEAVY),
    "exitplan.client": (("exitplan.api", "exitplan.client", "exitplan.planner.traces", "exitplan.worker.bundle_runtime"), HEAVY),
    "exitplan.operator": (("exitplan.api", "exitplan.planner", "exitplan.operator", "exitplan.localrun.deployment", "exitplan.localrun.service_setup", "exitplan.planner.tuning.autotune"), ("torch", "transformers")),
}


def imports_of(source: str, module: str, is_package: bool) -> list[str]:
    """Absolute names of everything `source` (the code of `module`) imports, relative imports resolved."""
    found = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
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
    for folder, package in FOLDERS.items():
        if package not in CONTRACTS:
            continue
        for path in sorted((REPO / folder).glob("*.py")):
            stem = path.stem
            module = package if stem == "__init__" else f"{package}.{stem}"
            yield package, module, path


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
    names = imports_of("import kubernetes\nfrom ..operator import reconcile\nfrom .dispatch import choose_bucket\n",
                       "exitplan.planner.e3", False)
    assert "exitplan.operator" in names and "exitplan.planner.dispatch" in names
    found = violations("exitplan.planner", "exitplan.planner.e3", names)
    assert any("kubernetes" in v for v in found) and any("exitplan.operator" in v for v in found)
    worker = imports_of("from exitplan.planner.e3 import solve\nfrom exitplan.planner.dispatch import least_loaded\n",
                        "exitplan.worker.classify.router", False)
    found = violations("exitplan.worker", "exitplan.worker.classify.router", worker)
    assert found and all("exitplan.planner.e3" in v for v in found)
    sneaky = imports_of("from exitplan.planner import plan_service\n", "exitplan.worker.classify.router", False)
    assert violations("exitplan.worker", "exitplan.worker.classify.router", sneaky)
