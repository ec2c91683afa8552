"""Shadow feedback from the last split: the complete per-ramp outputs of shadow-sampled rows, posted to
the routers that asked for them (each row's `reply_to`, one of the plan's routers)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import aiohttp

from exitplan.worker.classify.rows import Row

log = logging.getLogger(__name__)

FEEDBACK_TIMEOUT_S = 5.0


def send_feedback(session: aiohttp.ClientSession, rows: Sequence[Row], exit_ramps: Sequence[str]) -> None:
    """Post, in the background, each router's samples: id, the final head's prediction, and per exit ramp
    the confidence and prediction. Rows without a reply target or a complete record send nothing."""
    by_target: dict[str, list[dict]] = {}
    for row in rows:
        target, rec = row.item.reply_to, row.rec
        if not target or rec is None or rec.final is None:
            continue
        by_target.setdefault(target, []).append(
            {
                "id": row.item.id,
                "final": rec.final,
                "conf": [rec.conf.get(r) for r in exit_ramps],
                "pred": [rec.pred.get(r) for r in exit_ramps],
            }
        )
    for target, samples in by_target.items():
        asyncio.create_task(_post(session, target, samples))


async def _post(session: aiohttp.ClientSession, target: str, samples: list[dict]) -> None:
    try:
        async with session.post(
            f"http://{target}/v1/feedback",
            json={"samples": samples},
            timeout=aiohttp.ClientTimeout(total=FEEDBACK_TIMEOUT_S),
        ) as resp:
            resp.raise_for_status()
    except (TimeoutError, aiohttp.ClientError) as err:
        log.warning("feedback to %s lost (%s): %d samples", target, err, len(samples))
