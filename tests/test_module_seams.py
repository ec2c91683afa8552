"""Seams between modules (issue 29), checked on every import statement of the product code:

- no module imports a private name (`_name`) from another module: what a module offers others is public,
  the rest is its own;
- no import cycle between the modules of one room (a folder of DESIGN.md), counting the imports inside
  functions too: a deferred import that only hides a cycle is a cycle. Imports under `if TYPE_CHECKING:`
  are not counted (they never run; they name types for annotations).

The rooms and the way source files map to module names are tests/test_layers.py's.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ast_source
from test_layers import FOLDERS, layer_sources

PRODUCT = set(FOLDERS.values())


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: at module level, in functions and classes, not under TYPE_CHECKING."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            visit(child)

    visit(tree)
    return found


def resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = module if is_package else module.rpartition(".")[0]
    base = package.split(".")
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def known_modules() -> dict[str, Path]:
    return {module: path for _, module, path in layer_sources()}


def private_imports(source: str, module: str, is_package: bool, modules: dict[str, Path]) -> list[str]:
    bad = []
    for node in runtime_imports(ast_source.parse(source)) + _type_checking_imports(ast_source.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        target = resolve(node, module, is_package)
        if not target.startswith("exitplan"):
            continue
        for alias in node.names:
            name = alias.name
            if name.startswith("_") and not (name.startswith("__") and name.endswith("__")):
                if f"{target}.{name}" in modules:  # a private submodule is a module, not a name of one
                    continue
                bad.append(f"{module} imports {target}.{name}")
    return bad


def private_attributes(source: str, module: str, is_package: bool, modules: dict[str, Path]) -> list[str]:
    """`other._name` where `other` is a module of exitplan this module imported (`import exitplan.x.y as other`,
    `from exitplan.x import y`)."""
    tree = ast_source.parse(source)
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules and alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            target = resolve(node, module, is_package)
            for alias in node.names:
                if f"{target}.{alias.name}" in modules:
                    aliases[alias.asname or alias.name] = f"{target}.{alias.name}"
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            name = node.attr
            if name.startswith("_") and not (name.startswith("__") and name.endswith("__")):
                if aliases[node.value.id] != module:
                    bad.append(f"{module} uses {aliases[node.value.id]}.{name}")
    return sorted(set(bad))


def _type_checking_imports(tree: ast.AST) -> list[ast.ImportFrom]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            out.extend(n for stmt in node.body for n in ast.walk(stmt) if isinstance(n, ast.ImportFrom))
    return out


def room_of(module: str) -> str:
    """The room (top-level package under exitplan) a module belongs to; `exitplan` for the CLI."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and ".".join(parts[:2]) in PRODUCT else "exitplan"


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of its own room it imports when it runs."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        tree = ast_source.parse(path.read_text())
        for node in runtime_imports(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = resolve(node, module, path.stem == "__init__")
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != module and room_of(target) == room_of(module):
                    graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_no_module_imports_a_private_name_of_another():
    modules = known_modules()
    problems = []
    for module, path in modules.items():
        problems += private_imports(path.read_text(), module, path.stem == "__init__", modules)
        problems += private_attributes(path.read_text(), module, path.stem == "__init__", modules)
    assert not problems, "\n".join(problems)


def test_no_import_cycle_inside_a_room():
    found = cycles(import_graph(known_modules()))
    assert not found, "\n".join(" <-> ".join(c) for c in found)


def test_the_checks_catch_what_they_forbid():
    modules = {"exitplan.planner.a": Path("a.py"), "exitplan.planner.b": Path("b.py")}
    source = "from exitplan.planner.b import _helper, public\nfrom exitplan.planner import b as other\nother._x()\n"
    assert private_imports(source, "exitplan.planner.a", False, modules) == [
        "exitplan.planner.a imports exitplan.planner.b._helper"
    ]
    assert private_attributes(source, "exitplan.planner.a", False, modules) == [
        "exitplan.planner.a uses exitplan.planner.b._x"
    ]
    tree = ast_source.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from exitplan.planner import c\n"
        "def f():\n    from exitplan.planner import a\n"
    )
    found = [resolve(n, "exitplan.planner.b", False) for n in runtime_imports(tree) if isinstance(n, ast.ImportFrom)]
    assert found == ["typing", "exitplan.planner"]  # the deferred import counts, the TYPE_CHECKING one does not
    assert cycles({"x.a": {"x.b"}, "x.b": {"x.c"}, "x.c": {"x.a"}, "x.d": {"x.a"}}) == [["x.a", "x.b", "x.c"]]
    assert room_of("exitplan.operator.reconcile") == "exitplan.operator" and room_of("exitplan.cmd_up") == "exitplan"
