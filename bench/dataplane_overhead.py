"""What the router plus one split hop adds over calling ONNX Runtime directly on the same batch.

Side by side in one run, alternating, on the same texts padded to the same bucket, one ORT thread
each: (a) `BundleRuntime.run_range` in this process; (b) one KServe v2 request carrying the same
batch through a real router process and one split-worker process (the whole model in one split,
exits off).

Two figures for (b):
- *added per request*: the client's latency minus the worker's compute of that very batch, which the
  router reports in its `Server-Timing` header (`router;dur=..., split0;dur=...`). The batch's own
  compute cancels, so this is what the path adds, request by request; its p50 is the headline.
- *difference of the p50s* of (b) and (a): the issue's literal comparison, but two ~90 ms computes'
  own spread (a few ms on a shared 2-core VM) moves it by +-1 ms from run to run, so it is printed
  for reference.

Text models get the texts (`--input text`, the default: the router tokenizes them, which the direct
call does not have to do) or the same token ids the direct call gets (`--input ids`: the serving
path alone, nothing but transport, batching and bookkeeping added).

Clients (`--client`, default both, alternating): `httptools` (a blocking socket with llhttp parsing,
as a compiled client would be) and `http.client` (pure-Python parsing), each on one kept-alive
connection; `--new-connection` adds urllib with a new TCP connection per request.

`--floor` adds the machine's floor: the same three processes (client, proxy, worker) and the same
bytes, over raw length-prefixed sockets on the same event loop, with no HTTP and no serving logic
(the proxy parses the JSON body and sends one frame; the worker decodes it and runs the same ORT
calls). What exitplan adds is then its figure minus the floor.

`--colocated` adds the router that runs split 0 in its own process (`exitplan router --colocate`): the
same request with no hop and no second process; its *added per request* is the router's own code.

`--baseline-commit REV` (or `--baseline-code DIR`) also serves with other code, side by side: the
commit is `git archive`d and laid out as the `exitplan` package on the router's and worker's
PYTHONPATH. Code older than the Server-Timing header gets only the difference of the p50s.

    python bench/dataplane_overhead.py [--bundle artifacts/bundles/minilm] [--batch 8] [--bucket 32] [--runs 200]
        [--input text|ids] [--client both|httptools|http.client] [--floor] [--baseline-commit REV]
        [--colocated] [--new-connection] [--idle-ms 0] [--segments] [--json out.json]

`--idle-ms 30` lets the machine idle before each call as it does while MiniLM computes for 30 ms:
with the digits CNN it shows what the same serving path costs when it starts cold.

`--segments` also times each stretch of (b): a `sitecustomize` put on the router's and worker's
PYTHONPATH wraps the serving functions and the socket writes with wall-clock timestamps (the
processes share one clock), and the bench prints the median of each stretch. The hooks cost a few
microseconds each, so take the headline figures from a run without them.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import http.client
import io
import json
import multiprocessing
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

import httptools
import numpy as np
from tokenizers import Tokenizer

from exitplan.api.bundle import read_manifest
from exitplan.api.plan import Cell, Plan, SplitPlan
from exitplan.api.resources import EarlyExitServiceSpec
from exitplan.localrun.deployment import LocalDeployment
from exitplan.worker_image.bundle_runtime import BundleRuntime, pad_batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=Path("artifacts/bundles/minilm"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--bucket", type=int, default=32)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--port", type=int, default=18480)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--input",
        choices=["text", "ids"],
        default="text",
        help="text models: send texts (tokenized by the router) or the token ids",
    )
    ap.add_argument(
        "--client",
        choices=["both", "httptools", "http.client"],
        default="both",
        help="HTTP client(s) of the served path, each on one kept-alive connection (both: alternating)",
    )
    ap.add_argument(
        "--baseline-commit",
        default=None,
        help="also serve with this commit's code (git archive, laid out as the package): side by side",
    )
    ap.add_argument(
        "--baseline-code",
        type=Path,
        default=None,
        help="also serve with the `exitplan` package under this folder (on PYTHONPATH)",
    )
    ap.add_argument(
        "--floor",
        action="store_true",
        help="also the machine's floor: the same three processes and bytes over raw length-prefixed sockets",
    )
    ap.add_argument(
        "--colocated",
        action="store_true",
        help="also the router with split 0 in its own process (`exitplan router --colocate`): no hop, two processes",
    )
    ap.add_argument(
        "--new-connection",
        action="store_true",
        help="also a client that opens a new TCP connection per request (urllib)",
    )
    ap.add_argument(
        "--idle-ms",
        type=float,
        default=0.0,
        help="sleep this long before each timed call (both paths): the machine idles as it does during a long compute",
    )
    ap.add_argument(
        "--segments",
        action="store_true",
        help="also time each stretch of the path (timestamp hooks in the router and worker)",
    )
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
                {
                    "name": name,
                    "datatype": "INT64",
                    "shape": list(state[name].shape),
                    "data": state[name].ravel().tolist(),
                }
                for name in ("input_ids", "attention_mask")
            ]
        direct = BundleRuntime(args.bundle, buckets=[args.bucket], threads=1)
    plan = Plan(
        service="bench",
        model=manifest.name,
        splits=[SplitPlan(index=0, first_block=0, last_block=len(manifest.blocks) - 1)],
        buckets=[args.bucket],
        cells=[Cell(split=0, bucket=args.bucket, pool="cpu", replicas=1, batch_size=args.batch)],
        thresholds={},
    )
    spec = EarlyExitServiceSpec.model_validate(
        {
            "model": {"name": manifest.name, "bundle": str(args.bundle)},
            "slo": {"latencyMs": 1000},
            "accuracy": {"shadowFraction": 0.0},
            "pools": [{"name": "cpu"}],
        }
    )
    body = json.dumps({"inputs": body_inputs}).encode()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        env = _trace_env(Path(tmp)) if args.segments else {}
        client_marks: list[tuple[float, float]] = []
        path = f"/v2/models/{manifest.name}/infer"
        dep = stack.enter_context(
            LocalDeployment(
                args.bundle.resolve(), plan, spec, Path(tmp) / "this", port=args.port, base_port=args.port + 1, env=env
            )
        )
        clients = {name: _CLIENTS[name](dep.url, path, body) for name in _client_names(args)}
        if args.baseline_commit or args.baseline_code:
            code = args.baseline_code or _lay_out_commit(args.baseline_commit, Path(tmp) / "baseline-code")
            label = f"baseline {args.baseline_commit or code}"
            other = stack.enter_context(
                LocalDeployment(
                    args.bundle.resolve(),
                    plan,
                    spec,
                    Path(tmp) / "baseline",
                    port=args.port + 100,
                    base_port=args.port + 101,
                    env={"PYTHONPATH": str(code)},
                )
            )
            for name in list(clients):
                clients[f"{name}, {label}"] = _CLIENTS[name](other.url, path, body)
        if args.colocated:
            co = LocalDeployment(
                args.bundle.resolve(), plan, spec, Path(tmp) / "co", port=args.port + 300, base_port=args.port + 301
            )
            co.colocate = True
            stack.enter_context(co)
            for name in _client_names(args):
                clients[f"{name}, co-located"] = _CLIENTS[name](co.url, path, body)
        if args.floor:
            runtime_kw = {"buckets": [args.bucket]} if manifest.seq_axis is not None else {}
            floor_port = stack.enter_context(_floor(args.port + 200, args.bundle, runtime_kw, state))
            clients["floor: raw sockets, no serving logic"] = _FloorClient(floor_port, body)

        def in_process() -> float:
            t0 = time.perf_counter()
            direct.run_range(state, None, None)
            return (time.perf_counter() - t0) * 1000

        def timed(post) -> tuple[float, float | None, float | None]:
            w0, t0 = time.time(), time.perf_counter()
            answer, timing = post()
            elapsed = (time.perf_counter() - t0) * 1000
            client_marks.append((w0, time.time()))
            json.loads(answer)  # the client reads the answer, as any client does
            return elapsed, timing.get("router"), timing.get("split0")

        for _ in range(20):  # warm every path
            for post in clients.values():
                timed(post)
            in_process()
        client_marks.clear()
        worker = dep.procs[0].address
        before = _batch_totals(worker)
        direct_ms: list[float] = []
        served: dict[str, list[tuple[float, float | None, float | None]]] = {name: [] for name in clients}
        idle = args.idle_ms / 1000
        for _ in range(args.runs):
            time.sleep(idle)
            direct_ms.append(in_process())
            for name, post in clients.items():
                time.sleep(idle)
                served[name].append(timed(post))
        after = _batch_totals(worker)
        worker_mean = 1000 * (after[0] - before[0]) / max(after[1] - before[1], 1)
        for post in clients.values():
            getattr(post, "close", lambda: None)()
        stack.close()  # the processes exit and write their timestamp marks
        segments = _segments(Path(tmp), client_marks) if args.segments else {}
    p50_a, p90_a = statistics.median(direct_ms), float(np.percentile(direct_ms, 90))
    what = {"text": "texts", "ids": "token ids"}[args.input] if manifest.seq_axis is not None else "tensors"
    result = {
        "batch": n_inputs,
        "bucket": args.bucket,
        "runs": args.runs,
        "input": args.input if manifest.seq_axis is not None else "tensor",
        "idle_ms": args.idle_ms,
        "ort_direct_p50_ms": round(p50_a, 3),
        "ort_direct_p90_ms": round(p90_a, 3),
        "worker_batch_mean_ms": round(worker_mean, 3),
        "clients": {},
    }
    print(
        f"batch {n_inputs} at bucket {args.bucket} ({what}), {args.runs} runs each, alternating"
        f"{f'; {args.idle_ms:g} ms idle before each call' if args.idle_ms else ''}"
    )
    print(f"  ORT direct (this process)            p50 {p50_a:8.3f} ms   p90 {p90_a:8.3f} ms")
    for name, rows in served.items():
        elapsed = [r[0] for r in rows]
        p50_b = statistics.median(elapsed)
        row = {
            "router_hop_p50_ms": round(p50_b, 3),
            "router_hop_p90_ms": round(float(np.percentile(elapsed, 90)), 3),
            "difference_of_p50s_ms": round(p50_b - p50_a, 3),
            "ratio_p50": round(p50_b / p50_a, 3),
        }
        print(
            f"  router + 1 split hop, {name:<15} p50 {p50_b:8.3f} ms   p90 {row['router_hop_p90_ms']:8.3f} ms   ratio {row['ratio_p50']:.3f}x"
        )
        if all(r[2] is not None for r in rows):
            added = [r[0] - r[2] for r in rows]  # the client's latency minus the worker's compute of that very batch
            row.update(
                {
                    "added_p50_ms": round(statistics.median(added), 3),
                    "added_p90_ms": round(float(np.percentile(added, 90)), 3),
                    "worker_compute_p50_ms": round(statistics.median(r[2] for r in rows), 3),
                }
            )
            inner = ""
            if all(r[1] is not None for r in rows):
                row["router_to_worker_and_back_p50_ms"] = round(statistics.median(r[1] - r[2] for r in rows), 3)
                inner = f"; of it router <-> worker {row['router_to_worker_and_back_p50_ms']:.3f} ms"
            print(
                f"      added per request (latency - the worker's compute of its batch): p50 {row['added_p50_ms']:.3f} ms, "
                f"p90 {row['added_p90_ms']:.3f} ms{inner}"
            )
            print(
                f"      difference of the p50s {row['difference_of_p50s_ms']:+.3f} ms (worker compute p50 {row['worker_compute_p50_ms']:.3f} "
                f"ms vs direct {p50_a:.3f} ms: the two computes' own spread is in this figure)"
            )
        else:
            print(
                f"      difference of the p50s {row['difference_of_p50s_ms']:+.3f} ms (this code sends no Server-Timing: no per-request figure)"
            )
        result["clients"][name] = row
    if segments:
        result["segments_p50_ms"] = segments
        print("  stretches of (b), median over requests, timestamp hooks on:")
        for name, ms in segments.items():
            print(f"    {ms:8.3f} ms  {name}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


_HOOKS = textwrap.dedent("""
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
        from exitplan.worker_image.classify import executor, forward, requests, router_app, wire, worker_app
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
""")

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


def _lay_out_commit(rev: str, dest: Path) -> Path:
    """`git archive REV` laid out as the installed `exitplan` package (pyproject's package-dir) under dest."""
    import tarfile
    import tomllib

    raw = dest.parent / "archive"
    raw.mkdir(parents=True)
    tar = subprocess.run(["git", "archive", "--format=tar", rev], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(raw, filter="data")
    package_dir = tomllib.loads((raw / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in package_dir.items():
        target = dest.joinpath(*package.split("."))
        shutil.copytree(raw / folder, target, dirs_exist_ok=True)
    return dest


# ---- the machine's floor: the same three processes and bytes, raw length-prefixed sockets, no serving logic


def _floor_framed(on_frame):
    import asyncio

    class Framed(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport, self.buffer = transport, bytearray()
            transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def data_received(self, data):
            self.buffer += data
            while len(self.buffer) >= 4:
                n = int.from_bytes(self.buffer[:4], "little")
                if len(self.buffer) < 4 + n:
                    break
                frame = bytes(self.buffer[4 : 4 + n])
                del self.buffer[: 4 + n]
                on_frame(self, frame)

        def send(self, payload: bytes):
            self.transport.write(len(payload).to_bytes(4, "little") + payload)

    return Framed


def _floor_worker(port: int, bundle: str, runtime_kw: dict) -> None:
    """Decode a frame, run the same ORT calls, answer a frame with the compute time."""
    from exitplan.worker_image import wire
    from exitplan.worker_image.serve import new_loop

    runtime = BundleRuntime(bundle, threads=1, **runtime_kw)

    def on_frame(conn, frame):
        _, tensors = wire.decode(frame)
        t0 = time.perf_counter()
        runtime.run_range(dict(tensors), None, None)
        conn.send(wire.encode({"compute_ms": (time.perf_counter() - t0) * 1000}))

    loop = new_loop()
    loop.run_until_complete(loop.create_server(_floor_framed(on_frame), "127.0.0.1", port))
    loop.run_forever()


def _floor_proxy(port: int, worker_port: int, state: dict) -> None:
    """Parse the client's JSON body, send one frame (the batch's tensors) to the worker, answer JSON."""
    import asyncio

    import orjson

    from exitplan.worker_image import wire
    from exitplan.worker_image.serve import new_loop

    loop = new_loop()

    async def serve() -> None:
        waiting: list = []
        _, upstream = await loop.create_connection(
            _floor_framed(lambda conn, frame: waiting.pop(0).set_result(frame)), "127.0.0.1", worker_port
        )

        def on_request(conn, body):
            async def answer():
                orjson.loads(body)
                future = loop.create_future()
                waiting.append(future)
                upstream.send(
                    wire.encode({"items": [{"id": str(i)} for i in range(len(next(iter(state.values()))))]}, state)
                )
                meta, _ = wire.decode(await future)
                conn.send(orjson.dumps({"compute_ms": meta["compute_ms"]}))

            loop.create_task(answer())

        await loop.create_server(_floor_framed(on_request), "127.0.0.1", port)
        await asyncio.Event().wait()

    loop.run_until_complete(serve())


class _FloorClient:
    """Length-prefixed request bytes on one socket: no HTTP at either end."""

    def __init__(self, port: int, body: bytes) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.request = len(body).to_bytes(4, "little") + body

    def __call__(self) -> tuple[bytes, dict[str, float]]:
        self.sock.sendall(self.request)
        n = int.from_bytes(self.sock.recv(4, socket.MSG_WAITALL), "little")
        answer = self.sock.recv(n, socket.MSG_WAITALL)
        return answer, {"router": None, "split0": json.loads(answer)["compute_ms"]}

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def _floor(port: int, bundle: Path, runtime_kw: dict, state: dict):
    ctx = multiprocessing.get_context("spawn")
    worker = ctx.Process(target=_floor_worker, args=(port + 1, str(bundle), runtime_kw), daemon=True)
    worker.start()
    _wait_port(port + 1, worker)
    proxy = ctx.Process(target=_floor_proxy, args=(port, port + 1, state), daemon=True)
    proxy.start()
    _wait_port(port, proxy)
    try:
        yield port
    finally:
        for proc in (proxy, worker):
            proc.terminate()
            proc.join(5)


def _wait_port(port: int, proc, timeout_s: float = 120.0) -> None:
    until = time.time() + timeout_s
    while time.time() < until:
        if not proc.is_alive():
            raise RuntimeError(f"the floor process for port {port} exited ({proc.exitcode})")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the floor process did not listen on {port} within {timeout_s} s")


class _HttptoolsClient:
    """A blocking HTTP/1.1 client on one kept-alive socket; answers parsed by httptools (llhttp, C),
    as a compiled client (Go, Rust, wrk, k6) would parse them: the measured path is the server's."""

    def __init__(self, url: str, path: str, body: bytes) -> None:
        host, _, port = url.removeprefix("http://").rpartition(":")
        self.address = (host, int(port))
        self.request = (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        self.sock: socket.socket | None = None

    def __call__(self) -> tuple[bytes, dict[str, float]]:
        if self.sock is None:
            self.sock = socket.create_connection(self.address)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(self.request)
        self.body: list[bytes] = []
        self.timing = b""
        self.done = False
        parser = httptools.HttpResponseParser(self)
        while not self.done:
            data = self.sock.recv(1 << 16)
            if not data:
                raise RuntimeError("the router closed the connection before answering")
            parser.feed_data(data)
        answer = b"".join(self.body)
        if parser.get_status_code() != 200:
            raise RuntimeError(f"router answered {parser.get_status_code()}: {answer[:300]!r}")
        return answer, _server_timing(self.timing.decode())

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"server-timing":
            self.timing = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.done = True

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()


class _StdlibClient:
    """http.client on one kept-alive connection (pure-Python response parsing)."""

    def __init__(self, url: str, path: str, body: bytes) -> None:
        host, _, port = url.removeprefix("http://").rpartition(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=30)
        self.path, self.body = path, body

    def __call__(self) -> tuple[bytes, dict[str, float]]:
        self.conn.request("POST", self.path, body=self.body, headers={"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        answer = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"router answered {resp.status}: {answer[:300]!r}")
        return answer, _server_timing(resp.getheader("Server-Timing", ""))

    def close(self) -> None:
        self.conn.close()


class _NewConnectionClient:
    """urllib: a new TCP connection per request."""

    def __init__(self, url: str, path: str, body: bytes) -> None:
        self.url, self.body = url + path, body

    def __call__(self) -> tuple[bytes, dict[str, float]]:
        req = urllib.request.Request(self.url, data=self.body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req) as resp:
            return resp.read(), _server_timing(resp.headers.get("Server-Timing", ""))


_CLIENTS = {
    "httptools": _HttptoolsClient,
    "http.client": _StdlibClient,
    "new connection (urllib)": _NewConnectionClient,
}


def _client_names(args: argparse.Namespace) -> list[str]:
    names = ["httptools", "http.client"] if args.client == "both" else [args.client]
    return names + (["new connection (urllib)"] if args.new_connection else [])


def _server_timing(header: str) -> dict[str, float]:
    """{"router": ms, "split0": ms} from the router's Server-Timing header (empty from code older than it)."""
    out = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        if dur:
            out[name] = float(dur)
    return out


def _batch_totals(address: str) -> tuple[float, float]:
    """(sum of batch seconds, batch count) from a worker's /metrics."""
    with urllib.request.urlopen(f"http://{address}/metrics") as resp:
        lines = resp.read().decode().splitlines()
    value = lambda name: float(next(line for line in lines if line.startswith(name)).split()[-1])  # noqa: E731
    return value("exitplan_worker_batch_seconds_sum"), value("exitplan_worker_batch_seconds_count")


if __name__ == "__main__":
    main()
