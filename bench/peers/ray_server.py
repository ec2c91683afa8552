"""Ray Serve running the full MiniLM model (run inside .bench-venvs/ray).

One deployment, `--replicas` replicas (one CPU each), each with its own ONNX Runtime session. Its
HTTP adapter takes the same V2 (Open Inference Protocol) JSON as exitplan's router and the other
peers (POST /v2/models/NAME/infer with a BYTES `text` input; GET /v2/health/ready) and answers
label / scores / exit_ramp. Each text goes through `@serve.batch` (`--max-batch-size`,
`--max-batch-time-ms`), which runs the texts that arrive together in one session call.

    python -P bench/peers/ray_server.py --model M.onnx --port 8500 --replicas 2 --threads 1 \
        --max-batch-size 8 --max-batch-time-ms 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import ray  # noqa: E402
from ray import serve  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse  # noqa: E402


@serve.deployment
class FullMiniLM:
    def __init__(self, model: str, name: str, threads: int, max_batch_size: int, max_batch_time_s: float) -> None:
        sys.path.insert(0, str(HERE))
        from onnx_full import FullModel

        self.full = FullModel(model, threads)
        self.name = name
        self.infer.set_max_batch_size(max_batch_size)
        self.infer.set_batch_wait_timeout_s(max_batch_time_s)

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.005)
    async def infer(self, texts: list[str]) -> list[tuple]:
        labels, scores, ramps = self.full.predict(texts)
        return list(zip(labels, scores, ramps))

    async def __call__(self, request: Request) -> JSONResponse:
        from onnx_full import v2_outputs, v2_texts

        path = request.url.path.rstrip("/")
        if request.method == "GET" and path in ("/v2/health/ready", "/v2/health/live", f"/v2/models/{self.name}/ready"):
            return JSONResponse({"ready": True})
        if request.method != "POST" or path != f"/v2/models/{self.name}/infer":
            return JSONResponse({"error": f"no route {request.method} {path}"}, status_code=404)
        try:
            body = await request.json()
            texts = v2_texts(body)
        except ValueError as err:
            return JSONResponse({"error": str(err)}, status_code=400)
        rows = await asyncio.gather(*(self.infer(t) for t in texts))
        import numpy as np

        outputs = v2_outputs([r[0] for r in rows], np.stack([r[1] for r in rows]), [r[2] for r in rows])
        return JSONResponse({"model_name": self.name, "id": body.get("id") or str(uuid.uuid4()), "outputs": outputs})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--name", default="minilm")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--max-batch-time-ms", type=float, default=5.0)
    args = parser.parse_args()

    def stop(*_) -> None:  # SIGTERM: leave through SystemExit so that ray.shutdown() stops Ray's processes
        raise SystemExit(0)

    ray.init(
        num_cpus=max(args.replicas, os.cpu_count() or 1),
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(HERE)}},
        log_to_driver=False,
    )
    signal.signal(signal.SIGTERM, stop)  # after ray.init, which installs a handler of its own
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        app = FullMiniLM.options(
            num_replicas=args.replicas,
            max_ongoing_requests=max(4 * args.max_batch_size, 32),
            ray_actor_options={"num_cpus": 1},
        ).bind(
            str(Path(args.model).resolve()), args.name, args.threads, args.max_batch_size, args.max_batch_time_ms / 1000
        )
        serve.run(app, name=args.name, route_prefix="/")
        print(f"ray serve ready on 127.0.0.1:{args.port}", flush=True)
        while True:
            time.sleep(1)
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
