"""`exitplan check BUNDLE`: verify a finished bundle end to end before anyone serves it.

1. Load: bundle.yaml and every block and ramp ONNX file, through `BundleRuntime` (which checks the
   tensor names and input dtypes of each file against bundle.yaml), one session per length bucket.
2. Warm-up: one batch of dummy inputs through every block and ramp at every bucket, timed; each
   ramp's output must be [batch, ..., len(labels)].
3. Held-out chain: every held-out input through all blocks and ramps (no exits), in batches. The
   chained final answer must equal `full_pred` (the answer recorded at build time); with a source
   model (the unsplit ONNX model), its output on the same inputs must be within a tolerance of
   the final ramp's logits.
4. Exit ramps: agreement of each ramp's argmax with the chained final answer, accuracy against the
   labels, and the saving and cost per input exiting there (prepare/window.py's definition: read
   from data/window.npz, or measured again with `measure=True`).

`check_bundle` raises `BundleError` when the bundle cannot be loaded or run (the message names the
file and the tensor at fault) and otherwise returns a `CheckReport` whose `failures` list the
checks that failed (empty: the bundle is fine).

Held-out data is read and batched by prepare/measure.py (`load_heldout`, `heldout_batches`), in any
format it knows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as _ort_state

from exitplan.api.bundle import BundleError, BundleManifest, read_manifest
from exitplan.prepare.measure import Heldout, heldout_batches, load_heldout
from exitplan.prepare.window import WINDOW_BATCH_SIZES, measure_savings, ramp_window, window_bucket
from exitplan.worker_image.bundle_runtime import BATCH_DIM, SEQ_DIM, BundleRuntime, StateError, derived_inputs

DEFAULT_TOLERANCE = 1e-4
"""Largest max |difference| allowed between the chained final logits and the source model's output."""
DEFAULT_BATCH = 32
PRECISION_SLACK = 0.01
"""How far below its recorded agreement with the fp32 source a converted bundle's chain may read (the recorded
figure was measured on another run, possibly another device)."""
WINDOW = "data/window.npz"
_RUN_ERRORS: tuple[type[Exception], ...] = (
    StateError,
    _ort_state.Fail,
    _ort_state.InvalidArgument,
    _ort_state.RuntimeException,
    _ort_state.NotImplemented,
    _ort_state.EPFail,
)
"""What running a block, a ramp or the source model raises for a bundle that does not fit together."""


@dataclass
class FileCheck:
    kind: str
    """`block` or `ramp`."""
    name: str
    file: str
    inputs: list[str]
    outputs: list[str]


@dataclass
class BucketWarmup:
    bucket: int
    batch: int
    first_ms: float
    """First run of one batch through every block and ramp (ONNX Runtime's first-run allocations included)."""
    warm_ms: float
    """A second run of the same batch."""


@dataclass
class RampCheck:
    name: str
    after: int
    agreement: float
    """Fraction of held-out inputs whose ramp argmax equals the chained final answer."""
    accuracy: float
    """Fraction of held-out inputs whose ramp argmax equals the label."""
    saving_ms: float | None
    """Latency saved by exiting here: the blocks after the ramp's block plus the head (window.py's definition:
    per-batch latency, median of repeats, averaged over batch sizes 1..8)."""
    cost_ms: float | None
    """The ramp's own latency, paid by every input reaching it."""


@dataclass
class SourceCheck:
    path: str
    output: str
    """The source model's output compared with the final ramp's logits."""
    inputs: int
    max_abs_diff: float
    tolerance: float
    worst_row: int
    """Held-out row with the largest difference (-1 when the shapes differ)."""
    passed: bool


@dataclass
class CheckReport:
    bundle: str
    name: str
    task: str
    providers: list[str]
    files: list[FileCheck]
    warmup: list[BucketWarmup] = field(default_factory=list)
    heldout_inputs: int = 0
    heldout_format: str | None = None
    """`x`, `text` or `inputs` (one array per bundle input); None when the held-out checks were skipped."""
    final_accuracy: float | None = None
    """The chained final answer against the held-out labels."""
    full_pred_agreement: float | None = None
    """Fraction of held-out inputs whose chained final answer equals `full_pred` (must be 1.0; a bundle converted
    to a reduced precision: at least what bundle.yaml's `precision` records, less `PRECISION_SLACK`)."""
    precision: dict[str, Any] | None = None
    """bundle.yaml's `precision` record of a converted bundle (`exitplan prepare --precision`), re-checked here."""
    source: SourceCheck | None = None
    ramps: list[RampCheck] = field(default_factory=list)
    savings_from: str | None = None
    """Where saving_ms and cost_ms come from: data/window.npz, or measured by this check."""
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok, "exit_code": self.exit_code}


def one_line(err: BaseException | str) -> str:
    """An error message on one line (ONNX Runtime and pydantic messages span several)."""
    return " ".join(str(err).split())


def check_bundle(
    directory: str | Path,
    *,
    source: str | Path | None = None,
    output: str | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    buckets: Sequence[int] | None = None,
    batch: int = DEFAULT_BATCH,
    measure: bool = False,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    threads: int = 1,
    log: Callable[[str], None] | None = None,
) -> CheckReport:
    """Check the bundle at `directory` (see the module docstring); raises `BundleError` when it cannot be
    loaded or run. `buckets`: length buckets to warm up (default: the bundle's own list, else 16, 32, ...
    up to max_length); `batch`: inputs per batch; `measure`: time the savings again instead of reading
    data/window.npz; `output`: the source model's output to compare (default: the one bundle.yaml serves)."""
    say = log or (lambda _msg: None)
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    root = Path(directory)
    say("loading bundle.yaml and every block and ramp")
    runtime = load_runtime(root, buckets, providers, threads)
    m = runtime.manifest
    report = CheckReport(
        bundle=str(root),
        name=m.name,
        task=str(getattr(m.task, "value", m.task)),
        providers=runtime.active_providers,
        files=file_checks(m),
    )
    for bucket in runtime.buckets:
        say(f"warming up bucket {bucket}")
        report.warmup.append(warm_up(runtime, bucket, batch))
    if m.decoder is not None:
        report.notes.append(
            "text-generation bundle: loading and warm-up checked; the held-out checks apply to classification bundles"
        )
        return report
    data = load_heldout(root, m)
    runner = SourceModel(Path(source), m, providers, threads, output) if source is not None else None
    say(f"chaining {len(data)} held-out inputs through every block" + (" and the source model" if runner else ""))
    logits, source_out = chain_heldout(runtime, data, batch, runner)
    _check_final(report, m, data, logits)
    if runner is not None:
        report.source = compare_source(runner, logits[m.final_ramp().name], source_out, tolerance)
        if not report.source.passed:
            report.failures.append(_source_failure(report.source, m, logits[m.final_ramp().name], source_out))
    say("exit ramps: agreement and savings")
    saving, cost = ramp_savings(runtime, data, measure, report)
    _, pred, final = ramp_window(m, logits)
    for i, ramp in enumerate(m.exit_ramps()):
        report.ramps.append(
            RampCheck(
                name=ramp.name,
                after=ramp.after,
                agreement=float((pred[:, i] == final).mean()),
                accuracy=float((pred[:, i] == data.label).mean()),
                saving_ms=None if saving is None else float(saving[i]),
                cost_ms=None if cost is None else float(cost[i]),
            )
        )
    return report


# ---------------------------------------------------------------------------- 1. loading


def load_runtime(root: Path, buckets: Sequence[int] | None, providers: Sequence[str], threads: int) -> BundleRuntime:
    """A runtime over the whole bundle with a session per bucket (BundleRuntime checks each file's tensors)."""
    manifest = read_manifest(root)
    chosen = list(buckets or getattr(manifest, "buckets", None) or []) or None  # a bundle's own list, if it has one
    return BundleRuntime(root, buckets=chosen, providers=providers, threads=threads)


def file_checks(m: BundleManifest) -> list[FileCheck]:
    blocks = [FileCheck("block", b.name, b.file, list(b.inputs), list(b.outputs)) for b in m.blocks]
    ramps = [FileCheck("ramp", r.name, r.file, list(r.inputs), [r.output]) for r in m.ramps]
    return blocks + ramps


# ---------------------------------------------------------------------------- 2. warm-up


def dummy_state(m: BundleManifest, batch: int, bucket: int) -> dict[str, np.ndarray]:
    """A batch of the bundle's inputs at `bucket`: random floats, integer inputs all 1 (a valid token id and
    attention mask) but token types (0) and positions (0..bucket-1, as the router fills them in), a decoder's
    positions 0..bucket-1 and its KV caches empty."""
    rng = np.random.default_rng(0)
    state: dict[str, np.ndarray] = {}
    for spec in m.inputs:
        shape = []
        for axis, dim in enumerate(spec.shape):
            if isinstance(dim, int):
                shape.append(dim)
            elif dim == BATCH_DIM:
                shape.append(batch)
            elif dim == SEQ_DIM or axis == m.seq_axis:
                shape.append(bucket)
            else:  # another free axis: a decoder's cached positions (none yet), else one
                shape.append(0 if m.decoder is not None else 1)
        dtype = np.dtype(spec.dtype)
        if dtype.kind == "f":
            state[spec.name] = rng.standard_normal(shape).astype(dtype)
        else:
            state[spec.name] = np.ones(shape, dtype=dtype)
            if m.decoder is None and len(shape) == 2:
                state.update(derived_inputs(state[spec.name], [spec.name]))
    if m.decoder is not None and m.decoder.position_input in state:
        positions = state[m.decoder.position_input]
        positions[...] = np.arange(positions.shape[-1], dtype=positions.dtype)
    return state


def _guarded(path: Path, what: str, call: Callable[[], Any]) -> Any:
    try:
        return call()
    except _RUN_ERRORS as err:
        raise BundleError(f"{path}: {what}: {one_line(err)}") from err


def warm_up(runtime: BundleRuntime, bucket: int, batch: int) -> BucketWarmup:
    """Run one dummy batch through every block and ramp at `bucket` (twice: first run, then warm)."""
    m = runtime.manifest
    state = dummy_state(m, batch, bucket)
    work = dict(state)
    start = time.perf_counter()
    for index, block in enumerate(m.blocks):
        what = f"block {block.name!r} fails at bucket {bucket}"
        _guarded(runtime.directory / block.file, what, partial(runtime.run_block, index, work, bucket))
        for ramp in m.ramps_in(index, index):
            what = f"ramp {ramp.name!r} fails at bucket {bucket}"
            logits = _guarded(runtime.directory / ramp.file, what, partial(runtime.run_ramp, ramp.name, work, bucket))
            if logits.ndim < 2 or logits.shape[0] != batch or logits.shape[-1] != len(m.labels):
                raise BundleError(
                    f"{runtime.directory / ramp.file}: ramp {ramp.name!r} output tensor {ramp.output!r} has shape "
                    f"{tuple(logits.shape)} for a batch of {batch}; bundle.yaml's {len(m.labels)} labels need "
                    f"[{batch}, ..., {len(m.labels)}]"
                )
    first_ms = (time.perf_counter() - start) * 1000.0
    start = time.perf_counter()
    runtime.run_all_ramps(state, bucket)
    warm_ms = (time.perf_counter() - start) * 1000.0
    return BucketWarmup(bucket=bucket, batch=batch, first_ms=first_ms, warm_ms=warm_ms)


# ---------------------------------------------------------------------------- 3. held-out chain


def heldout_format(heldout: Heldout) -> str:
    """`inputs` (arrays keyed by bundle input) or `text`: how the held-out inputs are read."""
    return "inputs" if heldout.inputs is not None else "text"


class SourceModel:
    """The unsplit model as one ONNX file, run through ONNX Runtime on the bundle's inputs."""

    def __init__(
        self, path: Path, m: BundleManifest, providers: Sequence[str], threads: int, output: str | None = None
    ) -> None:
        if not path.is_file():
            raise BundleError(f"{path}: source model not found")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.log_severity_level = 3
        try:
            self.session = ort.InferenceSession(str(path), options, providers=list(providers))
        except Exception as err:  # onnxruntime raises several unrelated types for a bad file
            raise BundleError(f"{path}: ONNX Runtime cannot load the source model: {one_line(err)}") from err
        self.path = path
        bundle_inputs = [t.name for t in m.inputs]
        self.inputs = [i.name for i in self.session.get_inputs()]
        for name in self.inputs:
            if name not in bundle_inputs:
                raise BundleError(
                    f"{path}: the source model's input tensor {name!r} is not a bundle input "
                    f"(bundle.yaml's inputs are {bundle_inputs})"
                )
        outputs = [o.name for o in self.session.get_outputs()]
        served = output or m.source_output
        if served is not None:
            if served not in outputs:
                raise BundleError(
                    f"{path}: the source model has no output {served!r}"
                    + (" (the one bundle.yaml serves)" if output is None else "")
                    + f"; its outputs are {outputs}"
                )
            self.output = served
        elif m.final_ramp().output in outputs or len(outputs) == 1:
            wanted = m.final_ramp().output
            self.output = wanted if wanted in outputs else outputs[0]
        else:
            raise BundleError(
                f"{path}: the source model has outputs {outputs}; choose the one the bundle serves with --output NAME"
            )

    def run(self, state: dict[str, np.ndarray]) -> np.ndarray:
        feeds = {name: state[name] for name in self.inputs}
        (out,) = _guarded(self.path, "running the source model failed", lambda: self.session.run([self.output], feeds))
        return np.asarray(out)


def chain_heldout(
    runtime: BundleRuntime, data: Heldout, batch: int, source: SourceModel | None
) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """Logits of every ramp for every held-out input (no exits), and the source model's output on the same batches."""
    logits: dict[str, np.ndarray] = {}
    source_parts: list[tuple[np.ndarray, np.ndarray]] = []
    for rows, state, bucket in heldout_batches(runtime, data, batch):
        what = f"held-out batch at bucket {bucket}"
        out, _ = _guarded(runtime.directory, what, partial(runtime.run_all_ramps, state, bucket))
        for name, value in out.items():
            if name not in logits:
                logits[name] = np.zeros((len(data), *value.shape[1:]), dtype=np.float32)
            logits[name][rows] = value
        if source is not None:
            source_parts.append((rows, source.run(state)))
    if not logits:
        raise BundleError(f"{runtime.directory / runtime.manifest.data.heldout}: the held-out data holds no inputs")
    if source is None:
        return logits, None
    shapes = {part.shape[1:] for _, part in source_parts}
    if len(shapes) != 1:  # e.g. a per-position output whose length follows the bucket: no single array
        return logits, None
    merged = np.zeros((len(data), *shapes.pop()), dtype=np.float32)
    for rows, part in source_parts:
        merged[rows] = part
    return logits, merged


def _check_final(report: CheckReport, m: BundleManifest, data: Heldout, logits: dict[str, np.ndarray]) -> None:
    final = logits[m.final_ramp().name].argmax(axis=-1)
    report.heldout_inputs = len(data)
    report.heldout_format = heldout_format(data)
    report.final_accuracy = float((final == data.label).mean())
    if data.full_pred is None:
        report.notes.append(f"{m.data.heldout} has no full_pred: the chained final answer was not compared with it")
        return
    same = final == np.asarray(data.full_pred)
    report.full_pred_agreement = float(same.mean())
    record = m.precision
    if record is not None and record.name != "fp32":  # full_pred is the fp32 source's: the record says how close
        report.precision = record.model_dump(mode="json")
        if report.full_pred_agreement + PRECISION_SLACK < record.final_agreement:
            report.failures.append(
                f"the {record.name} chain agrees with its fp32 source on {report.full_pred_agreement:.2%} of the "
                f"held-out inputs, bundle.yaml records {record.final_agreement:.2%}: a file changed since it was "
                f"converted; run exitplan prepare --precision {record.name} again"
            )
        return
    if not same.all():
        rows = np.flatnonzero(~same)
        report.failures.append(
            f"the chained final answer ({m.final_ramp().name!r}) disagrees with full_pred in {m.data.heldout} on "
            f"{rows.size} of {len(data)} held-out inputs (rows {rows[:5].tolist()}{' ...' if rows.size > 5 else ''})"
        )


def compare_source(
    source: SourceModel, final: np.ndarray, source_out: np.ndarray | None, tolerance: float
) -> SourceCheck:
    """Max |difference| between the chained final logits and the source output (None: shapes vary by bucket)."""
    if source_out is None or source_out.shape != final.shape:
        return SourceCheck(str(source.path), source.output, len(final), float("inf"), tolerance, -1, False)
    diff = np.abs(final.astype(np.float64) - source_out.astype(np.float64)).reshape(len(final), -1)
    per_row = np.where(np.isnan(diff), np.inf, diff).max(axis=1)
    worst = int(per_row.argmax())
    biggest = float(per_row[worst])
    return SourceCheck(str(source.path), source.output, len(final), biggest, tolerance, worst, biggest <= tolerance)


def _source_failure(check: SourceCheck, m: BundleManifest, final: np.ndarray, source_out: np.ndarray | None) -> str:
    head = f"final ramp {m.final_ramp().name!r}"
    if check.worst_row < 0:
        got = "different shapes per bucket" if source_out is None or source_out.ndim < 2 else tuple(source_out.shape)
        return (
            f"the source model {check.path}'s output {check.output!r} has shape {got}, but the chained {head} "
            f"gives {tuple(final.shape)} on the held-out inputs"
        )
    return (
        f"the chained {head} differs from the source model {check.path} (output {check.output!r}): "
        f"max |difference| {check.max_abs_diff:.3g} > tolerance {check.tolerance:.3g} (held-out row {check.worst_row})"
    )


# ---------------------------------------------------------------------------- 4. exit ramps


def ramp_savings(
    runtime: BundleRuntime, data: Heldout, measure: bool, report: CheckReport
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """saving_ms [R], cost_ms [R] for the exit ramps: from data/window.npz unless `measure`, else timed
    with prepare/window.py's `measure_savings`. Sets `report.savings_from`; a window that lists other ramps
    than bundle.yaml is a failure."""
    m = runtime.manifest
    exits = [r.name for r in m.exit_ramps()]
    path = runtime.directory / WINDOW
    if not measure and path.is_file():
        with np.load(path) as window:
            listed = [str(r) for r in window["ramps"]] if "ramps" in window.files else []
            if listed == exits and {"saving_ms", "cost_ms"} <= set(window.files):
                batches = (
                    "..".join(str(b) for b in window["batch_sizes"][[0, -1]]) if "batch_sizes" in window.files else "?"
                )
                bucket = int(window["bucket"]) if "bucket" in window.files else "?"
                report.savings_from = f"{WINDOW} (build time; bucket {bucket}, batch {batches})"
                return np.asarray(window["saving_ms"]), np.asarray(window["cost_ms"])
        report.failures.append(
            f"{path} lists ramps {listed} (or lacks saving_ms/cost_ms), but bundle.yaml's exit ramps are {exits}; "
            f"rebuild the bundle"
        )
        return None, None
    bucket = window_bucket(runtime, data)
    saving, cost = measure_savings(runtime, data, bucket, WINDOW_BATCH_SIZES)
    sizes = f"{WINDOW_BATCH_SIZES[0]}..{WINDOW_BATCH_SIZES[-1]}"
    report.savings_from = f"measured by this check (bucket {bucket}, batch {sizes})"
    return saving, cost
