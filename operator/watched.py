"""One kind in one namespace kept current in memory by a list and then a watch (what client-go calls an
informer), and never older than what this process itself wrote.

`Watched` lists the collection once, then follows its watch from the list's resourceVersion: every ADDED,
MODIFIED and DELETED object updates the copy by name and its group (by name, or by the service label).
A watch that ends (the server's timeout) goes on from the last resourceVersion seen; one answered 410
Gone (too old), or that fails, lists again. Readers get the current copy without a request.

Freshness against this process's own writes (the rule the per-tick lists kept by time): the API client
tells every Watched of each write it made (`KubeClient.observers`). A write that returned resourceVersion
R of object N is *expected*: until the watch delivers N at R (events come in order, so from then on the
copy is at least as new as the write), a DELETED event of N, or a list asked for after the write returned,
the group N belongs to is not fresh (`fresh`), and its readers read on their own. Deletes expect the
object to go. resourceVersions are compared only for equality (they are opaque); an event that arrived
before the write's answer is found among the few versions of N seen last. An expectation still open after
EXPECT_TIMEOUT seconds (a watch that stalls without failing) makes the list be asked for again.

While the copy is not synced (the first list, or a relist after a failure), readers wait for it; a list
that fails raises to them (each service then reads on its own, as without a cache).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from exitplan.api.manifest import Manifest

log = logging.getLogger(__name__)

EXPECT_TIMEOUT = 30.0
"""Seconds an expected write may stay unseen by a watch that has not failed before the list is asked again."""
WATCH_SECONDS = 300
"""The watch's timeoutSeconds: the server ends it after this long, and it goes on from where it was."""
RECENT = 8
"""resourceVersions remembered per object (a write's answer may arrive after its watch event)."""
RETRY_SECONDS = (0.5, 1.0, 2.0, 5.0)
"""Waits before listing again after a failure (the last one repeats)."""

Lister = Callable[[], Awaitable[tuple[list[Manifest], str]]]
"""Lists the collection: (its items, the list's resourceVersion)."""
Watcher = Callable[[str, int], AsyncIterator[Manifest]]
"""Watches the collection from a resourceVersion for so many seconds: its events."""
Key = Callable[[Manifest], str]
"""The group an object belongs to (its name, or the service it belongs to)."""


class Expired(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


@dataclass
class _Expected:
    rv: str | None
    """The resourceVersion the write returned; None: a delete (the object is expected to go)."""
    at: float
    """When the write's answer arrived (monotonic)."""
    group: str


def _meta(obj: Manifest) -> Manifest:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


@dataclass
class Watched:
    """The copy of one collection (see the module docstring)."""

    lister: Lister
    watcher: Watcher
    key: Key
    objects: dict[str, Manifest] = field(default_factory=dict)
    groups: dict[str, dict[str, Manifest]] = field(default_factory=dict)
    lists: int = 0
    """Lists asked for (the first and every relist)."""
    _recent: dict[str, deque[str]] = field(default_factory=dict)
    _expected: dict[str, _Expected] = field(default_factory=dict)
    _synced: asyncio.Event = field(default_factory=asyncio.Event)
    _error: BaseException | None = None
    _failed: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def stopped(self) -> None:
        """Stop the list and watch, and wait until they have ended."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def group(self, key: str) -> list[Manifest]:
        """The objects of one group as the watch has them now (waits for the first list; raises when it failed)."""
        await self.synced()
        return list((self.groups.get(key) or {}).values())

    async def synced(self) -> None:
        """Wait until the copy is synced; raises the list's error when the last attempt failed."""
        self.start()
        if self._synced.is_set():
            return
        if self._error is None:
            failed = asyncio.ensure_future(self._failed.wait())
            synced = asyncio.ensure_future(self._synced.wait())
            try:
                await asyncio.wait({failed, synced}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                failed.cancel()
                synced.cancel()
        if not self._synced.is_set():
            raise RuntimeError(f"the list failed: {self._error!r}")

    def fresh(self, group: str) -> bool:
        """No write of this process to an object of `group` is still unseen by the copy."""
        now = time.monotonic()
        stale = [name for name, exp in self._expected.items() if exp.group == group]
        for name in stale:
            if now - self._expected[name].at > EXPECT_TIMEOUT:
                log.warning("a write to %s was not seen by its watch in %.0f s: listing again", name, EXPECT_TIMEOUT)
                self._relist()
                return False
        return not stale

    def expects(self, name: str, obj: Manifest) -> bool:
        """The write still unseen for `name` is the one that returned `obj` (that copy is the newest there is)."""
        exp = self._expected.get(name)
        return exp is not None and exp.rv is not None and exp.rv == str(_meta(obj).get("resourceVersion") or "")

    def wrote(self, obj: Manifest | None, name: str, deleted: bool) -> None:
        """This process wrote object `name` (the API's answer `obj`, when it returned the object)."""
        at = time.monotonic()
        current = self.objects.get(name)
        if deleted:
            if current is not None:
                self._expected[name] = _Expected(None, at, self.key(current))
            return
        if obj is None:
            return
        rv = str(_meta(obj).get("resourceVersion") or "")
        if rv and rv not in self._recent.get(name, ()):
            self._expected[name] = _Expected(rv, at, self.key(obj))

    # ------------------------------------------------------------------ the list and the watch

    def _relist(self) -> None:
        self._synced.clear()
        self.stop()
        self.start()

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                rv = await self._list()
                while True:  # each watch ends after WATCH_SECONDS: go on from the last version seen
                    rv = await self._follow(rv)
                    failures = 0  # a watch that ran its course (one that fails at once backs off further)
            except asyncio.CancelledError:
                raise
            except Expired:
                log.info("watch expired: listing again")
            except Exception as exc:  # noqa: BLE001 -- the readers read on their own meanwhile
                self._error = exc
                self._synced.clear()
                self._failed.set()
                log.warning("list/watch failed (%r): listing again", exc)
                await asyncio.sleep(RETRY_SECONDS[min(failures, len(RETRY_SECONDS) - 1)])
                failures += 1

    async def _list(self) -> str:
        asked = time.monotonic()
        self.lists += 1
        items, rv = await self.lister()
        self.objects, self.groups, self._recent = {}, {}, {}
        for item in items:
            self._put(item)
        self._expected = {n: e for n, e in self._expected.items() if e.at > asked}  # the list is newer than the rest
        self._error = None
        self._failed.clear()
        self._synced.set()
        return rv

    async def _follow(self, rv: str) -> str:
        async for event in self.watcher(rv, WATCH_SECONDS):
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                if obj.get("code") == 410:
                    raise Expired(obj.get("message"))
                raise RuntimeError(f"watch error: {obj.get('message') or obj}")
            rv = str(_meta(obj).get("resourceVersion") or rv)
            if kind == "BOOKMARK":
                continue
            if kind == "DELETED":
                self._drop(str(_meta(obj).get("name")))
            elif kind in ("ADDED", "MODIFIED"):
                self._put(obj)
        return rv

    def _put(self, obj: Manifest) -> None:
        meta = _meta(obj)
        name, rv = str(meta.get("name")), str(meta.get("resourceVersion") or "")
        old = self.objects.get(name)
        if old is not None:
            self.groups.get(self.key(old), {}).pop(name, None)
        self.objects[name] = obj
        self.groups.setdefault(self.key(obj), {})[name] = obj
        self._recent.setdefault(name, deque(maxlen=RECENT)).append(rv)
        exp = self._expected.get(name)
        if exp is not None and (exp.rv == rv or (exp.rv is None and meta.get("deletionTimestamp"))):
            del self._expected[name]

    def _drop(self, name: str) -> None:
        old = self.objects.pop(name, None)
        if old is not None:
            self.groups.get(self.key(old), {}).pop(name, None)
        self._recent.pop(name, None)
        self._expected.pop(name, None)
