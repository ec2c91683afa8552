"""Wire format between routers and workers: a small JSON header plus raw tensor bytes.

    frame := b"EXP1" | u32 header_length (little endian) | header (UTF-8 JSON) | tensor bytes
    header := {"meta": {...}, "tensors": [{"name", "dtype", "shape", "offset", "nbytes"}, ...]}

Tensor data is never JSON: each tensor is its C-contiguous bytes at `offset` (from the start of the
tensor area, 8-byte aligned). Decoding is zero-copy (`np.frombuffer` views into the body).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

MAGIC = b"EXP1"
CONTENT_TYPE = "application/x-exitplan-frame"
_DTYPES = {"float32", "float16", "int64", "int32", "uint8", "bool"}
_ITEMSIZE = {name: np.dtype(name).itemsize for name in _DTYPES}
_HEAD = struct.Struct("<4sI")


class WireError(ValueError):
    """A frame that cannot be decoded; the message says which part is wrong."""


def encode(meta: Mapping[str, Any], tensors: Mapping[str, np.ndarray] | None = None) -> bytes:
    """One frame holding `meta` (JSON-able) and `tensors` (name -> array)."""
    specs = []
    chunks: list = []
    offset = 0
    for name, array in (tensors or {}).items():
        array = np.ascontiguousarray(array)
        if array.dtype.name not in _DTYPES:
            raise WireError(f"tensor {name!r}: dtype {array.dtype} is not sendable; use one of {sorted(_DTYPES)}")
        nbytes = array.nbytes
        pad = (-nbytes) % 8
        specs.append({"name": name, "dtype": array.dtype.name, "shape": list(array.shape), "offset": offset, "nbytes": nbytes})
        chunks.append(array)  # contiguous (ascontiguousarray gives ndim >= 1): the join copies it once
        if pad:
            chunks.append(b"\0" * pad)
        offset += nbytes + pad
    header = json.dumps({"meta": meta, "tensors": specs}, separators=(",", ":")).encode()
    return b"".join([_HEAD.pack(MAGIC, len(header)), header, *chunks])


def decode(body: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(meta, tensors) from one frame; raises WireError naming what is malformed."""
    if len(body) < _HEAD.size:
        raise WireError(f"frame of {len(body)} bytes is shorter than its {_HEAD.size}-byte preamble")
    magic, header_len = _HEAD.unpack_from(body)
    if magic != MAGIC:
        raise WireError(f"frame starts with {magic!r}, expected {MAGIC!r}")
    start = _HEAD.size + header_len
    if start > len(body):
        raise WireError(f"header length {header_len} runs past the frame ({len(body)} bytes)")
    try:
        header = json.loads(body[_HEAD.size : start])
        meta, specs = header["meta"], header["tensors"]
    except (ValueError, KeyError, TypeError) as err:
        raise WireError(f"frame header is not valid JSON with meta and tensors: {err}") from err
    view = memoryview(body)[start:]
    tensors: dict[str, np.ndarray] = {}
    for spec in specs:
        try:
            name, dtype, shape = spec["name"], spec["dtype"], tuple(int(d) for d in spec["shape"])
            offset, nbytes = int(spec["offset"]), int(spec["nbytes"])
        except (KeyError, TypeError, ValueError) as err:
            raise WireError(f"tensor spec {spec!r} is incomplete: {err}") from err
        if dtype not in _DTYPES:
            raise WireError(f"tensor {name!r}: unknown dtype {dtype!r}")
        expected = math.prod(shape) * _ITEMSIZE[dtype]
        if nbytes != expected or offset < 0 or offset + nbytes > len(view):
            raise WireError(f"tensor {name!r}: {nbytes} bytes at offset {offset} do not hold {dtype}{list(shape)}")
        tensors[name] = np.frombuffer(view[offset : offset + nbytes], dtype=dtype).reshape(shape)
    return meta, tensors
