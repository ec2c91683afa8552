"""The Open Inference Protocol's binary tensor extension: request decoding, binary answers, the real
router (digits CNN bundle) and the load generator's binary bodies.

A binary body is the JSON request (its length in the `Inference-Header-Content-Length` header)
followed by the raw tensors of the inputs that declare `parameters.binary_data_size`, in their order.
"""

from __future__ import annotations

import asyncio
import json
import struct
from types import SimpleNamespace

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from dataplane_helpers import deployment, service_spec

from exitplan.api.bundle import BundleManifest, read_manifest
from exitplan.client.bench import run_bench
from exitplan.client.loadgen import replay
from exitplan.client.texts import (
    BINARY_HEADER,
    binary_body,
    binary_tensors_body,
    binary_text_body,
    build_inputs,
    load_pool,
    tensor_body,
    text_body,
)
from exitplan.localrun.service_setup import ServiceSetup, single_split_plan
from exitplan.worker_image import protocol
from exitplan.worker_image.classify.decode import BadRequest, decode_inputs, parse_request

# ---------------------------------------------------------------- helpers


def _manifest(inputs: dict[str, tuple[str, list]]) -> BundleManifest:
    """A fixed-size manifest with these inputs: name -> (dtype, shape)."""
    names = list(inputs)
    return BundleManifest.model_validate(
        {
            "name": "tiny",
            "task": "image-classification",
            "labels": ["a", "b"],
            "inputs": [{"name": n, "dtype": d, "shape": s} for n, (d, s) in inputs.items()],
            "blocks": [{"name": "b0", "file": "b0.onnx", "inputs": names, "outputs": ["h"]}],
            "ramps": [{"name": "head", "after": 0, "file": "head.onnx", "inputs": ["h"], "final": True}],
        }
    )


TEXT_MANIFEST = _manifest({"input_ids": ("int64", ["batch", "seq"])}).model_copy(
    update={"seq_axis": 1, "max_length": 16}
)


class _Tokenizer:
    """Token ids = [101, code points..., 102]: enough to tell texts apart."""

    def encode_batch(self, texts):
        return [SimpleNamespace(ids=[101, *(ord(c) % 30000 for c in t), 102]) for t in texts]


def _decode(raw: bytes, header: str | None, manifest: BundleManifest, tokenizer=None):
    return decode_inputs(parse_request(raw, header), manifest, tokenizer, [16], False)


def _binary(specs: list[dict], blobs: list[bytes], header: int | None = None) -> tuple[bytes, str]:
    """A body of the JSON `{"inputs": specs}` and `blobs`; header = the JSON's length unless given."""
    head = json.dumps({"inputs": specs}).encode()
    return head + b"".join(blobs), str(len(head) if header is None else header)


def _spec(name: str, datatype: str, shape: list[int], size: int, **extra) -> dict:
    return {"name": name, "datatype": datatype, "shape": shape, "parameters": {"binary_data_size": size}, **extra}


def _strings(*values: str) -> bytes:
    return b"".join(struct.pack("<I", len(v.encode())) + v.encode() for v in values)


def _split_answer(raw: bytes, header: str | None) -> dict[str, list]:
    """An infer answer's outputs (name -> flat values), JSON or binary (FP32 / BYTES)."""
    n = int(header) if header is not None else len(raw)
    doc = json.loads(raw[:n])
    offset, out = n, {}
    for o in doc["outputs"]:
        if "data" in o:
            out[o["name"]] = list(o["data"]) if o["datatype"] == "BYTES" else np.ravel(o["data"]).tolist()
            continue
        size = o["parameters"]["binary_data_size"]
        chunk = raw[offset : offset + size]
        offset += size
        if o["datatype"] == "BYTES":
            values, pos = [], 0
            while pos < len(chunk):
                (length,) = struct.unpack_from("<I", chunk, pos)
                values.append(chunk[pos + 4 : pos + 4 + length].decode())
                pos += 4 + length
            out[o["name"]] = values
        else:
            out[o["name"]] = np.frombuffer(chunk, dtype="<f4").tolist()
    assert offset == len(raw), "bytes left over after the binary outputs"
    return out


# ---------------------------------------------------------------- decoding binary requests


def test_a_binary_fp32_image_decodes_to_the_json_one_in_far_fewer_bytes():
    manifest = _manifest({"x": ("float32", ["batch", 3, 224, 224])})
    image = np.random.default_rng(0).standard_normal((3, 224, 224)).astype(np.float32)
    as_json = tensor_body("x", image)
    raw, headers = binary_tensors_body({"x": image})
    assert headers["Content-Type"] == "application/octet-stream"
    from_json = _decode(as_json, None, manifest).fixed["x"]
    from_binary = _decode(raw, headers[BINARY_HEADER], manifest).fixed["x"]
    assert from_binary.dtype == np.float32 and from_binary.shape == (1, 3, 224, 224)
    np.testing.assert_array_equal(from_binary, from_json)
    np.testing.assert_array_equal(from_binary[0], image)
    assert len(raw) < 3 * 224 * 224 * 4 + 200 < (1 << 20) < len(as_json)


def test_binary_bytes_texts_decode_to_the_json_ones():
    texts = ["great day", "héllo wörld ✓", "x"]
    spec = _spec("text", "BYTES", [3], len(_strings(*texts)))
    raw, header = _binary([spec], [_strings(*texts)])
    body = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [3], "data": texts}]}).encode()
    binary = _decode(raw, header, TEXT_MANIFEST, _Tokenizer())
    plain = _decode(body, None, TEXT_MANIFEST, _Tokenizer())
    assert binary.n == 3 and [t.tolist() for t in binary.tokens] == [t.tolist() for t in plain.tokens]
    np.testing.assert_array_equal(binary.lengths, plain.lengths)


def test_json_and_binary_inputs_mix_and_binary_ones_take_the_bytes_in_their_order():
    manifest = _manifest({"a": ("float32", ["batch", 2]), "b": ("uint8", ["batch", 3]), "c": ("int64", ["batch", 2])})
    b = np.array([[1, 2, 3], [4, 5, 255]], dtype=np.uint8)
    c = np.array([[-(2**40), 7], [0, 2**62]], dtype=np.int64)
    specs = [
        _spec("c", "INT64", [2, 2], c.nbytes),
        {"name": "a", "datatype": "FP32", "shape": [2, 2], "data": [0.5, 1.5, -2.0, 3.25]},
        _spec("b", "UINT8", [2, 3], b.nbytes),
    ]
    raw, header = _binary(specs, [c.astype("<i8").tobytes(), b.tobytes()])
    batch = _decode(raw, header, manifest)
    np.testing.assert_array_equal(batch.fixed["a"], [[0.5, 1.5], [-2.0, 3.25]])
    np.testing.assert_array_equal(batch.fixed["b"], b)
    np.testing.assert_array_equal(batch.fixed["c"], c)
    assert batch.fixed["c"].dtype == np.int64 and batch.n == 2


def test_binary_values_are_converted_and_checked_as_json_ones_are():
    """Narrower or wider datatypes convert the same way, and a bad value gets the JSON path's very message."""
    cases = [
        # (model dtype, datatype sent, values)
        ("float32", "FP32", [1.0, float("nan")]),
        ("float32", "FP64", [0.5, 1e39]),
        ("float16", "FP32", [1.0, 70000.0]),
        ("int32", "INT64", [1, 2**31]),
        ("int8", "INT16", [-129, 0]),
        ("bool", "BOOL", [1, 2]),
        ("float32", "UINT8", [3, 255]),  # no error: converted
        ("bool", "BOOL", [1, 0]),
        ("int64", "INT32", [-5, 2**31 - 1]),
    ]
    from exitplan.api.dtypes import by_v2

    for dtype, datatype, values in cases:
        manifest = _manifest({"x": (dtype, ["batch", 2])})
        spec = {"name": "x", "datatype": datatype, "shape": [1, 2]}
        wire = np.dtype("uint8" if datatype == "BOOL" else by_v2(datatype).numpy).newbyteorder("<")
        blob = np.asarray(values, dtype=wire).tobytes()
        raw, header = _binary([{**spec, "parameters": {"binary_data_size": len(blob)}}], [blob])
        try:  # the JSON path, from the parsed request (JSON text cannot hold NaN)
            expected = decode_inputs({"inputs": [{**spec, "data": values}]}, manifest, None, [1], False).fixed["x"]
        except BadRequest as err:
            with pytest.raises(BadRequest) as got:
                _decode(raw, header, manifest)
            assert str(got.value) == str(err), (dtype, datatype, values)
            continue
        got = _decode(raw, header, manifest).fixed["x"]
        assert got.dtype == expected.dtype and np.array_equal(got, expected), (dtype, datatype, values)


FLOATS = np.arange(4, dtype="<f4").tobytes()
MALFORMED = [
    # (specs, blobs, header override, text the 400 must hold)
    ([_spec("x", "FP32", [1, 4], 16)], [FLOATS], "sixteen", "Inference-Header-Content-Length must be the length"),
    ([_spec("x", "FP32", [1, 4], 16)], [FLOATS], "-3", "Inference-Header-Content-Length must be the length"),
    ([_spec("x", "FP32", [1, 4], 16)], [FLOATS], "100000", "past the end of the body"),
    ([_spec("x", "FP32", [1, 4], 12)], [FLOATS[:12]], None, "binary_data_size is 12 bytes, but 4 FP32 values"),
    ([_spec("x", "FP32", [1, 4], 20)], [FLOATS + FLOATS[:4]], None, "binary_data_size is 20 bytes, but 4 FP32"),
    ([_spec("x", "FP32", [2**32, 2**32], 0)], [], None, "binary_data_size is 0 bytes, but 18446744073709551616"),
    ([_spec("x", "FP32", [1, 4], 16)], [FLOATS[:10]], None, "run past the end of the body"),
    ([_spec("x", "FP32", [1, 4], 16)], [FLOATS + b"\0\0"], None, "holds 18 bytes after the JSON header"),
    ([_spec("x", "FP32", [1, 4], 16, data=[0.0] * 4)], [FLOATS], None, "also has data"),
    ([_spec("x", "FP32", [1, 4], "16")], [FLOATS], None, "binary_data_size must be a number of bytes"),
    ([_spec("x", "FP32", [1, 4], -1)], [FLOATS], None, "binary_data_size must be a number of bytes"),
    ([_spec("x", "FP99", [1, 4], 16)], [FLOATS], None, "datatype 'FP99' is not supported"),
    ([_spec("x", "FP32", [1, -4], 16)], [FLOATS], None, "shape must be a list of non-negative integers"),
    ([_spec("x", "FP32", [2, 2], 16)], [FLOATS], None, "input 'x' has shape [2, 2]; expected"),
    ([{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [0.0] * 4}], [b"\0"], None, "holds 1 bytes after"),
]


@pytest.mark.parametrize("specs, blobs, header, reason", MALFORMED)
def test_malformed_binary_requests_are_bad_requests_with_a_reason(specs, blobs, header, reason):
    raw, length = _binary(specs, blobs)
    with pytest.raises(BadRequest) as err:
        _decode(raw, header if header is not None else length, _manifest({"x": ("float32", ["batch", 4])}))
    assert reason in str(err.value), str(err.value)


def test_malformed_binary_strings_and_headers_are_bad_requests_with_a_reason():
    def fails(raw: bytes, header: str | None, reason: str) -> None:
        with pytest.raises(BadRequest) as err:
            _decode(raw, header, TEXT_MANIFEST, _Tokenizer())
        assert reason in str(err.value), str(err.value)

    two = _strings("ab", "cd")
    fails(*_binary([_spec("text", "BYTES", [3], len(two))], [two]), "ends before element 2 of 3")
    fails(*_binary([_spec("text", "BYTES", [1], len(two))], [two]), "its 1 BYTES elements take 6")
    bad = struct.pack("<I", 50) + b"ab"
    fails(*_binary([_spec("text", "BYTES", [1], len(bad))], [bad]), "element 0 (BYTES) declares 50 bytes")
    latin = struct.pack("<I", 2) + b"\xe9t"
    fails(*_binary([_spec("text", "BYTES", [1], len(latin))], [latin]), "is not UTF-8 text")
    raw, _ = _binary([_spec("text", "BYTES", [2], len(two))], [two])
    fails(raw, None, "not valid JSON: unexpected content after document")
    fails(raw, None, "a body with binary tensors needs the Inference-Header-Content-Length header")
    body = json.dumps({"inputs": [_spec("text", "BYTES", [0], 0)]}).encode()
    fails(body, None, "declares binary_data_size but the request has no Inference-Header-Content-Length header")
    fails(b"{not json" + two, "9", "the first 9 bytes of the body (Inference-Header-Content-Length) are not valid")
    fails(b'{"inputs": 3}' + two, "13", "no input declares binary data")


def test_a_header_with_no_binary_input_is_plain_json():
    body = text_body("hello")
    batch = _decode(body, str(len(body)), TEXT_MANIFEST, _Tokenizer())
    assert batch.n == 1 and batch.binary_outputs == frozenset()


# ---------------------------------------------------------------- binary answers


def test_binary_outputs_are_chosen_per_request_and_per_output():
    manifest = _manifest({"x": ("float32", ["batch", 2])})
    inputs = [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [0.0, 1.0]}]

    def chosen(**body) -> frozenset[str]:
        return decode_inputs({"inputs": inputs, **body}, manifest, None, [1], False).binary_outputs

    assert chosen() == frozenset()
    assert chosen(parameters={"binary_data_output": True}) == {"label", "scores", "exit_ramp"}
    assert chosen(outputs=[{"name": "scores", "parameters": {"binary_data": True}}]) == {"scores"}
    mixed = chosen(
        parameters={"binary_data_output": True}, outputs=[{"name": "label", "parameters": {"binary_data": False}}]
    )
    assert mixed == {"scores", "exit_ramp"}
    for body, reason in [
        ({"parameters": {"binary_data_output": "yes"}}, 'binary_data_output" must be true or false'),
        ({"outputs": [{"name": "logits"}]}, "output 'logits' is not one of"),
        ({"outputs": [{"name": "scores", "parameters": {"binary_data": 1}}]}, "binary_data must be true or false"),
        ({"outputs": {"name": "scores"}}, '"outputs" must be a list'),
    ]:
        with pytest.raises(BadRequest, match=reason):
            chosen(**body)


def test_a_binary_answer_holds_the_json_answers_values():
    scores = np.array([[0.25, 0.75], [0.9, 0.1]], dtype=np.float32)
    body = protocol.infer_response("m", "id-1", ["b", "ä"], scores, ["ramp0", "final"], 0.0123)
    plain = protocol.infer_http_response(body, (), headers={"Server-Timing": "router;dur=1"})
    assert plain.content_type == "application/json" and protocol.BINARY_HEADER not in plain.headers
    binary = protocol.infer_http_response(body, {"scores", "label"}, headers={"Server-Timing": "router;dur=1"})
    assert binary.content_type == "application/octet-stream" and binary.headers["Server-Timing"] == "router;dur=1"
    assert isinstance(binary.body, bytes)
    header = binary.headers[protocol.BINARY_HEADER]
    doc = json.loads(binary.body[: int(header)])
    assert [o["name"] for o in doc["outputs"]] == ["label", "scores", "exit_ramp"]
    assert doc["outputs"][1] == {
        "name": "scores",
        "datatype": "FP32",
        "shape": [2, 2],
        "parameters": {"binary_data_size": 16},
    }
    assert doc["outputs"][2]["data"] == ["ramp0", "final"] and doc["parameters"] == {"latency_ms": 12.3}
    got, want = _split_answer(binary.body, header), _split_answer(plain.body, None)
    assert got["label"] == want["label"] == ["b", "ä"] and got["exit_ramp"] == want["exit_ramp"]
    np.testing.assert_allclose(got["scores"], want["scores"], rtol=1e-7)


# ---------------------------------------------------------------- the load generator's bodies


@pytest.mark.slow
def test_load_generator_binary_bodies_round_trip_through_decode(digits_bundle):
    pool = load_pool(digits_bundle)
    manifest = read_manifest(digits_bundle)
    as_json = build_inputs(pool, [1] * 12, max_length=1, seed=3)
    as_binary = build_inputs(pool, [1] * 12, max_length=1, seed=3, binary=True)
    assert as_json.headers == [] and len(as_binary.headers) == 12
    assert as_binary.parts == as_json.parts and as_binary.reference == as_json.reference
    for body, headers, plain in zip(as_binary.bodies, as_binary.headers, as_json.bodies):
        assert headers["Content-Type"] == "application/octet-stream" and len(body) < len(plain)
        got = _decode(body, headers[BINARY_HEADER], manifest).fixed["x"]
        np.testing.assert_array_equal(got, _decode(plain, None, manifest).fixed["x"])


def test_load_generator_binary_text_and_bool_bodies_round_trip_through_decode():
    raw, headers = binary_text_body("héllo ✓")
    batch = _decode(raw, headers[BINARY_HEADER], TEXT_MANIFEST, _Tokenizer())
    assert batch.tokens[0].tolist() == _Tokenizer().encode_batch(["héllo ✓"])[0].ids
    manifest = _manifest({"x": ("float32", ["batch", 2]), "keep": ("bool", ["batch", 3])})
    arrays = {"x": np.array([1.5, -2.0], dtype=np.float32), "keep": np.array([True, False, True])}
    raw, headers = binary_tensors_body(arrays)
    batch = _decode(raw, headers[BINARY_HEADER], manifest)
    np.testing.assert_array_equal(batch.fixed["keep"], [[True, False, True]])
    np.testing.assert_array_equal(batch.fixed["x"], [[1.5, -2.0]])
    raw, headers = binary_body([("x", "FP32", [1, 2], np.array([1.0, 2.0], dtype="<f4").tobytes())])
    assert json.loads(raw[: int(headers[BINARY_HEADER])])["inputs"][0]["parameters"] == {"binary_data_size": 8}


async def test_replay_sends_each_requests_own_headers():
    seen: list[tuple[str | None, str | None, int]] = []

    async def infer(request: web.Request) -> web.Response:
        raw = await request.read()
        seen.append((request.headers.get("Content-Type"), request.headers.get(BINARY_HEADER), len(raw)))
        return web.json_response(
            {
                "outputs": [
                    {"name": "label", "datatype": "BYTES", "shape": [1], "data": ["a"]},
                    {"name": "scores", "datatype": "FP32", "shape": [1, 1], "data": [1.0]},
                    {"name": "exit_ramp", "datatype": "BYTES", "shape": [1], "data": ["final"]},
                ]
            }
        )

    app = web.Application()
    app.router.add_post("/v2/models/{name}/infer", infer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    try:
        binary, extra = binary_text_body("hi")
        outcomes = await replay(
            f"http://127.0.0.1:{port}", "m", [text_body("hi"), binary], [0.0, 0.0], headers=[{}, extra]
        )
    finally:
        await runner.cleanup()
    assert [o.kind for o in outcomes] == ["ok", "ok"]
    assert sorted(seen, key=str) == [
        ("application/json", None, len(text_body("hi"))),
        ("application/octet-stream", extra[BINARY_HEADER], len(binary)),
    ]
    with pytest.raises(ValueError, match="header sets"):
        await replay("http://127.0.0.1:9", "m", [binary], [0.0], headers=[])


# ---------------------------------------------------------------- a real router and worker

LIMIT = 4096
"""The service's router.maxBodyBytes in these tests (the smallest the resource accepts is 1024)."""


@pytest.fixture(scope="module")
def digits_served(digits_bundle, tmp_path_factory):
    manifest = read_manifest(digits_bundle)
    spec = service_spec(digits_bundle, slo_ms=500.0, max_body=LIMIT)
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"name": "digits"})})
    setup = ServiceSetup("binary-digits", spec, digits_bundle, manifest)
    plan = single_split_plan(
        setup, thresholds={r.name: 0.9 for r in manifest.exit_ramps()}, replicas=1, batch_size=8, reason="binary test"
    )
    with deployment(digits_bundle, plan, spec, tmp_path_factory.mktemp("binary")) as dep:
        yield dep


async def _post(url: str, data, headers: dict[str, str] | None = None) -> tuple[int, bytes, str | None]:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v2/models/digits/infer", data=data, headers=headers or {}) as resp:
            return resp.status, await resp.read(), resp.headers.get(BINARY_HEADER)


def _images(digits_bundle, n: int) -> np.ndarray:
    with np.load(digits_bundle / "data" / "heldout.npz") as data:
        return np.asarray(data["x"][:n], dtype=np.float32)


@pytest.mark.slow
async def test_the_router_answers_a_binary_request_as_it_answers_the_json_one(digits_served, digits_bundle):
    images = _images(digits_bundle, 4)
    specs = [{"name": "x", "datatype": "FP32", "shape": [4, 1, 8, 8]}]
    as_json = json.dumps({"inputs": [{**specs[0], "data": images.ravel().tolist()}]}).encode()
    raw, header = _binary([{**specs[0], "parameters": {"binary_data_size": images.nbytes}}], [images.tobytes()])
    status, plain, no_header = await _post(digits_served.url, as_json, {"Content-Type": "application/json"})
    assert status == 200 and no_header is None, plain
    status, binary, _ = await _post(
        digits_served.url, raw, {"Content-Type": "application/octet-stream", BINARY_HEADER: header}
    )
    assert status == 200, binary
    want, got = _split_answer(plain, None), _split_answer(binary, None)
    assert got["label"] == want["label"] and got["exit_ramp"] == want["exit_ramp"]
    np.testing.assert_allclose(got["scores"], want["scores"], atol=2e-6)
    # binary outputs too: the same values after the JSON header
    both = json.dumps(
        {
            "inputs": [{**specs[0], "parameters": {"binary_data_size": images.nbytes}}],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    status, answer, answer_header = await _post(
        digits_served.url, both + images.tobytes(), {BINARY_HEADER: str(len(both))}
    )
    assert status == 200 and answer_header is not None, answer
    got = _split_answer(answer, answer_header)
    assert got["label"] == want["label"] and got["exit_ramp"] == want["exit_ramp"]
    np.testing.assert_allclose(got["scores"], want["scores"], atol=2e-6)


@pytest.mark.slow
async def test_the_router_refuses_bad_and_oversized_binary_bodies(digits_served):
    noise = np.random.default_rng(1).random((8, 1, 8, 8), dtype=np.float32)
    spec = {"name": "x", "datatype": "FP32", "shape": [8, 1, 8, 8]}
    raw, header = _binary([{**spec, "parameters": {"binary_data_size": noise.nbytes}}], [noise.tobytes()])
    as_json = json.dumps({"inputs": [{**spec, "data": noise.ravel().tolist()}]}).encode()
    assert len(raw) <= LIMIT < len(as_json)  # 8 images fit the limit only in binary form
    status, answer, _ = await _post(digits_served.url, raw, {BINARY_HEADER: header})
    assert status == 200, answer
    assert (await _post(digits_served.url, as_json))[0] == 413
    # past the limit in binary form too: by Content-Length, and streamed (chunked, no Content-Length)
    big = np.zeros((20, 1, 8, 8), dtype=np.float32)
    spec20 = {**spec, "shape": [20, 1, 8, 8], "parameters": {"binary_data_size": big.nbytes}}
    raw20, header20 = _binary([spec20], [big.tobytes()])
    status, answer, _ = await _post(digits_served.url, raw20, {BINARY_HEADER: header20})
    assert status == 413 and b"over the limit of 4096" in answer, answer

    async def pieces(body: bytes, size: int = 700):
        for start in range(0, len(body), size):
            await asyncio.sleep(0.01)  # each piece arrives on its own: the router must read to the end
            yield body[start : start + size]

    status, answer, _ = await _post(digits_served.url, pieces(raw20), {BINARY_HEADER: header20})
    assert status == 413, answer
    status, answer, _ = await _post(digits_served.url, pieces(raw), {BINARY_HEADER: header})
    assert status == 200, answer
    # malformed: a 400 that says why
    status, answer, _ = await _post(digits_served.url, raw[:-4], {BINARY_HEADER: header})
    assert status == 400 and "run past the end of the body" in json.loads(answer)["error"]
    status, answer, _ = await _post(digits_served.url, raw, {BINARY_HEADER: "12abc"})
    assert status == 400 and "Inference-Header-Content-Length must be" in json.loads(answer)["error"]


@pytest.mark.slow
def test_bench_binary_sends_its_requests_in_binary_form_and_each_is_answered(
    digits_served, digits_bundle, shared_trace
):
    report = run_bench(
        digits_served.url, "digits", digits_bundle, rps=20.0, limit=24, slo_ms=500.0, seed=2, binary=True
    )
    assert report.requests == 24 and report.lost == 0
    assert report.errors["bad_request"] == 0 and report.errors["invalid"] == 0, report.error_samples
    assert report.results > 0 and report.run["binary"] is True
