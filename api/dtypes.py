"""The tensor dtypes exitplan supports: one table for the bundle manifest, ONNX Runtime, the wire
format between pods, request decoding and the load generator.

Each entry names the dtype three ways — numpy (`np.dtype(entry.numpy)`; this module does not import
numpy), ONNX Runtime's type string (`NodeArg.type`, e.g. `tensor(float)`) and the Open Inference
Protocol (KServe v2) datatype of requests (e.g. `FP32`) — and gives the values it holds: the integer
range, or for floats the largest finite magnitude. Look entries up with `by_numpy`, `by_onnx` and
`by_v2`; an unknown name raises `UnknownDType` listing the supported ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

DTypeName = Literal["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"]
"""The numpy names of the supported dtypes (the bundle manifest's `dtype` values)."""


class UnknownDType(ValueError):
    """A dtype name that is not in the table; the message lists the supported names of that kind."""


@dataclass(frozen=True, slots=True)
class DTypeInfo:
    numpy: DTypeName
    """numpy's name: `np.dtype(numpy)` is the dtype."""
    onnx: str
    """ONNX Runtime's type string of a tensor of this dtype (`NodeArg.type`)."""
    v2: str
    """Open Inference Protocol (KServe v2) datatype."""
    onnx_elem_type: int
    """ONNX `TensorProto` element type (for `onnx.helper.make_tensor_value_info`)."""
    itemsize: int
    """Bytes per element."""
    is_float: bool
    min: int | float
    """Smallest value: the integer minimum, or for floats the most negative finite value."""
    max: int | float
    """Largest value: the integer maximum (1 for bool), or for floats the largest finite value."""

    @property
    def is_bool(self) -> bool:
        return self.numpy == "bool"

    def describe_values(self) -> str:
        """What values this dtype holds, for error messages ("integers in [0, 255]")."""
        if self.is_bool:
            return "true or false (or 0 or 1)"
        if self.is_float:
            return f"finite numbers in [{self.min!r}, {self.max!r}]"
        return f"integers in [{self.min}, {self.max}]"


DTYPES: Final[tuple[DTypeInfo, ...]] = (
    DTypeInfo("bool", "tensor(bool)", "BOOL", 9, 1, False, 0, 1),
    DTypeInfo("uint8", "tensor(uint8)", "UINT8", 2, 1, False, 0, 2**8 - 1),
    DTypeInfo("int8", "tensor(int8)", "INT8", 3, 1, False, -(2**7), 2**7 - 1),
    DTypeInfo("int16", "tensor(int16)", "INT16", 5, 2, False, -(2**15), 2**15 - 1),
    DTypeInfo("int32", "tensor(int32)", "INT32", 6, 4, False, -(2**31), 2**31 - 1),
    DTypeInfo("int64", "tensor(int64)", "INT64", 7, 8, False, -(2**63), 2**63 - 1),
    DTypeInfo("float16", "tensor(float16)", "FP16", 10, 2, True, -65504.0, 65504.0),
    DTypeInfo("float32", "tensor(float)", "FP32", 1, 4, True, -3.4028234663852886e38, 3.4028234663852886e38),
    DTypeInfo("float64", "tensor(double)", "FP64", 11, 8, True, -1.7976931348623157e308, 1.7976931348623157e308),
)
"""Every supported dtype, in the order of `DTypeName`."""

NUMPY_NAMES: Final[tuple[str, ...]] = tuple(e.numpy for e in DTYPES)
ONNX_TYPES: Final[tuple[str, ...]] = tuple(e.onnx for e in DTYPES)
V2_DATATYPES: Final[tuple[str, ...]] = tuple(e.v2 for e in DTYPES)

_BY_NUMPY: Final[dict[str, DTypeInfo]] = {e.numpy: e for e in DTYPES}
_BY_ONNX: Final[dict[str, DTypeInfo]] = {e.onnx: e for e in DTYPES}
_BY_V2: Final[dict[str, DTypeInfo]] = {e.v2: e for e in DTYPES}


def by_numpy(name: object) -> DTypeInfo:
    """The entry for a numpy dtype name ("float32"; `str(np.dtype)` gives it)."""
    entry = _BY_NUMPY.get(str(name))
    if entry is None:
        raise UnknownDType(f"dtype {str(name)!r} is not supported; supported dtypes: {', '.join(NUMPY_NAMES)}")
    return entry


def by_onnx(type_: object) -> DTypeInfo:
    """The entry for an ONNX Runtime tensor type string ("tensor(float)")."""
    entry = _BY_ONNX.get(type_) if isinstance(type_, str) else None
    if entry is None:
        raise UnknownDType(f"ONNX type {type_!r} is not supported; supported types: {', '.join(ONNX_TYPES)}")
    return entry


def by_v2(datatype: object) -> DTypeInfo:
    """The entry for an Open Inference Protocol datatype ("FP32")."""
    entry = _BY_V2.get(datatype) if isinstance(datatype, str) else None
    if entry is None:
        raise UnknownDType(f"datatype {datatype!r} is not supported; supported datatypes: {', '.join(V2_DATATYPES)}")
    return entry
