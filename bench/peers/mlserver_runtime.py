"""Seldon MLServer running the full MiniLM model (run inside .bench-venvs/mlserver).

`FullMiniLMRuntime` is a custom `MLModel`: it decodes the V2 request's `text` input (BYTES), runs
the one ONNX session and answers label / scores / exit_ramp as exitplan's router does. MLServer's
adaptive batching is on (`max_batch_size`, `max_batch_time` in model-settings.json): it merges
concurrent requests into one `predict` call and splits the answer back; `parallel_workers`
inference processes (`--replicas`) each hold their own session.

    python -P bench/peers/mlserver_runtime.py --model M.onnx --port 8500 --replicas 2 --threads 1 \
        --max-batch-size 8 --max-batch-time-ms 5 --workdir /tmp/mlserver

writes the server's settings.json and model-settings.json into `--workdir` and runs `mlserver start` there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from mlserver import MLModel  # noqa: E402
from mlserver.codecs import NumpyCodec, StringCodec  # noqa: E402
from mlserver.types import InferenceRequest, InferenceResponse  # noqa: E402
from onnx_full import FullModel  # noqa: E402


class FullMiniLMRuntime(MLModel):
    async def load(self) -> bool:
        extra = (self.settings.parameters.extra if self.settings.parameters else None) or {}
        self.full = FullModel(extra["model"], int(extra.get("threads", 1)))
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        inputs = {i.name: i for i in payload.inputs}
        if "text" not in inputs:
            raise ValueError(f"send an input named 'text' (BYTES); got {sorted(inputs)}")
        texts = StringCodec.decode_input(inputs["text"])
        labels, scores, ramps = self.full.predict(texts)
        return InferenceResponse(
            model_name=self.name,
            id=payload.id,
            outputs=[
                StringCodec.encode_output("label", labels),
                NumpyCodec.encode_output("scores", scores),
                StringCodec.encode_output("exit_ramp", ramps),
            ],
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--name", default="minilm")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--max-batch-time-ms", type=float, default=5.0)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()
    workdir = Path(args.workdir)
    (workdir / args.name).mkdir(parents=True, exist_ok=True)
    settings = {
        "debug": False,
        "http_port": args.port,
        "grpc_port": args.port + 1,
        "metrics_port": args.port + 2,
        "parallel_workers": args.replicas,
        "host": "127.0.0.1",
    }
    (workdir / "settings.json").write_text(json.dumps(settings, indent=2))
    model_settings = {
        "name": args.name,
        "implementation": "mlserver_runtime.FullMiniLMRuntime",
        "max_batch_size": args.max_batch_size,
        "max_batch_time": args.max_batch_time_ms / 1000.0,
        "parameters": {"extra": {"model": str(Path(args.model).resolve()), "threads": args.threads}},
    }
    (workdir / args.name / "model-settings.json").write_text(json.dumps(model_settings, indent=2))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    mlserver = Path(sys.executable).with_name("mlserver")
    os.execve(str(mlserver), [str(mlserver), "start", str(workdir)], env)


if __name__ == "__main__":
    main()
