"""A stalled worker is routed around (worker_image/hop_client.py, worker_image/peer_choice.py).

A real local deployment (the digits bundle, one router, two worker replicas of its one split). One
worker is stopped with SIGSTOP while requests flow: it keeps its connections open and answers nothing,
the case a dead pod's refused connection does not cover. A frame it holds past the hedge bound is sent
to its twin too, and the stalled worker leaves the rotation until it answers its health check. Every
request gets an answer, at most 0.5 % of them an error, and after SIGCONT the worker is back in rotation.
The stop lasts until the router has ejected the worker and 125 more rounds of requests, not a time;
loops that wait are hang guards, not deadlines.
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

pytestmark = pytest.mark.slow

PATH = "/v2/models/digits/infer"
HANG_GUARD_S = 120.0
ROUNDS = 125
"""Rounds of AT_ONCE requests before, during and after the stop: 3,000 in all, the issue's figure (at most 0.5 %
errors of 3,000 requests across a stop; the requests in flight when the worker stops are a fixed count)."""
AT_ONCE = 8


@pytest.fixture(scope="module")
def served(digits_bundle, tmp_path_factory):
    manifest = read_manifest(digits_bundle)
    spec = service_spec(digits_bundle, slo_ms=1000.0)
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"name": "digits"})})
    setup = ServiceSetup("stalled", spec, digits_bundle, manifest)
    plan = single_split_plan(
        setup, thresholds={r.name: 0.9 for r in manifest.exit_ramps()}, replicas=2, batch_size=8, reason="test"
    )
    base = free_port_block(4)
    dep = LocalDeployment(
        digits_bundle, plan, spec, tmp_path_factory.mktemp("stalled"), port=base + 3, base_port=base, restart=None
    )
    with dep:
        yield dep


def bodies(bundle) -> list[bytes]:
    with np.load(bundle / "data" / "heldout.npz") as data:
        held = np.asarray(data["x"], dtype=np.float32)
    return [
        json.dumps(
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1, 8, 8], "data": x.ravel().tolist()}]}
        ).encode()
        for x in held
    ]


async def peers(dep: LocalDeployment) -> list[dict]:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {dep.control_token}"}) as s:
        async with s.get(f"{dep.control_url}/v1/peers") as resp:
            assert resp.status == 200
            return await resp.json()


async def ejections(dep: LocalDeployment, address: str) -> int:
    return {p["address"]: p for p in await peers(dep)}[address]["ejections"]


async def test_a_stopped_worker_fails_no_request_its_twin_can_answer(served, digits_bundle):
    dep = served
    victim = next(p for p in dep.procs if p.name.startswith("worker-"))
    inputs = bodies(digits_bundle)
    statuses: list[int | str] = []
    async with aiohttp.ClientSession() as s:

        async def one(i: int) -> int | str:
            try:
                async with s.post(
                    f"{dep.url}{PATH}", data=inputs[i % len(inputs)], headers={"Content-Type": "application/json"}
                ) as r:
                    await r.read()
                    return r.status
            except aiohttp.ClientError as err:  # no answer at all: a lost request
                return f"lost: {err}"

        async def rounds(n: int) -> None:
            for _ in range(n):
                statuses.extend(await asyncio.gather(*(one(len(statuses) + k) for k in range(AT_ONCE))))

        await rounds(ROUNDS)
        os.kill(victim.popen.pid, signal.SIGSTOP)
        try:
            end = time.monotonic() + HANG_GUARD_S
            while await ejections(dep, victim.address) == 0:  # until a frame stalled there and was hedged
                assert time.monotonic() < end, "the stopped worker was never taken out of rotation"
                await rounds(1)
            await rounds(ROUNDS)  # served by the twin alone meanwhile
        finally:
            os.kill(victim.popen.pid, signal.SIGCONT)
        await rounds(ROUNDS)
    lost = [s for s in statuses if isinstance(s, str)]
    errors = [s for s in statuses if s != 200]
    assert not lost, lost[:3]
    assert len(errors) <= 0.005 * len(statuses), f"{len(errors)} of {len(statuses)}: {sorted(set(map(str, errors)))}"
    end = time.monotonic() + HANG_GUARD_S
    while True:  # back in rotation once it answers its health check
        seen = {p["address"]: p for p in await peers(dep)}
        if seen[victim.address]["ready"] and not seen[victim.address]["ejected"]:
            break
        assert time.monotonic() < end, seen
        await asyncio.sleep(0.1)
