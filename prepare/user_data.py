"""A user's data for `exitplan prepare`: one array per model input, keyed by the input's name.

`DATA.npz` holds, for N samples, one array per input of the model (e.g. `pixels` [N, 1, 28, 28]
float32, or `input_ids` + `attention_mask` [N, L] int64) and optionally `label` [N] (integer class
indices). Every problem is a :class:`DataError` that names the file, the array and what to change.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper


class DataError(ValueError):
    """The data file does not fit the model; the message says what is wrong and what to do."""


@dataclass(frozen=True)
class InputInfo:
    """One graph input of an ONNX model."""

    name: str
    dtype: np.dtype
    shape: tuple[int | str | None, ...]
    """Fixed sizes as ints; free axes as their symbolic name (or None when unnamed)."""

    def describe(self) -> str:
        dims = ", ".join(
            "N" if i == 0 else str(d) if isinstance(d, int) else (d or "?") for i, d in enumerate(self.shape)
        )
        return f"{self.name!r} [{dims}] {self.dtype.name}"


def model_inputs(model: onnx.ModelProto) -> list[InputInfo]:
    """The graph inputs that are not initializers, in order."""
    inits = {i.name for i in model.graph.initializer}
    found = []
    for value in model.graph.input:
        if value.name in inits:
            continue
        tensor = value.type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim)
        found.append(InputInfo(value.name, np.dtype(helper.tensor_dtype_to_np_dtype(tensor.elem_type)), dims))
    return found


@dataclass
class UserData:
    inputs: dict[str, np.ndarray]
    """One array per model input, [N, ...]."""
    label: np.ndarray | None
    """[N] integer class indices, when the file has them."""

    def __len__(self) -> int:
        return int(next(iter(self.inputs.values())).shape[0])

    def take(self, rows: np.ndarray) -> UserData:
        return UserData({k: v[rows] for k, v in self.inputs.items()}, None if self.label is None else self.label[rows])


def read_npz(path: Path, what: str = "model input") -> dict[str, np.ndarray]:
    """Every array of the .npz at `path`, in the file's order; `what` names what each array is for."""
    if not path.is_file():
        raise DataError(f"{path}: no such file; pass an .npz with one array per {what} (numpy.savez)")
    try:
        with np.load(path, allow_pickle=False) as data:
            if not isinstance(data, np.lib.npyio.NpzFile):
                raise DataError(f"{path}: a single array, not an .npz; save one array per {what} with numpy.savez")
            return {name: data[name] for name in data.files}
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise DataError(f"{path}: not a readable .npz file ({err}); save the data with numpy.savez") from err


def _check_input(path: Path, info: InputInfo, array: np.ndarray) -> None:
    where = f"{path}: array {info.name!r}"
    if array.dtype != info.dtype:
        raise DataError(
            f"{where} is {array.dtype.name} but the model input {info.describe()} takes {info.dtype.name}; "
            f"save it as {info.dtype.name}"
        )
    if array.ndim != len(info.shape):
        raise DataError(
            f"{where} has shape {list(array.shape)} ({array.ndim} dimensions) but the model input "
            f"{info.describe()} has {len(info.shape)}; the first axis counts samples"
        )
    for axis, (size, want) in enumerate(zip(array.shape, info.shape, strict=True)):
        if axis > 0 and isinstance(want, int) and want > 0 and size != want:
            raise DataError(
                f"{where} has size {size} on axis {axis} but the model input {info.describe()} needs {want}"
            )


def check_finite(path: Path, name: str, array: np.ndarray) -> None:
    """A DataError naming the first row of a float array that holds NaN or an infinite value."""
    if array.dtype.kind != "f" or array.size == 0:
        return
    bad = ~np.isfinite(array.reshape(array.shape[0], -1))
    rows = np.flatnonzero(bad.any(axis=1))
    if rows.size:
        first = int(rows[0])
        where = int(np.argmax(bad[first]))
        value = array.reshape(array.shape[0], -1)[first, where]
        raise DataError(
            f"{path}: array {name!r} holds {value} in {rows.size} row(s), the first row {first} (position {where} of "
            f"that row); remove those rows or replace the values before preparing"
        )


def load_data(path: Path, inputs: list[InputInfo]) -> UserData:
    """The arrays of `path` checked against the model's inputs (names, dtypes, ranks, fixed sizes,
    one sample count) and the optional `label`."""
    path = Path(path)
    arrays = read_npz(path)
    names = [i.name for i in inputs]
    missing = [i for i in inputs if i.name not in arrays]
    if missing:
        raise DataError(
            f"{path}: no array for the model input(s) {', '.join(i.describe() for i in missing)}; "
            f"the file holds {sorted(arrays)}. Key each array by the model input's name"
        )
    extra = sorted(set(arrays) - set(names) - {"label"})
    if extra:
        raise DataError(f"{path}: arrays {extra} are not inputs of the model (its inputs: {names}; plus `label`)")
    for info in inputs:
        _check_input(path, info, arrays[info.name])
        check_finite(path, info.name, arrays[info.name])
    counts = {name: int(arrays[name].shape[0]) for name in names}
    if len(set(counts.values())) != 1:
        raise DataError(f"{path}: the arrays hold different numbers of samples {counts}; each needs one row per sample")
    n = next(iter(counts.values()))
    label = arrays.get("label")
    if label is not None:
        if label.ndim != 1 or label.shape[0] != n or label.dtype.kind not in "iu":
            raise DataError(
                f"{path}: `label` must be [N] integer class indices with N = {n}; got {label.dtype.name} {list(label.shape)}"
            )
        label = label.astype(np.int64)
    return UserData({name: arrays[name] for name in names}, label)
