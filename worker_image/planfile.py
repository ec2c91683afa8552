"""Reading the plan file and noticing when it changes (a ConfigMap volume, or `exitplan up`'s file)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from exitplan.api.plan import Plan

log = logging.getLogger(__name__)


class PlanFileError(ValueError):
    """The plan file is missing or invalid."""


def read_plan(path: Path) -> Plan:
    try:
        return Plan.from_file(path)
    except FileNotFoundError as err:
        raise PlanFileError(
            f"{path}: no plan file; run `exitplan plan ... --out {path}` or mount the plan ConfigMap"
        ) from err
    except (ValidationError, ValueError) as err:
        raise PlanFileError(f"{path}: invalid plan: {err}") from err


async def watch_plan(path: Path, on_change: Callable[[Plan], None], interval: float = 1.0) -> None:
    """Call `on_change` with each new valid plan; an invalid file keeps the last good plan."""

    def stamp() -> tuple[float, int] | None:
        try:
            st = path.stat()  # follows the ..data symlink a ConfigMap volume swaps atomically
            return (st.st_mtime, st.st_size)
        except OSError:
            return None

    seen = stamp()
    while True:
        await asyncio.sleep(interval)
        now = stamp()
        if now is None or now == seen:
            continue
        seen = now
        try:
            plan = read_plan(path)
        except PlanFileError as err:
            log.error("ignoring the changed plan file, keeping the last good plan: %s", err)
            continue
        on_change(plan)
