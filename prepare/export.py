"""Exporting one block or ramp (a torch module in eval mode) to an ONNX file.

Free axes are named "batch" and "seq" on every graph input and output, so a session can fix the
sequence length per bucket with `SessionOptions.add_free_dimension_override_by_name("seq", L)`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    import onnx

OPSET = 17


class ExportError(RuntimeError):
    """A block or ramp that did not export to a usable ONNX file."""


def export_module(
    module: nn.Module,
    example: Sequence[torch.Tensor],
    path: Path,
    *,
    input_names: Sequence[str],
    output_names: Sequence[str],
    free_axes: Mapping[str, Mapping[int, str]],
) -> Path:
    """Write `module` (called on `example`) to `path`; `free_axes[tensor] = {axis: "batch"|"seq"}`."""
    import onnx

    module.eval()
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            tuple(example),
            str(path),
            input_names=list(input_names),
            output_names=list(output_names),
            dynamic_axes={name: dict(axes) for name, axes in free_axes.items()},
            opset_version=OPSET,
            do_constant_folding=True,
            dynamo=False,
        )
    model = onnx.load(str(path))
    _name_free_axes(model, free_axes, path)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def _name_free_axes(model: onnx.ModelProto, free_axes: Mapping[str, Mapping[int, str]], path: Path) -> None:
    """Make sure every declared free axis carries its name (and nothing else is left symbolic)."""
    for value in list(model.graph.input) + list(model.graph.output):
        axes = free_axes.get(value.name, {})
        dims = value.type.tensor_type.shape.dim
        for axis, dim in enumerate(dims):
            if axis in axes:
                dim.ClearField("dim_value")
                dim.dim_param = axes[axis]
            elif dim.HasField("dim_param"):
                declared = {a: n for a, n in axes.items()} or "none"
                raise ExportError(
                    f"{path}: tensor {value.name!r} axis {axis} came out of the export with a free size (the exporter "
                    f"named it {dim.dim_param!r}, which is only its guess at where the size comes from), but the free "
                    f"axes declared for this tensor are {declared}: its size follows an input axis the export did not "
                    f"pin, e.g. padding computed from the input's shape. Export the model whole and use `exitplan "
                    f"prepare --onnx`, which pins every axis except batch and sequence to the data's sizes"
                )
