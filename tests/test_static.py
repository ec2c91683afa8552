"""Static checks of the source tree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_mypy_strict_passes_on_api_and_planner():
    """`mypy --strict` (pyproject's [tool.mypy]) on exitplan.api and exitplan.planner, via tools/typecheck.py."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "typecheck.py")], capture_output=True, text=True, cwd=REPO, timeout=600
    )
    assert proc.returncode == 0, f"mypy failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}"
