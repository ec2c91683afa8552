"""Shadow feedback from the last split: the complete per-ramp outputs of shadow-sampled rows, posted to
the routers that asked for them (each row's `reply_to`, one of the plan's routers) as
`control_bodies.FeedbackSample`s."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import aiohttp

from exitplan.worker_image.classify.rows import Row
from exitplan.worker_image.control_bodies import FeedbackSample, feedback_post

log = logging.getLogger(__name__)

FEEDBACK_TIMEOUT_S = 5.0


def send_feedback(session: aiohttp.ClientSession, rows: Sequence[Row], exit_ramps: Sequence[str]) -> None:
    """Post, in the background, each router's samples. Rows without a reply target or a complete
    record send nothing."""
    by_target: dict[str, list[FeedbackSample]] = {}
    for row in rows:
        target, rec = row.item.reply_to, row.rec
        sample = FeedbackSample.of(row.item.id, rec, exit_ramps) if target and rec is not None else None
        if target and sample is not None:
            by_target.setdefault(target, []).append(sample)
    for target, samples in by_target.items():
        asyncio.create_task(_post(session, target, samples))


async def _post(session: aiohttp.ClientSession, target: str, samples: list[FeedbackSample]) -> None:
    try:
        async with session.post(
            f"http://{target}/v1/feedback",
            json=feedback_post(samples),
            timeout=aiohttp.ClientTimeout(total=FEEDBACK_TIMEOUT_S),
        ) as resp:
            resp.raise_for_status()
    except (TimeoutError, aiohttp.ClientError) as err:
        log.warning("feedback to %s lost (%s): %d samples", target, err, len(samples))
