"""A batch kept on the device from a worker's first block to its last (`BundleRuntime(resident=True)`).

The host path (`BundleRuntime.run_range`) hands ONNX Runtime numpy arrays: on a GPU every block's inputs are
copied host -> device and its outputs device -> host, even between two blocks of one worker. Here the
entering state is copied to the device once, every block is IO-bound to the tensors the previous blocks
left there, a ramp's logits alone come back to the host (the exit decision reads them: a few numbers per
row), rows that exit are dropped from the state on the device (a Gather on axis 0, one small session per
dtype), and only what leaves the worker -- the state the next split needs -- is copied back at the end.

The Gather models are written here as ONNX protobuf bytes (`gather_model`): the worker image carries ONNX
Runtime but not the onnx package. On the CPU provider the same path runs with CPU tensors (what the tests
check against the host path); its point is the GPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort

from exitplan.worker_image.range_result import RampExit, RangeResult, softmax

if TYPE_CHECKING:
    from exitplan.worker_image.bundle_runtime import BundleRuntime

GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")
ONNX_TYPES = {
    np.dtype(np.float32): 1,
    np.dtype(np.uint8): 2,
    np.dtype(np.int8): 3,
    np.dtype(np.int32): 6,
    np.dtype(np.int64): 7,
    np.dtype(np.bool_): 9,
    np.dtype(np.float16): 10,
    np.dtype(np.float64): 11,
}
"""numpy dtype -> ONNX TensorProto elem_type, for the state tensors a Gather may drop rows of."""


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes | int | str) -> bytes:
    """One protobuf field: a varint (int) or a length-delimited one (bytes, str)."""
    if isinstance(payload, int):
        return _varint(number << 3) + _varint(payload)
    data = payload.encode() if isinstance(payload, str) else payload
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _value_info(name: str, elem_type: int, rank: int) -> bytes:
    """ValueInfoProto: `name`, a tensor of `elem_type` with `rank` free dimensions (named d0, d1, ...)."""
    shape = b"".join(_field(1, _field(2, f"{name}_d{i}")) for i in range(rank))  # dim { dim_param }
    tensor_type = _field(1, elem_type) + _field(2, shape)
    return _field(1, name) + _field(2, _field(1, tensor_type))


def gather_model(elem_type: int, rank: int, opset: int = 13) -> bytes:
    """ONNX ModelProto bytes: out = Gather(data, rows, axis=0), `data` of `elem_type` and `rank` free
    dimensions, `rows` int64 [n] -- the rows of a state tensor that go on."""
    attribute = _field(1, "axis") + _field(3, 0) + _field(20, 2)  # name, i, type INT
    node = _field(1, "data") + _field(1, "rows") + _field(2, "out") + _field(3, "keep_rows")
    node += _field(4, "Gather") + _field(5, attribute)
    graph = _field(1, node) + _field(2, "keep_rows")
    graph += _field(11, _value_info("data", elem_type, rank)) + _field(11, _value_info("rows", 7, 1))
    graph += _field(12, _value_info("out", elem_type, rank))
    opset_id = _field(1, "") + _field(2, opset)
    return _field(1, 8) + _field(7, graph) + _field(8, opset_id)  # ir_version 8, graph, opset_import


class ResidentRange:
    """Runs a runtime's block range with the batch on `device` ("cuda" or "cpu")."""

    def __init__(self, device: str, providers: Sequence[str]) -> None:
        self.device = device
        self.providers = list(providers)
        self._gather: dict[tuple[int, int], ort.InferenceSession] = {}

    @classmethod
    def for_providers(cls, providers: Sequence[str]) -> ResidentRange:
        return cls("cuda" if providers and providers[0] in GPU_PROVIDERS else "cpu", providers)

    def _to_device(self, array: np.ndarray) -> ort.OrtValue:
        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), self.device, 0)

    @staticmethod
    def _to_host(value: ort.OrtValue, n_rows: int) -> np.ndarray:
        """What leaves the worker; no rows left: an empty array of the tensor's row shape (no copy)."""
        if n_rows == 0:
            return np.empty((0, *value.shape()[1:]), dtype=_numpy_dtype(value.data_type()))
        return np.asarray(value.numpy())

    def keep_rows(self, value: ort.OrtValue, rows: np.ndarray) -> ort.OrtValue:
        """`value`'s rows `rows` (axis 0), computed where `value` lies."""
        dtype = _numpy_dtype(value.data_type())
        elem = ONNX_TYPES.get(dtype)
        if elem is None:
            raise TypeError(f"cannot drop rows of a {dtype} tensor on the device")
        key = (elem, len(value.shape()))
        if key not in self._gather:
            options = ort.SessionOptions()
            options.log_severity_level = 3
            self._gather[key] = ort.InferenceSession(gather_model(*key), options, providers=self.providers)
        session = self._gather[key]
        binding = session.io_binding()
        binding.bind_ortvalue_input("data", value)
        binding.bind_ortvalue_input("rows", self._to_device(rows.astype(np.int64)))
        binding.bind_output("out", self.device, 0)
        session.run_with_iobinding(binding)
        return binding.get_outputs()[0]

    def _run(
        self,
        runtime: BundleRuntime,
        rel: str,
        bucket: int,
        inputs: Sequence[str],
        outputs: Sequence[str],
        live: Mapping[str, ort.OrtValue],
        host: Sequence[str] = (),
    ) -> list[ort.OrtValue]:
        """One block's or ramp's session IO-bound: inputs from `live`, outputs on the device (`host` ones on
        the host)."""
        session = runtime.session(rel, bucket)
        binding = session.io_binding()
        for name in inputs:
            binding.bind_ortvalue_input(name, live[name])
        for name in outputs:
            binding.bind_output(name, "cpu" if name in host else self.device, 0)
        session.run_with_iobinding(binding)
        return list(binding.get_outputs())

    def run(
        self, runtime: BundleRuntime, state: Mapping[str, np.ndarray], bucket: int, limits: Mapping[str, float]
    ) -> RangeResult:
        """`run_range`'s semantics (earliest exit at or above its ramp's threshold, the final head answering the
        rest when the range ends the model) with the batch on the device; `state` already checked."""
        manifest = runtime.manifest
        live = {name: self._to_device(array) for name, array in state.items()}
        n = next(iter(state.values())).shape[0]
        rows = np.arange(n)
        exits: list[RampExit] = []
        for index in range(runtime.first_block, runtime.last_block + 1):
            if rows.size == 0:
                break
            block = manifest.blocks[index]
            live.update(zip(block.outputs, self._run(runtime, block.file, bucket, block.inputs, block.outputs, live)))
            for ramp in manifest.ramps_in(index, index):
                if rows.size == 0:
                    break
                limit = limits.get(ramp.name)
                if not ramp.final and (limit is None or limit > 1.0):
                    continue
                (value,) = self._run(runtime, ramp.file, bucket, ramp.inputs, [ramp.output], live, host=[ramp.output])
                logits = np.asarray(value.numpy())
                conf = softmax(logits).max(axis=-1)
                leave = np.ones(rows.size, dtype=bool) if ramp.final else conf >= limit
                for i in np.flatnonzero(leave):
                    exits.append(RampExit(int(rows[i]), ramp.name, logits[i], float(conf[i])))
                if leave.any():
                    keep = np.flatnonzero(~leave)
                    rows = rows[keep]
                    if keep.size:
                        live = {k: self.keep_rows(v, keep) for k, v in live.items()}
            wanted = manifest.live_after(index)
            live = {name: live[name] for name in wanted if name in live}
        out = [] if runtime.ends_model else manifest.live_after(runtime.last_block)
        out_state = {name: self._to_host(live[name], rows.size) for name in out if name in live}
        if runtime.ends_model:
            rows = rows[:0]
        return RangeResult(exits=exits, rows=rows, state=out_state)


def _numpy_dtype(onnx_type: str) -> np.dtype:
    """numpy dtype of an OrtValue's `data_type()` ("tensor(float16)", ...)."""
    name = onnx_type.removeprefix("tensor(").removesuffix(")")
    return np.dtype({"float": "float32", "double": "float64", "bool": "bool"}.get(name, name))
