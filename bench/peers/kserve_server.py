"""KServe's Python model server running the full MiniLM model (run inside .bench-venvs/kserve).

A custom `kserve.Model` whose `predict` takes the V2 (Open Inference Protocol) request's `text`
input and answers label / scores / exit_ramp, as exitplan's router does. KServe's Python server has
no batching of its own (its batcher is the InferenceService agent sidecar, not part of this server),
so each request runs alone; `--replicas` uvicorn worker processes (KServe's `workers`) serve in
parallel, each with its own ONNX Runtime session.

    python -P bench/peers/kserve_server.py --model M.onnx --port 8500 --replicas 2 --threads 1
"""

from __future__ import annotations

import argparse
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

_ARGS = argparse.ArgumentParser()
_ARGS.add_argument("--model", required=True)
_ARGS.add_argument("--name", default="minilm")
_ARGS.add_argument("--port", type=int, required=True)
_ARGS.add_argument("--replicas", type=int, default=1)
_ARGS.add_argument("--threads", type=int, default=1)
if __name__ == "__main__":
    ARGS = _ARGS.parse_args()
    sys.argv = sys.argv[:1]  # kserve parses the command line when imported: give it none of ours

from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer  # noqa: E402
from onnx_full import FullModel  # noqa: E402


class FullMiniLM(Model):
    def __init__(self, name: str, path: str, threads: int) -> None:
        super().__init__(name)
        self.path, self.threads = path, threads
        self.full: FullModel | None = None

    def load(self) -> bool:
        self.full = FullModel(self.path, self.threads)
        self.ready = True
        return self.ready

    # KServe's worker processes are spawned with the model pickled: each loads its own session.
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["full"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.full = FullModel(self.path, self.threads)

    def predict(self, payload: InferRequest, headers: dict[str, str] | None = None) -> InferResponse:
        assert self.full is not None
        inputs = {i.name: i for i in payload.inputs}
        if "text" not in inputs:
            raise ValueError(f"send an input named 'text' (BYTES); got {sorted(inputs)}")
        texts = [t.decode() if isinstance(t, bytes) else str(t) for t in inputs["text"].data]
        labels, scores, ramps = self.full.predict(texts)
        n = len(texts)
        outputs = [
            InferOutput("label", [n], "BYTES", labels),
            InferOutput("scores", list(scores.shape), "FP32", scores.ravel().tolist()),
            InferOutput("exit_ramp", [n], "BYTES", ramps),
        ]
        return InferResponse(payload.id or str(uuid.uuid4()), self.name, infer_outputs=outputs)


def main(args: argparse.Namespace) -> None:
    model = FullMiniLM(args.name, args.model, args.threads)
    model.load()
    ModelServer(http_port=args.port, workers=args.replicas, enable_grpc=False, enable_latency_logging=False).start(
        [model]
    )


if __name__ == "__main__":
    main(ARGS)
