"""Free ports for local processes, chosen below the kernel's ephemeral range.

A port the kernel handed out as free (bind to port 0) lies in the ephemeral range, where the same
kernel also picks the local ports of outgoing connections: between choosing a port for a process
and that process binding it, a probe or a hop from an earlier process can take it (`address already
in use`). Ports below the range are never handed to outgoing connections, so a block chosen there
stays free until its owner binds it, unless another listener takes it on purpose.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 10000
RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_start() -> int:
    """First port of the kernel's ephemeral range (32768 where the kernel does not say)."""
    try:
        return int(RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(ports: range) -> bool:
    socks: list[socket.socket] = []
    try:
        for port in ports:
            sock = socket.socket()
            socks.append(sock)
            sock.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        for sock in socks:
            sock.close()


def free_port_block(n: int, attempts: int = 500) -> int:
    """First of `n` consecutive ports on 127.0.0.1 that nothing listens on now, below the ephemeral range."""
    top = ephemeral_start() - n
    if top <= LOWEST:
        raise OSError(f"no room for {n} ports between {LOWEST} and the ephemeral range ({ephemeral_start()})")
    pick = random.SystemRandom()
    for _ in range(attempts):
        base = pick.randrange(LOWEST, top)
        if _bindable(range(base, base + n)):
            return base
    raise OSError(f"found no {n} consecutive free ports between {LOWEST} and {top + n} in {attempts} tries")


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now, below the ephemeral range."""
    return free_port_block(1)
