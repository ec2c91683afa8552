"""Wire format between routers and workers: a small JSON header plus raw tensor bytes.

    frame := b"EXP1" | u32 header_length (little endian) | header (UTF-8 JSON) | tensor bytes
    header := {"meta": {...}, "tensors": [{"name", "dtype", "shape", "offset", "nbytes"}, ...]}

Tensor data is never JSON: each tensor is its C-contiguous bytes at `offset` (from the start of the
tensor area, 8-byte aligned). Decoding is zero-copy (`np.frombuffer` views into the body).

The meta of a /v1/run frame (router -> split 0, split k -> split k + 1) and of its answer is typed
here: `HopRequest` (a `HopItem` per row of the tensors) and `HopAnswer` (a `HopResult` per row, row k
of its `logits`). Their `to_meta()` is exactly the JSON the untyped code built, so pods of either
version read each other's frames; `from_meta()` raises `WireError` naming the field that is wrong.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from exitplan.api.dtypes import DTYPES

if TYPE_CHECKING:
    from typing_extensions import Buffer

MAGIC = b"EXP1"
CONTENT_TYPE = "application/x-exitplan-frame"
_ITEMSIZE = {e.numpy: e.itemsize for e in DTYPES}
"""Sendable dtypes (numpy names, the project's table) -> bytes per element."""
_DTYPES = frozenset(_ITEMSIZE)
_HEAD = struct.Struct("<4sI")


class WireError(ValueError):
    """A frame that cannot be decoded; the message says which part is wrong."""


def encode(meta: Mapping[str, Any], tensors: Mapping[str, np.ndarray] | None = None) -> bytes:
    """One frame holding `meta` (JSON-able) and `tensors` (name -> array)."""
    specs = []
    chunks: list[Buffer] = []
    offset = 0
    for name, array in (tensors or {}).items():
        array = np.ascontiguousarray(array)
        if array.dtype.name not in _DTYPES:
            raise WireError(f"tensor {name!r}: dtype {array.dtype} is not sendable; use one of {sorted(_DTYPES)}")
        nbytes = array.nbytes
        pad = (-nbytes) % 8
        specs.append(
            {"name": name, "dtype": array.dtype.name, "shape": list(array.shape), "offset": offset, "nbytes": nbytes}
        )
        chunks.append(array.data)  # contiguous (ascontiguousarray gives ndim >= 1): the join copies it once
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


# ---------------------------------------------------------------- the meta of /v1/run frames


_STRING: tuple[type, ...] = (str,)
_NUMBER: tuple[type, ...] = (float, int)  # JSON numbers as parsed (`type(x) in _NUMBER` leaves out bool)
_BOOL: tuple[type, ...] = (bool,)
_KIND_TEXT = {_STRING: "a string", _NUMBER: "a number", _BOOL: "true or false"}


Fields = tuple[tuple[str, tuple[type, ...], bool], ...]
"""A message's fields: (key, the types its JSON value may have, required); an optional field may be
absent or null."""


def _checked(meta: Any, where: str, fields: Fields) -> dict[str, Any]:
    """`meta` when it is a JSON object whose `fields` have their kinds; else the WireError naming the
    first field it gets wrong."""
    if type(meta) is dict:
        get = meta.get
        for key, kinds, required in fields:  # nested ifs: the fastest form of this loop (the hot path)
            value = get(key)
            if value is None:
                if required:
                    break
            elif type(value) not in kinds:
                break
        else:
            return meta
    raise _named_error(meta, where, fields)


def _named_error(meta: Any, where: str, fields: Fields) -> WireError:
    """The error naming the first of `fields` that `meta` gets wrong. Only called once a check failed,
    so this path may be slow."""
    if not isinstance(meta, Mapping):
        return WireError(f"{where} must be a JSON object, got {meta!r}"[:300])
    for key, kinds, required in fields:
        value = meta.get(key)
        if value is None:
            if required:
                return WireError(f"{where}: field {key!r} is missing")
            continue
        if type(value) not in kinds:
            return WireError(f"{where}: field {key!r} must be {_KIND_TEXT[kinds]}, got {value!r}"[:300])
    return WireError(f"{where} is malformed: {meta!r}"[:300])


@dataclass(frozen=True, slots=True)
class ShadowRecord:
    """A shadow-sampled row's feedback so far: confidence and answer at every exit ramp the splits ran
    on it (active or not, in block order) and, once the final head ran, the full model's answer."""

    conf: dict[str, float]
    pred: dict[str, int]
    final: int | None = None

    def merged(self, conf: Mapping[str, float], pred: Mapping[str, int], final: int | None) -> ShadowRecord:
        """This record with a split's additions (a ramp seen before keeps its place, as dict.update)."""
        return ShadowRecord({**self.conf, **conf}, {**self.pred, **pred}, self.final if final is None else final)

    def to_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"conf": self.conf, "pred": self.pred}
        if self.final is not None:
            meta["final"] = self.final
        return meta

    @classmethod
    def from_meta(cls, meta: Any, where: str = "rec") -> ShadowRecord:
        if not isinstance(meta, dict):
            raise _named_error(meta, where, ())
        conf, pred = meta.get("conf", {}), meta.get("pred", {})
        if not isinstance(conf, dict) or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) for v in conf.values()
        ):
            raise WireError(f"{where}: field 'conf' must map ramp names to numbers, got {conf!r}")
        if not isinstance(pred, dict) or any(isinstance(v, bool) or not isinstance(v, int) for v in pred.values()):
            raise WireError(f"{where}: field 'pred' must map ramp names to class indices, got {pred!r}")
        final = meta.get("final")
        if final is not None and (isinstance(final, bool) or not isinstance(final, int)):
            raise WireError(f"{where}: field 'final' must be a class index, got {final!r}")
        return cls(conf, pred, final)


@dataclass(frozen=True, slots=True)
class HopItem:
    """One input travelling down the chain of splits: the header of one row of a /v1/run frame."""

    id: str
    """The router's id for the input; its answer names it."""
    deadline: float | None = None
    """Epoch seconds by which the router must answer (its SLO). None: not given (a worker allows 1 s)."""
    timeout: float | None = None
    """Epoch seconds after which the router gives up on the input. None: the deadline."""
    record: bool = False
    """Shadow-sampled: answered as usual, but keeps running to the final head with every exit ramp
    evaluated, so the last split can post a complete feedback sample."""
    reply_to: str | None = None
    """host:port of the router that takes the feedback sample (shadow-sampled inputs only)."""
    rec: ShadowRecord | None = None
    """The feedback sample so far (shadow-sampled inputs, from the first split that ran them)."""
    answered: bool | None = None
    """Already answered upstream (a shadow-sampled input still running for its feedback). None: not
    said (the router's frames to split 0); a worker always says."""

    def onward(self, rec: ShadowRecord | None, answered: bool) -> HopItem:
        """This item as a worker forwards it to the next split."""
        return HopItem(self.id, self.deadline, self.timeout, self.record, self.reply_to, rec, answered)

    def to_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"id": self.id}
        if self.deadline is not None:
            meta["deadline"] = self.deadline
        if self.timeout is not None:
            meta["timeout"] = self.timeout
        meta["record"] = self.record
        if self.reply_to is not None:
            meta["reply_to"] = self.reply_to
        if self.rec is not None:
            meta["rec"] = self.rec.to_meta()
        if self.answered is not None:
            meta["answered"] = self.answered
        return meta

    _FIELDS = (
        ("id", _STRING, True),
        ("deadline", _NUMBER, False),
        ("timeout", _NUMBER, False),
        ("record", _BOOL, False),
        ("reply_to", _STRING, False),
        ("answered", _BOOL, False),
    )

    @classmethod
    def from_meta(cls, meta: Any, where: str = "item") -> HopItem:
        checked = _checked(meta, where, cls._FIELDS)
        get = checked.get
        rec = get("rec")
        return cls(
            checked["id"],
            get("deadline"),
            get("timeout"),
            bool(get("record")),
            get("reply_to"),
            None if rec is None else ShadowRecord.from_meta(rec, f"{where}: field 'rec'"),
            get("answered"),
        )


@dataclass(frozen=True, slots=True)
class HopResult:
    """The answer for one row of a frame: the ramp that answered it, an error, or (a shadow-sampled
    row answered upstream) that it needs no answer from here."""

    id: str
    ramp: str | None = None
    """The exit ramp (or the final head) that answered; None for an error or a shadow marker."""
    final: bool = False
    """Answered by the final head."""
    error: str | None = None
    shadow: bool = False
    input_error: bool = False
    """The error is the input's own: the model cannot run it (it failed alone, while inputs batched
    with it ran). The router answers it 4xx and sends it nowhere else; any other error is the pod's."""

    @classmethod
    def answer(cls, id: str, ramp: str, final: bool) -> HopResult:
        return cls(id, ramp, final)

    @classmethod
    def failure(cls, id: str, error: str) -> HopResult:
        return cls(id, error=error)

    @classmethod
    def rejection(cls, id: str, error: str) -> HopResult:
        """The input's own failure (see `input_error`)."""
        return cls(id, error=error, input_error=True)

    @classmethod
    def shadow_of(cls, id: str) -> HopResult:
        return cls(id, shadow=True)

    def to_meta(self) -> dict[str, Any]:
        if self.error is not None:
            meta: dict[str, Any] = {"id": self.id, "error": self.error}
            if self.input_error:
                meta["input_error"] = True
            return meta
        if self.shadow:
            return {"id": self.id, "shadow": True}
        return {"id": self.id, "ramp": self.ramp, "final": self.final}

    _FIELDS = (
        ("id", _STRING, True),
        ("error", _STRING, False),
        ("shadow", _BOOL, False),
        ("final", _BOOL, False),
        ("input_error", _BOOL, False),
    )

    @classmethod
    def from_meta(cls, meta: Any, where: str = "result") -> HopResult:
        checked = _checked(meta, where, cls._FIELDS)
        get = checked.get
        ramp, error, shadow = get("ramp"), get("error"), bool(get("shadow"))
        if error is not None or shadow:
            ramp = None
        elif type(ramp) is not str:
            raise _named_error(meta, where, (("ramp", _STRING, True),))
        own = bool(get("input_error")) and error is not None
        return cls(checked["id"], ramp, bool(get("final")), error, shadow, own)


@dataclass(frozen=True, slots=True)
class HopRequest:
    """The meta of a /v1/run frame: one item per row of its tensors."""

    items: Sequence[HopItem]
    bucket: int | None = None
    """The length bucket the rows are padded to (informational; a pod serves one bucket)."""

    def to_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"items": [item.to_meta() for item in self.items]}
        if self.bucket is not None:
            meta["bucket"] = self.bucket
        return meta

    @classmethod
    def from_meta(cls, meta: Any) -> HopRequest:
        if not isinstance(meta, dict):
            raise _named_error(meta, "meta", ())
        items = meta.get("items")
        if not isinstance(items, list) or not items:
            raise WireError(f"meta: field 'items' must be a non-empty list, got {items!r}"[:300])
        bucket = meta.get("bucket")
        if bucket is not None and type(bucket) is not int:
            raise WireError(f"meta: field 'bucket' must be an integer, got {bucket!r}")
        try:
            return cls([HopItem.from_meta(item) for item in items], bucket)
        except WireError:  # once more, naming the row
            for i, item in enumerate(items):
                HopItem.from_meta(item, f"items[{i}]")
            raise


@dataclass(frozen=True, slots=True)
class HopAnswer:
    """The meta of a pod's answer to a /v1/run frame: result k goes with row k of its `logits`."""

    results: Sequence[HopResult]
    service_ms: float = 0.0
    """The pod's time for the frame's first batch, hand-off to its inference thread included."""
    expected_ms: float = 0.0
    """What the pod expected that batch to take (the straggler detector compares the two)."""
    compute_ms: float = 0.0
    """The first batch's compute alone."""
    thresholds_version: int = 0
    """The version of the thresholds the pod decided the first batch's exits with (0: not said)."""

    def to_meta(self) -> dict[str, Any]:
        meta = {
            "results": [r.to_meta() for r in self.results],
            "service_ms": self.service_ms,
            "expected_ms": self.expected_ms,
            "compute_ms": self.compute_ms,
        }
        if self.thresholds_version:  # (left out at 0: the answer an older pod sent)
            meta["thresholds_version"] = self.thresholds_version
        return meta

    _TIMINGS = (("service_ms", _NUMBER, False), ("expected_ms", _NUMBER, False), ("compute_ms", _NUMBER, False))

    @classmethod
    def from_meta(cls, meta: Any) -> HopAnswer:
        if not isinstance(meta, dict):
            raise _named_error(meta, "meta", ())
        results = meta.get("results")
        if results is None:
            results = []  # every row then counts as unanswered
        if not isinstance(results, list):
            raise WireError(f"meta: field 'results' must be a list, got {results!r}"[:300])
        service, expected, compute = meta.get("service_ms"), meta.get("expected_ms"), meta.get("compute_ms")
        if not all(t is None or type(t) in _NUMBER for t in (service, expected, compute)):
            raise _named_error(meta, "meta", cls._TIMINGS)
        try:
            parsed = [HopResult.from_meta(r) for r in results]
        except WireError:  # once more, naming the row
            for k, r in enumerate(results):
                HopResult.from_meta(r, f"results[{k}]")
            raise
        version = meta.get("thresholds_version", 0)
        if isinstance(version, bool) or not isinstance(version, int):
            raise WireError(f"meta: field 'thresholds_version' must be an integer, got {version!r}"[:300])
        return cls(parsed, float(service or 0.0), float(expected or 0.0), float(compute or 0.0), version)
