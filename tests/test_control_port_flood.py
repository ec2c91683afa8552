"""A flood of a router's control port leaves its inference port answering (issue 28 item 3).

The attack: 21,000 unfinished, unauthenticated connections to router 0's control port took the router
to its file-descriptor limit, and its inference port answered 0 of 159 probes for about 32 s (the
control port had no guard: no header timeout, no connection limit). Now the control port's listener
runs behind the same guard as the inference port (server_guard.py, auth.ControlPlane) with a limit of
its own (`ServerLimits.control_max_connections`, 256), refused connections past MAX_LINGERING are
closed as soon as their 503 is written, and the limits fit the process's descriptors
(server_limits.within_fd_limit).

Here a real router (digits bundle) gets its descriptor limit lowered to FD_LIMIT (prlimit on its
pid, as a small `ulimit -n`), then FLOOD connections to its control port that never send a head
(FLOOD > FD_LIMIT: unguarded, accept() would run out of descriptors), and while they are open,
PROBES inference requests. Every probe is answered 200; the flood is refused (503) past the control
limit and the rest closed at the header timeout. Figures (one run, 2-core VM): 3,000 flood
connections, 2,744 answered 503 at once, 256 held and closed without an answer after 3 s; 40/40
probes 200; the router's open descriptors peaked at 340 of 1,024.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource

import numpy as np
import pytest
from dataplane_helpers import free_port_block, service_spec

from exitplan.api.bundle import read_manifest
from exitplan.localrun.deployment import LocalDeployment
from exitplan.localrun.service_setup import ServiceSetup, single_split_plan
from exitplan.worker_image.server_limits import ServerLimits

pytestmark = pytest.mark.slow

FD_LIMIT = 1024
FLOOD = 3000
PROBES = 40
CONTROL_LIMIT = ServerLimits().control_max_connections
HANG_GUARD_S = 60.0
"""Only against a server that never answers; no test times the server."""
PATH = "/v2/models/digits/infer"


@pytest.fixture(scope="module")
def router(digits_bundle, tmp_path_factory):
    manifest = read_manifest(digits_bundle)
    spec = service_spec(digits_bundle, slo_ms=1000.0)
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"name": "digits"})})
    setup = ServiceSetup("flood", spec, digits_bundle, manifest)
    plan = single_split_plan(
        setup, thresholds={r.name: 0.9 for r in manifest.exit_ramps()}, replicas=1, batch_size=8, reason="test"
    )
    base = free_port_block(3)
    dep = LocalDeployment(
        digits_bundle,
        plan,
        spec,
        tmp_path_factory.mktemp("flood"),
        port=base + 2,
        base_port=base,
        window_seconds=3600,
        router_args=["--header-timeout-s", "3", "--max-connections", "64"],
    )
    with dep:
        yield dep


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _probe(port: int, body: bytes) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = f"POST {PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        writer.write(head.encode() + b"Connection: close\r\n\r\n" + body)
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), HANG_GUARD_S)
        return int(status_line.split()[1]) if status_line.startswith(b"HTTP/1.1 ") else 0
    finally:
        writer.close()


async def _fate(reader: asyncio.StreamReader) -> str:
    """What became of a flood connection: refused (503), closed (no answer) or reset."""
    try:
        got = await asyncio.wait_for(reader.read(64), HANG_GUARD_S)
    except ConnectionError:
        return "reset"
    return "refused" if got.startswith(b"HTTP/1.1 503") else ("closed" if not got else f"other: {got[:40]!r}")


async def test_a_control_port_flood_leaves_the_inference_port_answering(router, digits_bundle):
    (proc,) = router.router_procs()
    assert proc.popen is not None
    pid = proc.popen.pid
    _, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (FD_LIMIT, hard))
    with np.load(digits_bundle / "data" / "heldout.npz") as data:
        image = np.asarray(data["x"][0], dtype=np.float32).ravel().tolist()
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1, 8, 8], "data": image}]}).encode()
    assert await _probe(router.port, body) == 200

    flood = []
    peak = 0
    try:
        for _ in range(FLOOD):  # connections that never send a head
            flood.append(await asyncio.open_connection("127.0.0.1", router.control_port))
        peak = _open_fds(pid)
        probes = [await _probe(router.port, body) for _ in range(PROBES)]
        peak = max(peak, _open_fds(pid))
        fates = await asyncio.gather(*(_fate(reader) for reader, _ in flood))
    finally:
        for _, writer in flood:
            writer.close()
    counts = {fate: fates.count(fate) for fate in set(fates)}
    print(f"flood {FLOOD}: {counts}; probes {probes.count(200)}/{PROBES} 200; router fds peak {peak}/{FD_LIMIT}")
    assert probes == [200] * PROBES
    assert peak < FD_LIMIT
    assert counts.get("closed", 0) <= CONTROL_LIMIT  # held until the header timeout: at most the limit
    assert counts.get("refused", 0) + counts.get("reset", 0) >= FLOOD - CONTROL_LIMIT - 64, counts
    assert not [f for f in fates if f.startswith("other")], counts
    log = proc.log_path.read_text()
    assert f"a connection past the limit of {CONTROL_LIMIT} was refused (503)" in log
    assert "Traceback" not in log


def test_connection_limits_are_fitted_to_the_descriptor_limit():
    from exitplan.worker_image.server_limits import FD_RESERVE, MAX_LINGERING, within_fd_limit

    asked = ServerLimits(max_connections=10**7, control_max_connections=10**6)
    fitted = within_fd_limit(asked)  # (raises this process's soft limit to its hard one, as a server does)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft == resource.RLIM_INFINITY or (
        fitted.max_connections + fitted.control_max_connections + 2 * MAX_LINGERING + FD_RESERVE <= soft
    )
    assert fitted.max_connections > fitted.control_max_connections >= 1  # in the proportions asked
    assert within_fd_limit(ServerLimits(max_connections=8, control_max_connections=4)) == ServerLimits(
        max_connections=8, control_max_connections=4
    )  # limits that fit are kept
