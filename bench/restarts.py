"""Restarts under load: what a router drained with SIGTERM, a router killed with SIGKILL and a worker
killed with SIGKILL cost the requests in flight.

Serves a bundle as `exitplan up --routers 2` does: two router processes behind the local front (the
stand-in for the router Service, localrun/front.py), workers with two replicas per length bucket,
and the supervisor that restarts what exits (localrun/supervisor.py). Measures the capacity through
the front (`find_capacity`), then replays the trace open-loop at `--load` of it (half by default),
three times, with one event a third of the way into each run:

1. SIGTERM to router-0: it drains (readiness off, in-flight requests answered, exit 0); the front
   moves new connections to router-1. Expected: no request without an answer.
2. SIGKILL to router-0: the requests it held are cut off; the client sees their connections close
   (`transport` errors). Expected: only requests in flight at the kill fail, none sent after it.
3. SIGKILL to one worker replica: the router retries its inputs on the other replica of the hop and
   the supervisor restarts it. Expected: no request without an answer.
4. SIGSTOP to one worker replica for `--stop-s` seconds (5), then SIGCONT: the process holds its
   connections and answers nothing. The router sends a frame that got no answer within the hedge
   bound to the other replica too and takes the stalled one out of rotation until it answers its
   health check (worker_image/hop_client.py, peer_choice.py). Expected: at most 0.5 % errors, none
   without an answer.

Between runs every process is back and every router ready. Prints, per run: requests, results,
errors by kind, requests without an answer (transport + lost), requests in flight at the event
(sent before it, not yet answered; both routers' for a router kill), and failures among requests
sent after the event.

    python bench/restarts.py [--bundle artifacts/bundles/minilm] [--load 0.5] [--duration 30] [--rps R]
                             [--events sigterm,sigkill-router,sigkill-worker,sigstop] [--stop-s 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from exitplan.api.bundle import read_manifest
from exitplan.api.resources import EarlyExitServiceSpec
from exitplan.client.bench import BenchSetup, find_capacity, schedule
from exitplan.client.loadgen import Outcome, replay
from exitplan.client.texts import build_inputs
from exitplan.localrun.deployment import LocalDeployment
from exitplan.localrun.service_setup import ServiceSetup, single_split_plan, tuned_thresholds

EVENTS = {
    "sigterm": ("SIGTERM router-0", "router-0", signal.SIGTERM),
    "sigkill-router": ("SIGKILL router-0", "router-0", signal.SIGKILL),
    "sigkill-worker": ("SIGKILL a worker", "worker-", signal.SIGKILL),
    "sigstop": ("SIGSTOP a worker", "worker-", signal.SIGSTOP),
}
SLACK_S = 0.05
"""How far the event's time in the run may be off (the run's clock starts a few ms after ours)."""


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=2.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_all_serving(dep: LocalDeployment, timeout_s: float = 300.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        up = all(p.popen is not None and p.popen.poll() is None for p in dep.procs)
        if up and all(ready(f"http://{p.address}") for p in dep.procs):
            return
        time.sleep(0.2)
    raise RuntimeError("the deployment did not come back: " + json.dumps(dep.describe()))


async def run_with_event(
    dep: LocalDeployment, model: str, bodies, arrivals, at_s: float, target: str, sig, stop_s: float = 5.0
) -> dict:
    victim = next(p for p in dep.procs if p.name.startswith(target))
    pid = victim.popen.pid

    async def event() -> int | None:
        await asyncio.sleep(at_s)  # replay's clock starts a few ms after this one (SLACK_S)
        held = await asyncio.to_thread(router_inflight, victim.address) if target.startswith("router") else None
        os.kill(pid, sig)
        if sig == signal.SIGSTOP:  # stalled, not gone: it holds its connections and answers nothing
            await asyncio.sleep(stop_s)
            os.kill(pid, signal.SIGCONT)
        return held

    fired = asyncio.create_task(event())
    outcomes = await replay(dep.url, model, bodies, arrivals, timeout_s=30.0)
    return {**summary(outcomes, at_s, victim.name), "victim_inflight_before": await fired}


def router_inflight(address: str) -> int | None:
    """The router's exitplan_router_inflight_inputs gauge (inputs admitted, not yet answered)."""
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=2.0) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, OSError):
        return None
    values = [
        line.rsplit(" ", 1)[1] for line in text.splitlines() if line.startswith("exitplan_router_inflight_inputs{")
    ]
    return int(float(values[0])) if values else None


def summary(outcomes: list[Outcome], at_s: float, victim: str) -> dict:
    kinds = {
        k: sum(o.kind == k for o in outcomes)
        for k in ("ok", "overload", "bad_request", "server_error", "transport", "lost", "invalid")
    }
    failed = [o for o in outcomes if o.kind != "ok"]
    answered = [o.done_s - o.sent_s for o in outcomes if o.kind == "ok" and o.done_s is not None]
    in_flight = [o for o in outcomes if o.sent_s <= at_s + SLACK_S and (o.done_s is None or o.done_s >= at_s - SLACK_S)]
    return {
        "victim": victim,
        "requests": len(outcomes),
        **kinds,
        "unanswered": kinds["transport"] + kinds["lost"],
        "in_flight_at_event": len(in_flight),
        "failed_in_flight_at_event": sum(o in in_flight for o in failed),
        "failed_sent_after_event": sum(o.sent_s > at_s + SLACK_S for o in failed),
        "p99_ms": round(1000 * float(np.percentile(answered, 99)), 1) if answered else None,
        "errors": sorted({f"{o.kind} {o.status or ''} {o.error[:80]}".strip() for o in failed})[:5],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=Path("artifacts/bundles/minilm"))
    ap.add_argument("--trace", type=Path, default=None, help="default: the shared Azure trace")
    ap.add_argument("--slo-ms", type=float, default=500.0)
    ap.add_argument("--buckets", default="128")
    ap.add_argument("--replicas", type=int, default=2, help="worker replicas per length bucket")
    ap.add_argument("--load", type=float, default=0.5, help="offered load as a share of the measured capacity")
    ap.add_argument("--rps", type=float, default=None, help="offered load in requests/s (skips the capacity search)")
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--port", type=int, default=18680)
    ap.add_argument("--events", default=",".join(EVENTS), help=f"which events, in order (of {', '.join(EVENTS)})")
    ap.add_argument("--stop-s", type=float, default=5.0, help="how long SIGSTOP holds the worker")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    console = Console(width=200)

    bundle = args.bundle.resolve()
    manifest = read_manifest(bundle)
    buckets = [int(b) for b in args.buckets.split(",")] if manifest.seq_axis is not None else []
    spec = EarlyExitServiceSpec.model_validate(
        {
            "model": {"name": manifest.name, "bundle": str(bundle)},
            "slo": {"latencyMs": args.slo_ms},
            "pools": [{"name": "cpu"}],
            "workload": {"lengthBuckets": buckets},
        }
    )
    setup = ServiceSetup("restarts", spec, bundle, manifest)
    thresholds = tuned_thresholds(bundle, spec.accuracy.max_drop, spec.workload.length_buckets)
    plan = single_split_plan(setup, thresholds=thresholds, replicas=args.replicas, batch_size=8, reason="bench")
    events: list[str] = []
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dep = LocalDeployment(
            bundle, plan, spec, Path(tmp), port=args.port, base_port=args.port + 1, routers=2, on_event=events.append
        )
        with dep:
            bench = BenchSetup.connect(dep.url, manifest.name, bundle)
            if args.rps is None:
                capacity = find_capacity(
                    dep.url, manifest.name, bundle, args.trace, setup=bench, slo_ms=args.slo_ms, step_duration=8.0
                )
                console.print(capacity.table())
                rps = args.load * capacity.capacity_rps
            else:
                rps = args.rps
            info = bench.info
            window = schedule(args.trace, max_length=max(info.buckets), rps=rps, duration=args.duration).trace
            inputs = build_inputs(bench.pool, window.lengths, max_length=max(info.buckets), references=bench.references)
            for key in args.events.split(","):
                name, target, sig = EVENTS[key.strip()]
                wait_all_serving(dep)
                at_s = args.duration / 3
                result = asyncio.run(
                    run_with_event(dep, manifest.name, inputs.bodies, window.timestamps, at_s, target, sig, args.stop_s)
                )
                rows.append((name, result))
            wait_all_serving(dep)
            restarts = {p.name: p.restarts for p in dep.procs}
    table = Table(
        title=f"{manifest.name}: restarts at {rps:.1f} rps offered ({args.duration:g} s runs, event at {args.duration / 3:g} s)"
    )
    columns = ("event", "requests", "results", "errors %", "p99 ms", "overload", "5xx", "transport", "lost")
    columns += ("in flight at event", "victim's inputs in flight", "failed (in flight)", "failed (sent after)")
    for col in columns:
        table.add_column(col, justify="right")
    for name, r in rows:
        table.add_row(
            name,
            str(r["requests"]),
            str(r["ok"]),
            f"{100 * (r['requests'] - r['ok']) / max(r['requests'], 1):.2f}",
            str(r["p99_ms"]),
            str(r["overload"]),
            str(r["server_error"]),
            str(r["transport"]),
            str(r["lost"]),
            str(r["in_flight_at_event"]),
            "-" if r["victim_inflight_before"] is None else str(r["victim_inflight_before"]),
            str(r["failed_in_flight_at_event"]),
            str(r["failed_sent_after_event"]),
        )
    console.print(table)
    for name, r in rows:
        if r["errors"]:
            console.print(f"{name}: {r['errors']}")
    console.print("supervisor: " + "; ".join(events))
    console.print(f"restarts: {restarts}; cores {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(
            json.dumps({"rps": rps, "runs": {n: r for n, r in rows}, "restarts": restarts, "events": events}, indent=2)
        )


if __name__ == "__main__":
    main()
