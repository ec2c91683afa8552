"""`exitplan prepare --torch PKG.MODULE:FACTORY --data DATA.npz`: a PyTorch classifier to an early-exit bundle.

FACTORY() returns the model (a `torch.nn.Module`); it is put in eval mode and exported to ONNX in a
temporary directory, then the ONNX pipeline (:mod:`exitplan.prepare.from_onnx`) takes it from there.
The arrays of DATA.npz other than `label`, in the file's order, are the model's inputs: their names are
the ONNX input names and they are passed to `forward` positionally. The first two rows are the example
the exporter traces; axis 0 ("batch") of every input and of the output is free, and so is axis 1
("seq") of integer [N, L] inputs (token sequences). The exported model must reproduce the module on
the data (it would not where `forward` leaves torch, e.g. through numpy), and an export that fails
names the operator (and the module that calls it) when torch's message does.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from exitplan.prepare.build import BuildResult, PrepareError
from exitplan.prepare.user_data import DataError, check_finite, read_npz

if TYPE_CHECKING:
    import torch

OPSET = 17
CHECK_ROWS = 64
"""Data rows on which the exported model is compared with the module."""
EXPORT_YOURSELF = (
    "export the model to ONNX yourself (torch.onnx.export, with that part replaced by supported operators or "
    "given an ONNX symbolic) and run `exitplan prepare --onnx MODEL.onnx`"
)
_OP_PATTERNS = (
    re.compile(r"operator '([\w.:]+)'"),  # Exporting the operator 'aten::fft_fft' to ONNX opset version 17 ...
    re.compile(r"unrecognized namespace ([\w.:]+)"),  # a torch.library custom op
    re.compile(r"Fatal error: ([\w.:]+)\(-?\d+\) is not a registered function/op"),  # ONNX Runtime, unknown op
    re.compile(r"Could not find an implementation for (\w+)\(\d+\) node with name '([^']*)'"),
)


def load_factory(spec: str) -> Callable[[], Any]:
    """`PKG.MODULE:FACTORY` -> the callable, imported with the current directory on sys.path (as `python -m`)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise PrepareError(f"--torch {spec!r}: expected PKG.MODULE:FACTORY, e.g. mymodels.cnn:build")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise PrepareError(
            f"--torch {spec}: cannot import {module_name!r} ({err}); run from the directory that holds it, "
            f"or install it"
        ) from err
    except Exception as err:  # the user's module failed while importing
        raise PrepareError(f"--torch {spec}: importing {module_name!r} raised {type(err).__name__}: {err}") from err
    factory = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            callables = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            raise PrepareError(f"--torch {spec}: {module_name} has no {attr!r}; it defines {callables[:20]}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise PrepareError(
            f"--torch {spec}: {attr} is a {type(factory).__name__}, not a callable that builds the model"
        )
    return factory


def make_module(factory: Callable[[], Any], what: str) -> Any:
    """FACTORY() checked to be an nn.Module, in eval mode."""
    from torch import nn

    try:
        module = factory()
    except Exception as err:
        raise PrepareError(f"{what}() raised {type(err).__name__}: {err}") from err
    if not isinstance(module, nn.Module):
        shown = repr(module)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise PrepareError(
            f"{what}() returned {type(module).__module__}.{type(module).__qualname__} ({shown}), not a "
            f"torch.nn.Module; the factory must return the model"
        )
    return module.eval()


def read_inputs(path: Path) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """DATA.npz: the model's inputs in the file's order (every array but `label`), and `label`."""
    arrays = read_npz(path, "forward argument")
    label = arrays.pop("label", None)
    if not arrays:
        raise DataError(f"{path}: no input arrays (only `label`); save one array per forward argument")
    for name, array in arrays.items():
        if array.dtype.kind not in "biuf" or array.ndim == 0:
            raise DataError(
                f"{path}: array {name!r} is {array.dtype.name} {list(array.shape)}; inputs are numeric [N, ...]"
            )
        check_finite(path, name, array)
    return arrays, label


def free_axes(arrays: Mapping[str, np.ndarray], output: str = "logits") -> dict[str, dict[int, str]]:
    """Axis 0 of every input and the output is the batch; axis 1 of integer [N, L] inputs the sequence."""
    axes: dict[str, dict[int, str]] = {}
    for name, array in arrays.items():
        axes[name] = {0: "batch", 1: "seq"} if array.dtype.kind in "iu" and array.ndim == 2 else {0: "batch"}
    axes[output] = {0: "batch"}
    return axes


def _scope(module: Any, example: tuple[torch.Tensor, ...], onnx_path: Path | None, op: str) -> str | None:
    """Where `op` is called: the submodule's path, from a TorchScript trace (a torch operator `ns::name`)
    or from the exported graph's node names (`/path/to/module/Op`, an ONNX operator `domain:Op`)."""
    import torch

    if "::" in op:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            traced = torch.jit.trace(module, example, check_trace=False)
        scope = next((n.scopeName() for n in traced.inlined_graph.nodes() if n.kind() == op), None)
        return None if scope is None else scope.split("/")[-1].removeprefix("__module").lstrip(".")
    if onnx_path is None:
        return None
    import onnx

    domain, _, op_type = op.rpartition(":")
    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    node = next((n for n in graph.node if n.op_type == op_type and n.domain == domain), None)
    return None if node is None else node.name.rsplit("/", 1)[0].split("/")[-1]


def _module_calling(module: Any, example: tuple[torch.Tensor, ...], onnx_path: Path | None, op: str) -> str | None:
    """The submodule (path and class) whose forward calls `op`, if it can be found."""
    try:
        path = _scope(module, example, onnx_path, op)
        if path is None:
            return None
        owner = module.get_submodule(path) if path else module
    except Exception:  # best effort: the message names the operator either way
        return None
    return f"{path or '(the model itself)'} ({type(owner).__name__})"


def _failure(
    err: BaseException, module: Any, example: tuple[torch.Tensor, ...], what: str, onnx_path: Path | None = None
) -> PrepareError:
    text = str(err).strip()
    op = next((m.group(1) for p in _OP_PATTERNS if (m := p.search(text))), None)
    first = text.splitlines()[0] if text else type(err).__name__
    if onnx_path is not None:
        first = first.replace(f"Load model from {onnx_path} failed:", "").strip()
    if op is None:
        return PrepareError(
            f"{what}: the export to ONNX failed ({type(err).__name__}: {first[:300]}); {EXPORT_YOURSELF}"
        )
    where = _module_calling(module, example, onnx_path, op)
    return PrepareError(
        f"{what}: operator {op!r}{f' in module {where}' if where else ''} cannot be exported to ONNX (opset {OPSET}) "
        f"in a form ONNX Runtime runs ({first[:240]}); {EXPORT_YOURSELF}"
    )


def export_onnx(module: Any, arrays: Mapping[str, np.ndarray], path: Path, what: str) -> list[str]:
    """Export `module` with the arrays' names as inputs (traced on their first 2 rows) to `path`; returns
    the tracer's warnings. Raises DataError when forward fails on the data, PrepareError naming the
    unsupported operator (and its module) where torch says which."""
    import torch

    example = tuple(torch.from_numpy(np.ascontiguousarray(a[:2])) for a in arrays.values())
    try:
        with torch.no_grad():
            module(*example)
    except Exception as err:
        described = ", ".join(f"{n!r} {a.dtype.name} {list(a.shape)}" for n, a in arrays.items())
        raise DataError(
            f"{what}: forward on the data's first rows raised {type(err).__name__}: {str(err).strip()[:300]}; it is "
            f"called with the arrays other than `label`, in the file's order: {described}"
        ) from err
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        try:
            torch.onnx.export(
                module,
                example,
                str(path),
                input_names=list(arrays),
                output_names=["logits"],
                dynamic_axes=free_axes(arrays),
                opset_version=OPSET,
                do_constant_folding=True,
                dynamo=False,
            )
        except Exception as err:
            raise _failure(err, module, example, what) from err
    module.eval()  # the exporter restores the mode it found; keep eval whatever the factory returned
    # torch.jit.TracerWarning is torch's public name for the class, but torch.jit's __all__ leaves it out
    tracer_warning = torch.jit.TracerWarning  # type: ignore[attr-defined]
    return [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if issubclass(w.category, tracer_warning)]


def _first_tensor(out: Any) -> Any:
    if isinstance(out, (tuple, list)) and out:
        return _first_tensor(out[0])
    if isinstance(out, Mapping) and out:
        return _first_tensor(next(iter(out.values())))
    return out


def verify_export(
    module: Any, arrays: Mapping[str, np.ndarray], path: Path, what: str, tolerance: float, traced: list[str]
) -> float:
    """Max |ONNX - module| of the first output on the first CHECK_ROWS rows; a PrepareError above `tolerance`."""
    import onnxruntime as ort
    import torch

    rows = {name: np.ascontiguousarray(a[:CHECK_ROWS]) for name, a in arrays.items()}
    try:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        got = session.run([session.get_outputs()[0].name], rows)[0]
    except Exception as err:
        raise _failure(err, module, tuple(torch.from_numpy(a[:2]) for a in rows.values()), what, path) from err
    with torch.no_grad():
        want = _first_tensor(module(*(torch.from_numpy(a) for a in rows.values())))
    if not isinstance(want, torch.Tensor):
        raise PrepareError(f"{what}: forward returned {type(want).__name__}, not class scores (a tensor)")
    want = want.detach().float().numpy()
    diff = float(np.abs(got - want).max()) if got.shape == want.shape else float("inf")
    if not diff <= tolerance:
        hint = f"; the tracer warned: {traced[0]}" if traced else ""
        raise PrepareError(
            f"{what}: the exported ONNX model differs from the module by {diff:.3g} (shapes {list(got.shape)} vs "
            f"{list(want.shape)}) on {len(got)} rows: forward depends on something the exporter cannot trace (numpy, "
            f"Python values, data-dependent control flow){hint}; {EXPORT_YOURSELF}"
        )
    return diff


def from_torch(
    factory: str | Callable[[], Any],
    data: str | Path,
    out: str | Path,
    **options: Any,
) -> BuildResult:
    """Build (or reuse) an early-exit bundle at `out` from a PyTorch classifier: `factory` is
    "PKG.MODULE:FACTORY" or a callable returning the `nn.Module`; `data` is DATA.npz (the forward arguments
    in the file's order, keyed by the names the bundle's inputs get, and optional `label`); `options` are
    those of :func:`exitplan.prepare.from_onnx.from_onnx` (force, bar, threads and OnnxOptions' fields).
    Raises PrepareError, DataError or GraphError; nothing is left at `out` unless the bundle is complete."""
    if isinstance(factory, str):
        what = f"--torch {factory}"
        build = load_factory(factory)
        default_name = factory.partition(":")[0].rsplit(".", 1)[-1]
    else:
        what = getattr(factory, "__qualname__", repr(factory))
        build, default_name = factory, getattr(factory, "__name__", "model")
    arrays, _ = read_inputs(Path(data))
    module = make_module(build, what)
    options.setdefault("name", default_name)
    options.setdefault("source", what)
    with tempfile.TemporaryDirectory(prefix="exitplan-torch-") as tmp:
        path = Path(tmp) / "model.onnx"
        traced = export_onnx(module, arrays, path, what)
        verify_export(module, arrays, path, what, float(options.get("tolerance", 1e-4)), traced)
        return run_onnx_pipeline(path, data, out, what, options)


def run_onnx_pipeline(
    model: Path, data: str | Path, out: str | Path, what: str, options: dict[str, Any]
) -> BuildResult:
    """`from_onnx` on an exported model; errors name `what`, not the temporary file."""
    from exitplan.prepare.from_onnx import from_onnx
    from exitplan.prepare.onnx_graph import GraphError

    try:
        return from_onnx(model, data, out, **options)
    except (PrepareError, GraphError, DataError) as err:
        raise type(err)(str(err).replace(str(model), what)) from err
