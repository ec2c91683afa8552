"""Bundles served in reduced precision: an fp32 bundle converted to fp16, checked against its source.

`convert_bundle` writes a copy of a bundle whose blocks and ramps compute in fp16 (ONNX Runtime's float16
converter, `onnxruntime.transformers.float16`): the activations between blocks are fp16 on both sides of
every boundary (no cast between two blocks of one worker; `bundle.yaml`'s `dtype` says so), the model's
own inputs keep their dtype (token ids stay int64, an image stays fp32 and is cast inside the first block),
and every ramp's logits come out in fp32 (the answers' scores and the exit decisions read fp32).

The converted chain is run on the bundle's held-out inputs beside the fp32 chain: the share of inputs
whose final answer agrees, the largest difference of the final softmax scores, and the agreement of each
exit ramp's answer are recorded in `bundle.yaml` (`precision`), and the calibration window is built again
from the converted chain's ramps (thresholds are tuned on the precision that is served). A conversion
whose final answers agree on fewer than `MIN_AGREEMENT` of the inputs is refused with the figure.

bf16 is refused with the reason: ONNX Runtime's CUDA provider lacks bf16 kernels for the attention and
normalisation ops these models use, so a bf16 bundle would run cast-heavy or fall back to the CPU.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import onnx

from exitplan.api.bundle import BundleError, BundleManifest, PrecisionRecord, read_manifest, record_digests
from exitplan.api.bundle import write_manifest as write_bundle_manifest
from exitplan.prepare.check import PRECISION_SLACK
from exitplan.prepare.measure import all_ramp_logits, load_heldout
from exitplan.prepare.window import build_window
from exitplan.worker_image.bundle_runtime import BundleRuntime, softmax

Precision = Literal["fp32", "fp16", "bf16"]
"""A precision's name, as bundle.yaml's `precision.name` records it."""
PRECISIONS: tuple[Precision, ...] = ("fp32", "fp16", "bf16")
DTYPES = {"fp32": "float32", "fp16": "float16"}
MIN_AGREEMENT = 0.995
"""The converted chain's final answers must agree with the fp32 chain's on this share of the held-out inputs."""
FLOAT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE)


class PrecisionError(ValueError):
    """A precision that cannot be served: unknown, unsupported, or a conversion that changes the answers."""


@dataclass
class ConversionReport:
    precision: str
    record: PrecisionRecord
    directory: Path


def _float_inputs(model: onnx.ModelProto, names: set[str]) -> list[str]:
    return [i.name for i in model.graph.input if i.name in names and i.type.tensor_type.elem_type in FLOAT_TYPES]


def convert_file(source: Path, target: Path, keep: list[str]) -> None:
    """One ONNX file to fp16, `keep` (input and output names) left in their dtype."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = onnx.load(str(source))
    try:
        converted = convert_float_to_float16(model, keep_io_types=keep, disable_shape_infer=False)
    except Exception as err:  # the converter raises assorted types for graphs it cannot handle
        raise PrecisionError(f"{source}: ONNX Runtime's float16 converter failed: {err}") from err
    onnx.save(converted, str(target))


def check_precision(precision: str) -> Precision:
    known = next((p for p in PRECISIONS if p == precision), None)
    if known is None:
        raise PrecisionError(f"precision {precision!r} is not one of {list(PRECISIONS)}")
    if known == "bf16":
        raise PrecisionError(
            "bf16 is not served: ONNX Runtime's CUDA provider has no bf16 kernels for the attention and "
            "normalisation ops of these models; use --precision fp16 (tensor cores run it at the same speed)"
        )
    return known


def convert_bundle(
    source: Path, target: Path, precision: str, *, providers: tuple[str, ...] = ("CPUExecutionProvider",)
) -> ConversionReport:
    """Write `source` converted to `precision` into `target` (replaced), checked on the held-out data with
    `providers`; raises PrecisionError when it changes too many answers (nothing is left at `target`)."""
    chosen = check_precision(precision)
    manifest = read_manifest(source)
    if manifest.decoder is not None:
        raise PrecisionError(f"{source}: generation bundles are served in fp32 only")
    if manifest.dtype != "float32":
        raise PrecisionError(f"{source}: the bundle is already {manifest.dtype}; convert its fp32 source")
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("profiles", "__pycache__", ".complete.json"))
    try:
        report = _convert_in_place(source, target, manifest, chosen, providers)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    return report


def source_dir(target: Path, precision: str) -> Path:
    """Where `exitplan prepare --precision P --out TARGET` keeps the fp32 bundle it converts: TARGET itself for
    fp32, else the sibling `TARGET-fp32` (kept, so that a rerun reuses the build and converts again)."""
    check_precision(precision)
    return target if precision == "fp32" else target.with_name(f"{target.name}-fp32")


def convert_prepared(built: Path, target: Path, precision: str, *, force: bool = False) -> ConversionReport:
    """`exitplan prepare --precision`: the fp32 bundle `built` converted into `target`, which may hold an earlier
    conversion of the same model (replaced) but not another model's bundle or other files, unless `force`."""
    if target.exists() and not force and any(target.iterdir()):
        try:
            held = read_manifest(target).name
        except BundleError:
            raise PrecisionError(f"{target} exists and is not a bundle; choose another --out or remove it") from None
        name = read_manifest(built).name
        if held != name:
            raise PrecisionError(
                f"{target} holds the bundle of another model, {held}, not {name}; pass --force to replace it, "
                "or choose another --out"
            )
    return convert_bundle(built, target, precision)


def _convert_in_place(
    source: Path, target: Path, manifest: BundleManifest, precision: Precision, providers: tuple[str, ...]
) -> ConversionReport:
    model_inputs = {t.name for t in manifest.inputs}
    if precision != "fp32":
        for block in manifest.blocks:
            keep = _float_inputs(onnx.load(str(source / block.file), load_external_data=False), model_inputs)
            convert_file(source / block.file, target / block.file, keep)
        for ramp in manifest.ramps:
            keep = _float_inputs(onnx.load(str(source / ramp.file), load_external_data=False), model_inputs)
            convert_file(source / ramp.file, target / ramp.file, [*keep, ramp.output])
    converted = manifest.model_copy(update={"dtype": DTYPES[precision], "digests": {}})
    write_bundle_manifest(target, converted)
    record = _agreement(source, target, manifest, precision, providers)
    if record.final_agreement < MIN_AGREEMENT:
        raise PrecisionError(
            f"{precision}: the converted chain's final answers agree with fp32 on {record.final_agreement:.2%} of "
            f"{record.heldout_rows} held-out inputs (at least {MIN_AGREEMENT:.1%} needed); serve this model in fp32"
        )
    write_bundle_manifest(target, converted.model_copy(update={"precision": record}))
    record_digests(target)
    return ConversionReport(precision, record, target)


def _agreement(
    source: Path, target: Path, manifest: BundleManifest, precision: Precision, providers: tuple[str, ...]
) -> PrecisionRecord:
    """Run both chains on the held-out data; rebuild the converted bundle's calibration window."""
    heldout = load_heldout(source, manifest)
    reference = all_ramp_logits(BundleRuntime(source, providers=providers), heldout)  # fp32 on the same device
    runtime = BundleRuntime(target, providers=providers)
    logits = all_ramp_logits(runtime, heldout)
    final = manifest.final_ramp().name
    if not np.isfinite(logits[final]).all():
        raise PrecisionError(f"{precision}: the converted chain gives non-finite logits (fp16 overflow); serve in fp32")
    agree = float(np.mean(logits[final].argmax(-1) == reference[final].argmax(-1)))
    score_diff = float(np.max(np.abs(softmax(logits[final]) - softmax(reference[final]))))
    ramps = {
        r.name: float(np.mean(logits[r.name].argmax(-1) == reference[r.name].argmax(-1))) for r in manifest.exit_ramps()
    }
    if manifest.exit_ramps():
        build_window(runtime, heldout, logits).save(target / "data" / "window.npz")
    return PrecisionRecord(
        name=precision,
        source_dtype="float32",
        final_agreement=agree,
        max_score_diff=score_diff,
        ramp_agreement=ramps,
        heldout_rows=len(heldout),
        checked_with=",".join(providers),
    )


def recheck(directory: Path, *, providers: tuple[str, ...] = ("CPUExecutionProvider",)) -> PrecisionRecord | None:
    """The agreement of a converted bundle's chain with itself as recorded: None for an fp32 bundle; raises
    BundleError when the recorded figure cannot be reproduced (a file changed since it was converted)."""
    manifest = read_manifest(directory)
    record = manifest.precision
    if record is None or record.name == "fp32":
        return None
    heldout = load_heldout(directory, manifest)
    logits = all_ramp_logits(BundleRuntime(directory, providers=providers), heldout)
    final = logits[manifest.final_ramp().name]
    if not np.isfinite(final).all():
        raise BundleError(f"{directory}: the {record.name} chain gives non-finite logits on the held-out data")
    if heldout.full_pred is not None:
        agree = float(np.mean(final.argmax(-1) == heldout.full_pred))
        if agree + PRECISION_SLACK < record.final_agreement:
            raise BundleError(
                f"{directory}: the {record.name} chain agrees with the source on {agree:.2%} of the held-out inputs, "
                f"bundle.yaml records {record.final_agreement:.2%}; convert the bundle again"
            )
    return record
