"""Ways to run a bundle's whole chain on one device, timed per (bucket, batch): what the GPU proof compares.

- `numpy`: the data plane as it is (worker_image/bundle_runtime.py): one session per block and bucket, every
  block's inputs handed over as numpy arrays and its outputs copied back to the host;
- `iobinding`: the same sessions, the batch kept on the device (`BundleRuntime.run_range(resident=True)`, what
  a GPU worker runs): copied to the device once, every block reads the previous block's outputs where they
  lie, and only the logits come back;
- `cudagraph`: the chain merged into one graph (`merged_model`), one session per (bucket, batch) with every
  shape fixed, replayed as a CUDA graph (ONNX Runtime's `enable_cuda_graph`) on preallocated buffers;
- `tensorrt`: the merged graph on ONNX Runtime's TensorRT provider, where it loads.

Every mode's logits are compared with `numpy`'s on the same batch (`max_abs_diff`), so a mode that is
fast because it computes something else shows. Timings: warm-up runs, then the median of timed runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from exitplan.api.bundle import BundleManifest, read_manifest
from exitplan.worker_image.bundle_runtime import BATCH_DIM, SEQ_DIM, BundleRuntime

MODES = ("numpy", "iobinding", "cudagraph", "tensorrt")


@dataclass
class Point:
    mode: str
    precision: str
    bucket: int
    batch: int
    ms: float | None = None
    """Median wall time of one batch through the whole chain."""
    p90_ms: float | None = None
    max_abs_diff: float | None = None
    """Largest difference of this mode's logits from the numpy mode's on the same batch."""
    error: str = ""

    @property
    def inputs_per_s(self) -> float | None:
        return None if not self.ms else self.batch * 1000.0 / self.ms


@dataclass
class Timer:
    warmup: int = 3
    repeats: int = 20
    budget_s: float = 1.0
    """At most this long timing one point (fewer repeats past it)."""

    def time(self, call: Callable[[], object]) -> tuple[float, float]:
        for _ in range(self.warmup):
            call()
        times: list[float] = []
        end = time.perf_counter() + self.budget_s
        while len(times) < self.repeats and (len(times) < 3 or time.perf_counter() < end):
            start = time.perf_counter()
            call()
            times.append((time.perf_counter() - start) * 1000.0)
        times.sort()
        return statistics.median(times), times[min(len(times) - 1, int(0.9 * len(times)))]


def sample_state(manifest: BundleManifest, batch: int, bucket: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A batch of full-length inputs: token ids (masks all ones) for a text model, random values else."""
    rng = np.random.default_rng(seed)
    state: dict[str, np.ndarray] = {}
    for spec in manifest.inputs:
        shape = [batch if d == BATCH_DIM else bucket if d == SEQ_DIM else int(d) for d in spec.shape]
        if "mask" in spec.name.lower():
            state[spec.name] = np.ones(shape, dtype=spec.dtype)
        elif np.issubdtype(np.dtype(spec.dtype), np.integer):
            state[spec.name] = rng.integers(1000, 2000, size=shape).astype(spec.dtype)
        else:
            state[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
    return state


def merged_model(directory: Path, manifest: BundleManifest | None = None) -> onnx.ModelProto:
    """The whole model (every block, then the final head) as one ONNX graph: each file's own tensor,
    initializer and node names prefixed with its index, the state's names (model inputs, block outputs)
    kept, so tensors flow from block to block as they do between sessions."""
    manifest = manifest or read_manifest(directory)
    files = [(b.file, b.inputs, b.outputs) for b in manifest.blocks]
    head = manifest.final_ramp()
    files.append((head.file, head.inputs, [head.output]))
    state = {t.name for t in manifest.inputs} | {o for _, _, outs in files for o in outs}
    graph = onnx.helper.make_graph([], f"{manifest.name}-whole", [], [])
    opsets: dict[str, int] = {}
    ir_version = 0
    inputs: dict[str, onnx.ValueInfoProto] = {}
    for index, (rel, _, _) in enumerate(files):
        model = onnx.load(str(directory / rel))
        ir_version = max(ir_version, model.ir_version)
        for op in model.opset_import:
            opsets[op.domain] = max(opsets.get(op.domain, 0), op.version)
        rename = _renamer(f"f{index}/", state)
        for init in model.graph.initializer:
            init.name = rename(init.name)
            graph.initializer.append(init)
        for node in model.graph.node:
            node.input[:] = [rename(n) if n else n for n in node.input]
            node.output[:] = [rename(n) if n else n for n in node.output]
            node.name = f"f{index}/{node.name}"
            graph.node.append(node)
        for vi in model.graph.value_info:
            vi.name = rename(vi.name)
            graph.value_info.append(vi)
        for vi in model.graph.input:
            if vi.name in {t.name for t in manifest.inputs} and vi.name not in inputs:
                inputs[vi.name] = vi
    graph.input.extend(inputs[t.name] for t in manifest.inputs if t.name in inputs)
    last = onnx.load(str(directory / head.file), load_external_data=False)
    graph.output.extend(o for o in last.graph.output if o.name == head.output)
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()])
    model.ir_version = ir_version
    return model


def _renamer(prefix: str, keep: set[str]) -> Callable[[str], str]:
    return lambda name: name if name in keep else prefix + name


def _options(bucket: int, batch: int | None, sequence: bool, threads: int) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    if sequence:
        options.add_free_dimension_override_by_name(SEQ_DIM, bucket)
    if batch is not None:
        options.add_free_dimension_override_by_name(BATCH_DIM, batch)
    return options


@dataclass
class ChainRunner:
    """A bundle's whole chain on one device, per bucket; `run(mode, state, bucket)` returns the final logits."""

    directory: Path
    buckets: Sequence[int]
    device: str = "cuda"
    """cuda or cpu: where IO-bound tensors live and which provider runs."""
    threads: int = 1
    merged_path: Path | None = None
    runtime: BundleRuntime = field(init=False)
    _graphs: dict[tuple[int, int], tuple[ort.InferenceSession, dict, ort.OrtValue]] = field(default_factory=dict)
    _trt: dict[int, ort.InferenceSession] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.runtime = BundleRuntime(
            self.directory, buckets=list(self.buckets), providers=self.providers, threads=self.threads, resident=False
        )
        self.manifest = self.runtime.manifest

    @property
    def providers(self) -> tuple[str, ...]:
        return ("CUDAExecutionProvider", "CPUExecutionProvider") if self.device == "cuda" else ("CPUExecutionProvider",)

    @property
    def sequence(self) -> bool:
        return self.manifest.seq_axis is not None

    def run_numpy(self, state: dict[str, np.ndarray], bucket: int) -> np.ndarray:
        result = self.runtime.run_range(state, bucket, thresholds={})
        rows = sorted(result.exits, key=lambda e: e.row)
        return np.stack([e.logits for e in rows])

    def run_iobinding(self, state: dict[str, np.ndarray], bucket: int) -> np.ndarray:
        """The data plane's device-resident path (worker_image/resident.py): the batch copied to the device
        once, blocks IO-bound to each other's outputs, the logits alone copied back."""
        result = self.runtime.run_range(state, bucket, thresholds={}, resident=True)
        rows = sorted(result.exits, key=lambda e: e.row)
        return np.stack([e.logits for e in rows])

    def merged(self) -> Path:
        if self.merged_path is None or not self.merged_path.is_file():
            raise FileNotFoundError("the merged model was not written (ChainRunner.merged_path)")
        return self.merged_path

    def run_cudagraph(self, state: dict[str, np.ndarray], bucket: int) -> np.ndarray:
        """The merged graph replayed as a CUDA graph: fixed shapes and buffers per (bucket, batch)."""
        if self.device != "cuda":
            raise RuntimeError("CUDA graphs need the CUDA provider (this run is on the CPU)")
        batch = next(iter(state.values())).shape[0]
        key = (bucket, batch)
        if key not in self._graphs:
            options = _options(bucket, batch, self.sequence, self.threads)
            session = ort.InferenceSession(
                str(self.merged()), options, providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})]
            )
            buffers = {n: ort.OrtValue.ortvalue_from_numpy(a, "cuda", 0) for n, a in state.items()}
            out_meta = session.get_outputs()[0]
            shape = [batch, len(self.manifest.labels)]
            out = ort.OrtValue.ortvalue_from_shape_and_type(shape, _numpy_type(out_meta.type), "cuda", 0)
            self._graphs[key] = (session, buffers, out)
        session, buffers, out = self._graphs[key]
        for name, array in state.items():
            buffers[name].update_inplace(array)
        binding = session.io_binding()
        for name, value in buffers.items():
            binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_output(session.get_outputs()[0].name, out)
        session.run_with_iobinding(binding)
        return np.asarray(out.numpy())

    def run_tensorrt(self, state: dict[str, np.ndarray], bucket: int, cache: Path) -> np.ndarray:
        if self.device != "cuda":
            raise RuntimeError("TensorRT needs the GPU (this run is on the CPU)")
        if "TensorrtExecutionProvider" not in ort.get_available_providers():
            raise RuntimeError(f"this onnxruntime has no TensorRT provider (it has {ort.get_available_providers()})")
        if bucket not in self._trt:
            cache.mkdir(parents=True, exist_ok=True)
            trt = (
                "TensorrtExecutionProvider",
                {"trt_engine_cache_enable": "True", "trt_engine_cache_path": str(cache)},
            )
            options = _options(bucket, None, self.sequence, self.threads)
            session = ort.InferenceSession(str(self.merged()), options, providers=[trt])
            if "TensorrtExecutionProvider" not in session.get_providers():
                raise RuntimeError(f"the TensorRT provider did not load (session runs on {session.get_providers()})")
            self._trt[bucket] = session
        (logits,) = self._trt[bucket].run(None, state)
        return np.asarray(logits)


def _numpy_type(onnx_type: str) -> type:
    return {"tensor(float)": np.float32, "tensor(float16)": np.float16}.get(onnx_type, np.float32)


def curve(
    runner: ChainRunner,
    precision: str,
    modes: Sequence[str],
    buckets: Sequence[int],
    batches: Sequence[int],
    timer: Timer,
    *,
    trt_cache: Path,
    graph_batches: Sequence[int] | None = None,
    deadline: float | None = None,
) -> list[Point]:
    """Every (mode, bucket, batch) point; a mode that fails at one point is recorded with the error and
    not tried again at larger batches of that bucket. Points past `deadline` (time.monotonic) are skipped."""
    points: list[Point] = []
    for bucket in buckets:
        failed: dict[str, str] = {}
        for batch in batches:
            state = sample_state(runner.manifest, batch, bucket)
            reference = runner.run_numpy(state, bucket)
            for mode in modes:
                point = Point(mode, precision, bucket, batch)
                points.append(point)
                if mode == "cudagraph" and graph_batches is not None and batch not in graph_batches:
                    point.error = "not in the CUDA-graph grid"
                    continue
                if deadline is not None and time.monotonic() > deadline:
                    point.error = "skipped: the proof's time budget ran out"
                    continue
                if mode in failed:
                    point.error = failed[mode]
                    continue
                call = {
                    "numpy": lambda s=state, b=bucket: runner.run_numpy(s, b),
                    "iobinding": lambda s=state, b=bucket: runner.run_iobinding(s, b),
                    "cudagraph": lambda s=state, b=bucket: runner.run_cudagraph(s, b),
                    "tensorrt": lambda s=state, b=bucket: runner.run_tensorrt(s, b, trt_cache),
                }[mode]
                try:
                    logits = call()
                    point.max_abs_diff = float(np.max(np.abs(logits.astype(np.float32) - reference)))
                    point.ms, point.p90_ms = timer.time(call)
                except Exception as err:  # a provider or mode that cannot run here: recorded, the rest goes on
                    point.error = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
                    failed[mode] = point.error
    return points
