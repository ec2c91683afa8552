"""Decoding a classification request: an Open Inference Protocol (KServe v2) body into checked model
inputs. (Not to be confused with `generate/decoder.py`, the decoder *model* of generation.)

Accepted inputs:
- text models: `text` (BYTES, shape [n]) tokenized here, or `input_ids` (INT64, [n, L]; ids inside
  the model's vocabulary) with an optional `attention_mask` (INT64, [n, L]; 0 or 1); lengths above
  the largest bucket are rejected unless truncation is requested (`parameters.truncate: true`, or
  the router's setting);
- fixed-size models: the bundle's input tensors by name, with their shapes; values are sent with the
  input's datatype or, where no value can be lost to it, another one (integers to a float input,
  narrower or wider integers checked against the input's range).
Every problem is a `BadRequest` whose message says what is wrong and what is expected: an input the
model does not take, a missing one, and every value its datatype cannot hold (out of range, not an
integer in an integer input, NaN or infinite, beyond the float's range), named by its position in the
input's flat (row-major) `data`. Datatypes are the project's table (`exitplan.api.dtypes`).

The binary tensor extension (`parse_request`): with an `Inference-Header-Content-Length: n` header the
first n bytes of the body are the JSON request and the rest the raw tensors (little-endian, row-major;
BYTES as a 4-byte little-endian length then the bytes, per element) of the inputs that declare
`"parameters": {"binary_data_size": bytes}`, concatenated in their order. Each becomes its input's
`data` (a numpy array, or a list of strings for BYTES), so its values are checked exactly as JSON
ones are. `parameters.binary_data_output` (all outputs) or an output's `parameters.binary_data` asks
for the answer in the same layout (`DecodedBatch.binary_outputs`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from exitplan.api.bundle import BundleManifest
from exitplan.api.dtypes import V2_DATATYPES, DTypeInfo, UnknownDType, by_numpy, by_v2
from exitplan.worker_image.bundle_runtime import derived_inputs
from exitplan.worker_image.protocol import BINARY_HEADER, CLASSIFY_OUTPUTS

if TYPE_CHECKING:
    from tokenizers import Tokenizer

_INT64 = by_numpy("int64")
_EXACT = 2**53
"""float64 holds every integer up to this magnitude exactly."""
MAX_ID_CHARS = 1024
"""The longest request `id` a router echoes."""
_TEXT_INPUTS = ("text", "input_ids", "attention_mask")
_TEXT_INPUTS_TEXT = "'text' (BYTES, [n]) or 'input_ids' (INT64, [n, length]) with an optional 'attention_mask'"


class BadRequest(ValueError):
    """An inference request that cannot be served as sent (HTTP 400)."""


@dataclass
class DecodedBatch:
    n: int
    lengths: np.ndarray
    """Per input: its length in tokens (1 for fixed-size inputs)."""
    tokens: list[np.ndarray] | None = None
    """Per input: its token ids (text models)."""
    fixed: dict[str, np.ndarray] | None = None
    """Fixed-size models: the input tensors, [n, ...]."""
    pad_id: int = 0
    names: tuple[str, ...] = ()
    """The model's inputs (text models: token types and positions among them are filled in here)."""
    binary_outputs: frozenset[str] = frozenset()
    """The outputs the answer carries as binary tensors (the binary tensor extension)."""
    request_id: str = ""
    """The request's `id`, echoed in its answer."""

    def state_for(self, rows: list[int], bucket: int) -> dict[str, np.ndarray]:
        """The split-0 state for these inputs, padded to `bucket`."""
        if self.fixed is not None:
            return {k: np.ascontiguousarray(v[rows]) for k, v in self.fixed.items()}
        assert self.tokens is not None
        ids = np.full((len(rows), bucket), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), bucket), dtype=np.int64)
        for j, i in enumerate(rows):
            seq = self.tokens[i]
            ids[j, : len(seq)] = seq
            mask[j, : len(seq)] = 1
        return {"input_ids": ids, "attention_mask": mask, **derived_inputs(ids, self.names)}


def _tensor(spec: dict[str, Any], target: DTypeInfo | None = None) -> np.ndarray:
    """One input's array; numeric data is checked against its datatype and converted to `target`
    (default: the datatype sent)."""
    for key in ("name", "datatype", "shape", "data"):
        if key not in spec:
            raise BadRequest(f"input is missing {key!r}; each input needs name, datatype, shape and data")
    name, datatype = spec["name"], spec["datatype"]
    shape, expected = _shape(name, spec["shape"])
    if datatype == "BYTES":
        if target is not None:
            raise BadRequest(f"input {name!r} takes {target.v2} values, not BYTES")
        try:
            data = np.asarray(spec["data"], dtype=object).ravel()
        except ValueError as err:  # ragged nesting
            raise BadRequest(f"input {name!r}: data does not hold BYTES values in shape {shape}: {err}") from None
    else:
        source = _datatype(name, datatype)
        data = _values(name, spec["data"], source, target or source)
    if data.size != expected:
        raise BadRequest(f"input {name!r}: shape {shape} needs {expected} values, data has {data.size}")
    return data.reshape(shape)


def _shape(name: object, shape: object) -> tuple[list[int], int]:
    """(shape, number of values it holds); BadRequest unless a list of non-negative integers."""
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise BadRequest(f"input {name!r}: shape must be a list of non-negative integers, got {shape!r}")
    return shape, math.prod(shape)  # exact: no int64 wrap-around for absurd shapes


def _datatype(name: object, datatype: object) -> DTypeInfo:
    """The table entry of a numeric datatype; BadRequest naming the supported ones."""
    try:
        return by_v2(datatype)
    except UnknownDType:
        raise BadRequest(
            f"input {name!r}: datatype {datatype!r} is not supported; use one of BYTES, {', '.join(V2_DATATYPES)}"
        ) from None


@cache
def _allowed(source: DTypeInfo, target: DTypeInfo) -> tuple[int | float, int | float, str, np.dtype | None]:
    """(lo, hi, description, float dtype to check finiteness in) for values sent as `source` to a
    `target` input. Integer sources: [lo, hi] is the integers both dtypes hold. Float sources: the
    values must stay finite in the narrower float."""
    if source.is_float:
        narrow = source if source.itemsize < target.itemsize else target
        return narrow.min, narrow.max, narrow.describe_values(), np.dtype(narrow.numpy)
    lo, hi = max(int(source.min), math.ceil(target.min)), min(int(source.max), math.floor(target.max))
    text = "true or false (or 0 or 1)" if (lo, hi) == (0, 1) else f"integers in [{lo}, {hi}]"
    return lo, hi, text, np.dtype(target.numpy) if target.is_float else None


def _value_error(
    name: str, source: DTypeInfo, target: DTypeInfo, value: object, index: int, problem: str
) -> BadRequest:
    where = (
        f"input {name!r} ({source.v2})"
        if source == target
        else f"input {name!r} ({source.v2} sent to a {target.v2} input)"
    )
    if isinstance(value, np.generic):
        value = value.item()
    return BadRequest(
        f"{where}: value {value!r} at position {index} of its data {problem}; allowed: {_allowed(source, target)[2]}"
    )


def _values(name: str, data: object, source: DTypeInfo, target: DTypeInfo) -> np.ndarray:
    """`data` (JSON numbers, flat or nested) as a flat `target` array, every value checked.

    One numpy parse and a few vectorised reductions for well-formed data; a per-value pass only for
    data numpy cannot hold as one numeric array (strings, nulls, integers past 64 bits) or integers
    past 2**53 mixed with floats, where it names the first bad value or converts exactly."""
    if source.is_float and not target.is_float:
        raise BadRequest(
            f"input {name!r} takes {target.v2} values; {source.v2} cannot be sent to it (send {target.v2})"
        )
    lo, hi, _, check = _allowed(source, target)
    try:
        flat = np.asarray(data).ravel()
    except (ValueError, TypeError) as err:
        raise BadRequest(f"input {name!r}: data does not hold {source.v2} values: {err}") from err
    kind = flat.dtype.kind
    if kind in "biu":
        if not source.is_float and flat.size and (int(flat.min()) < lo or int(flat.max()) > hi):
            bad = (flat < lo) | (flat > hi)
            index = int(np.argmax(bad))
            raise _value_error(name, source, target, flat[index], index, "is out of range")
    elif kind == "f":
        if source.is_float:
            finite = np.isfinite(flat)
            if not finite.all():
                index = int(np.argmin(finite))
                raise _value_error(name, source, target, flat[index], index, "is not a finite number")
        else:  # integers sent as JSON floats: integral values only; exact where float64 is
            with np.errstate(invalid="ignore"):
                ok = np.isfinite(flat) & (flat == np.trunc(flat)) & (flat >= lo) & (flat < hi + 1)
            if not ok.all() or (check is None and flat.size and np.abs(flat).max() > _EXACT):
                flat = _exact(name, data, source, target)
    else:
        flat = _exact(name, data, source, target)
    if check is not None:
        with np.errstate(over="ignore", invalid="ignore"):
            out = flat.astype(target.numpy)
            checked = out if check == out.dtype else flat.astype(check)
        finite = np.isfinite(checked)
        if not finite.all():
            index = int(np.argmin(finite))
            raise _value_error(name, source, target, flat[index], index, "is out of range")
        return out
    return flat.astype(target.numpy)


def _exact(name: str, data: object, source: DTypeInfo, target: DTypeInfo) -> np.ndarray:
    """The slow path of `_values`: value by value, raising on the first bad one; else float64 values
    (float inputs, checked for range by the caller) or int64 values (integer inputs, checked here)."""
    lo, hi, _, check = _allowed(source, target)
    try:
        items = np.asarray(data, dtype=object).ravel().tolist()
    except (ValueError, TypeError) as err:
        raise BadRequest(f"input {name!r}: data does not hold {source.v2} values: {err}") from err
    for index, value in enumerate(items):
        problem = None
        if isinstance(value, float):
            if not math.isfinite(value):
                problem = "is not a finite number"
            elif not source.is_float and not value.is_integer():
                problem = "is not an integer"
        elif not isinstance(value, int):  # bool is an int
            problem = "is not a number"
        if problem is None and not source.is_float and not lo <= value <= hi:
            problem = "is out of range"
        if problem is None and check is not None:
            try:
                float(value)
            except OverflowError:
                problem = "is out of range"
        if problem is not None:
            raise _value_error(name, source, target, value, index, problem)
    if check is not None:
        return np.asarray([float(v) for v in items], dtype=np.float64)
    return np.asarray([int(v) for v in items], dtype=np.int64)


# ---------------------------------------------------------------- the binary tensor extension


def parse_request(raw: bytes, header_length: str | None) -> object:
    """The request of a body: its JSON, or with `header_length` (the Inference-Header-Content-Length
    header) the JSON header followed by binary tensors, each set as the `data` of its input."""
    if header_length is None:
        try:
            body = orjson.loads(raw)
        except ValueError as err:
            raise BadRequest(
                f"body is not valid JSON: {err} (a body with binary tensors needs the {BINARY_HEADER} header)"
            ) from None
        tail = memoryview(b"")
    else:
        text = header_length.strip()
        if not text.isdigit() or not text.isascii():
            raise BadRequest(
                f"{BINARY_HEADER} must be the length in bytes of the JSON header that starts the body, got {header_length!r}"
            )
        n = int(text)
        if n > len(raw):
            raise BadRequest(f"{BINARY_HEADER} is {n} bytes, past the end of the body ({len(raw)} bytes)")
        try:
            body = orjson.loads(memoryview(raw)[:n])
        except ValueError as err:
            raise BadRequest(f"the first {n} bytes of the body ({BINARY_HEADER}) are not valid JSON: {err}") from None
        tail = memoryview(raw)[n:]
    inputs = body.get("inputs") if isinstance(body, dict) else None
    if isinstance(inputs, list):
        body["inputs"] = _attach_binary(inputs, tail, header_length is not None)
    elif len(tail):
        raise BadRequest(f"the body holds {len(tail)} bytes after the JSON header but no input declares binary data")
    return body


def _binary_size(spec: object) -> int | None:
    """An input's `parameters.binary_data_size`, None when it has none (its values are JSON)."""
    if not isinstance(spec, dict):
        return None
    params = spec.get("parameters")
    if not isinstance(params, dict) or "binary_data_size" not in params:
        return None
    size = params["binary_data_size"]
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise BadRequest(f"input {spec.get('name')!r}: binary_data_size must be a number of bytes (>= 0), got {size!r}")
    return size


def _attach_binary(inputs: list[Any], tail: memoryview, has_header: bool) -> list[Any]:
    """The inputs, each that declares binary data with its share of `tail` (in input order) as its `data`."""
    out, offset = [], 0
    for spec in inputs:
        size = _binary_size(spec)
        if size is None:
            out.append(spec)
            continue
        name = spec.get("name")
        if not has_header:
            raise BadRequest(
                f"input {name!r} declares binary_data_size but the request has no {BINARY_HEADER} header "
                "(the length of the JSON header that starts the body)"
            )
        if "data" in spec:
            raise BadRequest(f"input {name!r} declares binary_data_size and also has data; send its values one way")
        _, count = _shape(name, spec.get("shape"))
        datatype = spec.get("datatype")
        info = None if datatype == "BYTES" else _datatype(name, datatype)
        if info is not None and size != count * info.itemsize:
            raise BadRequest(
                f"input {name!r}: binary_data_size is {size} bytes, but {count} {datatype} values of shape "
                f"{spec.get('shape')} take {count * info.itemsize}"
            )
        if offset + size > len(tail):
            raise BadRequest(
                f"input {name!r}: its {size} bytes of binary data run past the end of the body: the binary part "
                f"(after the {BINARY_HEADER} bytes of JSON) holds {len(tail)} bytes, {offset} of them used by earlier inputs"
            )
        chunk = tail[offset : offset + size]
        offset += size
        data = _binary_strings(name, chunk, count) if info is None else _binary_numbers(chunk, info)
        out.append({**spec, "data": data})
    if offset != len(tail):
        raise BadRequest(
            f"the body holds {len(tail)} bytes after the JSON header but the inputs declare {offset} "
            "(the sum of their binary_data_size); send exactly the declared bytes"
        )
    return out


def _binary_numbers(chunk: memoryview, info: DTypeInfo) -> np.ndarray:
    """Raw little-endian values; BOOL as bytes (0 or 1, any other value refused like JSON's)."""
    dtype = np.dtype(np.uint8 if info.is_bool else info.numpy).newbyteorder("<")
    return np.frombuffer(chunk, dtype=dtype)


def _binary_strings(name: object, chunk: memoryview, count: int) -> list[str]:
    """`count` BYTES elements, each a 4-byte little-endian length and that many UTF-8 bytes."""
    out, pos = [], 0
    for i in range(count):
        if pos + 4 > len(chunk):
            raise BadRequest(f"input {name!r}: binary_data_size ends before element {i} of {count} (BYTES)")
        length = int.from_bytes(chunk[pos : pos + 4], "little")
        if pos + 4 + length > len(chunk):
            raise BadRequest(
                f"input {name!r}: element {i} (BYTES) declares {length} bytes, past its binary_data_size of {len(chunk)}"
            )
        try:
            out.append(str(chunk[pos + 4 : pos + 4 + length], "utf-8"))
        except UnicodeDecodeError as err:
            raise BadRequest(f"input {name!r}: element {i} (BYTES) is not UTF-8 text: {err}") from None
        pos += 4 + length
    if pos != len(chunk):
        raise BadRequest(
            f"input {name!r}: binary_data_size is {len(chunk)} bytes, but its {count} BYTES elements take {pos}"
        )
    return out


def _binary_outputs(body: dict[str, Any], params: dict[str, Any]) -> frozenset[str]:
    """The outputs to answer in binary form: `parameters.binary_data_output` for all, overridden per
    output by its `parameters.binary_data`."""
    default = params.get("binary_data_output", False)
    if not isinstance(default, bool):
        raise BadRequest(f'"parameters.binary_data_output" must be true or false, got {default!r}')
    chosen = dict.fromkeys(CLASSIFY_OUTPUTS, default)
    outputs = body.get("outputs", [])
    if not isinstance(outputs, list):
        raise BadRequest('"outputs" must be a list of objects like {"name": "scores"}')
    for out in outputs:
        name = out.get("name") if isinstance(out, dict) else None
        if name not in chosen:
            raise BadRequest(f"requested output {name!r} is not one of this model's outputs {list(CLASSIFY_OUTPUTS)}")
        out_params = out.get("parameters") or {}
        flag = out_params.get("binary_data", default) if isinstance(out_params, dict) else None
        if not isinstance(flag, bool):
            raise BadRequest(f"output {name!r}: parameters.binary_data must be true or false, got {flag!r}")
        chosen[name] = flag
    return frozenset(name for name, flag in chosen.items() if flag)


def decode_inputs(
    body: object,
    manifest: BundleManifest,
    tokenizer: Tokenizer | None,
    buckets: list[int],
    truncate_default: bool,
    vocab_size: int | None = None,
) -> DecodedBatch:
    """The request's inputs, every value checked; `vocab_size`: the token ids the model runs
    (`exitplan.worker_image.vocabulary`), None when unknown (ids are then only checked to be >= 0)."""
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), list) or not body["inputs"]:
        raise BadRequest('body must be a JSON object with a non-empty "inputs" list (Open Inference Protocol)')
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise BadRequest('"parameters" must be an object')
    truncate = bool(params.get("truncate", truncate_default))
    inputs: dict[str, dict[str, Any]] = {}
    for spec in body["inputs"]:
        if not isinstance(spec, dict):
            raise BadRequest("each entry of inputs must be an object")
        name = spec.get("name")
        if not isinstance(name, str):
            raise BadRequest(f"each input needs a string 'name' (and datatype, shape and data), got {name!r}")
        if name in inputs:
            raise BadRequest(f"input {name!r} is sent twice; send each input once")
        inputs[name] = spec
    if manifest.seq_axis is None:
        known = [t.name for t in manifest.inputs]
        takes = ", ".join(f"{t.name!r} ({by_numpy(t.dtype).v2}, shape {t.shape})" for t in manifest.inputs)
    else:
        known, takes = list(_TEXT_INPUTS), _TEXT_INPUTS_TEXT
    for name in inputs:
        if name not in known:
            raise BadRequest(f"this model has no input named {name!r}; it takes {takes}")
    binary = _binary_outputs(body, params)
    request_id = body.get("id", "")
    if not isinstance(request_id, str) or len(request_id) > MAX_ID_CHARS:
        raise BadRequest(f'"id" must be a string of at most {MAX_ID_CHARS} characters, got {str(request_id)[:40]!r}')
    if manifest.seq_axis is None:
        batch = _decode_fixed(inputs, manifest, takes)
    else:
        batch = _decode_text(inputs, manifest, tokenizer, buckets, truncate, vocab_size)
    batch.binary_outputs, batch.request_id = binary, request_id
    return batch


def _decode_text(
    inputs: dict[str, dict[str, Any]],
    manifest: BundleManifest,
    tokenizer: Tokenizer | None,
    buckets: list[int],
    truncate: bool,
    vocab_size: int | None,
) -> DecodedBatch:
    longest = buckets[-1]
    if "text" in inputs:
        if len(inputs) > 1:
            raise BadRequest(
                f"send either 'text' or 'input_ids' (with an optional 'attention_mask'), not both; got {sorted(inputs)}"
            )
        spec = inputs["text"]
        if spec.get("datatype") != "BYTES":
            raise BadRequest(f"input 'text' must have datatype BYTES, got {spec.get('datatype')!r}")
        texts = _tensor(spec)
        if texts.ndim != 1 or texts.size == 0:
            raise BadRequest(f"input 'text' must have shape [n] with n >= 1, got {list(texts.shape)}")
        if tokenizer is None:
            raise BadRequest("this model has no tokenizer; send input_ids")
        for i, t in enumerate(texts):
            if not isinstance(t, str) or not t.strip():
                raise BadRequest(f"text {i} is empty or not a string; send non-empty strings")
        # No offsets are needed: the fast variant skips computing them.
        encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        tokens = [np.asarray(e.ids, dtype=np.int64) for e in encode([str(t) for t in texts])]
    elif "input_ids" in inputs:
        spec = inputs["input_ids"]
        if spec.get("datatype") not in ("INT64", "INT32"):
            raise BadRequest(f"input 'input_ids' must have datatype INT64 (or INT32), got {spec.get('datatype')!r}")
        ids = _tensor(spec, _INT64)
        if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
            raise BadRequest(
                f"input 'input_ids' must have shape [n, length] with n, length >= 1, got {list(ids.shape)}"
            )
        _check_token_ids(ids, vocab_size)
        if "attention_mask" in inputs:
            mask = _tensor(inputs["attention_mask"], _INT64)
            if mask.shape != ids.shape:
                raise BadRequest(
                    f"attention_mask shape {list(mask.shape)} differs from input_ids shape {list(ids.shape)}"
                )
            _check_mask(mask)
            tokens = [row[m.astype(bool)] for row, m in zip(ids, mask)]
        else:
            tokens = list(ids)
        if any(len(t) == 0 for t in tokens):
            raise BadRequest("an input has no tokens (its attention_mask is all zeros)")
    else:
        raise BadRequest(f"send an input named 'text' (BYTES) or 'input_ids' (INT64); got {sorted(inputs)}")
    for i, seq in enumerate(tokens):
        if len(seq) > longest:
            if not truncate:
                raise BadRequest(
                    f"input {i} has {len(seq)} tokens, more than the largest bucket ({longest}); shorten it or send "
                    f'"parameters": {{"truncate": true}}'
                )
            tokens[i] = np.concatenate([seq[: longest - 1], seq[-1:]])  # keep the closing special token
    lengths = np.asarray([len(t) for t in tokens], dtype=np.int64)
    names = tuple(t.name for t in manifest.inputs)
    return DecodedBatch(len(tokens), lengths, tokens=tokens, pad_id=manifest.pad_token_id, names=names)


def _check_token_ids(ids: np.ndarray, vocab_size: int | None) -> None:
    """BadRequest naming the first token id outside the model's vocabulary (or negative)."""
    top = (vocab_size - 1) if vocab_size else None
    bad = (ids < 0) if top is None else (ids < 0) | (ids > top)
    if bad.any():
        index = int(np.argmax(bad.ravel()))
        allowed = (
            f"token ids in [0, {top}] (the model's vocabulary of {vocab_size} ids)"
            if top is not None
            else "token ids >= 0"
        )
        raise BadRequest(
            f"input 'input_ids': value {int(ids.ravel()[index])} at position {index} of its data is not a token id "
            f"this model knows; allowed: {allowed}"
        )


def _check_mask(mask: np.ndarray) -> None:
    """BadRequest naming the first attention_mask value that is neither 0 nor 1."""
    bad = (mask != 0) & (mask != 1)
    if bad.any():
        index = int(np.argmax(bad.ravel()))
        raise BadRequest(
            f"input 'attention_mask': value {int(mask.ravel()[index])} at position {index} of its data is not 0 or 1; "
            "allowed: 1 for a token of the input, 0 for padding"
        )


def _decode_fixed(inputs: dict[str, dict[str, Any]], manifest: BundleManifest, takes: str) -> DecodedBatch:
    tensors = {}
    n = None
    for t in manifest.inputs:
        if t.name not in inputs:
            raise BadRequest(f"send an input named {t.name!r}; this model takes {takes}; got {sorted(inputs)}")
        arr = _tensor(inputs[t.name], by_numpy(t.dtype))
        if arr.ndim != len(t.shape) or any(isinstance(d, int) and arr.shape[k] != d for k, d in enumerate(t.shape)):
            raise BadRequest(f"input {t.name!r} has shape {list(arr.shape)}; expected {t.shape}")
        if arr.shape[0] == 0:
            raise BadRequest(f"input {t.name!r} holds no inputs")
        n = arr.shape[0] if n is None else n
        if arr.shape[0] != n:
            raise BadRequest("inputs disagree on the batch size")
        tensors[t.name] = arr
    assert n is not None
    return DecodedBatch(n, np.ones(n, dtype=np.int64), fixed=tensors)
