"""What the router plus one split hop adds over calling ONNX Runtime directly on the same batch.

Side by side in one run, alternating, on the same texts padded to the same bucket, one ORT thread
each: (a) `BundleRuntime.run_range` in this process; (b) one KServe v2 request carrying the same
batch through a real router process and one split-worker process (the whole model in one split,
exits off). Prints p50/p90 of both, the difference in ms and the ratio.

The client keeps one HTTP/1.1 connection open across requests (keep-alive, as any serving client
does); `--new-connection` opens a new TCP connection per request instead (urllib), which adds the
connect and teardown to (b).

    python bench/dataplane_overhead.py [--bundle artifacts/bundles/minilm] [--batch 8] [--bucket 32] [--runs 200] [--new-connection]

With the digits CNN bundle (compute ~0.3 ms) the difference is almost pure serving overhead; with
MiniLM it also shows what the extra processes cost the compute on a 2-core machine.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import tempfile
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
    ap.add_argument("--new-connection", action="store_true", help="a new TCP connection per request (default: one kept-alive connection)")
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
        body_inputs = [{"name": "text", "datatype": "BYTES", "shape": [n_inputs], "data": texts}]
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
        with LocalDeployment(args.bundle.resolve(), plan, spec, Path(tmp), port=args.port, base_port=args.port + 1) as dep:
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
                t0 = time.perf_counter()
                answer = post()
                elapsed = (time.perf_counter() - t0) * 1000
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
            worker = dep.procs[0].address
            before = _batch_totals(worker)
            a, b = [], []
            for _ in range(args.runs):
                a.append(in_process())
                b.append(via_router())
            after = _batch_totals(worker)
            worker_mean = 1000 * (after[0] - before[0]) / max(after[1] - before[1], 1)
            conn.close()
    p50_a, p50_b = statistics.median(a), statistics.median(b)
    p90_a, p90_b = np.percentile(a, 90), np.percentile(b, 90)
    result = {
        "batch": n_inputs, "bucket": args.bucket, "runs": args.runs, "client": "new-connection" if args.new_connection else "keep-alive",
        "ort_direct_p50_ms": round(p50_a, 3), "router_hop_p50_ms": round(p50_b, 3),
        "added_p50_ms": round(p50_b - p50_a, 3), "ratio_p50": round(p50_b / p50_a, 3),
        "ort_direct_p90_ms": round(float(p90_a), 3), "router_hop_p90_ms": round(float(p90_b), 3),
    }
    print(f"batch {n_inputs} at bucket {args.bucket}, {args.runs} runs each, alternating; client: "
          f"{'a new connection per request' if args.new_connection else 'one kept-alive connection'}")
    print(f"  ORT direct           p50 {p50_a:8.3f} ms   p90 {p90_a:8.3f} ms")
    print(f"  router + 1 split hop p50 {p50_b:8.3f} ms   p90 {p90_b:8.3f} ms")
    print(f"  added at p50: {p50_b - p50_a:.3f} ms   ratio {p50_b / p50_a:.3f}x")
    router_p50 = statistics.median(router_ms)
    result.update({"router_internal_p50_ms": round(router_p50, 3), "worker_batch_mean_ms": round(worker_mean, 3)})
    print(f"  segments: client - router {p50_b - router_p50:.3f} ms, router - worker batch {router_p50 - worker_mean:.3f} ms "
          f"(router's own latency p50 {router_p50:.3f} ms, worker batch mean {worker_mean:.3f} ms)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


def _batch_totals(address: str) -> tuple[float, float]:
    """(sum of batch seconds, batch count) from a worker's /metrics."""
    with urllib.request.urlopen(f"http://{address}/metrics") as resp:
        lines = resp.read().decode().splitlines()
    value = lambda name: float(next(line for line in lines if line.startswith(name)).split()[-1])  # noqa: E731
    return value("exitplan_worker_batch_seconds_sum"), value("exitplan_worker_batch_seconds_count")


if __name__ == "__main__":
    main()
