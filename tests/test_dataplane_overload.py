"""Overload is answered explicitly: 503 (in-flight limit) or 429 (the bucket cannot meet the SLO), both with
Retry-After, and every request of a burst gets an answer."""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import pytest
from dataplane_helpers import deployment

from exitplan.api.plan import Cell, Plan, SplitPlan
from exitplan.api.resources import EarlyExitServiceSpec

pytestmark = pytest.mark.slow


def one_split(max_queue: int, slo_ms: float, bundle) -> tuple[Plan, EarlyExitServiceSpec]:
    plan = Plan(
        service="overload",
        model="minilm",
        splits=[SplitPlan(index=0, first_block=0, last_block=5)],
        buckets=[128],
        cells=[Cell(split=0, bucket=128, pool="cpu", replicas=1, batch_size=4)],
    )
    spec = EarlyExitServiceSpec.model_validate(
        {
            "model": {"name": "minilm", "bundle": str(bundle)},
            "slo": {"latencyMs": slo_ms},
            "accuracy": {"shadowFraction": 0.0},
            "pools": [{"name": "cpu"}],
            "router": {"maxQueue": max_queue},
        }
    )
    return plan, spec


async def burst(url: str, texts: list[str], n: int) -> list[tuple[int, str | None]]:
    async with aiohttp.ClientSession() as s:

        async def one(i):
            body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [texts[i % len(texts)]]}]}
            async with s.post(
                f"{url}/v2/models/minilm/infer", json=body, timeout=aiohttp.ClientTimeout(total=60)
            ) as resp:
                await resp.read()
                return resp.status, resp.headers.get("Retry-After")

        return await asyncio.gather(*(one(i) for i in range(n)))


@pytest.fixture(scope="module")
def texts(minilm_bundle):
    with np.load(minilm_bundle / "data" / "heldout.npz", allow_pickle=True) as data:
        return [str(t) for t in data["text"][:20]]


@pytest.mark.parametrize("max_queue, slo_ms, expected", [(6, 60000.0, 503), (4096, 400.0, 429)])
async def test_burst_beyond_capacity_gets_explicit_overload_answers(
    minilm_bundle, texts, tmp_path, max_queue, slo_ms, expected
):
    plan, spec = one_split(max_queue, slo_ms, minilm_bundle)
    dep = deployment(minilm_bundle, plan, spec, tmp_path)
    await asyncio.to_thread(dep.start)
    try:
        answers = await burst(dep.url, texts, 80)
    finally:
        await asyncio.to_thread(dep.stop)
    statuses = [s for s, _ in answers]
    assert len(answers) == 80  # every request answered (a lost one would raise a timeout above)
    assert statuses.count(200) >= 4
    assert statuses.count(expected) >= 10
    assert set(statuses) <= {200, expected}
    assert all(retry is not None and int(retry) >= 1 for s, retry in answers if s == expected)
