"""The router's per-bucket observation figures (what the operator compares with the plan: answered,
within the SLO, refused, p99, capacity in use) filled from real requests: router + MiniLM workers as
processes (buckets 32 and 128), real HTTP, the window in progress read from the control port."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from dataplane_helpers import control_headers, deployment, heldout_texts, service_spec
from tokenizers import Tokenizer

from exitplan.api.bundle import read_manifest
from exitplan.api.observations import Observations
from exitplan.api.plan import Cell, Plan, SplitPlan
from exitplan.worker_image.control_client import ControlClient

pytestmark = pytest.mark.slow

SLO_MS = 500.0


def two_bucket_plan(blocks: int) -> Plan:
    return Plan(
        service="accuracy",
        model="minilm",
        splits=[SplitPlan(index=0, first_block=0, last_block=blocks - 1)],
        buckets=[32, 128],
        cells=[Cell(split=0, bucket=b, pool="cpu", replicas=1, batch_size=8) for b in (32, 128)],
    )


def texts_by_length(bundle) -> tuple[list[str], list[str]]:
    """Held-out texts of at most 32 tokens, and texts of 40-128 tokens (several joined)."""
    tok = Tokenizer.from_file(str(bundle / read_manifest(bundle).tokenizer))
    texts = heldout_texts(bundle, 200)
    short = [t for t in texts if len(tok.encode(t).ids) <= 32][:40]
    long, i = [], 0
    while len(long) < 12 and i + 2 <= len(texts):
        joined = " ".join(texts[i : i + 2])
        if 40 <= len(tok.encode(joined).ids) <= 128:
            long.append(joined)
        i += 2
    assert len(short) >= 20 and len(long) >= 6, (len(short), len(long))
    return short, long


async def infer(session: aiohttp.ClientSession, url: str, text: str) -> tuple[int, float | None]:
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [text]}]}
    async with session.post(url, json=body) as resp:
        answer = await resp.json()
        return resp.status, (answer["parameters"]["latency_ms"] if resp.status == 200 else None)


async def test_per_bucket_figures_come_from_real_requests(minilm_bundle, tmp_path):
    short, long = texts_by_length(minilm_bundle)
    plan = two_bucket_plan(len(read_manifest(minilm_bundle).blocks))
    dep = deployment(minilm_bundle, plan, service_spec(minilm_bundle, slo_ms=SLO_MS), tmp_path)
    dep.start()
    try:
        url = f"{dep.url}/v2/models/minilm/infer"
        results: list[tuple[int, float | None, bool]] = []  # (status, latency ms, long)
        async with aiohttp.ClientSession(headers=control_headers(dep)) as s:

            async def observed() -> Observations:
                async with s.get(f"{dep.control_url}/v1/observations?window=current") as resp:
                    assert resp.status == 200
                    return Observations.model_validate(await resp.json())

            async def round_(burst: int) -> None:
                texts = [*short, *long] + short * (burst // len(short))
                answers = await asyncio.gather(*(infer(s, url, t) for t in texts))
                results.extend((st, ms, t in long) for (st, ms), t in zip(answers, texts))

            obs = await observed()
            for _ in range(30):  # load is sampled once a second: keep inputs in flight until a sample saw them
                await round_(burst=len(short) * 3)
                obs = await observed()
                if all(obs.per_bucket[k].load_seconds > 0 for k in ("32", "128")):
                    break
            # the operator's read: the closed window and the one in progress in one answer (?window=both)
            async with ControlClient(dep.control_url, token=dep.control_token) as router:
                closed, current = await router.recent_observations()
            assert current.requests == obs.requests and current.per_bucket.keys() == obs.per_bucket.keys()
            assert closed.since <= current.since and closed.until <= current.until
    finally:
        dep.stop()

    answered = [(ms, is_long) for st, ms, is_long in results if st == 200]
    refused = [st for st, _, _ in results if st == 429]
    assert answered and all(st in (200, 429, 503) for st, _, _ in results), {st for st, _, _ in results}
    b32, b128 = obs.per_bucket["32"], obs.per_bucket["128"]
    assert set(obs.per_bucket) == {"32", "128"}
    # every answer is counted once, in the bucket that gave it; long inputs only fit bucket 128
    assert b32.requests + b128.requests == len(answered) == obs.requests
    assert b128.requests >= sum(is_long for _, is_long in answered) > 0 and b32.requests > 0
    # within the SLO: what the answers' own latencies say
    within = sum(ms is not None and ms <= SLO_MS for ms, _ in answered)
    assert b32.within_slo + b128.within_slo == within == obs.within_slo
    assert b32.within_slo <= b32.requests and b128.within_slo <= b128.requests
    # refusals (429) by the bucket the input fits best; 503s (the router's own limit) are not per bucket
    assert b32.refused + b128.refused == len(refused)
    # p99 per bucket: positive, and no more than the slowest answer
    slowest = max(ms for ms, _ in answered)
    for b in (b32, b128):
        assert 0 < b.p99_ms <= slowest + 0.01
    # capacity in use: sampled while inputs were in flight, a mean within what admission allows
    span = obs.until - obs.since
    assert b32.load_seconds > 0 and b128.load_seconds > 0, (b32, b128)
    assert 0 < (b32.load_seconds + b128.load_seconds) / span < 10
