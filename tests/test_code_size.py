"""Small modules and short functions: no module over 600 lines and no function over 80 lines in the
product's code (tests and benchmarks aside), except those named here with the reason."""

from __future__ import annotations

import ast
from pathlib import Path

import ast_source
from test_layers import FOLDERS, REPO

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80

EXCEPTIONS: dict[str, str] = {}
"""`path` or `path:function` -> why it stays longer than the limit."""


def _sources() -> list[Path]:
    return [p for folder in FOLDERS for p in sorted((REPO / folder).rglob("*.py"))]


def oversized(path: Path, root: Path = REPO) -> list[str]:
    """`path` (over MAX_MODULE_LINES) and `path:function` (over MAX_FUNCTION_LINES) entries for one
    file, paths relative to `root`."""
    source = path.read_text()
    rel = path.relative_to(root).as_posix()
    found = []
    if source.count("\n") > MAX_MODULE_LINES:
        found.append(rel)
    for node in ast.walk(ast_source.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.end_lineno is not None and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                found.append(f"{rel}:{node.name}")
    return found


def test_no_module_or_function_over_its_limit_unless_named():
    found = [entry for path in _sources() for entry in oversized(path)]
    unexplained = [entry for entry in found if entry not in EXCEPTIONS]
    assert not unexplained, (
        f"over {MAX_MODULE_LINES} lines (module) or {MAX_FUNCTION_LINES} lines (function): "
        f"{unexplained}; split them or name each in EXCEPTIONS with the reason"
    )
    stale = sorted(set(EXCEPTIONS) - set(found))
    assert not stale, f"EXCEPTIONS names entries that are within the limits now: {stale}"


def test_the_check_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    sample = tmp_path / "sample.py"
    sample.write_text(f"def long_one():\n{body}\n\n\ndef short_one():\n    return 1\n")
    assert oversized(sample, tmp_path) == ["sample.py:long_one"]
    sample.write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert oversized(sample, tmp_path) == ["sample.py"]
