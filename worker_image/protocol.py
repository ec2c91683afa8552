"""The Open Inference Protocol (KServe v2) as the routers speak it: its routes, the bodies they answer,
and their HTTP responses.

Both routers (`classify/router.py:Router`, `generate/router.py:GenerationRouter`) serve the same route
table (`v2_routes`) from the same handler names (`V2Handlers`).

One place for the shape of every body a client reads: classification (`infer_response`, the
`label` / `scores` / `exit_ramp` outputs with `parameters.latency_ms`), generation
(`generate_response`, its server-sent events), model and server metadata, health, and errors
(`{"error": message}`, with Retry-After on overload). The bodies are TypedDicts built by plain
functions, serialised as before: orjson for the classification answer (the hot path: one dict, no
validation layer), `json` (aiohttp's `json_response`) for the rest. A classification answer whose
request asked for binary outputs (`infer_http_response`) follows the binary tensor extension: the
JSON header, then the raw tensors of those outputs, its length in `Inference-Header-Content-Length`.

Request decoding lives beside its router (`classify/decode.py`, `generate/routes.py`).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol, TypedDict

import numpy as np
import orjson
from aiohttp import web

from exitplan.api.bundle import BundleManifest
from exitplan.api.dtypes import by_numpy, by_v2

SERVER_NAME = "exitplan-router"
SERVER_VERSION = "0.1.0"
CLASSIFIER_PLATFORM = "exitplan-early-exit-onnx"
GENERATOR_PLATFORM = "exitplan-early-exit-generation"
BINARY_HEADER = "Inference-Header-Content-Length"
"""The binary tensor extension's header: the length in bytes of the JSON that starts the body."""
CLASSIFY_OUTPUTS = ("label", "scores", "exit_ramp")
"""The outputs of a classification answer, in order."""
"""Bundle tensor dtype -> the protocol's datatype name."""


class TensorSpec(TypedDict):
    name: str
    datatype: str
    shape: list[int]


class OutputTensor(TensorSpec):
    data: list[Any]


class InferResponse(TypedDict):
    model_name: str
    id: str
    outputs: list[OutputTensor]
    parameters: dict[str, Any]


class ModelMetadata(TypedDict):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    parameters: dict[str, Any]


class ServerMetadata(TypedDict):
    name: str
    version: str
    extensions: list[str]


class ErrorBody(TypedDict):
    error: str


class GenerateResponse(TypedDict):
    model_name: str
    text_output: str
    token_ids: list[int]
    exits: list[str]
    confidences: list[float]
    recomputed: int
    finish_reason: str
    threshold: float
    prompt_tokens: int
    first_token_seconds: float | None
    time_per_token_seconds: float | None
    total_seconds: float


class V2Handlers(Protocol):
    """The handlers of the routes every router serves on its inference port."""

    async def handle_infer(self, request: web.Request) -> web.Response: ...

    async def handle_model(self, request: web.Request) -> web.Response: ...

    async def handle_model_ready(self, request: web.Request) -> web.Response: ...

    async def handle_server(self, request: web.Request) -> web.Response: ...

    async def handle_live(self, request: web.Request) -> web.Response: ...

    async def handle_ready(self, request: web.Request) -> web.Response: ...

    async def handle_metrics(self, request: web.Request) -> web.Response: ...


def v2_routes(handlers: V2Handlers) -> list[web.RouteDef]:
    """POST /v2/models/{name}/infer, GET /v2/models/{name}, GET /v2/models/{name}/ready, GET /v2,
    GET /v2/health/live|ready, GET /metrics."""
    return [
        web.post("/v2/models/{name}/infer", handlers.handle_infer),
        web.get("/v2/models/{name}", handlers.handle_model),
        web.get("/v2/models/{name}/ready", handlers.handle_model_ready),
        web.get("/v2", handlers.handle_server),
        web.get("/v2/health/live", handlers.handle_live),
        web.get("/v2/health/ready", handlers.handle_ready),
        web.get("/metrics", handlers.handle_metrics),
    ]


class Token(Protocol):
    """A generated token as the generation bodies read it (`generate.decoder.TokenEvent`)."""

    @property
    def token_id(self) -> int: ...

    @property
    def text(self) -> str: ...

    @property
    def exit(self) -> str: ...

    @property
    def confidence(self) -> float: ...

    @property
    def recomputed(self) -> int: ...

    @property
    def seconds(self) -> float: ...


def tensor_spec(name: str, datatype: str, shape: Sequence[int]) -> TensorSpec:
    return {"name": name, "datatype": datatype, "shape": list(shape)}


# ---------------------------------------------------------------- classification


def infer_response(
    model_name: str, request_id: str, labels: list[str], scores: np.ndarray, ramps: list[str], latency_s: float
) -> InferResponse:
    """The answer to POST /v2/models/{name}/infer: per input its label, class scores ([n, classes],
    rounded to 6 places) and the exit ramp that answered it."""
    n = len(labels)
    return {
        "model_name": model_name,
        "id": request_id,
        "outputs": [
            {"name": "label", "datatype": "BYTES", "shape": [n], "data": labels},
            {
                "name": "scores",
                "datatype": "FP32",
                "shape": [n, scores.shape[1]],
                "data": scores.ravel().round(6).tolist(),
            },
            {"name": "exit_ramp", "datatype": "BYTES", "shape": [n], "data": ramps},
        ],
        "parameters": {"latency_ms": round(latency_s * 1000, 3)},
    }


def tensor_bytes(datatype: str, data: Sequence[Any]) -> bytes:
    """An output's values in binary form: raw little-endian numbers, or per BYTES element its 4-byte
    little-endian length and its UTF-8 bytes."""
    if datatype == "BYTES":
        encoded = [str(v).encode() for v in data]
        return b"".join(len(b).to_bytes(4, "little") + b for b in encoded)
    return np.asarray(data, dtype=np.dtype(by_v2(datatype).numpy).newbyteorder("<")).tobytes()


def infer_http_response(
    body: InferResponse, binary: Collection[str] = (), headers: dict[str, str] | None = None
) -> web.Response:
    """The HTTP answer of `body`: JSON, or with the outputs named in `binary` as binary tensors after
    the JSON header (each with `parameters.binary_data_size` instead of `data`, in output order)."""
    if not binary:
        return orjson_response(body, headers)
    outputs: list[dict[str, Any]] = []
    blobs = []
    for out in body["outputs"]:
        if out["name"] not in binary:
            outputs.append(dict(out))
            continue
        blobs.append(tensor_bytes(out["datatype"], out["data"]))
        spec = tensor_spec(out["name"], out["datatype"], out["shape"])
        outputs.append({**spec, "parameters": {"binary_data_size": len(blobs[-1])}})
    header = orjson.dumps({**body, "outputs": outputs}, option=orjson.OPT_SERIALIZE_NUMPY)
    return web.Response(
        body=header + b"".join(blobs),
        content_type="application/octet-stream",
        headers={**(headers or {}), BINARY_HEADER: str(len(header))},
    )


def classifier_metadata(manifest: BundleManifest, name: str, version: str, parameters: dict[str, Any]) -> ModelMetadata:
    """GET /v2/models/{name} of a classifier: text (with a tokenizer) or token ids in (or the bundle's
    fixed-size inputs), the infer outputs out; `parameters.accepts` says which in words."""
    if manifest.seq_axis is not None:
        ids = [tensor_spec("input_ids", "INT64", [-1, -1]), tensor_spec("attention_mask", "INT64", [-1, -1])]
        inputs = [tensor_spec("text", "BYTES", [-1]), *ids] if manifest.tokenizer else ids
        accepts = (
            "text, or input_ids with an optional attention_mask"
            if manifest.tokenizer
            else "input_ids only, with an optional attention_mask (the bundle has no tokenizer: prepare it with "
            "--tokenizer to send text)"
        )
    else:
        inputs = [
            tensor_spec(t.name, by_numpy(t.dtype).v2, [-1 if isinstance(d, str) else d for d in t.shape])
            for t in manifest.inputs
        ]
        accepts = ", ".join(t.name for t in manifest.inputs)
    parameters = {**parameters, "accepts": accepts}
    outputs = [
        tensor_spec("label", "BYTES", [-1]),
        tensor_spec("scores", "FP32", [-1, len(manifest.labels)]),
        tensor_spec("exit_ramp", "BYTES", [-1]),
    ]
    return {
        "name": name,
        "versions": [version],
        "platform": CLASSIFIER_PLATFORM,
        "inputs": inputs,
        "outputs": outputs,
        "parameters": parameters,
    }


# ---------------------------------------------------------------- generation


def generate_response(
    model_name: str,
    tokens: Sequence[Token],
    *,
    finish_reason: str,
    threshold: float,
    prompt_tokens: int,
    total_seconds: float,
) -> GenerateResponse:
    """The answer to POST /v2/models/{name}/generate (and the last event of generate_stream)."""
    steps = [t.seconds for t in tokens[1:]]
    return {
        "model_name": model_name,
        "text_output": "".join(t.text for t in tokens),
        "token_ids": [t.token_id for t in tokens],
        "exits": [t.exit for t in tokens],
        "confidences": [round(t.confidence, 6) for t in tokens],
        "recomputed": sum(t.recomputed for t in tokens),
        "finish_reason": finish_reason,
        "threshold": threshold,
        "prompt_tokens": prompt_tokens,
        "first_token_seconds": tokens[0].seconds if tokens else None,
        "time_per_token_seconds": sum(steps) / len(steps) if steps else None,
        "total_seconds": total_seconds,
    }


def generator_metadata(name: str, version: str, parameters: dict[str, Any]) -> ModelMetadata:
    """GET /v2/models/{name} of a generation service: a prompt in, text out."""
    return {
        "name": name,
        "versions": [version],
        "platform": GENERATOR_PLATFORM,
        "inputs": [tensor_spec("text_input", "BYTES", [1])],
        "outputs": [tensor_spec("text_output", "BYTES", [1])],
        "parameters": parameters,
    }


def sse_event(data: Mapping[str, object], event: str | None = None) -> bytes:
    """One server-sent event (`data: {json}`, after `event: <name>` when named)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n".encode()


# ---------------------------------------------------------------- server, health, errors


def server_metadata(extensions: list[str]) -> ServerMetadata:
    """GET /v2."""
    return {"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": extensions}


def error_body(message: str) -> ErrorBody:
    return {"error": message}


def error_response(status: int, message: str, retry_after: int | None = None) -> web.Response:
    """`{"error": message}` with the status; Retry-After (whole seconds) when the client should retry."""
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return web.json_response(error_body(message), status=status, headers=headers)


def live_response() -> web.Response:
    """GET /v2/health/live."""
    return web.json_response({"live": True})


def ready_response(ready: bool, reason: str = "") -> web.Response:
    """GET /v2/health/ready (and /v2/models/{name}/ready): 200 when ready, else 503 with the reason when known."""
    body: dict[str, Any] = {"ready": ready}
    if reason:
        body["reason"] = reason
    return web.json_response(body, status=200 if ready else 503)


def orjson_response(body: Any, headers: dict[str, str] | None = None) -> web.Response:
    """A JSON answer via orjson (numpy scalars and arrays serialise as their values)."""
    return web.Response(
        body=orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), content_type="application/json", headers=headers
    )
