"""The router of a generation service (a bundle with a `decoder` section): the cluster entry point for
early-exit text generation, started by the same `exitplan router` command as every router (a
classification service's router is `classify/router.py`; both serve `protocol.v2_routes`).

It coordinates the plan's stage workers (`exitplan generate-stage`, one replica per split, chained by
`--next`): the first stage is the router's `--peers` (the split-0 headless Service in a cluster),
re-resolved every few seconds the way the data plane resolves peers. One split is KV recomputation
in that worker; several are EE-LLM's pipeline-based mode. The router tokenizes, checks each request
(empty prompt, context, max tokens -> 400 naming the field), steps the sequence token by token through
the stages, streams tokens as server-sent events, and releases the sequence's cache on every stage
when it ends or the client goes away.

Endpoints: POST /v2/models/{name}/generate and /generate_stream (see routes.py),
GET /v2/models/{name}, GET /v2/models/{name}/ready, GET /v2, GET /v2/health/live|ready, GET /metrics,
POST /v2/models/{name}/infer answers 400 (this model generates); behind the service's control token,
on the control port when there is one (`exitplan.worker_image.auth`): GET/POST /v1/thresholds (one exit
threshold for every head; the plan's thresholds are hot-updated).
"""

from __future__ import annotations

import asyncio
import logging
import math
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from exitplan.api.bundle import read_manifest
from exitplan.api.plan import Plan
from exitplan.worker_image import protocol
from exitplan.worker_image.auth import ControlPlane
from exitplan.worker_image.discovery import parse_peer_spec, resolve
from exitplan.worker_image.generate.decoder import NEVER_EXIT
from exitplan.worker_image.generate.remote_pipeline import RemotePipelineEngine
from exitplan.worker_image.generate.routes import add_generate_routes
from exitplan.worker_image.metrics import GenerationMetrics
from exitplan.worker_image.planfile import read_plan, watch_plan
from exitplan.worker_image.protocol import error_response as _error
from exitplan.worker_image.request_body import json_body

log = logging.getLogger(__name__)
RESOLVE_SECONDS = 2.0


def is_generative(bundle: str | Path) -> bool:
    """True when the bundle is a decoder (its manifest has a `decoder` section)."""
    return read_manifest(bundle).decoder is not None


def plan_threshold(plan: Plan) -> float:
    """The one exit threshold of a generation plan (every exit head shares it; 1.0 = never exit)."""
    values = [min(float(v), NEVER_EXIT) for v in plan.thresholds.values()]
    return min(values) if values else NEVER_EXIT


class GenerationRouter:
    def __init__(
        self,
        bundle: str | Path,
        plan_path: str | Path,
        *,
        peers: str,
        control_token: str | None = None,
        control_port: int | None = None,
        control_host: str = "0.0.0.0",
    ) -> None:
        self.control = ControlPlane(control_token, control_port, control_host)
        self.bundle = Path(bundle)
        self.plan_path = Path(plan_path)
        self.plan = read_plan(self.plan_path)
        self.model = self.plan.model
        self.peer_spec = parse_peer_spec(peers)
        if not self.peer_spec:
            raise ValueError("--peers must name the first stage (split 0) of the generation service (host:port)")
        self.manifest = read_manifest(self.bundle)
        self.exit_ramps = [r.name for r in self.manifest.exit_ramps()]
        self.threshold = plan_threshold(self.plan)
        self.mode = "recompute" if len(self.plan.splits) == 1 else "pipeline"
        host, port = self.peer_spec[0]
        self.engine = RemotePipelineEngine(self.bundle, [f"http://{host}:{port}"])
        self.metrics = GenerationMetrics(self.plan.service, self.mode)
        self.first_stage_ready = False
        self.reason = "the first stage has not been reached yet"
        self.session: aiohttp.ClientSession | None = None
        self.tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ plan and stages

    def apply_plan(self, plan: Plan) -> None:
        if [(s.first_block, s.last_block) for s in plan.splits] != [
            (s.first_block, s.last_block) for s in self.plan.splits
        ]:
            log.warning("the new plan changes the splits; the stages restart with it and the router follows them")
        self.plan = plan
        new = plan_threshold(plan)
        if new != self.threshold:
            log.info("generation threshold %s -> %s (plan %s)", self.threshold, new, plan.content_hash())
            self.threshold = new

    async def refresh(self) -> None:
        """Resolve the first stage and ask whether the chain of stages is ready."""
        assert self.session is not None
        found = await resolve(self.peer_spec)
        if not found:
            self.first_stage_ready, self.reason = (
                False,
                f"the first stage {self.peer_spec[0][0]} resolves to no address",
            )
            return
        url = f"http://{found[0]}"
        try:
            async with self.session.get(f"{url}/v2/health/ready", timeout=aiohttp.ClientTimeout(total=3)) as r:
                body = await r.json(content_type=None)
                ready = r.status == 200 and bool(body.get("ready"))
                reason = body.get("reason") or f"the first stage {url} is not ready"
        except (TimeoutError, aiohttp.ClientError, ValueError) as err:
            ready, reason = False, f"the first stage {url} does not answer ({err or type(err).__name__})"
        if ready:
            self.engine.urls = [url]
        self.first_stage_ready, self.reason = ready, ("" if ready else reason)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(RESOLVE_SECONDS)
            try:
                await self.refresh()
            except Exception as err:  # keep looping: the next refresh may succeed
                log.warning("refreshing the first stage failed: %s", err)

    def unavailable(self) -> str | None:
        return None if self.first_stage_ready else f"no ready stages: {self.reason}; retry shortly"

    # ------------------------------------------------------------------ handlers

    async def handle_live(self, _: web.Request) -> web.Response:
        return protocol.live_response()

    async def handle_ready(self, _: web.Request) -> web.Response:
        if not self.first_stage_ready:
            await self.refresh()
        return protocol.ready_response(self.first_stage_ready, self.reason)

    async def handle_model_ready(self, request: web.Request) -> web.Response:
        if request.match_info["name"] != self.model:
            return _error(404, f"unknown model {request.match_info['name']!r}; this router serves {self.model!r}")
        return await self.handle_ready(request)

    async def handle_server(self, _: web.Request) -> web.Response:
        return web.json_response(protocol.server_metadata(["generate", "generate_stream", "thresholds"]))

    async def handle_model(self, request: web.Request) -> web.Response:
        if request.match_info["name"] != self.model:
            return _error(404, f"unknown model {request.match_info['name']!r}; this router serves {self.model!r}")
        spec = self.manifest.decoder
        assert spec is not None
        parameters = {
            "mode": self.mode,
            "threshold": self.threshold,
            "max_context": spec.max_context,
            "ramps": self.exit_ramps,
            "splits": [[s.first_block, s.last_block] for s in self.plan.splits],
        }
        return web.json_response(protocol.generator_metadata(self.model, self.plan.content_hash(), parameters))

    async def handle_infer(self, request: web.Request) -> web.Response:
        return _error(
            400,
            f"model {self.model!r} generates text: POST /v2/models/{self.model}/generate "
            f'(or /generate_stream) with {{"text_input": "..."}}',
        )

    async def handle_metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def handle_thresholds_get(self, _: web.Request) -> web.Response:
        return web.json_response(
            {"thresholds": {name: self.threshold for name in self.exit_ramps}, "threshold": self.threshold}
        )

    async def handle_thresholds_post(self, request: web.Request) -> web.Response:
        """`{"threshold": x}` or `{"thresholds": {ramp: x}}` (the heads share one threshold: the lowest given)."""
        body = await json_body(request, 64 << 10)
        if isinstance(body, web.Response):
            return body
        try:
            if not isinstance(body, dict):
                raise TypeError("the body must be a JSON object")
            if "threshold" in body:
                value = float(body["threshold"])
            else:
                given = {str(k): float(v) for k, v in body["thresholds"].items()}
                unknown = sorted(set(given) - set(self.exit_ramps))
                if unknown:
                    return _error(
                        400, f"thresholds names unknown ramps {unknown}; the bundle's exit ramps are {self.exit_ramps}"
                    )
                value = min(given.values()) if given else NEVER_EXIT
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            return _error(400, f'bad thresholds: {err}; send {{"threshold": 0.8}} (0..1, 1 never exits)')
        if not math.isfinite(value) or value < 0:
            return _error(400, f"threshold must be a number >= 0 (1 or more never exits), got {value}")
        self.threshold = min(value, NEVER_EXIT)
        return web.json_response({"threshold": self.threshold})

    # ------------------------------------------------------------------ lifecycle

    async def _startup(self, _: web.Application) -> None:
        self.session = aiohttp.ClientSession()
        await self.refresh()
        self.tasks += [
            asyncio.create_task(self._refresh_loop()),
            asyncio.create_task(watch_plan(self.plan_path, self.apply_plan)),
        ]

    async def _cleanup(self, _: web.Application) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.session:
            await self.session.close()
        await self.engine.aclose()
        await asyncio.get_running_loop().run_in_executor(None, self.engine.close)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 20)
        add_generate_routes(
            app,
            self.engine,
            self.model,
            service=self.plan.service,
            threshold=lambda: self.threshold,
            metrics=self.metrics,
            unavailable=self.unavailable,
        )
        app.add_routes(protocol.v2_routes(self))
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        self.control.mount(
            app,
            [
                web.get("/v1/thresholds", self.handle_thresholds_get),
                web.post("/v1/thresholds", self.handle_thresholds_post),
            ],
        )
        return app
