"""A split worker's HTTP surface: its routes, the parsing and checks of what they receive, their answers.

- POST /v1/run: a frame of inputs (`wire.HopRequest` and the rows of the split's input state, padded to
  the bucket), checked here (400 naming what is wrong; 403 when an input's reply_to is not a router the
  plan names, `Plan.routers`), handed to `SplitWorker.enqueue`, answered with its `wire.HopAnswer` and
  logits once every row has its answer;
- GET /v1/info (`control_bodies.WorkerInfo`: what this pod is), GET /v1/peers (the next split's pods
  with their straggler marks), POST /v1/thresholds (a hot update, forwarded down the chain), and with
  EXITPLAN_ENABLE_FAULTS=1 POST /v1/faults (slow-down injection for straggler tests and chaos drills);
- GET /v2/health/live, /v2/health/ready, /metrics.

Every /v1 route answers only requests that carry the service's control token (`exitplan.worker_image.auth`).
What happens to the rows (batching, execution, forwarding) is `worker.py`'s.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from exitplan.worker_image import wire
from exitplan.worker_image.auth import guarded
from exitplan.worker_image.control_bodies import MAX_THRESHOLDS_BODY, BadControl, ThresholdUpdate
from exitplan.worker_image.request_body import json_body
from exitplan.worker_image.wire import HopItem, HopRequest

if TYPE_CHECKING:
    from exitplan.worker_image.classify.worker import SplitWorker

FAULTS_ENV = "EXITPLAN_ENABLE_FAULTS"
"""Set to 1 to enable POST /v1/faults (slow-down injection for straggler tests and chaos drills)."""
MAX_FRAME_BYTES = 256 << 20


def check_frame(worker: SplitWorker, tensors: dict[str, np.ndarray], n: int) -> None:
    """Raise ValueError unless the frame holds the split's inputs, n rows each, padded to its bucket."""
    for name in worker.input_names:
        if name not in tensors:
            raise ValueError(f"tensor {name!r} missing; this split reads {worker.input_names}")
        t = tensors[name]
        if t.shape[0] != n:
            raise ValueError(f"tensor {name!r} has {t.shape[0]} rows for {n} items")
        if worker.runtime.is_sequence_model and (t.ndim < 2 or t.shape[1] != worker.bucket):
            raise ValueError(
                f"tensor {name!r} shape {list(t.shape)}: axis 1 must be this bucket's length {worker.bucket}"
            )


def parse_frame(worker: SplitWorker, body: bytes) -> tuple[list[HopItem], dict[str, np.ndarray]]:
    """The items and tensors of a /v1/run frame; WireError, KeyError, TypeError or ValueError when it
    is not one of this split's."""
    meta, tensors = wire.decode(body)
    items = list(HopRequest.from_meta(meta).items)
    check_frame(worker, tensors, len(items))
    return items, tensors


class WorkerRoutes:
    """The HTTP handlers of one SplitWorker."""

    def __init__(self, worker: SplitWorker) -> None:
        self.worker = worker

    async def handle_run(self, request: web.Request) -> web.Response:
        w = self.worker
        if not w.ready:
            return web.Response(status=503, text="worker is warming up", headers={"Retry-After": "1"})
        try:
            items, tensors = parse_frame(w, await request.read())
        except (wire.WireError, KeyError, TypeError, ValueError) as err:
            return web.Response(status=400, text=f"bad frame: {err}")
        for target in {item.reply_to for item in items if item.reply_to}:
            if not await w.replies.allows(target):
                return web.Response(
                    status=403,
                    text=f"reply_to {target[:100]!r} is not a router of this service's plan "
                    f"(its routers: {w.replies.entries}); a worker posts feedback only to them",
                )
        pending = w.enqueue(items, tensors)
        await pending.future
        return web.Response(
            body=wire.encode(pending.reply().to_meta(), {"logits": pending.logits}), content_type=wire.CONTENT_TYPE
        )

    async def handle_info(self, _: web.Request) -> web.Response:
        return web.json_response(self.worker.info().to_json())

    async def handle_peers(self, _: web.Request) -> web.Response:
        nxt = self.worker.next
        return web.json_response(nxt.snapshot() if nxt else [])

    async def handle_live(self, _: web.Request) -> web.Response:
        return web.json_response({"live": True})

    async def handle_ready(self, _: web.Request) -> web.Response:
        w = self.worker
        ok = w.ready and (w.next is None or bool(w.next.candidates(w.bucket, w.split + 1)))
        return web.json_response({"ready": ok}, status=200 if ok else 503)

    async def handle_metrics(self, _: web.Request) -> web.Response:
        w = self.worker
        w.metrics.stragglers.set(sum(p.straggler for p in w.next.peers.values()) if w.next else 0)
        return web.Response(body=generate_latest(w.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def handle_thresholds(self, request: web.Request) -> web.Response:
        w = self.worker
        body = await json_body(request, MAX_THRESHOLDS_BODY)
        if isinstance(body, web.Response):
            return body
        try:
            update = ThresholdUpdate.parse(body, w.exit_ramps, w.runtime.manifest.final_ramp().name)
            new = w.threshold_set.current.changed(update.thresholds, replace=update.replace, version=update.version)
            await w.push_thresholds(new, update.reason)
        except (BadControl, ValueError) as err:
            return web.Response(status=400, text=f"bad thresholds: {err}")
        return web.json_response(w.threshold_set.current.to_json())

    async def handle_faults(self, request: web.Request) -> web.Response:
        body = await json_body(request, 1024)
        if isinstance(body, web.Response):
            return body
        slowdown = body.get("slowdown", 1.0) if isinstance(body, dict) else None
        if isinstance(slowdown, bool) or not isinstance(slowdown, (int, float)) or not 1.0 <= slowdown <= 100.0:
            return web.Response(status=400, text='send {"slowdown": x} with x in [1, 100]')
        self.worker.inject_slowdown(float(slowdown))
        return web.json_response({"slowdown": self.worker.slowdown})

    def routes(self) -> list[web.RouteDef]:
        token = self.worker.control_token
        table = [
            web.post("/v1/run", guarded(token, self.handle_run)),
            web.get("/v1/info", guarded(token, self.handle_info)),
            web.get("/v1/peers", guarded(token, self.handle_peers)),
            web.get("/v2/health/live", self.handle_live),
            web.get("/v2/health/ready", self.handle_ready),
            web.get("/metrics", self.handle_metrics),
            web.post("/v1/thresholds", guarded(token, self.handle_thresholds)),
        ]
        if os.environ.get(FAULTS_ENV) == "1":
            table.append(web.post("/v1/faults", guarded(token, self.handle_faults)))
        return table


def worker_app(worker: SplitWorker) -> web.Application:
    """The worker's aiohttp app: its routes, and its start and stop with the app's."""

    async def startup(_: web.Application) -> None:
        await worker.start()

    async def cleanup(_: web.Application) -> None:
        await worker.stop()

    app = web.Application(client_max_size=MAX_FRAME_BYTES)
    app.add_routes(WorkerRoutes(worker).routes())
    app.on_startup.append(startup)
    app.on_cleanup.append(cleanup)
    return app
