"""Restarts and drains on a real local deployment (the digits bundle, two routers behind the front,
one worker), in this order (the worker's restart count adds up): a worker killed with SIGKILL is started again by the supervisor and serves the requests
after it; a router or a worker sent SIGTERM with a request in flight turns its readiness off,
answers that request, and exits 0.

The request held in flight is one whose body is only half sent (the body timeout is far away): it
stays in flight exactly as long as the test wants, so nothing depends on timing. Loops that wait
for a process to come back are hang guards, not deadlines.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import numpy as np
import pytest
from dataplane_helpers import free_port_block, service_spec

from exitplan.api.bundle import read_manifest
from exitplan.localrun.deployment import LocalDeployment
from exitplan.localrun.service_setup import ServiceSetup, single_split_plan
from exitplan.localrun.supervisor import RestartPolicy
from exitplan.worker_image import wire
from exitplan.worker_image.wire import HopAnswer, HopItem, HopRequest

pytestmark = pytest.mark.slow

PATH = "/v2/models/digits/infer"
HANG_GUARD_S = 120.0


@pytest.fixture(scope="module")
def served(digits_bundle, tmp_path_factory):
    manifest = read_manifest(digits_bundle)
    spec = service_spec(digits_bundle, slo_ms=1000.0)
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"name": "digits"})})
    setup = ServiceSetup("restarts", spec, digits_bundle, manifest)
    plan = single_split_plan(
        setup, thresholds={r.name: 0.9 for r in manifest.exit_ramps()}, replicas=1, batch_size=8, reason="test"
    )
    base = free_port_block(5)
    events: list[str] = []
    dep = LocalDeployment(
        digits_bundle,
        plan,
        spec,
        tmp_path_factory.mktemp("restarts"),
        port=base + 4,
        base_port=base,
        window_seconds=3600,
        routers=2,
        router_args=["--drain-delay-s", "0.5", "--body-timeout-s", "600"],
        restart=RestartPolicy(initial_s=0.5),
        on_event=events.append,
    )
    dep.events = events
    with dep:
        yield dep


@pytest.fixture(scope="module")
def body(digits_bundle) -> bytes:
    with np.load(digits_bundle / "data" / "heldout.npz") as data:
        image = np.asarray(data["x"][0], dtype=np.float32).ravel().tolist()
    return json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1, 8, 8], "data": image}]}).encode()


def proc(dep: LocalDeployment, name: str):
    return next(p for p in dep.procs if p.name == name or p.name.startswith(name))


async def statuses(url: str, body: bytes, n: int, at_once: int = 4) -> list[int]:
    """n requests, `at_once` at a time (a load the one worker admits, not a burst)."""
    out: list[int] = []
    async with aiohttp.ClientSession() as session:

        async def one() -> int:
            async with session.post(f"{url}{PATH}", data=body, headers={"Content-Type": "application/json"}) as r:
                await r.read()
                return r.status

        for start in range(0, n, at_once):
            out += await asyncio.gather(*(one() for _ in range(min(at_once, n - start))))
    return out


async def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.get(url, headers=headers or {}) as r:
            return r.status, await r.json(content_type=None)


async def until(check, what: str) -> None:
    """Poll `check()` (async, truthy when done) until it holds; a hang guard, not a deadline."""
    end = time.monotonic() + HANG_GUARD_S
    while not await check():
        assert time.monotonic() < end, f"still waiting for {what} after {HANG_GUARD_S:g} s"
        await asyncio.sleep(0.1)


async def all_serving(dep: LocalDeployment, body: bytes) -> bool:
    """Every process up (none waiting for a restart), every router ready (it sees a ready worker),
    and a request through the front answered."""
    if any(p.popen is None or p.popen.poll() is not None for p in dep.procs):
        return False
    for router in dep.router_procs():
        if await ready_status(router.address) != 200:
            return False
    try:
        return (await statuses(dep.url, body, 1)) == [200]
    except aiohttp.ClientError:
        return False


async def ready_status(address: str) -> int:
    try:
        return (await get(f"http://{address}/v2/health/ready"))[0]
    except aiohttp.ClientError:
        return 0


async def held_request(address: str, head: bytes, body: bytes):
    """A connection that sent `head` and half of `body`: its request stays in flight until `finish`."""
    host, port = address.split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    half = len(body) // 2
    writer.write(head + body[:half])
    await writer.drain()

    async def finish() -> tuple[int, bytes]:
        writer.write(body[half:])
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), HANG_GUARD_S)  # the drain answers with Connection: close
        writer.close()
        status_line, _, rest = answer.partition(b"\r\n")
        return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]

    return finish


# ---------------------------------------------------------------- a worker killed


async def test_a_killed_worker_is_restarted_and_serves_the_requests_after_it(served, body):
    assert await statuses(served.url, body, 8) == [200] * 8
    worker = proc(served, "worker-")
    killed = worker.popen
    os.kill(killed.pid, signal.SIGKILL)
    assert killed.wait() == -signal.SIGKILL
    await until(lambda: all_serving(served, body), "the worker to be restarted and serve")
    assert worker.popen is not killed and worker.restarts == 1 and worker.last_exit == -signal.SIGKILL
    assert await statuses(served.url, body, 20) == [200] * 20
    assert any(e.startswith(f"{worker.name} exited with code -9") for e in served.events)
    assert f"{worker.name} restarted (restart 1" in worker.log_path.read_text()
    (row,) = [d for d in served.describe() if d["name"] == worker.name]
    assert row["restarts"] == 1 and row["lastExit"] == -9


# ---------------------------------------------------------------- drains on SIGTERM


async def test_a_router_sent_sigterm_answers_what_is_in_flight_and_exits_0(served, body):
    await until(lambda: all_serving(served, body), "every process serving")
    router = proc(served, "router-0")
    head = (
        f"POST {PATH} HTTP/1.1\r\nHost: {router.address}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    finish = await held_request(router.address, head, body)
    assert await ready_status(router.address) == 200
    draining = router.popen
    draining.send_signal(signal.SIGTERM)
    await until(lambda: _is(ready_status(router.address), 503), "the router's readiness off")
    assert draining.poll() is None  # still up: a request is in flight
    assert await statuses(served.url, body, 10) == [200] * 10  # the front sends the service's requests elsewhere
    status, answer = await finish()
    assert status == 200, answer
    assert json.loads(answer)["outputs"][0]["name"] == "label"
    assert await asyncio.to_thread(draining.wait, HANG_GUARD_S) == 0
    log = router.log_path.read_text()
    assert "SIGTERM: draining (readiness off), 1 request(s) in flight" in log and "drained in" in log
    await until(lambda: all_serving(served, body), "the router to be restarted")
    assert router.restarts == 1 and router.last_exit == 0


async def test_a_worker_sent_sigterm_reports_not_ready_finishes_its_frame_and_exits_0(served, body):
    await until(lambda: all_serving(served, body), "every process serving")
    worker = proc(served, "worker-")
    token = {"Authorization": f"Bearer {served.control_token}"}
    x = np.asarray(json.loads(body)["inputs"][0]["data"], dtype=np.float32).reshape(1, 1, 8, 8)
    frame = wire.encode(
        HopRequest([HopItem("held-1", time.time() + 600, time.time() + 600)], bucket=1).to_meta(), {"x": x}
    )
    head = (
        f"POST /v1/run HTTP/1.1\r\nHost: {worker.address}\r\nAuthorization: {token['Authorization']}\r\n"
        f"Content-Type: application/octet-stream\r\nContent-Length: {len(frame)}\r\n\r\n"
    ).encode()
    finish = await held_request(worker.address, head, frame)
    draining = worker.popen
    draining.send_signal(signal.SIGTERM)
    await until(lambda: _is(ready_status(worker.address), 503), "the worker's readiness off")
    status, info = await get(f"http://{worker.address}/v1/info", token)
    assert status == 200 and info["ready"] is False  # the hops that send to it stop choosing it
    status, answer = await finish()
    assert status == 200, answer
    meta, _ = wire.decode(answer)
    (result,) = HopAnswer.from_meta(meta).results
    assert result.id == "held-1" and result.error is None and result.ramp
    assert await asyncio.to_thread(draining.wait, HANG_GUARD_S) == 0
    await until(lambda: all_serving(served, body), "the worker to be restarted")
    assert worker.restarts == 2 and worker.last_exit == 0


async def _is(status, want: int) -> bool:
    return (await status) == want
