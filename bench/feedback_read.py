"""The re-tune's feedback read, whole against a piece at a time, side by side in one run.

A router (the real ring and answer: worker_image/classify/observe.FeedbackRing.window, FeedbackArrays.to_npz,
served by aiohttp in a process of its own) gains `--per` shadow samples between two reads, as a router at
~200 new samples a drift period does; the reader reads its newest `--window` (the operator's TUNE_WINDOW):

- whole: `ControlClient.feedback(window)`, every read the whole window (what the operator did);
- followed: `router_fleet.fleet_feedback` with a `FeedbackFollower` (what it does now: the samples since).

The two alternate read by read over the same router. Printed: the reader's CPU per read (its process, user +
system: the HTTP request, the answer's bytes, the npz parse, and for `followed` the append) and the bytes per
answer, each as a ratio followed / whole. Both end with the same window (checked each read).

    python -P bench/feedback_read.py [--reads 400] [--per 200] [--window 1024] [--ramps 10]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import socket
import time

import numpy as np
from aiohttp import web

from exitplan.worker_image.classify.observe import FeedbackRing
from exitplan.worker_image.control_client import ControlClient
from exitplan.worker_image.router_fleet import FeedbackFollower, fleet_feedback


def serve(sock: socket.socket, ramps: int, per: int) -> None:
    """The router side: a ring that gains `per` samples at each POST /add, and GET /v1/window.npz as the router
    answers it (control.py's parsing of last / after / ring)."""
    ring, rng = FeedbackRing(ramps), np.random.default_rng(0)

    async def add(_: web.Request) -> web.Response:
        for _ in range(per):
            conf = np.sort(rng.uniform(0.5, 1.0, ramps))
            final = int(rng.integers(0, 3))
            ring.add(list(conf), [final if rng.uniform() < c else (final + 1) % 3 for c in conf], final)
        return web.Response(text="ok")

    async def window(request: web.Request) -> web.Response:
        last = int(request.query.get("last", 0)) or None
        after = (request.query["ring"], int(request.query["after"])) if "after" in request.query else None
        saving, cost = np.linspace(2.0 * ramps, 2.0, ramps), np.full(ramps, 0.2)
        return web.Response(body=ring.window(saving, cost, last=last, after=after).to_npz())

    app = web.Application()
    app.router.add_post("/add", add)
    app.router.add_get("/v1/window.npz", window)
    web.run_app(app, sock=sock, print=None, access_log=None)


async def measure(url: str, reads: int, window: int) -> dict[str, list[float]]:
    import aiohttp

    out: dict[str, list[float]] = {"whole_cpu": [], "followed_cpu": [], "whole_bytes": [], "followed_bytes": []}
    sizes: dict[str, int] = {}

    async def count(_: object, ctx: object, params: aiohttp.TraceResponseChunkReceivedParams) -> None:
        sizes["n"] = sizes.get("n", 0) + len(params.chunk)

    trace = aiohttp.TraceConfig()
    trace.on_response_chunk_received.append(count)
    async with aiohttp.ClientSession(trace_configs=[trace]) as session:
        client, follower = ControlClient(url, session=session), FeedbackFollower(window)
        for k in range(reads + 20):  # the first 20 reads of each warm up (and fill the ring)
            async with session.post(f"{url}/add") as resp:
                await resp.read()
            kept = None
            for way in ("whole", "followed") if k % 2 else ("followed", "whole"):
                sizes["n"], t = 0, time.process_time()
                if way == "whole":
                    whole = await client.feedback(window)
                else:
                    kept, _ = await fleet_feedback([client], window, follower)
                if k >= 20:
                    out[f"{way}_cpu"].append(time.process_time() - t)
                    out[f"{way}_bytes"].append(sizes["n"])
            assert kept is not None and whole is not None and np.array_equal(kept.final, whole.final)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reads", type=int, default=400, help="reads of each way (alternated)")
    parser.add_argument("--per", type=int, default=200, help="new samples between two reads")
    parser.add_argument("--window", type=int, default=1024, help="samples the reader keeps (TUNE_WINDOW)")
    parser.add_argument("--ramps", type=int, default=10)
    args = parser.parse_args()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    router = multiprocessing.get_context("fork").Process(target=serve, args=(sock, args.ramps, args.per), daemon=True)
    router.start()
    time.sleep(1.0)
    try:
        out = asyncio.run(measure(f"http://127.0.0.1:{port}", args.reads, args.window))
    finally:
        router.kill()
    cpu_w, cpu_f = np.mean(out["whole_cpu"]), np.mean(out["followed_cpu"])
    bytes_w, bytes_f = np.mean(out["whole_bytes"]), np.mean(out["followed_bytes"])
    print(f"{args.reads} reads each, {args.per} new samples between reads, window {args.window}, {args.ramps} ramps")
    print(
        f"  reader CPU per read   whole {1000 * cpu_w:.3f} ms   followed {1000 * cpu_f:.3f} ms   ratio {cpu_f / cpu_w:.2f}x"
    )
    print(
        f"  bytes per answer      whole {bytes_w / 1024:.1f} KiB   followed {bytes_f / 1024:.1f} KiB   ratio {bytes_f / bytes_w:.2f}x"
    )


if __name__ == "__main__":
    main()
