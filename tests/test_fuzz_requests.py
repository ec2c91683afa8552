"""A fuzz corpus against a real router and its workers: no client input ever gets a 5xx.

Two deployments serve it: the MiniLM text bundle (texts, token ids, masks) and the fragile fixed-size
bundle (`fragile_bundle`: FP32 `x`, UINT8 `code`, a model that refuses codes of 200 and above). The
corpus holds every malformed request the tracker issue names — out-of-vocabulary ids, integers past
their dtype, non-finite and out-of-range floats, wrong shapes and datatypes, missing and unknown
inputs, bodies that are not JSON or not an object, huge nesting, more inputs than the router ever
admits, BYTES that are not UTF-8 — and a few hundred random mutations of valid requests (fixed seed).
Issue 28 added the other ways a body arrives (fuzz_encodings.py): gzip, deflate and raw deflate (valid,
corrupt, truncated, with data after the end, bombs that inflate past the body limit, codings not taken),
chunked bodies (valid, and malformed chunks), inputs whose scores are not finite (422), the request `id`
echoed; each mutation goes out plain, gzip, deflate or chunked, and 120 valid bodies go out with their
compressed stream or their chunks damaged at random. Every answer must be below 500, come before the
connection closes, and every 4xx a JSON body whose "error" says why. Figures (one run): 66 corpus +
22 encoded corpus + 300 mutations + 120 damaged = 508 cases (225 of the mutations gzip, deflate or chunked), 0 x 5xx, 0 unanswered.
"""

from __future__ import annotations

import copy
import json
import random
import struct

import aiohttp
import fuzz_encodings as enc
import pytest
from dataplane_helpers import deployment, one_cell_plan, service_spec
from fragile_bundle import fragile_bundle, fragile_request

from exitplan.api.bundle import read_manifest
from exitplan.worker_image.protocol import BINARY_HEADER

pytestmark = pytest.mark.slow

MUTATIONS = 300
DAMAGED = 120
MAX_INFLIGHT = 4096
"""The router's default limit on inputs in flight (the service's router.maxQueue)."""


@pytest.fixture(scope="module")
def text_served(minilm_bundle, tmp_path_factory):
    plan = one_cell_plan("minilm", len(read_manifest(minilm_bundle).blocks), 128, batch=8)
    with deployment(minilm_bundle, plan, service_spec(minilm_bundle), tmp_path_factory.mktemp("fuzz-text")) as dep:
        yield dep


@pytest.fixture(scope="module")
def fixed_served(tmp_path_factory):
    bundle = fragile_bundle(tmp_path_factory.mktemp("fuzz-fragile"))
    spec = service_spec(bundle)
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"name": "fragile"})})
    plan = one_cell_plan("fragile", 1, 1, batch=8)
    with deployment(bundle, plan, spec, tmp_path_factory.mktemp("fuzz-fragile-run")) as dep:
        yield dep


def _ids(data, shape, datatype="INT64") -> dict:
    return {"inputs": [{"name": "input_ids", "datatype": datatype, "shape": shape, "data": data}]}


def _text(data, shape=None, datatype="BYTES") -> dict:
    shape = [len(data)] if shape is None else shape
    return {"inputs": [{"name": "text", "datatype": datatype, "shape": shape, "data": data}]}


def _x(data, shape=(1, 4), datatype="FP32") -> dict:
    body = fragile_request([0.0, 0.0, 0.0, 0.0], 1)
    body["inputs"][0] = {"name": "x", "datatype": datatype, "shape": list(shape), "data": data}
    return body


def _binary_text(chunk: bytes, count: int = 1) -> tuple[bytes, dict]:
    spec = {"name": "text", "datatype": "BYTES", "shape": [count], "parameters": {"binary_data_size": len(chunk)}}
    head = json.dumps({"inputs": [spec]}).encode()
    return head + chunk, {BINARY_HEADER: str(len(head))}


VALID_TEXT = _text(["what a lovely ride", "not my day"])
VALID_IDS = {
    "inputs": [
        {"name": "input_ids", "datatype": "INT64", "shape": [1, 4], "data": [101, 2054, 1037, 102]},
        {"name": "attention_mask", "datatype": "INT64", "shape": [1, 4], "data": [1, 1, 1, 1]},
    ]
}
VALID_FIXED = fragile_request([0.5, -1.0, 2.0, 0.0], 17)
TEXT_JSON = json.dumps(VALID_TEXT).encode()
NAN_LITERAL = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[NaN,0,0,0]}]}'
HUGE_LITERAL = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1e999,0,0,0]}]}'
LONE_SURROGATE = b'{"inputs":[{"name":"text","datatype":"BYTES","shape":[1],"data":["\\ud800"]}]}'
NOT_UTF8 = b'{"inputs":[{"name":"text","datatype":"BYTES","shape":[1],"data":["\xff\xfe"]}]}'
DEEP = b'{"inputs":[{"name":"input_ids","datatype":"INT64","shape":[1,1],"data":%s}]}' % (
    b"[" * 100_000 + b"1" + b"]" * 100_000
)
MASK_2 = {
    "inputs": [*_ids([[101, 102]], [1, 2])["inputs"], {**_ids([[1, 2]], [1, 2])["inputs"][0], "name": "attention_mask"}]
}
PIXELS = {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1], "data": [0]}]}
NO_DATA = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1]}]}

# (name, target, body: object (sent as JSON) or bytes, headers, expected status, phrase in the error)
CORPUS = [
    ("out-of-vocabulary id", "text", _ids([[101, 999999, 102]], [1, 3]), {}, 400, "vocabulary of 30522"),
    ("negative token id", "text", _ids([[101, -7, 102]], [1, 3]), {}, 400, "token ids in [0, 30521]"),
    ("token id 2^63", "text", _ids([[101, 2**63, 102]], [1, 3]), {}, 400, "out of range"),
    ("INT64 2^64-1", "text", _ids([[101, 2**64 - 1]], [1, 2]), {}, 400, "out of range"),
    ("INT32 2^40", "text", _ids([[101, 2**40]], [1, 2], "INT32"), {}, 400, "INT32"),
    ("token id as float", "text", _ids([[101, 2.5]], [1, 2]), {}, 400, "not an integer"),
    ("token ids FP32", "text", _ids([[101.0, 102.0]], [1, 2], "FP32"), {}, 400, "FP32"),
    ("mask value 2", "text", MASK_2, {}, 400, "not 0 or 1"),
    ("UINT8 -1", "fixed", fragile_request([0, 0, 0, 0], -1), {}, 400, "UINT8"),
    ("UINT8 300", "fixed", fragile_request([0, 0, 0, 0], 300), {}, 400, "[0, 255]"),
    ("FP32 1e39", "fixed", _x([1e39, 0, 0, 0]), {}, 400, "out of range"),
    ("FP32 NaN string", "fixed", _x(["NaN", 0, 0, 0]), {}, 400, "not a number"),
    ("FP32 Infinity string", "fixed", _x(["Infinity", 0, 0, 0]), {}, 400, "not a number"),
    ("FP32 NaN literal", "fixed", NAN_LITERAL, {}, 400, "JSON"),
    ("FP32 1e999 literal", "fixed", HUGE_LITERAL, {}, 400, ""),
    ("FP64 to FP32 past range", "fixed", _x([3.5e38, 0, 0, 0], datatype="FP64"), {}, 400, "out of range"),
    ("wrong shape", "fixed", _x([0, 0, 0, 0], shape=(2, 2)), {}, 400, "expected"),
    ("shape/data mismatch", "fixed", _x([0, 0, 0], shape=(1, 4)), {}, 400, "needs 4 values"),
    ("negative shape", "text", _text(["hi"], shape=[-1]), {}, 400, "non-negative"),
    ("boolean in shape", "fixed", _x([0, 0, 0, 0], shape=(1, True, 4)), {}, 400, "non-negative integers"),
    ("shape not a list", "text", _text(["hi"], shape="1"), {}, 400, "shape"),
    ("text shape [1, 1]", "text", _text(["hi"], shape=[1, 1]), {}, 400, "shape [n]"),
    ("wrong datatype name", "fixed", _x([0, 0, 0, 0], datatype="FLOAT32"), {}, 400, "not supported"),
    ("lower-case datatype", "text", _ids([[101, 102]], [1, 2], "int64"), {}, 400, "INT64"),
    ("datatype a list", "fixed", _x([0, 0, 0, 0], datatype=["FP32"]), {}, 400, "not supported"),
    ("text not BYTES", "text", _text(["hi"], datatype="FP32"), {}, 400, "BYTES"),
    ("missing input", "fixed", {"inputs": fragile_request([0, 0, 0, 0], 1)["inputs"][:1]}, {}, 400, "'code'"),
    ("unknown input", "text", PIXELS, {}, 400, "no input named"),
    ("input without data", "text", NO_DATA, {}, 400, "'data'"),
    ("input sent twice", "text", {"inputs": VALID_TEXT["inputs"] * 2}, {}, 400, "twice"),
    ("text and ids", "text", {"inputs": VALID_TEXT["inputs"] + VALID_IDS["inputs"][:1]}, {}, 400, "not both"),
    ("empty inputs list", "text", {"inputs": []}, {}, 400, "non-empty"),
    ("inputs an object", "text", {"inputs": {"text": "hi"}}, {}, 400, "non-empty"),
    ("input not an object", "text", {"inputs": [1]}, {}, 400, "object"),
    ("non-JSON", "text", b"not json at all", {}, 400, "not valid JSON"),
    ("not UTF-8 at all", "text", b"\xff\xfe\x00", {}, 400, "not valid JSON"),
    ("JSON array", "text", [], {}, 400, "JSON object"),
    ("JSON string", "text", "inputs", {}, 400, "JSON object"),
    ("JSON number", "text", 7, {}, 400, "JSON object"),
    ("JSON null", "text", None, {}, 400, "JSON object"),
    ("empty body", "text", b"", {}, 400, "not valid JSON"),
    ("deep nesting", "text", DEEP, {}, 400, ""),
    ("nesting past numpy's dims", "text", _ids(json.loads("[" * 80 + "1" + "]" * 80), [1, 1]), {}, 400, ""),
    ("ragged data", "text", _ids([[101, 102], [101]], [2, 2]), {}, 400, ""),
    ("ragged texts", "text", _text([["a", "b"], ["c"]], shape=[2]), {}, 400, ""),
    ("huge flat ids", "text", _ids([1] * 200_000, [1, 200_000]), {}, 400, "largest bucket"),
    ("huge shape", "text", _ids([101, 102], [10**12, 10**12]), {}, 400, "needs"),
    ("empty texts", "text", _text([]), {}, 400, "n >= 1"),
    ("blank text", "text", _text(["   "]), {}, 400, "empty"),
    ("text a number", "text", _text([42]), {}, 400, "not a string"),
    ("text too long", "text", _text(["word " * 400]), {}, 400, "largest bucket"),
    ("lone surrogate", "text", LONE_SURROGATE, {}, 400, ""),
    ("non-UTF-8 in a JSON string", "text", NOT_UTF8, {}, 400, "JSON"),
    ("binary BYTES not UTF-8", "text", *_binary_text(struct.pack("<I", 2) + b"\xff\xfe"), 400, "not UTF-8"),
    ("binary BYTES past the end", "text", *_binary_text(struct.pack("<I", 99) + b"hi"), 400, "past"),
    ("binary header not a number", "text", TEXT_JSON, {BINARY_HEADER: "abc"}, 400, BINARY_HEADER),
    ("binary header past the body", "text", TEXT_JSON, {BINARY_HEADER: "99999"}, 400, "past the end"),
    ("parameters not an object", "text", {**VALID_TEXT, "parameters": [1]}, {}, 400, "parameters"),
    ("unknown output", "text", {**VALID_TEXT, "outputs": [{"name": "logits"}]}, {}, 400, "not one of"),
    ("outputs not a list", "text", {**VALID_TEXT, "outputs": "label"}, {}, 400, "outputs"),
    ("25,000 texts", "text", _text(["ok"] * 25_000), {}, 413, f"limit of {MAX_INFLIGHT} inputs in flight"),
    ("25,000 token rows", "text", _ids([[101, 102]] * 25_000, [25_000, 2]), {}, 413, f"at most {MAX_INFLIGHT}"),
    ("a code the model refuses", "fixed", fragile_request([0, 0, 0, 0], 250), {}, 422, "cannot run this input"),
    ("valid text", "text", VALID_TEXT, {}, 200, None),
    ("valid ids", "text", VALID_IDS, {}, 200, None),
    ("valid fixed", "fixed", VALID_FIXED, {}, 200, None),
]

FIXED_JSON = json.dumps(VALID_FIXED).encode()
BAD_GZIP = enc.encode(FIXED_JSON, "gzip")[:10] + b"garbage, not deflate data at all"
CHUNKS = enc.chunked(FIXED_JSON, random.Random(3))
# (name, target, body, headers, chunked framing (None: Content-Length), expected status, phrase in the error)
ENCODED = [
    ("gzip", "fixed", enc.encode(FIXED_JSON, "gzip"), {"Content-Encoding": "gzip"}, None, 200, None),
    ("x-gzip", "fixed", enc.encode(FIXED_JSON, "gzip"), {"Content-Encoding": "x-gzip"}, None, 200, None),
    ("deflate (zlib)", "fixed", enc.encode(FIXED_JSON, "deflate"), {"Content-Encoding": "deflate"}, None, 200, None),
    ("deflate (raw)", "fixed", enc.deflate(FIXED_JSON, raw=True), {"Content-Encoding": "deflate"}, None, 200, None),
    (
        "two gzip members",
        "fixed",
        enc.encode(FIXED_JSON[:9], "gzip") + enc.encode(FIXED_JSON[9:], "gzip"),
        {"Content-Encoding": "gzip"},
        None,
        200,
        None,
    ),
    ("identity", "fixed", FIXED_JSON, {"Content-Encoding": "identity"}, None, 200, None),
    ("chunked", "fixed", b"", {}, CHUNKS, 200, None),
    (
        "chunked gzip",
        "fixed",
        b"",
        {"Content-Encoding": "gzip"},
        enc.chunked(enc.encode(FIXED_JSON, "gzip"), random.Random(4)),
        200,
        None,
    ),
    ("corrupt gzip", "fixed", BAD_GZIP, {"Content-Encoding": "gzip"}, None, 400, "not a valid gzip stream"),
    (
        "truncated gzip",
        "fixed",
        enc.encode(FIXED_JSON, "gzip")[:-12],
        {"Content-Encoding": "gzip"},
        None,
        400,
        "ends before",
    ),
    (
        "deflate then garbage",
        "fixed",
        enc.encode(FIXED_JSON, "deflate") + b"tail",
        {"Content-Encoding": "deflate"},
        None,
        400,
        "after the end",
    ),
    ("gzip of no JSON", "fixed", enc.encode(b"not json", "gzip"), {"Content-Encoding": "gzip"}, None, 400, "JSON"),
    ("empty gzip body", "fixed", b"", {"Content-Encoding": "gzip"}, None, 400, "ends before"),
    (
        "gzip bomb 64 MiB",
        "text",
        lambda: enc.bomb(64 << 20, "gzip"),
        {"Content-Encoding": "gzip"},
        None,
        413,
        "once inflated",
    ),
    (
        "deflate bomb 100 MB",
        "text",
        lambda: enc.bomb(100 << 20),
        {"Content-Encoding": "deflate"},
        None,
        413,
        "once inflated",
    ),
    ("brotli", "fixed", FIXED_JSON, {"Content-Encoding": "br"}, None, 415, "gzip, x-gzip, deflate"),
    (
        "gzip twice",
        "fixed",
        enc.encode(enc.encode(FIXED_JSON, "gzip"), "gzip"),
        {"Content-Encoding": "gzip, gzip"},
        None,
        415,
        "not taken",
    ),
    ("chunk size not hex", "fixed", b"", {}, b'5\r\n{"inp\r\nZZ\r\nuts\r\n0\r\n\r\n', 400, "chunk"),
    ("chunk longer than its size", "fixed", b"", {}, b'3\r\n{"inputs\r\n0\r\n\r\n', 400, "malformed"),
    ("chunk size overflow", "fixed", b"", {}, b"ffffffffffffffffffffff\r\n{}\r\n0\r\n\r\n", 400, "malformed"),
    ("FP32 3.4e38", "fixed", json.dumps(_x([3.4e38] * 4)).encode(), {}, None, 422, "not finite"),
    ("id not a string", "fixed", json.dumps({**VALID_FIXED, "id": 7}).encode(), {}, None, 400, '"id"'),
]


ODD_NUMBERS = [True, False, 0, -1, 1.5, -0.0, 255, 256, 300, 999999, 30522, 2**31, 2**40, 2**63, 2**64, -(2**63) - 1]
ODD_STRINGS = ["NaN", "Infinity", "-inf", "", "x", "\u0000", "\ud7ff", "é" * 50, "BYTES", "FP32", "INT64", "text"]
ODD_OTHERS = [None, 10**30, 1e39, -1e39, 1e-45, [], {}, [[]], [1, [2]], [[1, 2], [3]], {"a": 1}, ["a"], [None], [1e39]]
ODD_VALUES = ODD_NUMBERS + ODD_STRINGS + ODD_OTHERS


def _mutate(body: object, rng: random.Random) -> object:
    """One random change: a value replaced by an odd one, a key or element dropped, an odd one added."""
    body = copy.deepcopy(body)
    paths: list[list] = []

    def walk(node, path):
        paths.append(path)
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, child in items:
            walk(child, [*path, key])

    walk(body, [])
    path = rng.choice(paths)
    if not path:
        return rng.choice(ODD_VALUES)
    parent = body
    for key in path[:-1]:
        parent = parent[key]
    roll = rng.random()
    if roll < 0.6:
        parent[path[-1]] = copy.deepcopy(rng.choice(ODD_VALUES))
    elif roll < 0.8:
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent[rng.choice(["parameters", "outputs", "shape", "extra", "binary_data_size"])] = rng.choice(ODD_VALUES)
    else:
        parent.insert(path[-1], copy.deepcopy(rng.choice(ODD_VALUES)))
    return body


def generated_cases(n: int, seed: int = 14) -> list[tuple[str, str, object]]:
    """`n` (name, target, body) mutations of the valid requests: one to three changes each."""
    rng = random.Random(seed)
    bases = [("text", VALID_TEXT), ("text", VALID_IDS), ("fixed", VALID_FIXED)]
    cases = []
    for i in range(n):
        target, body = rng.choice(bases)
        for _ in range(rng.randint(1, 3)):
            body = _mutate(body, rng)
        cases.append((f"mutation {i}", target, body))
    return cases


async def _send(session, url: str, body, headers: dict) -> tuple[int, bytes, str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.post(url, data=data, headers={"Content-Type": "application/json", **headers}) as resp:
        return resp.status, await resp.read(), resp.headers.get("Content-Type", "")


def _problem(status: int, raw: bytes) -> str | None:
    """Why an answer breaks the rules (none; a 5xx; a 4xx without a JSON error), or None."""
    if status == 0:
        return raw.decode(errors="replace")
    if status >= 500:
        return f"HTTP {status}: {raw[:300]!r}"
    if status >= 400:
        try:
            error = json.loads(raw).get("error")
        except (ValueError, AttributeError):
            return f"HTTP {status} without a JSON body: {raw[:300]!r}"
        if not isinstance(error, str) or not error.strip():
            return f"HTTP {status} without an error reason: {raw[:300]!r}"
    return None


async def test_the_corpus_gets_4xx_with_a_reason_and_never_a_5xx(text_served, fixed_served):
    urls = {"text": f"{text_served.url}/v2/models/minilm/infer", "fixed": f"{fixed_served.url}/v2/models/fragile/infer"}
    wrong = []
    async with aiohttp.ClientSession() as s:
        for name, target, body, headers, expected, phrase in CORPUS:
            status, raw, _ = await _send(s, urls[target], body, headers)
            problem = _problem(status, raw)
            if problem is None and status != expected:
                problem = f"HTTP {status}, expected {expected}: {raw[:300]!r}"
            if problem is None and phrase and phrase not in json.loads(raw)["error"]:
                problem = f"the error does not say {phrase!r}: {raw[:300]!r}"
            if problem:
                wrong.append(f"{name}: {problem}")
    assert not wrong, "\n".join(wrong)


WAYS = ("identity", "gzip", "deflate", "chunked")
"""How the mutations go out, in turn."""


async def _send_way(session, served: dict, target: str, body: object, way: str, rng: random.Random):
    """`body` as JSON, plain (aiohttp), compressed or chunked (a raw connection)."""
    url, (port, path) = served[target]
    if way == "identity":
        status, raw, _ = await _send(session, url, body, {})
        return status, raw
    data = json.dumps(body).encode()
    if way == "chunked":
        return await enc.exchange(port, enc.request(path, b"", {}, chunks=enc.chunked(data, rng)))
    return await enc.exchange(port, enc.request(path, enc.encode(data, way), enc.header_of(way)))


def _served(text_served, fixed_served) -> dict:
    """target -> (url, (port, path)) of each deployment's infer route."""
    paths = {"text": ("/v2/models/minilm/infer", text_served), "fixed": ("/v2/models/fragile/infer", fixed_served)}
    return {t: (f"{dep.url}{path}", (dep.port, path)) for t, (path, dep) in paths.items()}


async def test_a_few_hundred_mutated_requests_get_no_5xx_and_the_service_still_answers(text_served, fixed_served):
    served = _served(text_served, fixed_served)
    urls = {target: url for target, (url, _) in served.items()}
    cases = generated_cases(MUTATIONS)
    wrong, statuses = [], {}
    rng = random.Random(28)
    async with aiohttp.ClientSession() as s:
        for i, (name, target, body) in enumerate(cases):
            status, raw = await _send_way(s, served, target, body, WAYS[i % len(WAYS)], rng)
            statuses[status] = statuses.get(status, 0) + 1
            problem = _problem(status, raw)
            if problem:
                wrong.append(f"{name}, {WAYS[i % len(WAYS)]} ({json.dumps(body)[:200]}): {problem}")
        assert not wrong, "\n".join(wrong)
        assert statuses.get(400, 0) >= MUTATIONS // 3, statuses  # most mutations break the request ...
        assert statuses.get(200, 0) >= 1, statuses  # ... some leave it valid
        for target, body in (("text", VALID_TEXT), ("fixed", VALID_FIXED)):  # nothing was hurt
            status, raw, _ = await _send(s, urls[target], body, {})
            assert status == 200, raw[:300]


async def test_compressed_and_chunked_bodies_get_their_4xx_and_never_a_5xx(text_served, fixed_served):
    served = _served(text_served, fixed_served)
    wrong = []
    for name, target, body, headers, chunks, expected, phrase in ENCODED:
        _, (port, path) = served[target]
        body = body() if callable(body) else body  # (a bomb: made when sent)
        status, raw = await enc.exchange(port, enc.request(path, body, headers, chunks=chunks))
        problem = _problem(status, raw)
        if problem is None and status != expected:
            problem = f"HTTP {status}, expected {expected}: {raw[:300]!r}"
        if problem is None and phrase and phrase not in json.loads(raw)["error"]:
            problem = f"the error does not say {phrase!r}: {raw[:300]!r}"
        if problem:
            wrong.append(f"{name}: {problem}")
    assert not wrong, "\n".join(wrong)


async def test_valid_bodies_with_their_compression_or_chunks_damaged_get_no_5xx(text_served, fixed_served):
    served = _served(text_served, fixed_served)
    rng, wrong, statuses = random.Random(2028), [], {}
    for i in range(DAMAGED):
        target, body = rng.choice([("text", VALID_TEXT), ("fixed", VALID_FIXED)])
        _, (port, path) = served[target]
        data, way = json.dumps(body).encode(), rng.choice(("gzip", "deflate", "raw-deflate", "chunked"))
        if way == "chunked":  # the payload damaged inside valid framing (a stalled chunk would wait for its body)
            raw_request = enc.request(path, b"", {}, chunks=enc.chunked(enc.damage(data, rng), rng))
        else:
            raw_request = enc.request(path, enc.damage(enc.encode(data, way), rng), enc.header_of(way))
        status, raw = await enc.exchange(port, raw_request)
        statuses[status] = statuses.get(status, 0) + 1
        if problem := _problem(status, raw):
            wrong.append(f"damaged {i} ({way}): {problem}")
    assert not wrong, "\n".join(wrong)
    assert statuses.get(400, 0) >= DAMAGED // 3, statuses


async def test_the_answer_echoes_the_request_id(fixed_served):
    async with aiohttp.ClientSession() as s:
        url = f"{fixed_served.url}/v2/models/fragile/infer"
        status, raw, _ = await _send(s, url, {**VALID_FIXED, "id": "req-28"}, {})
        assert status == 200 and json.loads(raw)["id"] == "req-28", raw[:300]
        status, raw, _ = await _send(s, url, VALID_FIXED, {"X-Request-Id": "from-header"})
        assert status == 200 and json.loads(raw)["id"] == "from-header", raw[:300]


def test_the_mutations_are_fixed_by_their_seed_and_varied():
    first, again = generated_cases(50), generated_cases(50)
    assert first == again
    assert len({json.dumps(body, sort_keys=True) for _, _, body in first}) >= 45
