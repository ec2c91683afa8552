"""What the router plus one split hop adds over calling ONNX Runtime directly on the same batch.

Side by side in one run, alternating, on the same texts padded to the same bucket, one ORT thread
each: (a) `BundleRuntime.run_range` in this process; (b) one KServe v2 request carrying the same
batch through a real router process and one split-worker process (the whole model in one split,
exits off). Prints p50/p90 of both, the difference in ms and the ratio.

Text models get the texts (`--input text`, the default: the router tokenizes them, which the direct
call does not have to do) or the same token ids the direct call gets (`--input ids`: the serving
path alone, nothing but transport, batching and bookkeeping added).

The client keeps one HTTP/1.1 connection open across requests (keep-alive, as any serving client
does); `--new-connection` opens a new TCP connection per request instead (urllib), which adds the
connect and teardown to (b).

    python bench/dataplane_overhead.py [--bundle artifacts/bundles/minilm] [--batch 8] [--bucket 32] [--runs 200] [--input text|ids] [--new-connection] [--idle-ms 0] [--segments]

`--idle-ms 30` lets the machine idle before each call as it does while MiniLM computes for 30 ms:
with the digits CNN it shows what the same serving path costs when it starts cold.

`--segments` also times each stretch of (b): a `sitecustomize` put on the router's and worker's
PYTHONPATH wraps the serving functions and the socket writes with wall-clock timestamps (the
processes share one clock), and the bench prints the median of each stretch. The hooks cost a few
microseconds each, so take the headline figures from a run without them.

With the digits CNN bundle (compute ~0.3 ms) the difference is almost pure serving overhead; with
MiniLM it also shows what the extra processes cost the compute on a 2-core machine.
"""

from __future__ import annotations

import argparse
import bisect
import http.client
import json
import os
import statistics
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from exitplan.api.bundle import read_manifest
from exitplan.api.plan import Cell, Plan, SplitPlan
from exitplan.api.resources import EarlyExitServiceSpec
from exitplan.local import LocalDeployment
from exitplan.worker.bundle_runtime import BundleRuntime, pad_batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=Path("artifacts/bundles/minilm"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--bucket", type=int, default=32)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--port", type=int, default=18480)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--input", choices=["text", "ids"], default="text", help="text models: send texts (tokenized by the router) or the token ids")
    ap.add_argument("--new-connection", action="store_true", help="a new TCP connection per request (default: one kept-alive connection)")
    ap.add_argument("--idle-ms", type=float, default=0.0, help="sleep this long before each timed call (both paths): the machine idles as it does during a long compute")
    ap.add_argument("--segments", action="store_true", help="also time each stretch of the path (timestamp hooks in the router and worker)")
    args = ap.parse_args()

    manifest = read_manifest(args.bundle)
    if manifest.seq_axis is None:  # a fixed-size model: the same tensor both ways
        args.bucket = 1
        spec_in = manifest.inputs[0]
        with np.load(args.bundle / "data" / "heldout.npz") as data:
            x = data["x"][: args.batch].astype(spec_in.dtype)
        state = {spec_in.name: x}
        body_inputs = [{"name": spec_in.name, "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]
        n_inputs = len(x)
        direct = BundleRuntime(args.bundle, threads=1)
    else:
        with np.load(args.bundle / "data" / "heldout.npz", allow_pickle=True) as data:
            texts_all = [str(t) for t in data["text"]]
        tok = Tokenizer.from_file(str(args.bundle / "tokenizer.json"))
        tok.no_padding()
        tok.no_truncation()
        texts = [t for t in texts_all if len(tok.encode(t).ids) <= args.bucket][: args.batch]
        state = pad_batch([tok.encode(t).ids for t in texts], args.bucket)
        n_inputs = len(texts)
        if args.input == "text":
            body_inputs = [{"name": "text", "datatype": "BYTES", "shape": [n_inputs], "data": texts}]
        else:
            body_inputs = [
                {"name": name, "datatype": "INT64", "shape": list(state[name].shape), "data": state[name].ravel().tolist()}
                for name in ("input_ids", "attention_mask")
            ]
        direct = BundleRuntime(args.bundle, buckets=[args.bucket], threads=1)
    plan = Plan(
        service="bench", model=manifest.name,
        splits=[SplitPlan(index=0, first_block=0, last_block=len(manifest.blocks) - 1)],
        buckets=[args.bucket], cells=[Cell(split=0, bucket=args.bucket, pool="cpu", replicas=1, batch_size=args.batch)],
        thresholds={},
    )
    spec = EarlyExitServiceSpec.model_validate({
        "model": {"name": manifest.name, "bundle": str(args.bundle)}, "slo": {"latencyMs": 1000},
        "accuracy": {"shadowFraction": 0.0}, "pools": [{"name": "cpu"}],
    })
    body = json.dumps({"inputs": body_inputs}).encode()
    with tempfile.TemporaryDirectory() as tmp:
        env = _trace_env(Path(tmp)) if args.segments else {}
        client_marks: list[tuple[float, float]] = []
        with LocalDeployment(args.bundle.resolve(), plan, spec, Path(tmp), port=args.port, base_port=args.port + 1, env=env) as dep:
            path = f"/v2/models/{manifest.name}/infer"
            conn = http.client.HTTPConnection("127.0.0.1", args.port, timeout=30)
            headers = {"Content-Type": "application/json"}

            router_ms: list[float] = []

            def post() -> bytes:
                if args.new_connection:
                    req = urllib.request.Request(dep.url + path, data=body, headers=headers)
                    with urllib.request.urlopen(req) as resp:
                        return resp.read()
                conn.request("POST", path, body=body, headers=headers)
                resp = conn.getresponse()
                answer = resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"router answered {resp.status}: {answer[:300]!r}")
                return answer

            def via_router() -> float:
                w0, t0 = time.time(), time.perf_counter()
                answer = post()
                elapsed = (time.perf_counter() - t0) * 1000
                client_marks.append((w0, time.time()))
                router_ms.append(json.loads(answer)["parameters"]["latency_ms"])
                return elapsed

            def in_process() -> float:
                t0 = time.perf_counter()
                direct.run_range(state, None, None)
                return (time.perf_counter() - t0) * 1000

            for _ in range(20):  # warm both paths
                via_router()
                in_process()
            router_ms.clear()
            client_marks.clear()
            worker = dep.procs[0].address
            before = _batch_totals(worker)
            a, b = [], []
            idle = args.idle_ms / 1000
            for _ in range(args.runs):
                time.sleep(idle)
                a.append(in_process())
                time.sleep(idle)
                b.append(via_router())
            after = _batch_totals(worker)
            worker_mean = 1000 * (after[0] - before[0]) / max(after[1] - before[1], 1)
            conn.close()
        segments = _segments(Path(tmp), client_marks) if args.segments else {}
    p50_a, p50_b = statistics.median(a), statistics.median(b)
    p90_a, p90_b = np.percentile(a, 90), np.percentile(b, 90)
    result = {
        "batch": n_inputs, "bucket": args.bucket, "runs": args.runs, "client": "new-connection" if args.new_connection else "keep-alive",
        "input": args.input if manifest.seq_axis is not None else "tensor", "idle_ms": args.idle_ms,
        "ort_direct_p50_ms": round(p50_a, 3), "router_hop_p50_ms": round(p50_b, 3),
        "added_p50_ms": round(p50_b - p50_a, 3), "ratio_p50": round(p50_b / p50_a, 3),
        "ort_direct_p90_ms": round(float(p90_a), 3), "router_hop_p90_ms": round(float(p90_b), 3),
    }
    what = {"text": "texts", "ids": "token ids"}[args.input] if manifest.seq_axis is not None else "tensors"
    print(f"batch {n_inputs} at bucket {args.bucket} ({what}), {args.runs} runs each, alternating; client: "
          f"{'a new connection per request' if args.new_connection else 'one kept-alive connection'}"
          f"{f'; {args.idle_ms:g} ms idle before each call' if args.idle_ms else ''}")
    print(f"  ORT direct           p50 {p50_a:8.3f} ms   p90 {p90_a:8.3f} ms")
    print(f"  router + 1 split hop p50 {p50_b:8.3f} ms   p90 {p90_b:8.3f} ms")
    print(f"  added at p50: {p50_b - p50_a:.3f} ms   ratio {p50_b / p50_a:.3f}x")
    router_p50 = statistics.median(router_ms)
    result.update({"router_internal_p50_ms": round(router_p50, 3), "worker_batch_mean_ms": round(worker_mean, 3)})
    print(f"  segments: client - router {p50_b - router_p50:.3f} ms, router - worker batch {router_p50 - worker_mean:.3f} ms "
          f"(router's own latency p50 {router_p50:.3f} ms, worker batch mean {worker_mean:.3f} ms)")
    if segments:
        result["segments_p50_ms"] = segments
        print("  stretches of (b), median over requests, timestamp hooks on:")
        for name, ms in segments.items():
            print(f"    {ms:8.3f} ms  {name}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


_HOOKS = textwrap.dedent('''
    # Written by bench/dataplane_overhead.py --segments: wall-clock marks around the serving path.
    import os
    OUT = os.environ.get("EXITPLAN_BENCH_TRACE")
    if OUT:
        import asyncio
        import asyncio.selector_events as selector_events
        import atexit
        import functools
        import json
        import time
        import aiohttp.web_protocol as web_protocol
        from exitplan.worker import executor, forward, requests, router_app, wire, worker_app
        MARKS = []

        def mark(name):
            MARKS.append((name, time.time()))

        @atexit.register
        def dump():
            with open(f"{OUT}.{os.getpid()}", "w") as fh:
                json.dump(MARKS, fh)

        def wrap(owner, name, tag, also=()):
            orig = getattr(owner, name)
            if asyncio.iscoroutinefunction(orig):
                async def hooked(*a, **k):
                    mark(tag + ">")
                    try:
                        return await orig(*a, **k)
                    finally:
                        mark(tag + "<")
            else:
                def hooked(*a, **k):
                    mark(tag + ">")
                    try:
                        return orig(*a, **k)
                    finally:
                        mark(tag + "<")
            functools.update_wrapper(hooked, orig)
            for target in (owner, *also):
                setattr(target, name, hooked)

        wrap(router_app.Router, "handle_infer", "router.handler")
        wrap(requests, "decode_inputs", "router.decode", also=(router_app,))
        wrap(router_app.Router, "_respond", "router.respond")
        wrap(forward, "send", "send", also=(router_app, worker_app))
        wrap(wire, "encode", "wire.encode")
        wrap(wire, "decode", "wire.decode")
        wrap(worker_app.SplitWorker, "handle_run", "worker.handler")
        wrap(worker_app.SplitWorker, "run_batch", "worker.batch")
        wrap(executor, "execute", "worker.compute", also=(worker_app,))
        wrap(web_protocol.RequestHandler, "data_received", "http.server.recv")
        wrap(forward._Connection, "data_received", "http.hop.recv")
        wrap(selector_events._SelectorSocketTransport, "write", "socket.write")
''')

_STRETCHES = [
    # (name, from mark, to mark): each is the first `to` after the first `from` within one request.
    ("client -> router handler (client send, loopback, HTTP parse)", "client.send", "R:router.handler>"),
    ("router: JSON + tokenize/decode", "R:router.handler>", "R:router.decode<"),
    ("router: admission, frame items", "R:router.decode<", "R:wire.encode>"),
    ("router: frame encode", "R:wire.encode>", "R:wire.encode<"),
    ("router -> worker handler (write, loopback, HTTP parse)", "R:wire.encode<", "W:worker.handler>"),
    ("worker: frame decode, queue, launch, hand-off to the inference thread", "W:worker.handler>", "W:worker.compute>"),
    ("worker: compute (the same ORT calls as the direct call)", "W:worker.compute>", "W:worker.compute<"),
    ("worker: hand-back, answers, frame encode", "W:worker.compute<", "W:wire.encode<"),
    ("worker -> router (response write, loopback, parse)", "W:wire.encode<", "R:wire.decode>"),
    ("router: frame decode, results, response JSON", "R:wire.decode>", "R:router.handler<"),
    ("router -> client (write, loopback, client parse)", "R:router.handler<", "client.done"),
]


def _trace_env(tmp: Path) -> dict[str, str]:
    hooks = tmp / "trace-hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(_HOOKS)
    path = os.pathsep.join(p for p in (str(hooks), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "EXITPLAN_BENCH_TRACE": str(tmp / "marks")}


def _segments(tmp: Path, client_marks: list[tuple[float, float]]) -> dict[str, float]:
    """Median ms of each stretch over the measured requests (marks of the router R: and the worker W:)."""
    marks: list[tuple[float, str]] = []
    for path in tmp.glob("marks.*"):
        own = json.loads(path.read_text())
        role = "W" if any(name.startswith("worker.") for name, _ in own) else "R"
        marks += [(t, f"{role}:{name}") for name, t in own]
    marks.sort()
    times = [t for t, _ in marks]
    per: dict[str, list[float]] = {name: [] for name, _, _ in _STRETCHES}
    for c0, c1 in client_marks:
        lo, hi = bisect.bisect_left(times, c0), bisect.bisect_right(times, c1)
        seen: dict[str, list[float]] = {"client.send": [c0], "client.done": [c1]}
        for t, name in marks[lo:hi]:
            seen.setdefault(name, []).append(t)
        for name, start, end in _STRETCHES:
            if start in seen and end in seen:
                t0 = seen[start][0]
                after = [t for t in seen[end] if t >= t0]
                if after:
                    per[name].append((after[0] - t0) * 1000)
    return {name: round(statistics.median(v), 3) for name, v in per.items() if v}


def _batch_totals(address: str) -> tuple[float, float]:
    """(sum of batch seconds, batch count) from a worker's /metrics."""
    with urllib.request.urlopen(f"http://{address}/metrics") as resp:
        lines = resp.read().decode().splitlines()
    value = lambda name: float(next(line for line in lines if line.startswith(name)).split()[-1])  # noqa: E731
    return value("exitplan_worker_batch_seconds_sum"), value("exitplan_worker_batch_seconds_count")


if __name__ == "__main__":
    main()
