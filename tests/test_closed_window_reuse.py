"""The drift loop's read of a router (`GET /v1/observations?window=both`) parses the last closed window once:
a closed window no longer changes, so a later read that finds the same one (same bounds) keeps the window
already parsed, and parses only the window in progress -- over real HTTP (an aiohttp server answering as a
router does) through the operator's own read (driftloop.read_routers)."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from exitplan.api.observations import Observations
from exitplan.operator import driftloop
from exitplan.worker_image.control_client import ControlClient


def window(since: float, until: float, requests: int) -> dict[str, Any]:
    return {
        "service": "svc",
        "model": "m",
        "since": since,
        "until": until,
        "requests": requests,
        "withinSlo": requests,
        "ramps": ["r1"],
        "survival": [0.5],
        "lengthBuckets": [32, 128],
        "lengthHistogram": [requests // 2, requests - requests // 2],
    }


class Router:
    """Answers ?window=both from `closed` and `current` (a closed window of None: before the first roll)."""

    def __init__(self) -> None:
        self.closed: dict[str, Any] | None = None
        self.current = window(100.0, 105.0, 10)

    async def handle(self, request: web.Request) -> web.Response:
        assert request.query.get("window") == "both"
        return web.json_response({"closed": self.closed or self.current, "current": self.current})


async def test_a_closed_window_read_again_is_the_one_already_parsed_and_the_one_in_progress_is_new():
    router = Router()
    app = web.Application()
    app.router.add_get("/v1/observations", router.handle)
    async with TestServer(app) as server:
        url = str(server.make_url("")).rstrip("/")
        async with ControlClient(url) as client:
            closed, current = await client.recent_observations()
            assert (closed.since, closed.until) == (current.since, current.until) == (100.0, 105.0)
            # before the first roll the "closed" window is the one in progress: never kept as closed
            router.current = window(100.0, 110.0, 20)
            again, current = await client.recent_observations(closed)
            assert again is not closed and again.requests == current.requests == 20
            # the window rolled: the closed one is parsed once, then kept while it is the last closed one
            router.closed, router.current = window(100.0, 120.0, 40), window(120.0, 125.0, 5)
            first, current = await client.recent_observations(again)
            assert first is not again and (first.since, first.until, first.requests) == (100.0, 120.0, 40)
            router.current = window(120.0, 130.0, 11)
            kept, current = await client.recent_observations(first)
            assert kept is first and current.requests == 11
            # another closed window (the next roll, or a router that restarted) is parsed
            router.closed, router.current = window(120.0, 140.0, 30), window(140.0, 141.0, 1)
            later, _ = await client.recent_observations(first)
            assert later is not first and later.requests == 30

        # through the drift loop's read: what it keeps per router, and what the slices add up to
        seen: dict[str, Observations] = {}
        closed_kept: dict[str, Observations] = {}
        reads = []
        for current in (window(140.0, 150.0, 9), window(140.0, 155.0, 14), window(140.0, 160.0, 20)):
            router.current = current
            read = await driftloop.read_routers(None, seen, [url], token="", closed=closed_kept)  # type: ignore[arg-type]
            reads.append(read)
        assert closed_kept[url].requests == 30 and seen[url].requests == 20
        assert [r.piece.requests for r in reads if r.piece is not None][1:] == [5, 6]  # what arrived since each read
        await driftloop.read_routers(None, seen, [], token="", closed=closed_kept)  # type: ignore[arg-type]
        assert closed_kept == {} and seen == {}  # a router gone is forgotten
