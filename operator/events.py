"""The service's events as a cluster shows them: aggregated, as client-go's event recorder does.

The first report of a (object, type, reason, message) creates a core/v1 Event (count 1,
firstTimestamp = lastTimestamp = now); each later report of the same one patches that Event's `count`
and `lastTimestamp` instead of adding another, so `kubectl get events` and `kubectl describe ees NAME`
show one line, "x17 over 3m", not seventeen. Reports are posted in the background, in order, one at a
time (`Service.event` is called from synchronous code); an Event that went meanwhile (a server's TTL)
is created again. Messages are cut to 1024 characters, the middle elided, as kopf cut them.

Normal reports are rate-limited per object and reason, as client-go's spam filter limits them per object
(a token bucket: a burst of BURST, then one every REFILL_SECONDS; the rest are logged, not posted): a
routine report that recurs with new figures each time -- ThresholdsTuned, once a period per service at
most -- would otherwise be an API write per service and period (at 200 services, a third of the
operator's API traffic). Per reason, so that a chatty one never silences another; Warnings are never
limited.
"""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import logging
import os
import time
import weakref

from exitplan.api.manifest import Manifest
from exitplan.operator.kube import ApiError, KubeClient, path

log = logging.getLogger("exitplan.operator")
COMPONENT = "exitplan-operator"
"""The events' source (the From column of `kubectl describe`)."""
MAX_MESSAGE = 1024
REMEMBERED = 4096
"""Distinct events kept for aggregation (least recently reported dropped)."""
BURST, REFILL_SECONDS = 25, 300.0
"""Normal reports of one reason about one object: at most BURST at once, then one every REFILL_SECONDS
(client-go's EventSourceObjectSpamFilter: 25, one per 5 minutes)."""

Key = tuple[str, str, str, str, str, str, str]


def now() -> str:
    return dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def cut(message: str) -> str:
    if len(message) <= MAX_MESSAGE:
        return message
    half = (MAX_MESSAGE - 3) // 2
    return f"{message[:half]}...{message[len(message) - (MAX_MESSAGE - 3 - half) :]}"


def reference(obj: Manifest) -> Manifest:
    meta = obj.get("metadata") or {}
    ref = {
        "apiVersion": obj.get("apiVersion", ""),
        "kind": obj.get("kind", ""),
        "name": meta.get("name", ""),
        "namespace": meta.get("namespace") or "default",
        "uid": meta.get("uid", ""),
    }
    return {k: v for k, v in ref.items() if v}


def new_event(obj: Manifest, kind: str, reason: str, message: str) -> Manifest:
    """A core/v1 Event about `obj`, first seen now."""
    ref = reference(obj)
    stamp = now()
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{ref.get('name', 'object')}.", "namespace": ref["namespace"]},
        "involvedObject": ref,
        "type": kind,
        "reason": reason,
        "message": message,
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": os.environ.get("HOSTNAME", COMPONENT),
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


class EventRecorder:
    """Posts and aggregates events (see the module docstring); one per process."""

    def __init__(self) -> None:
        self.seen: collections.OrderedDict[Key, tuple[str, int]] = collections.OrderedDict()
        """(object, type, reason, message) -> (the Event's name, its count)."""
        self._locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = weakref.WeakKeyDictionary()
        self._tasks: set[asyncio.Task[None]] = set()
        self.tokens: collections.OrderedDict[tuple[str, ...], tuple[float, float]] = collections.OrderedDict()
        """(object, reason) -> (tokens left, when counted) of its Normal reports."""

    def allowed(self, obj: Manifest, kind: str, reason: str, now: float | None = None) -> bool:
        """Whether a report may be posted (Warnings always; Normal ones within their object's and reason's
        bucket), and one token taken if so."""
        if kind != "Normal":
            return True
        ref, now = reference(obj), time.monotonic() if now is None else now
        key = (ref["namespace"], ref.get("kind", ""), ref.get("name", ""), ref.get("uid", ""), reason)
        left, then = self.tokens.get(key, (float(BURST), now))
        left = min(float(BURST), left + (now - then) / REFILL_SECONDS)
        allowed = left >= 1.0
        self.tokens[key] = (left - 1.0 if allowed else left, now)
        self.tokens.move_to_end(key)
        while len(self.tokens) > REMEMBERED:
            self.tokens.popitem(last=False)
        return allowed

    def record(self, client: KubeClient, obj: Manifest, kind: str, reason: str, message: str) -> None:
        """Post in the background (the caller's event loop); nothing to await, nothing raised. A Normal report
        over its rate (`allowed`) is logged instead."""
        if not self.allowed(obj, kind, reason):
            name = (obj.get("metadata") or {}).get("name", "")
            log.debug(
                "event %s %s about %s not posted (past a burst of %d, one per %.0f s): %s",
                kind,
                reason,
                name,
                BURST,
                REFILL_SECONDS,
                message,
            )
            return
        loop = asyncio.get_running_loop()
        lock = self._locks.setdefault(loop, asyncio.Lock())
        task = loop.create_task(self._post(client, lock, obj, kind, reason, cut(message)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def post(self, client: KubeClient, obj: Manifest, kind: str, reason: str, message: str) -> Manifest:
        """Create the Event, or count one more of the same; the Event as written."""
        ref = reference(obj)
        key: Key = (
            ref["namespace"],
            ref.get("kind", ""),
            ref.get("name", ""),
            ref.get("uid", ""),
            kind,
            reason,
            message,
        )
        known = self.seen.get(key)
        if known is not None:
            name, count = known
            patch = {"count": count + 1, "lastTimestamp": now()}
            try:
                written = await client.merge_patch(path("Event", ref["namespace"], name), patch)
                self._remember(key, name, count + 1)
                return written
            except ApiError as err:
                if err.status not in (403, 404):  # gone (TTL), or no right to patch: a new one
                    raise
        written = await client.create(new_event(obj, kind, reason, message))
        self._remember(key, written["metadata"]["name"], 1)
        return written

    def _remember(self, key: Key, name: str, count: int) -> None:
        self.seen[key] = (name, count)
        self.seen.move_to_end(key)
        while len(self.seen) > REMEMBERED:
            self.seen.popitem(last=False)

    async def _post(
        self, client: KubeClient, lock: asyncio.Lock, obj: Manifest, kind: str, reason: str, message: str
    ) -> None:
        async with lock:
            try:
                await self.post(client, obj, kind, reason, message)
            except (ApiError, OSError) as err:  # events are auxiliary: never fail a reconcile for one
                log.warning("could not post the event %s %s: %s", kind, reason, err)


RECORDER = EventRecorder()
