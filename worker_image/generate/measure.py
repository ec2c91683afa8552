"""Measuring a generative bundle on this machine for the generation planner (exitplan.planner.generation).

- `measure_times`: each block's and head's time for one new token against a `context`-long cache;
- `measure_thresholds`: per candidate threshold, teacher forced on held-out texts, the share of
  positions each head decides (the first head whose confidence reaches the threshold) and how often
  that head's token differs from the final head's;
- `measure_recompute_ratio`: what one more position costs in a block call, relative to one position
  (KV recomputation batches the positions an exited token skipped into the next token's call);
- `measure_hop`: one stage-to-stage hand-off over HTTP on localhost (a hidden state as a wire frame);
- `measure_profile`: times and the shares at one threshold.

Results are plain data (the worker layer imports no planner module but the dispatch policy); the
planner reads them with `GenerationProfile.load` and `ThresholdPoint.load`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from exitplan.worker_image.generate.decoder import NEVER_EXIT, DecoderModel, GenerationError

DEFAULT_CANDIDATES = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)


def measure_times(model: DecoderModel, *, context: int = 64, repeats: int = 50) -> tuple[list[float], dict[int, float]]:
    """(ms per block, ms per head by the block it follows) for one new token over a `context`-long cache."""
    spec = model.spec
    context = min(context, spec.max_context - 1)
    past = np.random.default_rng(0).standard_normal((1, spec.num_heads, context, spec.head_dim)).astype(np.float32)
    hidden = np.random.default_rng(1).standard_normal((1, 1, spec.hidden_size)).astype(np.float32)
    block_ms: list[float] = []
    head_ms: dict[int, float] = {}
    for block in range(model.first_block, model.last_block + 1):
        x = np.asarray([[1]], dtype=np.int64) if block == 0 else hidden
        block_ms.append(_time(lambda: model.run_block(block, x, context, past, past), repeats))
        if model.ramp_after(block) is not None:
            head_ms[block] = _time(lambda: model.head_logits(block, hidden), repeats)
    return block_ms, head_ms


def measure_recompute_ratio(model: DecoderModel, *, context: int = 64, repeats: int = 50) -> float:
    """Mean over blocks of (time for 2 new positions - time for 1) / time for 1, clipped to [0, 10]."""
    spec = model.spec
    context = min(context, spec.max_context - 2)
    past = np.random.default_rng(0).standard_normal((1, spec.num_heads, context, spec.head_dim)).astype(np.float32)
    ratios = []
    for block in range(model.first_block, model.last_block + 1):
        times = []
        for q in (1, 2):
            x = (
                np.ones((1, q), dtype=np.int64)
                if block == 0
                else np.random.default_rng(q).standard_normal((1, q, spec.hidden_size)).astype(np.float32)
            )
            times.append(_time(lambda: model.run_block(block, x, context, past, past), repeats))
        ratios.append((times[1] - times[0]) / times[0])
    return float(min(max(float(np.mean(ratios)), 0.0), 10.0))


def measure_thresholds(
    model: DecoderModel, texts: Sequence[str], candidates: Sequence[float] = DEFAULT_CANDIDATES
) -> list[dict[str, Any]]:
    """Per candidate threshold `{"threshold", "disagreement", "decide_share": {block: share}}`: the share of
    positions each head decides and how often the deciding head's token differs from the final head's."""
    if not texts:
        raise GenerationError("give some held-out texts to measure the thresholds on")
    heads = [h.after for h in model.heads]
    final_after = model.n_blocks - 1
    confs, tokens = [], []
    for text in texts:
        ids = model.codec.encode(text)[: model.spec.max_context]
        logits = model.full_forward(ids).logits
        conf_rows, token_rows = [], []
        for after in heads:
            z = logits[model.ramp_after(after).name].astype(np.float64)  # type: ignore[union-attr]
            p = np.exp(z - z.max(axis=1, keepdims=True))
            conf_rows.append(p.max(axis=1) / p.sum(axis=1))
            token_rows.append(z.argmax(axis=1))
        confs.append(np.stack(conf_rows))
        tokens.append(np.stack(token_rows))
    conf, token = np.concatenate(confs, axis=1), np.concatenate(tokens, axis=1)  # [heads, positions]
    final_token = token[-1]
    points = []
    for threshold in sorted(set(float(c) for c in candidates)):
        if not 0.0 <= threshold <= NEVER_EXIT:
            raise GenerationError(f"candidate thresholds must lie in 0..1, got {threshold}")
        undecided = np.ones(conf.shape[1], dtype=bool)
        shares: dict[int, float] = {}
        wrong = 0
        for row, after in enumerate(heads):
            take = undecided & ((after == final_after) | ((threshold < NEVER_EXIT) & (conf[row] >= threshold)))
            shares[after] = float(take.mean())
            wrong += int((take & (token[row] != final_token)).sum())
            undecided &= ~take
        points.append({"threshold": threshold, "disagreement": wrong / conf.shape[1], "decide_share": shares})
    return points


def measure_profile(
    model: DecoderModel,
    texts: Sequence[str],
    threshold: float,
    *,
    hop_ms: float = 0.0,
    context: int = 64,
    repeats: int = 50,
) -> dict[str, Any]:
    """`{"block_ms", "head_ms", "decide_share", "hop_ms"}`: block and head times for one token against a
    `context`-long cache, and the share of tokens each head decides at `threshold` (teacher forced on
    `texts`: the first head whose confidence reaches it)."""
    block_ms, head_ms = measure_times(model, context=context, repeats=repeats)
    (point,) = measure_thresholds(model, texts, [threshold])
    return {
        "block_ms": block_ms,
        "head_ms": head_ms,
        "decide_share": point["decide_share"],
        "hop_ms": hop_ms,
        "recompute_ratio": measure_recompute_ratio(model, context=context, repeats=repeats),
    }


_HOP_SERVER = """
import sys
from aiohttp import web
async def hop(request):
    await request.read()
    return web.Response(body=b'{"queued": true}\\n')
app = web.Application(client_max_size=1 << 24)
app.router.add_post("/hop", hop)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""


def measure_hop(model: DecoderModel, *, repeats: int = 50) -> float:
    """Milliseconds of one stage-to-stage hand-off on this machine: a hidden state posted as a wire frame to
    an aiohttp server in another process on localhost, answered with a short line (what a stage does per token)."""
    import asyncio
    import socket
    import subprocess
    import sys

    import aiohttp

    from exitplan.worker_image import wire

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-c", _HOP_SERVER, str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    hidden = np.zeros((1, 1, model.spec.hidden_size), dtype=np.float32)
    frame = wire.encode({"seq": "x", "start": 0, "decide": True, "threshold": 1.0}, {"x": hidden})

    async def run() -> float:
        async with aiohttp.ClientSession() as session:

            async def once() -> None:
                async with session.post(f"http://127.0.0.1:{port}/hop", data=frame) as r:
                    await r.read()

            for _ in range(600):  # the server process starts (bounded wait)
                if server.poll() is not None:
                    raise GenerationError("the hop measurement server exited")
                try:
                    await once()
                    break
                except aiohttp.ClientError:
                    await asyncio.sleep(0.05)
            for _ in range(5):
                await once()
            started = time.perf_counter()
            for _ in range(repeats):
                await once()
            return 1000 * (time.perf_counter() - started) / repeats

    try:
        return asyncio.run(run())
    finally:
        server.terminate()
        server.wait()


def _time(call: Callable[[], object], repeats: int) -> float:
    call()
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    return 1000 * (time.perf_counter() - started) / repeats
