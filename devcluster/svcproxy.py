"""The dev-cluster's stand-in for Services and cluster DNS.

- `TcpProxy`: one local port per Service; each connection goes to the next ready endpoint (round
  robin), bytes copied both ways. The port is published in the Service's
  `status.loadBalancer.ingress` (ip 127.0.0.1 + port), where clients and the operator find it (a
  headless Service gets one too, for processes outside the pods: the operator, tests).
- `write_resolve_file`: the JSON file named by EXITPLAN_RESOLVE_FILE that routers and workers read
  instead of DNS: {"<svc>.<ns>.svc": ["127.0.0.1:31001", ...]} for headless Services (every ready
  endpoint) and the proxy address for ClusterIP Services. Written atomically (rename).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
from pathlib import Path


class TcpProxy:
    def __init__(self, name: str) -> None:
        self.name = name
        self.endpoints: list[tuple[str, int]] = []
        self.port = 0
        self._server: asyncio.base_events.Server | None = None
        self._rr = itertools.count()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self._server = await asyncio.start_server(self._handle, host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        endpoints = list(self.endpoints)
        if not endpoints:
            writer.close()  # no ready endpoint: refuse, as kube-proxy does
            return
        host, port = endpoints[next(self._rr) % len(endpoints)]
        try:
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    dst.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))


def service_hostnames(name: str, namespace: str) -> list[str]:
    """The names a pod may use for a Service (what cluster DNS answers)."""
    return [f"{name}.{namespace}.svc", f"{name}.{namespace}.svc.cluster.local", f"{name}.{namespace}"]


def write_resolve_file(path: Path, mapping: dict[str, list[str]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(mapping, indent=1, sort_keys=True))
    os.replace(tmp, path)
