"""The router's control endpoints (the bodies they read and write, and their checks: `control_bodies.py`).

Every route here sits behind the service's control token (`exitplan.worker_image.auth`), on the router's
control port (``--control-port``) or, without one, on its inference port:

- ``GET  /v1/thresholds``, ``POST /v1/thresholds``: the exit thresholds in force with their version /
  a hot update (merged unless `"replace": true`; router_thresholds.py), forwarded to the other routers
  and pushed to every split-0 pod (which forward it down the chain);
- ``POST /v1/feedback``: shadow-sampled feedback samples from the last split;
- ``GET  /v1/observations[?window=current|both]`` (both: ``{"closed": ..., "current": ...}`` in one answer,
  what the operator's drift read needs), ``GET /v1/window.npz?last=N[&after=K&ring=R]`` (after: only the
  samples after number K of ring R, which a reader holds from an earlier answer), ``GET /v1/peers``.

What a post may carry is checked before anything changes (`control_bodies.py`); of the feedback, only
samples of inputs this router shadow-sampled count. The free-text `reason` of a threshold update goes
to the log, never into a metric label.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from aiohttp import web

from exitplan.worker_image.control_bodies import (
    MAX_FEEDBACK_BODY,
    MAX_THRESHOLDS_BODY,
    BadControl,
    ThresholdUpdate,
    parse_feedback,
)
from exitplan.worker_image.protocol import error_response
from exitplan.worker_image.request_body import json_body

if TYPE_CHECKING:
    from exitplan.worker_image.classify.router import Router

log = logging.getLogger(__name__)


class RouterControl:
    """The control handlers of one Router."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/observations", self.handle_observations),
            web.get("/v1/window.npz", self.handle_window),
            web.get("/v1/thresholds", self.handle_thresholds_get),
            web.post("/v1/thresholds", self.handle_thresholds_post),
            web.get("/v1/peers", self.handle_peers),
            web.post("/v1/feedback", self.handle_feedback),
        ]

    async def handle_feedback(self, request: web.Request) -> web.Response:
        r = self.router
        body = await json_body(request, MAX_FEEDBACK_BODY)
        if isinstance(body, web.Response):
            return body
        try:
            samples = parse_feedback(body, len(r.exit_ramps), len(r.manifest.labels))
        except BadControl as err:
            return error_response(400, f"bad feedback: {err}")
        accepted = 0
        for s in samples:
            if s.id not in r.pending_records:  # not an input this router shadow-sampled (or long forgotten)
                continue
            answered_by = r.pending_records.pop(s.id)
            if not r.feedback.add(s.conf, s.pred, s.final):
                continue
            accepted += 1
            if answered_by in r.ramp_index:
                i = r.ramp_index[answered_by]
                r.window.record_feedback(i, s.pred[i] == s.final)
        return web.json_response({"accepted": accepted, "ignored": len(samples) - accepted})

    async def handle_thresholds_get(self, _: web.Request) -> web.Response:
        return web.json_response(self.router.threshold_set.current.to_json())

    async def handle_thresholds_post(self, request: web.Request) -> web.Response:
        r = self.router
        body = await json_body(request, MAX_THRESHOLDS_BODY)
        if isinstance(body, web.Response):
            return body
        try:
            update = ThresholdUpdate.parse(body, r.exit_ramps, r.final_name)
        except BadControl as err:
            return error_response(400, f"bad thresholds: {err}")
        return web.json_response((await r.threshold_set.post(update)).to_json())

    async def handle_observations(self, request: web.Request) -> web.Response:
        r = self.router
        window, closed = request.query.get("window"), r.last_window
        if window in ("current", "both") or closed is None:
            current = r.snapshot(time.time())
            if window == "both":  # before the first roll the window in progress is the closed one too
                return web.json_response({"closed": (closed or current).dump(), "current": current.dump()})
            return web.json_response(current.dump())  # asked for, or no window closed yet
        return web.json_response(closed.dump())

    async def handle_window(self, request: web.Request) -> web.Response:
        r = self.router
        try:
            last = int(request.query.get("last", 0))
            if last < 0:
                raise ValueError
        except ValueError:
            return error_response(400, "last must be a non-negative integer (0 = every stored sample)")
        after = None
        if "after" in request.query:  # a reader that holds the samples through this number of this ring
            try:
                after = (request.query.get("ring", ""), int(request.query["after"]))
            except ValueError:
                return error_response(400, "after must be a sample number (the `added` of an earlier answer)")
        kind = request.query.get("format", "npz")
        if kind not in ("npz", "safetensors"):
            return error_response(400, f"format must be npz (the default) or safetensors, not {kind!r}")
        arrays = r.feedback.window(r.saving_ms, r.cost_ms, last=last or None, after=after)
        body = arrays.to_npz() if kind == "npz" else arrays.to_safetensors()
        return web.Response(body=body, content_type="application/octet-stream")

    async def handle_peers(self, _: web.Request) -> web.Response:
        return web.json_response(self.router.peers.snapshot())
