"""The operator's API client under a slow API server (operator/kube.py): at most MAX_IN_FLIGHT requests in
flight at once, and requests that time out -- more of them than that bound, cancelled wherever their timeout
finds them -- leave the client able to send the next ones (aiohttp's own pool limit could lose its slots to
such cancellations: a 400-service burst once left every later request of the operator timing out)."""

from __future__ import annotations

import asyncio

import aiohttp.web

from exitplan.operator import kube
from exitplan.operator.kube import ApiError, KubeClient


class SlowApi:
    """Answers after `delay` seconds; counts the requests it holds at once."""

    def __init__(self) -> None:
        self.delay, self.holding, self.most = 0.0, 0, 0

    async def handle(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        self.holding += 1
        self.most = max(self.most, self.holding)
        try:
            await asyncio.sleep(self.delay)
            return aiohttp.web.json_response({"items": []})
        finally:
            self.holding -= 1


async def test_timeouts_beyond_the_in_flight_bound_leave_the_client_working(monkeypatch):
    monkeypatch.setattr(kube, "MAX_IN_FLIGHT", 8)
    api = SlowApi()
    app = aiohttp.web.Application()
    app.router.add_get("/{tail:.*}", api.handle)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with KubeClient(f"http://127.0.0.1:{port}", backoffs=(), timeout_s=0.3) as client:
            api.delay = 0.1  # 40 at once, each answered within its timeout: at most 8 reach the server together
            answers = await asyncio.gather(*(client.request("GET", f"/api/v1/namespaces/n{i}/pods") for i in range(40)))
            assert answers == [{"items": []}] * 40 and 1 < api.most <= 8, api.most
            api.delay = 1.0  # every request times out, 40 at once, five times the bound
            results = await asyncio.gather(
                *(client.request("GET", f"/api/v1/namespaces/n{i}/pods") for i in range(40)), return_exceptions=True
            )
            assert all(isinstance(r, ApiError) and r.status == 503 for r in results), results
            api.delay = 0.0  # the server answers again: so does the client, for as many as before
            answers = await asyncio.gather(*(client.request("GET", f"/api/v1/namespaces/n{i}/pods") for i in range(40)))
            assert answers == [{"items": []}] * 40
    finally:
        await runner.cleanup()
