"""The stand-in router of bench/operator_scale.py: one process answering every service's router control
endpoints as a router of that service's plan would (worker_image/classify/control.py), from one aiohttp
server with a listening socket per service (the operator reaches each service's routers at the address its
control Service publishes; the socket an answer came in on tells which service it is for):

- GET /v1/observations[?window=current|both]: a steady window matching the plan -- windows one period long
  on the wall clock, arrivals at RATE_RPS in the plan's length mix, the plan's survival with a +-3 % wobble
  from window to window, exits per ramp, every ramp's shadow agreement (SHADOW_SHARE of the answers), p99
  at 30 % of the SLO -- and the thresholds in force;
- GET /v1/window.npz?last=N[&after=K&ring=R]: the service's newest N (at most FEEDBACK) shadow-sampled feedback
  samples over every ramp, from a stream that gains one sample per shadow-sampled answer (RATE_RPS x
  SHADOW_SHARE a second): each period's re-tune sees ~200 new samples of 1,024, as on a router with that
  traffic, and reads only those (the samples after K, numbered as a router's ring numbers them)
  (--no-feedback: an empty window, as before a router's first shadow sample: the re-tune stops there);
- GET /v1/thresholds, POST /v1/thresholds: the thresholds in force with their version, a push taken as a
  router takes it (worker_image/control_bodies.ThresholdUpdate, threshold_set.ThresholdHolder);
- GET /stats (no token): requests served and router reads (closed-window GETs) so far.

One process on one event loop: 1,000 services' reads arriving together wait their turn instead of timing
out (the ThreadingHTTPServer it replaced answered 271 of 400 at once).

    python -P bench/stand_in_router.py PLANS.json --period 20   # PLANS.json: a JSON list of plans;
                                                               # prints their ports (one JSON line), in order
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web

from exitplan.api.plan import Plan
from exitplan.worker_image.control_bodies import BadControl, FeedbackArrays, ThresholdUpdate
from exitplan.worker_image.threshold_set import ThresholdHolder, ThresholdSet

SLO_MS = 50.0
RATE_RPS = 200.0
"""Arrival rate of the stand-in windows."""
SHADOW_SHARE = 0.05
"""Share of the answers shadow-sampled (their agreement is in every window)."""
AGREEMENT = 0.99
FEEDBACK = 1024
"""Samples in a service's feedback window (the operator's re-tune asks for 1,024)."""
BACKLOG = 1024
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def ramp_names(plan: Plan) -> list[str]:
    """The exit ramps the plan's routers run: those its thresholds name, else one per survival figure."""
    names = list(plan.thresholds)
    return names if len(names) == len(plan.survival) else [f"ramp{k}" for k in range(len(plan.survival))]


def steady_window(
    plan: Plan,
    period: float,
    current: bool,
    now: float,
    thresholds: dict[str, float] | None = None,
    version: int | None = None,
) -> dict[str, Any]:
    """A router's window at `now` for steady traffic that matches `plan`: the one in progress
    (`current`) or the last closed one; windows are one period long on the wall clock."""
    start = math.floor(now / period) * period
    since, until = (start, now) if current else (start - period, start)
    n = int(RATE_RPS * (until - since))
    mix = plan.length_histogram or [1.0 / len(plan.buckets)] * len(plan.buckets)
    hist = [int(round(n * share / sum(mix))) for share in mix]
    wobble = 1.0 + 0.03 * math.sin(start / period)  # survival varies a little from window to window
    survival = [min(1.0, x * wobble) for x in plan.survival]
    reached = [1.0, *survival]
    total = sum(hist)
    exits = [int(round(total * (reached[k] - reached[k + 1]))) for k in range(len(survival))]
    shadow = int(total * SHADOW_SHARE)
    ramps = ramp_names(plan)
    return {
        "service": plan.service,
        "model": "stand-in",
        "since": since,
        "until": until,
        "requests": total,
        "withinSlo": total,
        "ramps": ramps,
        "exitCounts": [*exits, max(0, total - sum(exits))],
        "survival": survival,
        "lengthBuckets": list(plan.buckets),
        "lengthHistogram": hist,
        "latency": {"p50Ms": 0.1 * SLO_MS, "p99Ms": 0.3 * SLO_MS},
        "agreement": [{"ramp": r, "samples": shadow, "agree": int(shadow * AGREEMENT)} for r in ramps],
        "thresholds": dict(plan.thresholds if thresholds is None else thresholds),
        "thresholdsVersion": plan.thresholds_version if version is None else version,
    }


POOL = 8192
"""Distinct feedback samples the stand-in draws per ramp count; a service's stream walks through them."""


def sample_pool(n_ramps: int, seed: int = 0) -> FeedbackArrays:
    """POOL shadow samples over `n_ramps` ramps: confidence rising with depth, a ramp's answer the full
    model's with probability its confidence; exiting earlier saves more."""
    rng = np.random.default_rng(seed)
    final = rng.integers(0, 2, POOL)
    conf = np.sort(rng.uniform(0.5, 1.0, (POOL, n_ramps)), axis=1)
    pred = np.where(rng.uniform(size=(POOL, n_ramps)) < conf, final[:, None], 1 - final[:, None])
    return FeedbackArrays(conf, pred, final, np.linspace(2.0 * n_ramps, 2.0, n_ramps), np.full(n_ramps, 0.2))


def feedback_window(
    pool: FeedbackArrays, offset: int, now: float, last: int, after: int | None = None, ring: str = "stand-in"
) -> FeedbackArrays:
    """A service's newest `last` feedback samples at `now`: its stream (the pool from `offset` on, round
    and round) gains RATE_RPS x SHADOW_SHARE samples a second, so each period's window holds new ones.
    Numbered as a router's ring numbers them (`ring`); `after` (a number of this ring): only the samples since."""
    newest = offset + int(now * RATE_RPS * SHADOW_SHARE)
    if after is not None and 0 <= after <= newest:
        last = min(last, newest - after)
    rows = np.arange(newest - last, newest) % POOL
    return FeedbackArrays(
        pool.conf[rows], pool.pred[rows], pool.final[rows], pool.saving_ms, pool.cost_ms, newest, ring
    )


@dataclass
class Served:
    """One service's routers, as the stand-in answers them."""

    plan: Plan
    ramps: list[str]
    holder: ThresholdHolder
    pool: FeedbackArrays
    offset: int


class StandIn:
    def __init__(self, plans: list[Plan], period: float, feedback: bool = True) -> None:
        self.plans, self.period, self.feedback = plans, period, feedback
        self.served, self.reads = 0, 0
        self.by_port: dict[int, Served] = {}
        self.pools: dict[int, FeedbackArrays] = {}
        self.runner: web.AppRunner | None = None

    async def start(self) -> list[int]:
        """Listen for every plan's service; their ports, in order."""
        app = web.Application()
        app.router.add_get("/stats", self.stats)
        app.router.add_get("/v1/observations", self.guarded(self.observations))
        app.router.add_get("/v1/window.npz", self.guarded(self.window))
        app.router.add_get("/v1/thresholds", self.guarded(self.thresholds))
        app.router.add_post("/v1/thresholds", self.guarded(self.push))
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        ports = []
        for i, plan in enumerate(self.plans):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", 0))
            await web.SockSite(self.runner, sock, backlog=BACKLOG).start()
            port = sock.getsockname()[1]
            ramps = ramp_names(plan)
            if len(ramps) not in self.pools:
                self.pools[len(ramps)] = sample_pool(len(ramps))
            holder = ThresholdHolder(ThresholdSet(dict(plan.thresholds), plan.thresholds_version))
            self.by_port[port] = Served(plan, ramps, holder, self.pools[len(ramps)], 977 * i)
            ports.append(port)
        return ports

    def guarded(self, handler: Callable[[web.Request, Served], Awaitable[web.StreamResponse]]) -> Handler:
        async def run(request: web.Request) -> web.StreamResponse:
            self.served += 1
            if not request.headers.get("Authorization", "").startswith("Bearer "):
                return web.json_response({"error": "no token"}, status=401)
            sockname = request.transport.get_extra_info("sockname") if request.transport else None
            served = self.by_port.get(sockname[1]) if sockname else None
            if served is None:
                return web.json_response({"error": "no service on this socket"}, status=404)
            return await handler(request, served)

        return run

    async def stats(self, _: web.Request) -> web.Response:
        return web.json_response({"served": self.served, "reads": self.reads})

    async def observations(self, request: web.Request, s: Served) -> web.Response:
        window, now, values, version = (
            request.query.get("window"),
            time.time(),
            s.holder.values,
            s.holder.current.version,
        )
        if window != "current":
            self.reads += 1  # one closed-window GET per read
        if window == "both":  # as the router answers it: both windows in one answer
            closed = steady_window(s.plan, self.period, False, now, values, version)
            return web.json_response(
                {"closed": closed, "current": steady_window(s.plan, self.period, True, now, values, version)}
            )
        return web.json_response(steady_window(s.plan, self.period, window == "current", now, values, version))

    async def window(self, request: web.Request, s: Served) -> web.Response:
        if not self.feedback:  # as a router before its first shadow sample: an empty window
            empty = np.zeros(0)
            return web.Response(body=FeedbackArrays(empty, empty, empty, empty, empty).to_npz())
        last, ring = int(request.query.get("last", FEEDBACK)), f"stand-in-{s.offset}"
        after = int(request.query["after"]) if request.query.get("ring") == ring and "after" in request.query else None
        arrays = feedback_window(s.pool, s.offset, time.time(), min(max(last, 0), FEEDBACK) or FEEDBACK, after, ring)
        body = arrays.to_safetensors() if request.query.get("format") == "safetensors" else arrays.to_npz()
        return web.Response(body=body, content_type="application/octet-stream")

    async def thresholds(self, _: web.Request, s: Served) -> web.Response:
        return web.json_response(s.holder.current.to_json())

    async def push(self, request: web.Request, s: Served) -> web.Response:
        try:
            update = ThresholdUpdate.parse(await request.json(), s.ramps, "final")
        except (BadControl, ValueError) as err:
            return web.json_response({"error": f"bad thresholds: {err}"}, status=400)
        new = s.holder.current.changed(update.thresholds, replace=update.replace, version=update.version)
        s.holder.adopt(new, update.reason)
        return web.json_response(s.holder.current.to_json())


async def serve(plans: list[Plan], period: float, feedback: bool) -> None:
    stand_in = StandIn(plans, period, feedback)
    print(json.dumps(await stand_in.start()), flush=True)
    await asyncio.Event().wait()  # until terminated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plans", type=Path, help="a JSON list of plans, one per service")
    parser.add_argument("--period", type=float, default=20.0, help="spec.planner.periodSeconds")
    parser.add_argument("--no-feedback", action="store_true", help="answer an empty feedback window (no re-tune)")
    args = parser.parse_args()
    plans = [Plan.model_validate(p) for p in json.loads(args.plans.read_text())]
    asyncio.run(serve(plans, args.period, not args.no_feedback))


if __name__ == "__main__":
    main()
