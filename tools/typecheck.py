"""Run ``mypy --strict`` on every package exitplan ships (or the ones named with ``--packages``).

The repository maps the ``exitplan`` import root onto folders named for the parts of the system
(pyproject's ``[tool.setuptools.package-dir]``: ``exitplan.api`` lives in ``api/``, ``exitplan.planner`` in
``planner/``), a layout mypy cannot follow from the folders alone. This script builds the package tree mypy
expects in a temporary directory -- ``exitplan/`` holding the CLI's modules, with one symlink per sub-package
onto its folder, read from pyproject -- and runs mypy there with the repository's ``pyproject.toml`` as its
configuration.

Prints mypy's output and exits with mypy's exit code; other arguments go to mypy.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "pyproject.toml"


def package_dirs() -> dict[str, str]:
    """Sub-package name under exitplan -> its folder, as pyproject maps them (the CLI, `exitplan`, is "")."""
    mapping = tomllib.loads(CONFIG.read_text())["tool"]["setuptools"]["package-dir"]
    return {name.partition(".")[2]: folder for name, folder in mapping.items() if name.count(".") <= 1}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packages", default="", help="comma-separated sub-packages (cli = the CLI); default all")
    args, rest = parser.parse_known_args()
    dirs = package_dirs()
    wanted = [p.strip() for p in args.packages.split(",") if p.strip()] or ["cli", *[n for n in dirs if n]]
    with tempfile.TemporaryDirectory(prefix="exitplan-typecheck-") as tmp:
        root = Path(tmp) / "exitplan"
        root.mkdir()
        for path in (REPO / dirs[""]).glob("*.py"):
            (root / path.name).symlink_to(path)
        for name, folder in dirs.items():
            if name:
                (root / name).symlink_to(REPO / folder, target_is_directory=True)
        cmd = [sys.executable, "-m", "mypy", "--config-file", str(CONFIG), *rest]
        if args.packages:  # report only these packages' errors (the others are still read for their types)
            cmd.append("--follow-imports=silent")
        for name in wanted:
            if name == "cli":
                cmd += ["-m", "exitplan"]
                for path in sorted((REPO / dirs[""]).glob("*.py")):
                    if path.stem != "__init__":
                        cmd += ["-m", f"exitplan.{path.stem}"]
            elif name in dirs:
                cmd += ["-p", f"exitplan.{name}"]
            else:
                parser.error(f"unknown package {name!r}; known: cli, {', '.join(n for n in dirs if n)}")
        # Run from the farm: mypy finds the packages there, and the repository's own folders (operator/
        # would shadow the standard library's operator module) stay off the child's sys.path.
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, check=False)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
