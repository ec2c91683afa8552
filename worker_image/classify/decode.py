"""Decoding an Open Inference Protocol (KServe v2) request body into model inputs.

Accepted inputs:
- text models: `text` (BYTES, shape [n]) tokenized here, or `input_ids` (INT64, [n, L]) with an
  optional `attention_mask` (INT64, [n, L]); lengths above the largest bucket are rejected unless
  truncation is requested (`parameters.truncate: true`, or the router's setting);
- fixed-size models: the bundle's input tensor by name, with its dtype and shape.
Every problem is a `BadRequest` whose message says what is wrong and what is expected.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from exitplan.api.bundle import BundleManifest

_DTYPES = {
    "FP32": np.float32,
    "FP16": np.float16,
    "INT64": np.int64,
    "INT32": np.int32,
    "UINT8": np.uint8,
    "FP64": np.float64,
}


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
        return {"input_ids": ids, "attention_mask": mask}


def _tensor(spec: dict) -> np.ndarray:
    for key in ("name", "datatype", "shape", "data"):
        if key not in spec:
            raise BadRequest(f"input is missing {key!r}; each input needs name, datatype, shape and data")
    name, datatype, shape = spec["name"], spec["datatype"], spec["shape"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise BadRequest(f"input {name!r}: shape must be a list of non-negative integers, got {shape!r}")
    if datatype == "BYTES":
        data = np.asarray(spec["data"], dtype=object).ravel()
    elif datatype in _DTYPES:
        try:
            data = np.asarray(spec["data"], dtype=_DTYPES[datatype]).ravel()
        except (ValueError, TypeError) as err:
            raise BadRequest(f"input {name!r}: data does not hold {datatype} values: {err}") from err
    else:
        raise BadRequest(
            f"input {name!r}: datatype {datatype!r} is not supported; use one of BYTES, {', '.join(_DTYPES)}"
        )
    expected = int(np.prod(shape)) if shape else 1
    if data.size != expected:
        raise BadRequest(f"input {name!r}: shape {shape} needs {expected} values, data has {data.size}")
    return data.reshape(shape)


def decode_inputs(
    body: object, manifest: BundleManifest, tokenizer, buckets: list[int], truncate_default: bool
) -> DecodedBatch:
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), list) or not body["inputs"]:
        raise BadRequest('body must be a JSON object with a non-empty "inputs" list (Open Inference Protocol)')
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise BadRequest('"parameters" must be an object')
    truncate = bool(params.get("truncate", truncate_default))
    inputs = {}
    for spec in body["inputs"]:
        if not isinstance(spec, dict):
            raise BadRequest("each entry of inputs must be an object")
        inputs[spec.get("name")] = spec
    if manifest.seq_axis is None:
        return _decode_fixed(inputs, manifest)
    return _decode_text(inputs, manifest, tokenizer, buckets, truncate)


def _decode_text(inputs: dict, manifest: BundleManifest, tokenizer, buckets: list[int], truncate: bool) -> DecodedBatch:
    longest = buckets[-1]
    if "text" in inputs:
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
            raise BadRequest(f"input 'input_ids' must have datatype INT64, got {spec.get('datatype')!r}")
        ids = _tensor(spec).astype(np.int64)
        if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
            raise BadRequest(
                f"input 'input_ids' must have shape [n, length] with n, length >= 1, got {list(ids.shape)}"
            )
        if "attention_mask" in inputs:
            mask = _tensor(inputs["attention_mask"]).astype(np.int64)
            if mask.shape != ids.shape:
                raise BadRequest(
                    f"attention_mask shape {list(mask.shape)} differs from input_ids shape {list(ids.shape)}"
                )
            tokens = [row[m.astype(bool)] for row, m in zip(ids, mask)]
        else:
            tokens = list(ids)
        if any(len(t) == 0 for t in tokens):
            raise BadRequest("an input has no tokens (its attention_mask is all zeros)")
    else:
        raise BadRequest(f"send an input named 'text' (BYTES) or 'input_ids' (INT64); got {sorted(map(str, inputs))}")
    for i, seq in enumerate(tokens):
        if len(seq) > longest:
            if not truncate:
                raise BadRequest(
                    f"input {i} has {len(seq)} tokens, more than the largest bucket ({longest}); shorten it or send "
                    f'"parameters": {{"truncate": true}}'
                )
            tokens[i] = np.concatenate([seq[: longest - 1], seq[-1:]])  # keep the closing special token
    lengths = np.asarray([len(t) for t in tokens], dtype=np.int64)
    return DecodedBatch(len(tokens), lengths, tokens=tokens, pad_id=manifest.pad_token_id)


def _decode_fixed(inputs: dict, manifest: BundleManifest) -> DecodedBatch:
    tensors = {}
    n = None
    for t in manifest.inputs:
        if t.name not in inputs:
            raise BadRequest(
                f"send an input named {t.name!r} ({t.dtype}, shape {t.shape}); got {sorted(map(str, inputs))}"
            )
        arr = _tensor(inputs[t.name])
        want = np.dtype(t.dtype)
        if arr.dtype != want:
            if arr.dtype.kind == want.kind or (arr.dtype.kind in "iu" and want.kind == "f"):
                arr = arr.astype(want)
            else:
                raise BadRequest(f"input {t.name!r} must be {t.dtype}, got {arr.dtype}")
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
