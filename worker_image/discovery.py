"""Finding the addresses of a hop's pods, and of the routers a worker may answer to.

A peer spec is a comma-separated list of `host:port`. Hostnames are re-resolved every refresh: when
the environment variable EXITPLAN_RESOLVE_FILE names a JSON file {"host": ["ip:port", ...]} the
mapping there wins (the local pod runner's stand-in for the cluster DNS of headless Services);
otherwise every DNS A record of the host is a peer (a headless Service resolves to its ready pods).
What the pods at these addresses are, and which one takes the next frame: `peer_choice.py`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import Iterable

log = logging.getLogger(__name__)

RESOLVE_FILE_ENV = "EXITPLAN_RESOLVE_FILE"


def parse_peer_spec(spec: str | None) -> list[tuple[str, int]]:
    """[(host, port)] from "a:1,b:2"; raises ValueError naming the bad entry."""
    out: list[tuple[str, int]] = []
    for entry in (spec or "").split(","):
        entry = entry.strip()
        if not entry:
            continue
        host, sep, port = entry.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"peer {entry!r}: expected host:port")
        out.append((host, int(port)))
    return out


def _resolve_file() -> dict[str, list[str]]:
    path = os.environ.get(RESOLVE_FILE_ENV)
    if not path:
        return {}
    try:
        with open(path) as fh:
            data = json.load(fh)
        return {str(k): [str(v) for v in vs] for k, vs in data.items()}
    except (OSError, ValueError, AttributeError) as err:
        log.warning("cannot read %s=%s: %s", RESOLVE_FILE_ENV, path, err)
        return {}


async def resolve(spec: list[tuple[str, int]]) -> list[str]:
    """Every `ip:port` the spec names right now (duplicates removed, order kept)."""
    mapping = _resolve_file()
    loop = asyncio.get_running_loop()
    found: list[str] = []
    for host, port in spec:
        if host in mapping:
            found.extend(mapping[host])
            continue
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, family=socket.AF_INET)
        except OSError as err:
            log.debug("resolving %s: %s", host, err)
            continue
        found.extend(f"{info[4][0]}:{port}" for info in infos)
    return list(dict.fromkeys(found))


class ReplyTargets:
    """Where a worker may post shadow feedback: the routers its plan names (`Plan.routers`, host:port
    entries resolved like peers, so a headless Service stands for its router pods). A frame whose
    reply_to is not among them is refused: a worker answers only to the service's own routers."""

    def __init__(self, entries: Iterable[str] = (), min_interval_s: float = 1.0) -> None:
        self.min_interval_s = min_interval_s
        self.set(entries)

    def set(self, entries: Iterable[str]) -> None:
        self.entries = [e for e in entries if e]
        self.spec = parse_peer_spec(",".join(self.entries))
        self.known: set[str] = set(self.entries)
        self.resolved_at = -float("inf")

    async def refresh(self) -> None:
        self.resolved_at = time.monotonic()
        self.known = set(self.entries) | set(await resolve(self.spec))

    async def allows(self, address: str) -> bool:
        """True when `address` is a router the plan names (re-resolved, at most once per
        min_interval_s, when it is not among the addresses resolved so far: a new router pod)."""
        if address in self.known:
            return True
        if self.spec and time.monotonic() - self.resolved_at >= self.min_interval_s:
            await self.refresh()
        return address in self.known
