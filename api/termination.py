"""What a container's termination message says went wrong, in one line.

A kubelet with `terminationMessagePolicy: FallbackToLogsOnError` makes the tail of a failed
container's log its termination message (at most 2048 bytes or 80 lines); the dev cluster's pod
runner does the same, with a header line of its own before each run (`--- HH:MM:SS name: command`).
The operator quotes a failed container in conditions and events by `error_line`: the first line of
its error, never a header or a progress line, so that the same failure reads the same at every
restart (and its events aggregate instead of piling up).
"""

from __future__ import annotations

import re

TAIL_BYTES = 2048
"""A kubelet's limit on a termination message taken from the log."""
TAIL_LINES = 80
HEADER = re.compile(r"^--- \d\d:\d\d:\d\d ")
"""The dev cluster's line before each run of a container (devcluster/pods.py)."""
ERROR = re.compile(r"^(error|fatal)\b:?", re.IGNORECASE)
LIMIT = 300
"""Characters of the error line kept."""


def log_tail(text: str) -> str:
    """What a kubelet keeps of a log as a termination message: the last TAIL_LINES lines of the last
    run (the dev cluster's header lines mark runs), at most TAIL_BYTES from the end."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if HEADER.match(line)]
    kept = "\n".join(lines[starts[-1] + 1 if starts else 0 :][-TAIL_LINES:]).strip()
    return kept.encode()[-TAIL_BYTES:].decode(errors="ignore")


def error_line(message: str) -> str:
    """The first line of the error a termination message (or a log) holds: the first `error: ...`
    line (exitplan's commands end with one), else the exception line that ends the last traceback,
    else the last line that is not a run header; '' for nothing."""
    raw = [line.rstrip() for line in message.splitlines() if line.strip() and not HEADER.match(line)]
    for line in raw:
        if ERROR.match(line.strip()):
            return line.strip()[:LIMIT]
    traceback = max(
        (i for i, line in enumerate(raw) if line.startswith("Traceback (most recent call last)")), default=-1
    )
    if traceback >= 0:
        ends = [line for line in raw[traceback + 1 :] if not line.startswith((" ", "\t"))]
        if ends:
            return ends[0].strip()[:LIMIT]
    return raw[-1].strip()[:LIMIT] if raw else ""
