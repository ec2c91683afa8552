"""What an exitplan HTTP server (a router, a worker) holds its clients to, and how it drains: the settings
that `serve.py` runs a server with and `server_guard.py` enforces (`exitplan router --help` names each)."""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass, replace

log = logging.getLogger(__name__)

MAX_LINGERING = 64
"""Refused connections (503) that may linger open for their answer to be read; past them a refused
connection is closed as soon as its answer is written (server_guard.py)."""
FD_RESERVE = 256
"""File descriptors a server keeps for what is not a client connection (hops, files, logs)."""


@dataclass(frozen=True)
class ServerLimits:
    """What a server holds its clients to, and how it drains (server_guard.py)."""

    header_timeout_s: float = 10.0
    """From a connection's opening, or the first byte of a later request on it, to the end of the request's head."""
    keepalive_timeout_s: float = 75.0
    """How long a kept-alive connection may stay idle between requests."""
    body_timeout_s: float = 30.0
    """From the end of a request's head to the end of its body (408 past it)."""
    max_connections: int = 4096
    """Open connections past which a new one is answered 503 and closed."""
    drain_delay_s: float = 2.0
    """After SIGTERM, keep serving (readiness off, answers with Connection: close) at least this long,
    so that clients with kept-alive connections and the other hops see the replica leave."""
    drain_timeout_s: float = 20.0
    """After SIGTERM, the longest the server waits for its in-flight requests (the delay included)."""
    control_max_connections: int = 256
    """The same limit on a router's control port (its own count: a flood there leaves the inference
    port's connections alone); control clients are the operator, the tuner and the workers' feedback."""

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "keepalive_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_connections", "control_max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.drain_delay_s < 0 or self.drain_timeout_s < self.drain_delay_s:
            raise ValueError(
                f"need 0 <= drain_delay_s <= drain_timeout_s, got {self.drain_delay_s} and {self.drain_timeout_s}"
            )


def within_fd_limit(limits: ServerLimits) -> ServerLimits:
    """`limits` with the connection limits lowered, if need be, to fit this process's file descriptors
    (the soft limit raised to the hard one first): a flood of connections is answered 503 before accept()
    runs out of descriptors, which would leave every port of the process deaf."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    connections = limits.max_connections + limits.control_max_connections
    room = soft - FD_RESERVE - 2 * MAX_LINGERING
    if soft == resource.RLIM_INFINITY or connections <= room:
        return limits
    scale = max(room, 2) / connections
    fitted = replace(
        limits,
        max_connections=max(1, int(limits.max_connections * scale)),
        control_max_connections=max(1, int(limits.control_max_connections * scale)),
    )
    log.warning(
        "%d file descriptors allowed (ulimit -n): connection limits lowered to %d (port) and %d (control port)",
        soft,
        fitted.max_connections,
        fitted.control_max_connections,
    )
    return fitted
