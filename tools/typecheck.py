"""Run ``mypy --strict`` on the ``exitplan.api`` and ``exitplan.planner`` packages.

The repository maps the ``exitplan`` import root onto folders named for the
parts of the system (pyproject's ``[tool.setuptools.package-dir]``:
``exitplan.api`` lives in ``api/``, ``exitplan.planner`` in ``planner/``), a
layout mypy cannot follow from the folders alone. This script builds the
package tree mypy expects in a temporary directory -- an empty
``exitplan/__init__.py`` with symlinks ``exitplan/api`` and
``exitplan/planner`` onto the repository's folders -- and runs mypy there with
the repository's ``pyproject.toml`` as its configuration.

Prints mypy's output and exits with mypy's exit code; extra arguments go to mypy.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "pyproject.toml"
# package under the exitplan import root -> folder in the repository
PACKAGES = {"api": "api", "planner": "planner"}


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="exitplan-typecheck-") as tmp:
        root = Path(tmp) / "exitplan"
        root.mkdir()
        (root / "__init__.py").write_text("")
        for name, folder in PACKAGES.items():
            (root / name).symlink_to(REPO / folder, target_is_directory=True)
        cmd = [sys.executable, "-m", "mypy", "--config-file", str(CONFIG), *sys.argv[1:]]
        for name in PACKAGES:
            cmd += ["-p", f"exitplan.{name}"]
        # Run from the farm: mypy finds the packages there, and the repository's own folders (operator/
        # would shadow the standard library's operator module) stay off the child's sys.path.
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, check=False)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
