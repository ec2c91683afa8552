"""One process of a local deployment: the command it runs (the CLI's own `exitplan worker`, `exitplan router`,
`exitplan generate-stage`, as a pod would run it), its port and its log, and what the supervisor knows of it.

The classification plan's processes are `deployment.py`'s (`LocalDeployment`), a generation plan's
`generation.py`'s; both build `Proc`s from here.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


class StartError(RuntimeError):
    """A process of the deployment did not come up; the message names it and shows its log tail."""


def exitplan_command() -> list[str]:
    """How to run the CLI from here: the installed script beside this interpreter, else `python -m`."""
    script = Path(sys.executable).with_name("exitplan")
    if script.exists():
        return [str(script)]
    found = shutil.which("exitplan")
    return [found] if found else [sys.executable, "-m", "exitplan"]


@dataclass
class Proc:
    name: str
    args: list[str]
    port: int
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    """Times the supervisor started it again."""
    last_exit: int | None = None
    """Its last exit code (negative: the signal that ended it)."""
    started_at: float = 0.0
    backoff_s: float = 0.0
    restart_at: float | None = None
    """When the supervisor starts it again (monotonic clock), while it is down."""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
