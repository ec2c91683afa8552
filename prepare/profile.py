"""`exitplan profile`'s engine: measure a bundle on this machine and write a ModelProfile.

For each sequence length (a length bucket; [1] for fixed-size models) and batch size, real held-out
inputs padded to the length are chained through every block (statically shaped ONNX Runtime
sessions, as the workers run them); each block and ramp is timed on the activations it really
receives: warm-up first, then the fastest of the repeats (prepare/measure.py `time_chain`: other work
on the machine only ever adds time, and a call short enough for one time slice keeps its true cost in
its fastest run, where a median takes the preemptions). Big batches get fewer repeats (see
`repeats_for`). Activation bytes per sample at each block boundary are read from the real
states; weight bytes per block from the ONNX initializers; the survival curve from the bundle's
calibration window (held-out data) at the given thresholds.

On a shared machine a burst of other work only ever adds time, so a cell that takes longer than a
larger batch or a longer sequence of the same block is a spike: such cells are measured again (up to
SPIKE_ROUNDS times, keeping each cell's fastest reading), and the tables written are the monotone lower
envelope of what was measured (no cell above a larger batch or a longer sequence), which every planner
check accepts. The annotation `exitplan.io/profile-repairs` says how many cells that took.
"""

from __future__ import annotations

import json
import math
import platform
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from exitplan.api.bundle import BundleError, BundleManifest
from exitplan.api.resources import API_VERSION, BlockProfile, ModelProfile, ModelProfileSpec, RampProfile
from exitplan.planner.tuning.initial import survival_at
from exitplan.prepare.measure import batch_state, load_heldout, time_chain
from exitplan.worker_image.bundle_runtime import FIXED_SIZE_BUCKET, BundleRuntime

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_THRESHOLD = 0.9
THRESHOLDS_ANNOTATION = "exitplan.io/survival-thresholds"
REPAIRS_ANNOTATION = "exitplan.io/profile-repairs"
SPIKE_ROUNDS = 3
"""How often cells that look like spikes are measured again."""
SPIKE_FACTOR = 1.25
"""A cell above this factor of the envelope (the fastest larger batch or longer sequence) is a spike."""
SPIKE_FLOOR_MS = 0.02
"""Differences below this are timer resolution, not spikes."""


class ProfileError(ValueError):
    """Profile options that do not fit the bundle; the message names the option."""


@dataclass
class ProfileOptions:
    pool: str
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES
    seq_lens: Sequence[int] | None = None
    """Lengths to measure (default: the runtime's buckets; [1] for models without a sequence axis)."""
    repeats: int = 5
    warmup: int = 1
    threads: int = 1
    thresholds: Mapping[str, float] | None = None
    """Per exit ramp, for the survival curve (default: DEFAULT_THRESHOLD for every exit ramp)."""
    model_name: str | None = None
    """The ModelProfile's model (default: the bundle's name)."""
    providers: Sequence[str] = ("CPUExecutionProvider",)
    extra_annotations: dict[str, str] = field(default_factory=dict)


def repeats_for(batch: int, seq: int, repeats: int) -> int:
    """Fewer repeats where one call is long: all of them up to 1,024 tokens a batch, half up to 4,096, then 2."""
    tokens = batch * seq
    if tokens <= 1024:
        return repeats
    if tokens <= 4096:
        return max(2, math.ceil(repeats / 2))
    return min(repeats, 2)


def read_thresholds(path: Path) -> dict[str, float]:
    """A JSON object {ramp: threshold}, or one holding such an object under "thresholds"."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ProfileError(f"--thresholds {path}: cannot read a JSON object: {err}") from err
    if isinstance(doc, dict) and isinstance(doc.get("thresholds"), dict):
        doc = doc["thresholds"]
    if not isinstance(doc, dict) or not all(isinstance(v, (int, float)) for v in doc.values()):
        raise ProfileError(f"--thresholds {path}: expected a JSON object {{ramp name: threshold}}")
    return {str(k): float(v) for k, v in doc.items()}


def resolve_thresholds(manifest: BundleManifest, thresholds: Mapping[str, float] | None) -> dict[str, float]:
    exits = [r.name for r in manifest.exit_ramps()]
    if thresholds is None:
        return {name: DEFAULT_THRESHOLD for name in exits}
    unknown = sorted(set(thresholds) - set(exits))
    if unknown:
        raise ProfileError(
            f"thresholds name ramps that are not exit ramps of {manifest.name!r}: {unknown} (exit ramps: {exits})"
        )
    for name, value in thresholds.items():
        if not math.isfinite(value) or value < 0:
            raise ProfileError(f"threshold of ramp {name!r} must be a number >= 0 (above 1 disables it), got {value}")
    return {name: float(thresholds.get(name, 2.0)) for name in exits}


def weight_bytes(path: Path) -> int:
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    return int(sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer))


def _per_sample_bytes(state: Mapping[str, np.ndarray], names: Sequence[str]) -> int:
    return int(sum(state[n].nbytes // max(1, state[n].shape[0]) for n in names if n in state))


def _open_runtime(directory: Path, options: ProfileOptions) -> tuple[BundleRuntime, list[int]]:
    """The bundle's runtime for the options' pool, providers and sequence lengths, and the batch sizes
    to measure; ProfileError when the options do not make sense here."""
    if not options.pool:
        raise ProfileError("--pool must name the GPUPool this profile describes")
    if options.repeats < 1:
        raise ProfileError(f"--repeats must be >= 1, got {options.repeats}")
    batch_sizes = sorted(set(int(b) for b in options.batch_sizes))
    if not batch_sizes or batch_sizes[0] < 1:
        raise ProfileError(f"--batch-sizes must be positive integers, got {list(options.batch_sizes)}")
    seq_lens = sorted(set(int(s) for s in options.seq_lens)) if options.seq_lens else None
    available = set(ort.get_available_providers())
    missing = [p for p in options.providers if p not in available]
    if not options.providers or missing:
        raise ProfileError(
            f"--providers {list(options.providers)}: not available here ({missing}); this ONNX Runtime has {sorted(available)}"
        )
    try:
        runtime = BundleRuntime(directory, buckets=seq_lens, providers=options.providers, threads=options.threads)
    except BundleError as err:
        if seq_lens and "bucket" in str(err):
            raise ProfileError(f"--seq-lens {seq_lens}: {err}") from err
        raise
    return runtime, batch_sizes


def profile_bundle(
    directory: Path, options: ProfileOptions, progress: Callable[[int, str], object] | None = None
) -> ModelProfile:
    """Measure the bundle at `directory`; `progress(n, what)` is called after each measured cell."""
    directory = Path(directory)
    runtime, batch_sizes = _open_runtime(directory, options)
    manifest = runtime.manifest
    thresholds = resolve_thresholds(manifest, options.thresholds)
    heldout = load_heldout(directory, manifest)
    lengths = list(runtime.buckets)

    n_blocks = len(manifest.blocks)
    cells = _Cells(runtime, heldout, options, lengths, list(batch_sizes))
    for si, length in enumerate(lengths):
        for bi, batch in enumerate(batch_sizes):
            cells.measure(si, bi)
            if progress:
                progress(1, f"seq {length} batch {batch}")
    repairs = cells.settle()
    block_ms, ramp_ms, out_bytes, in_bytes = cells.block_ms, cells.ramp_ms, cells.out_bytes, cells.in_bytes

    survival = survival_at(directory, manifest, thresholds)
    ramps_in_order = manifest.ramps_in(0, n_blocks - 1)
    spec = ModelProfileSpec(
        model=options.model_name or manifest.name,
        pool=options.pool,
        batch_sizes=batch_sizes,
        seq_lens=lengths if manifest.seq_axis is not None else [FIXED_SIZE_BUCKET],
        blocks=[
            BlockProfile(
                name=b.name,
                latency_ms=_rounded(block_ms[k]),
                weight_bytes=weight_bytes(directory / b.file),
                output_bytes=[int(v) for v in out_bytes[k]],
            )
            for k, b in enumerate(manifest.blocks)
        ],
        ramps=[
            RampProfile(name=r.name, after_block=r.after, latency_ms=_rounded(ramp_ms[r.name])) for r in ramps_in_order
        ],
        survival=[survival[r.name] for r in ramps_in_order],
        input_bytes=[int(v) for v in in_bytes],
        measured_on=_machine(options.threads, runtime.active_providers),
        providers=list(runtime.active_providers),
    )
    annotations = {
        THRESHOLDS_ANNOTATION: json.dumps(thresholds, sort_keys=True),
        REPAIRS_ANNOTATION: repairs,
        **options.extra_annotations,
    }
    name = f"{spec.model}-{options.pool}".lower().replace("_", "-")
    return ModelProfile(apiVersion=API_VERSION, metadata={"name": name, "annotations": annotations}, spec=spec)


class _Cells:
    """The latency tables of every block and ramp, [seq, batch] each, measured cell by cell (one cell =
    one chained pass at a length and batch size), keeping each cell's fastest reading."""

    def __init__(
        self, runtime: BundleRuntime, heldout: Any, options: ProfileOptions, lengths: list[int], batch_sizes: list[int]
    ) -> None:
        self.runtime, self.heldout, self.options = runtime, heldout, options
        self.lengths, self.batch_sizes = lengths, batch_sizes
        manifest = runtime.manifest
        shape = (len(lengths), len(batch_sizes))
        self.block_ms = np.zeros((len(manifest.blocks), *shape))
        self.ramp_ms = {r.name: np.zeros(shape) for r in manifest.ramps}
        self.out_bytes = np.zeros((len(manifest.blocks), len(lengths)), dtype=np.int64)
        self.in_bytes = np.zeros(len(lengths), dtype=np.int64)
        self.seen = np.zeros(shape, dtype=bool)

    def measure(self, si: int, bi: int) -> None:
        manifest, length, batch = self.runtime.manifest, self.lengths[si], self.batch_sizes[bi]
        state = batch_state(self.runtime, self.heldout, batch, length)
        repeats = repeats_for(batch, length, self.options.repeats)
        timing = time_chain(self.runtime, state, length, repeats, self.options.warmup)
        first = not self.seen[si, bi]
        self.seen[si, bi] = True
        cell = self.block_ms[:, si, bi]
        self.block_ms[:, si, bi] = timing.block_ms if first else np.minimum(cell, timing.block_ms)
        for name, value in timing.ramp_ms.items():
            self.ramp_ms[name][si, bi] = value if first else min(self.ramp_ms[name][si, bi], value)
        if bi == 0 and first:
            self.in_bytes[si] = _per_sample_bytes(state, [t.name for t in manifest.inputs])
            n_blocks = len(manifest.blocks)
            for k in range(n_blocks):
                names = manifest.live_after(k) if k < n_blocks - 1 else manifest.final_ramp().inputs
                self.out_bytes[k, si] = _per_sample_bytes(timing.states[k], names)

    def settle(self) -> str:
        """Measure spikes again (SPIKE_ROUNDS at most), then lower every table to its envelope; the
        repairs in words."""
        tables = [*self.block_ms, *self.ramp_ms.values()]
        remeasured = 0
        for _ in range(SPIKE_ROUNDS):
            cells = sorted({cell for table in tables for cell in spikes(table)})
            for si, bi in cells:
                self.measure(si, bi)
            remeasured += len(cells)
            if not cells:
                break
        lowered = sum(int((table > envelope(table)).sum()) for table in tables)
        for table in tables:
            table[...] = envelope(table)
        return f"{remeasured} cell(s) measured again as spikes; {lowered} value(s) lowered to the envelope"


def envelope(table: np.ndarray) -> np.ndarray:
    """[seq, batch] latencies lowered so that no cell exceeds a larger batch or a longer sequence: the
    minimum over every cell at or after it on both axes (noise only adds time, so the lower is truer)."""
    out = np.minimum.accumulate(table[:, ::-1], axis=1)[:, ::-1]
    return np.minimum.accumulate(out[::-1, :], axis=0)[::-1, :]


def spikes(table: np.ndarray) -> list[tuple[int, int]]:
    """Cells more than SPIKE_FACTOR above the envelope (and SPIKE_FLOOR_MS): measure them again."""
    env = envelope(table)
    bad = (table > SPIKE_FACTOR * env) & (table - env > SPIKE_FLOOR_MS)
    return [(int(i), int(j)) for i, j in np.argwhere(bad)]


def _rounded(table: np.ndarray) -> list[list[float]]:
    return [[round(float(v), 4) for v in row] for row in table]


def _machine(threads: int, providers: Sequence[str]) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}; onnxruntime {ort.__version__} {'+'.join(providers)}, {threads} intra-op thread(s)"


def profile_document(profile: ModelProfile) -> dict[str, Any]:
    """The whole resource document (apiVersion, kind, metadata, spec) in its wire form (camelCase)."""
    return profile.model_dump(by_alias=True, exclude_none=True, mode="json")
