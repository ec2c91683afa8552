"""A router's exit thresholds: one versioned set per service, the same on every router.

The set (`threshold_set.ThresholdSet`) reaches a router four ways, and the router takes it only when it
is newer than the one it holds, so every router converges on the newest:

- a POST /v1/thresholds without a version (an operator's change by hand): merged into the set in force
  (or, with `"replace": true`, replacing it) as the next version, and forwarded at once to every other
  router the plan names (`Plan.routers`) before the post is answered;
- a POST with a version (the tuner's, or another router's forward): taken as that version;
- the plan file (`Plan.thresholds_version`, written by the tuner of `exitplan up` and the operator);
- every `sync_s` seconds the router reads the other routers' sets and takes the newest (a router that
  was restarting or missed a forward catches up within one period).

Whatever the router takes it pushes to its split-0 pods (and their chains); a pod that missed the push
gets it at its next probe (`threshold_push.catch_up`). An answer's metadata names the version the
split-0 pod decided its exits with.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import aiohttp

from exitplan.worker_image.control_bodies import ThresholdUpdate
from exitplan.worker_image.control_client import ControlClient, ControlError
from exitplan.worker_image.discovery import parse_peer_spec, resolve
from exitplan.worker_image.metrics import reason_label
from exitplan.worker_image.threshold_push import catch_up, push_to_peers
from exitplan.worker_image.threshold_set import PLAN_UPDATE, ThresholdHolder, ThresholdSet

if TYPE_CHECKING:
    from exitplan.worker_image.classify.router import Router

log = logging.getLogger(__name__)

SYNC_SECONDS = 2.0
"""How often a router reads the other routers' sets (and probes its split-0 pods)."""


class RouterThresholds:
    """The set a router holds, where it comes from and where it goes."""

    def __init__(self, router: Router) -> None:
        self.router = router
        plan = router.plan
        self.holder = ThresholdHolder(ThresholdSet(dict(plan.thresholds), plan.thresholds_version))

    @property
    def current(self) -> ThresholdSet:
        return self.holder.current

    def publish(self) -> None:
        r = self.router
        for name in r.exit_ramps:
            r.metrics.set_threshold(name, self.current.values.get(name))

    def _took(self, before: ThresholdSet, reason: str) -> None:
        r, now = self.router, self.current
        log.info("thresholds %s %s -> %s %s (%r)", before.label, before.values, now.label, now.values, reason)
        r.metrics.threshold_updates.labels(r.plan.service, reason_label(reason)).inc()
        self.publish()

    async def adopt(self, new: ThresholdSet, reason: str) -> bool:
        """Take `new` when it is newer, and push it to split 0 (the pods, or the workers in this process)."""
        before = self.current
        if not self.holder.adopt(new, reason):
            return False
        self._took(before, reason)
        await self.push_down(reason)
        return True

    async def push_down(self, reason: str) -> None:
        r, now = self.router, self.current
        pushes = [w.push_thresholds(now, reason) for w in r.local.values()]
        if r.session is not None:
            pushes.append(push_to_peers(r.session, r.peers.peers.values(), now, reason))
        for result in await asyncio.gather(*pushes, return_exceptions=True):
            if isinstance(result, Exception):
                log.warning("threshold push failed: %s", result)

    def adopt_plan(self, thresholds: dict[str, float], version: int) -> None:
        """A new plan file's thresholds (`ThresholdHolder.adopt_plan`); the pods read the same file."""
        before = self.current
        if self.holder.adopt_plan(thresholds, version):
            self._took(before, PLAN_UPDATE)

    async def post(self, update: ThresholdUpdate) -> ThresholdSet:
        """A POST /v1/thresholds: the change taken here and, when it is a new one (no version), forwarded
        to every other router; the set in force after it."""
        new = self.current.changed(update.thresholds, replace=update.replace, version=update.version)
        if await self.adopt(new, update.reason) and update.version is None:
            await self._forward(self.current, update.reason)
        return self.current

    async def _others(self) -> list[str]:
        """The control addresses of the other routers (the plan's, resolved; this one left out)."""
        r = self.router
        found = await resolve(parse_peer_spec(",".join(r.plan.routers)))
        return [a for a in found if a != r.advertise]

    async def _forward(self, new: ThresholdSet, reason: str) -> None:
        session = self.router.session
        if session is None:
            return

        async def one(address: str) -> None:
            try:
                await ControlClient(f"http://{address}", session=session, timeout_s=5.0).push_set(new, reason)
            except ControlError as err:
                log.warning(
                    "forwarding thresholds %s to router %s failed (it syncs later): %s", new.label, address, err
                )

        await asyncio.gather(*(one(a) for a in await self._others()))

    async def sync_once(self) -> None:
        """Read every other router's set; take the newest. Then bring split-0 pods that missed a push up to date."""
        session = self.router.session
        if session is None:
            return

        async def read(address: str) -> ThresholdSet | None:
            try:
                return await ControlClient(f"http://{address}", session=session, timeout_s=2.0).threshold_set()
            except ControlError as err:
                log.debug("reading router %s's thresholds: %s", address, err)
                return None

        sets = [s for s in await asyncio.gather(*(read(a) for a in await self._others())) if s is not None]
        if sets:
            await self.adopt(max(sets, key=ThresholdSet.key), "router-sync")
        await catch_up(session, self.router.peers, self.holder)

    async def run(self, session: aiohttp.ClientSession, period_s: float = SYNC_SECONDS) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                await self.sync_once()
            except Exception:
                log.exception("threshold sync")
