"""The routers of one service seen together, as the threshold tuners see them (`exitplan up`'s loop,
exitplan.localrun.autotune, and the operator's, exitplan.operator.driftloop).

- `fleet_feedback`: every router's newest shadow-sampled feedback merged into one window (each router
  samples the traffic it serves: the window of one router is a share of the service's); with a
  `FeedbackFollower`, each router is asked only for the samples since its previous answer;
- `fleet_thresholds`: the newest versioned set among the routers (`threshold_set.py`);
- `push_fleet`: a new set, as the next version, pushed to every router.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from exitplan.worker_image.control_bodies import FeedbackArrays
from exitplan.worker_image.control_client import ControlClient, ControlError
from exitplan.worker_image.threshold_set import ThresholdSet


def merge_feedback(windows: Sequence[FeedbackArrays], last: int) -> FeedbackArrays | None:
    """The windows of several routers as one of at most `last` samples: each router's newest, in
    proportion to what it holds. None when none holds a sample."""
    held = [w for w in windows if w.final.size]
    if not held:
        return None
    total = sum(w.final.size for w in held)
    keep = [w.final.size if total <= last else max(1, round(last * w.final.size / total)) for w in held]
    return FeedbackArrays(
        np.concatenate([w.conf[-k:] for w, k in zip(held, keep)]),
        np.concatenate([w.pred[-k:] for w, k in zip(held, keep)]),
        np.concatenate([w.final[-k:] for w, k in zip(held, keep)]),
        held[0].saving_ms,
        held[0].cost_ms,
    )


async def _each(clients: Sequence[ControlClient], call: str, *args: object) -> tuple[list[Any], list[str]]:
    """(the answers of the clients that answered, what failed for the others)."""
    results = await asyncio.gather(*(getattr(c, call)(*args) for c in clients), return_exceptions=True)
    return _answers(results)


def _answers(results: Sequence[Any]) -> tuple[list[Any], list[str]]:
    """(the answers among `results`, what failed for the others); an error other than ControlError raises."""
    answers = [r for r in results if not isinstance(r, BaseException)]
    notes = [str(r) for r in results if isinstance(r, ControlError)]
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, ControlError):
            raise r
    return answers, notes


@dataclass
class FeedbackFollower:
    """Each router's newest `last` samples as last read (by router URL), so that a reader that looks again reads
    only the samples that arrived since (`?after=`): a re-tune a period reads the ~200 new samples of a
    service, not the 1,024 of its window again. An answer that does not follow on from what is kept (another
    ring: the router restarted; more new samples than it holds; a router that predates numbering; other
    ramps) replaces it."""

    last: int
    kept: dict[str, FeedbackArrays] = field(default_factory=dict)

    def after(self, url: str) -> tuple[str, int] | None:
        """The ring and sample number the router's next answer may start after (None: read it whole)."""
        held = self.kept.get(url)
        return None if held is None or held.ring is None or held.added is None else (held.ring, held.added)

    def follow(self, url: str, answer: FeedbackArrays) -> FeedbackArrays:
        """The router's window once `answer` is added to what is kept of it."""
        held = self.kept.get(url)
        follows = (
            held is not None
            and answer.ring is not None
            and answer.ring == held.ring
            and answer.added is not None
            and held.added is not None
            and answer.added - answer.final.size == held.added
            and answer.conf.shape[1:] == held.conf.shape[1:]
        )
        if held is not None and follows:
            answer = FeedbackArrays(
                np.concatenate([held.conf, answer.conf])[-self.last :],
                np.concatenate([held.pred, answer.pred])[-self.last :],
                np.concatenate([held.final, answer.final])[-self.last :],
                answer.saving_ms,
                answer.cost_ms,
                answer.added,
                answer.ring,
            )
        self.kept[url] = answer
        return answer

    def keep_only(self, urls: Sequence[str]) -> None:
        """Forget the routers no longer among `urls`."""
        for url in [u for u in self.kept if u not in urls]:
            del self.kept[url]


async def _followed(client: ControlClient, follower: FeedbackFollower) -> FeedbackArrays | None:
    answer = await client.feedback(follower.last, follower.after(client.base_url))
    if answer is None:
        return None
    window = follower.follow(client.base_url, answer)
    return window if window.final.size else None


async def fleet_feedback(
    clients: Sequence[ControlClient], last: int, follower: FeedbackFollower | None = None
) -> tuple[FeedbackArrays | None, list[str]]:
    """(every router's newest feedback merged, or None while none has any; what failed). ControlError
    when no router answers. `follower`: what earlier reads kept (its `last` is the window's), so that only
    new samples are read."""
    if follower is None:
        windows, notes = await _each(clients, "feedback", last)
    else:
        follower.keep_only([c.base_url for c in clients])
        results = await asyncio.gather(*(_followed(c, follower) for c in clients), return_exceptions=True)
        windows, notes = _answers(results)
    if notes and not windows:
        raise ControlError(clients[0].base_url, "no router answered: " + "; ".join(notes))
    return merge_feedback([w for w in windows if w is not None], last), notes


async def fleet_thresholds(clients: Sequence[ControlClient]) -> ThresholdSet:
    """The newest set the routers hold; ControlError when none answers."""
    sets, notes = await _each(clients, "threshold_set")
    if not sets:
        raise ControlError(clients[0].base_url, "no router answered: " + "; ".join(notes))
    newest: ThresholdSet = max(sets, key=ThresholdSet.key)
    return newest


async def push_fleet(
    clients: Sequence[ControlClient], current: ThresholdSet, values: dict[str, float], reason: str
) -> ThresholdSet:
    """Push `values` to every router as the version after `current`; the set pushed. ControlError when
    no router took it (a router that missed it takes it from the others within its sync period)."""
    new = ThresholdSet({k: float(v) for k, v in values.items()}, current.version + 1)
    taken, notes = await _each(clients, "push_set", new, reason)
    if not taken:
        raise ControlError(clients[0].base_url, "no router took the thresholds: " + "; ".join(notes))
    return new
