"""ONNX Runtime execution of a model bundle: any contiguous range of blocks, with its ramps.

A `BundleRuntime` loads `bundle.yaml`, checks every ONNX file against it, and keeps one
statically shaped session per (block or ramp, length bucket): the sequence dimension, named
"seq" in the ONNX files, is fixed per bucket with a free-dimension override (Arlo's polymorphing:
one runtime per max-length bucket, inputs padded only up to their bucket). Models without a
sequence axis get one session per file and a single pseudo-bucket, 1.

Execution follows the bundle's state-dict model (`exitplan.api.bundle`): a state is a dict of
named arrays, blocks read and write it, ramps read it and return logits. `run_range` runs the
whole range with early exits and returns who exited where plus the state to forward.

Only numpy, onnxruntime and exitplan.api here: this module runs inside worker pods.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from exitplan.api.bundle import BundleError, BundleManifest, RampSpec, read_manifest
from exitplan.api.dtypes import UnknownDType, by_numpy, by_onnx
from exitplan.worker_image.range_result import RampExit, RangeResult, softmax
from exitplan.worker_image.resident import GPU_PROVIDERS, ResidentRange

__all__ = ["BundleRuntime", "RampExit", "RangeResult", "StateError", "softmax"]

SEQ_DIM = "seq"
BATCH_DIM = "batch"
FIXED_SIZE_BUCKET = 1
"""The only bucket of a model without a sequence axis (a profile's seqLens is [1] for them)."""


class StateError(ValueError):
    """A state (or call) that does not fit the bundle: a missing tensor, a wrong dtype or length."""


def choose_providers(spec: str = "auto") -> tuple[str, ...]:
    """Execution providers from a comma-separated list; `auto` = CUDA first when this onnxruntime build
    offers it (onnxruntime-gpu on a machine with a visible GPU), always with the CPU as fallback."""
    available = ort.get_available_providers()
    if spec.strip() == "auto":
        # onnxruntime-gpu lists CUDA even on machines without a GPU: ask the driver's device node too.
        gpu = Path("/dev/nvidiactl").exists()
        wanted = [p for p in ("CUDAExecutionProvider",) if p in available and gpu]
        return (*wanted, "CPUExecutionProvider")
    names = tuple(p.strip() for p in spec.split(",") if p.strip())
    missing = [p for p in names if p not in available]
    if not names or missing:
        raise ValueError(
            f"providers {list(missing or names)} are not available in this onnxruntime (it has {available})"
        )
    return names


def default_buckets(max_length: int) -> tuple[int, ...]:
    """Length buckets 16, 32, 64, ... up to max_length (max_length itself always included)."""
    buckets = []
    length = 16
    while length < max_length:
        buckets.append(length)
        length *= 2
    buckets.append(max_length)
    return tuple(buckets)


def bucket_for(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `length` tokens."""
    for bucket in sorted(buckets):
        if length <= bucket:
            return bucket
    raise StateError(f"input of length {length} is longer than the largest bucket ({max(buckets)}); truncate it")


def input_role(name: str) -> str:
    """What a text model's input holds, by its name, so the router and `prepare` fill in what clients do
    not send: `tokens` (input_ids), `mask` (1 per token, 0 for padding), `token_types` (zeros: a single
    segment), `positions` (0, 1, ..., L-1), else `data` (only the client can send it)."""
    lowered = name.lower()
    if lowered == "input_ids":
        return "tokens"
    if "mask" in lowered:
        return "mask"
    if "token_type" in lowered or lowered in ("segment_ids", "segment_ids_input"):
        return "token_types"
    if "position" in lowered:
        return "positions"
    return "data"


def derived_inputs(ids: np.ndarray, names: Sequence[str]) -> dict[str, np.ndarray]:
    """The inputs among `names` that follow from the token ids' shape: token types (zeros) and positions."""
    out = {}
    for name in names:
        role = input_role(name)
        if role == "token_types":
            out[name] = np.zeros_like(ids)
        elif role == "positions":
            out[name] = np.broadcast_to(np.arange(ids.shape[1], dtype=ids.dtype), ids.shape).copy()
    return out


def pad_batch(
    sequences: Sequence[Sequence[int]], bucket: int, pad_id: int = 0, names: Sequence[str] = ()
) -> dict[str, np.ndarray]:
    """Token id lists -> `input_ids` and `attention_mask` [n, bucket] (int64), right-padded, and the token
    types and positions among the model's input `names` (:func:`derived_inputs`)."""
    ids = np.full((len(sequences), bucket), pad_id, dtype=np.int64)
    mask = np.zeros((len(sequences), bucket), dtype=np.int64)
    for row, seq in enumerate(sequences):
        if len(seq) > bucket:
            raise StateError(f"row {row}: {len(seq)} tokens do not fit bucket {bucket}")
        ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1
    return {"input_ids": ids, "attention_mask": mask, **derived_inputs(ids, names)}


@dataclass(frozen=True)
class _IOSpec:
    names: tuple[str, ...]
    dtypes: tuple[np.dtype, ...]
    shapes: tuple[tuple[int | str | None, ...], ...]


class BundleRuntime:
    """Statically shaped ONNX Runtime sessions for blocks [first_block, last_block] of a bundle."""

    def __init__(
        self,
        directory: str | Path,
        *,
        first_block: int = 0,
        last_block: int | None = None,
        buckets: Sequence[int] | None = None,
        providers: Sequence[str] = ("CPUExecutionProvider",),
        threads: int = 1,
        free_length: bool = False,
        resident: bool | None = None,
    ) -> None:
        """`free_length`: the sessions keep the `seq` dimension free (no fixed length per bucket): a bucket's
        session then runs any length up to it (a trimming worker, classify/trim.py). `resident`: `run_range`
        keeps the batch on the device between blocks (worker_image/resident.py); None = where the first
        provider is a GPU's."""
        self.directory = Path(directory)
        self.free_length = free_length
        self.manifest: BundleManifest = read_manifest(self.directory)
        n_blocks = len(self.manifest.blocks)
        last = n_blocks - 1 if last_block is None else last_block
        if not 0 <= first_block <= last < n_blocks:
            raise BundleError(
                f"{self.directory}: block range [{first_block}, {last}] is not inside the bundle's "
                f"{n_blocks} blocks (0..{n_blocks - 1})"
            )
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.first_block = first_block
        self.last_block = last
        self.buckets: tuple[int, ...] = self._resolve_buckets(buckets)
        self.providers = tuple(providers)
        self.threads = threads
        self.resident = self.providers[:1] in [(p,) for p in GPU_PROVIDERS] if resident is None else resident
        self._resident: ResidentRange | None = None
        self._check_dataflow()
        self._sessions: dict[tuple[str, int], ort.InferenceSession] = {}
        self._io: dict[tuple[str, int], _IOSpec] = {}
        for block in self.manifest.blocks[first_block : last + 1]:
            self._load(block.file, block.inputs, block.outputs, f"block {block.name!r}")
        for ramp in self.ramps:
            self._load(ramp.file, ramp.inputs, [ramp.output], f"ramp {ramp.name!r}")

    # ------------------------------------------------------------------ loading

    @property
    def is_sequence_model(self) -> bool:
        return self.manifest.seq_axis is not None

    @property
    def ramps(self) -> list[RampSpec]:
        """Ramps (final head included when the range ends the model) after blocks of the range."""
        return self.manifest.ramps_in(self.first_block, self.last_block)

    @property
    def active_providers(self) -> list[str]:
        """Execution providers the sessions run on (ONNX Runtime falls back silently when one is missing)."""
        return list(next(iter(self._sessions.values())).get_providers())

    def session(self, rel: str, bucket: int) -> ort.InferenceSession:
        """The session of ONNX file `rel` (a block's or ramp's, as bundle.yaml names it) for `bucket`: what an
        IO-bound caller runs (the sessions' inputs and outputs are as bundle.yaml names them)."""
        try:
            return self._sessions[(rel, bucket)]
        except KeyError:
            raise StateError(
                f"no session for {rel!r} at bucket {bucket} (buckets here: {list(self.buckets)})"
            ) from None

    def session_providers(self) -> list[tuple[str, list[str]]]:
        """(file@bucket, the providers its session runs on, first = where its nodes run) for every session."""
        return [(f"{rel}@{bucket}", list(s.get_providers())) for (rel, bucket), s in self._sessions.items()]

    @property
    def ends_model(self) -> bool:
        return self.last_block == len(self.manifest.blocks) - 1

    def _resolve_buckets(self, buckets: Sequence[int] | None) -> tuple[int, ...]:
        m = self.manifest
        if m.seq_axis is None:
            if buckets not in (None, (), [], [FIXED_SIZE_BUCKET], (FIXED_SIZE_BUCKET,)):
                raise BundleError(
                    f"{self.directory}: bundle {m.name!r} has no sequence axis; it takes no length buckets"
                )
            return (FIXED_SIZE_BUCKET,)
        assert m.max_length is not None  # the manifest validator guarantees it
        chosen = default_buckets(m.max_length) if not buckets else tuple(sorted(set(int(b) for b in buckets)))
        for b in chosen:
            if not 1 <= b <= m.max_length:
                raise BundleError(
                    f"{self.directory}: bucket {b} is outside 1..{m.max_length} (the bundle's max_length)"
                )
        return chosen

    def _check_dataflow(self) -> None:
        """Every tensor a block or ramp reads is a bundle input or written by an earlier block."""
        m = self.manifest
        available = {t.name for t in m.inputs}
        for index, block in enumerate(m.blocks):
            for name in block.inputs:
                if name not in available:
                    raise BundleError(
                        f"{self.directory / 'bundle.yaml'}: block {block.name!r} reads tensor {name!r} "
                        f"that no bundle input or earlier block provides"
                    )
            available.update(block.outputs)
            for ramp in m.ramps:
                if ramp.after == index:
                    for name in ramp.inputs:
                        if name not in available:
                            raise BundleError(
                                f"{self.directory / 'bundle.yaml'}: ramp {ramp.name!r} reads tensor {name!r} "
                                f"that is not in the state after block {index}"
                            )

    def _options(self, bucket: int) -> ort.SessionOptions:
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        if self.threads > 1:  # spinning pool threads steal cores from neighbours on shared machines
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if self.is_sequence_model and not self.free_length:
            options.add_free_dimension_override_by_name(SEQ_DIM, bucket)
        return options

    def _load(self, rel: str, inputs: list[str], outputs: list[str], what: str) -> None:
        path = self.directory / rel
        for bucket in self.buckets:
            try:
                session = ort.InferenceSession(str(path), self._options(bucket), providers=list(self.providers))
            except Exception as err:  # onnxruntime raises several unrelated types for a bad file
                raise BundleError(f"{path}: ONNX Runtime cannot load this file ({what}): {err}") from err
            self._io[(rel, bucket)] = self._validate(path, session, inputs, outputs, what)
            self._sessions[(rel, bucket)] = session

    def _validate(
        self, path: Path, session: ort.InferenceSession, inputs: list[str], outputs: list[str], what: str
    ) -> _IOSpec:
        got_in = [i.name for i in session.get_inputs()]
        got_out = [o.name for o in session.get_outputs()]
        for kind, expected, got in (("input", inputs, got_in), ("output", outputs, got_out)):
            for name in expected:
                if name not in got:
                    raise BundleError(
                        f"{path}: bundle.yaml names {kind} tensor {name!r} for {what}, but the ONNX file's "
                        f"{kind}s are {got}; re-export the bundle or fix bundle.yaml"
                    )
            for name in got:
                if name not in expected:
                    raise BundleError(
                        f"{path}: the ONNX file has {kind} tensor {name!r} that bundle.yaml does not name for "
                        f"{what} (it names {expected}); re-export the bundle or fix bundle.yaml"
                    )
        by_name = {i.name: i for i in session.get_inputs()}
        declared = {t.name: t for t in self.manifest.inputs}
        dtypes = []
        for name in inputs:
            try:
                dtype = np.dtype(by_onnx(by_name[name].type).numpy)
            except UnknownDType as err:
                raise BundleError(f"{path}: input tensor {name!r}: {err}") from err
            spec = declared.get(name)
            if spec is not None and np.dtype(by_numpy(spec.dtype).numpy) != dtype:
                raise BundleError(
                    f"{path}: input tensor {name!r} is {dtype} in the ONNX file but {spec.dtype} in bundle.yaml"
                )
            dtypes.append(dtype)
        shapes = tuple(tuple(by_name[name].shape) for name in inputs)
        return _IOSpec(names=tuple(inputs), dtypes=tuple(dtypes), shapes=shapes)

    # ------------------------------------------------------------------ running

    def _feeds(
        self, rel: str, state: Mapping[str, np.ndarray], bucket: int | None, what: str
    ) -> tuple[dict[str, np.ndarray], int]:
        """The arrays `rel` reads from `state`, checked against its session for `bucket` (None: inferred)."""
        first = self._io[(rel, self.buckets[0])]
        feeds: dict[str, np.ndarray] = {}
        for name, dtype in zip(first.names, first.dtypes):
            if name not in state:
                raise StateError(f"{what} reads tensor {name!r}, which is not in the state (it has {sorted(state)})")
            array = state[name]
            if not isinstance(array, np.ndarray) or array.dtype != dtype:
                got = getattr(array, "dtype", type(array).__name__)
                raise StateError(f"{what}: tensor {name!r} must be a numpy array of {dtype}, got {got}")
            feeds[name] = array
        if bucket is None:
            bucket = next((b for b in self.buckets if not self._shape_errors(rel, b, feeds)), None)
            if bucket is None:
                shapes = {name: a.shape for name, a in feeds.items()}
                raise StateError(
                    f"{what}: tensor shapes {shapes} fit none of the buckets {list(self.buckets)}; pad inputs to a bucket"
                )
        elif bucket not in self.buckets:
            if not self.is_sequence_model:
                raise StateError(f"{what}: bundle {self.manifest.name!r} has no length buckets (got bucket {bucket})")
            raise StateError(f"{what}: bucket {bucket} is not one of this runtime's buckets {list(self.buckets)}")
        errors = self._shape_errors(rel, bucket, feeds)
        if errors:
            raise StateError(f"{what}, bucket {bucket}: " + "; ".join(errors))
        return feeds, bucket

    def _shape_errors(self, rel: str, bucket: int, feeds: Mapping[str, np.ndarray]) -> list[str]:
        io = self._io[(rel, bucket)]
        errors = []
        for name, shape in zip(io.names, io.shapes):
            got = feeds[name].shape
            if len(got) != len(shape) or any(isinstance(d, int) and d != g for d, g in zip(shape, got)):
                expected = tuple(d if isinstance(d, int) else (d or "?") for d in shape)
                errors.append(f"tensor {name!r} has shape {got}, expected {expected}")
        return errors

    def run_block(self, index: int, state: dict[str, np.ndarray], bucket: int | None = None) -> None:
        """Run block `index` on `state` (arrays padded to `bucket`; None = infer it) and write its outputs."""
        if not self.first_block <= index <= self.last_block:
            raise StateError(f"block {index} is outside this runtime's range [{self.first_block}, {self.last_block}]")
        block = self.manifest.blocks[index]
        what = f"block {block.name!r}"
        feeds, bucket = self._feeds(block.file, state, bucket, what)
        outputs = self._sessions[(block.file, bucket)].run(block.outputs, feeds)
        state.update(zip(block.outputs, outputs))

    def run_ramp(self, ramp_name: str, state: Mapping[str, np.ndarray], bucket: int | None = None) -> np.ndarray:
        """Logits [n, len(labels)] of ramp `ramp_name` on `state`."""
        ramp = next((r for r in self.ramps if r.name == ramp_name), None)
        if ramp is None:
            raise StateError(
                f"ramp {ramp_name!r} is not in this runtime's range (ramps here: {[r.name for r in self.ramps]})"
            )
        feeds, bucket = self._feeds(ramp.file, state, bucket, f"ramp {ramp.name!r}")
        logits: np.ndarray
        (logits,) = self._sessions[(ramp.file, bucket)].run([ramp.output], feeds)
        return logits

    def run_all_ramps(
        self, state: Mapping[str, np.ndarray], bucket: int | None = None
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Run the whole range with no exits and every ramp in it (shadow runs, calibration windows).

        Returns (logits per ramp name, the state to forward); the caller's state is not modified.
        """
        work = dict(state)
        logits: dict[str, np.ndarray] = {}
        for index in range(self.first_block, self.last_block + 1):
            self.run_block(index, work, bucket)
            for ramp in self.manifest.ramps_in(index, index):
                logits[ramp.name] = self.run_ramp(ramp.name, work, bucket)
        live = [] if self.ends_model else self.manifest.live_after(self.last_block)
        return logits, {name: work[name] for name in live if name in work}

    def _check_thresholds(self, thresholds: Mapping[str, float] | None) -> dict[str, float]:
        if not thresholds:
            return {}
        known = {r.name for r in self.manifest.ramps}
        out = {}
        for name, value in thresholds.items():
            if name not in known:
                raise StateError(f"threshold for unknown ramp {name!r}; the bundle's ramps are {sorted(known)}")
            value = float(value)
            if not np.isfinite(value):
                raise StateError(f"threshold for ramp {name!r} is {value}; use a number (above 1 disables the ramp)")
            out[name] = value
        return out

    def run_range(
        self,
        state: Mapping[str, np.ndarray],
        bucket: int | None = None,
        thresholds: Mapping[str, float] | None = None,
        resident: bool | None = None,
    ) -> RangeResult:
        """Run every block of the range with early exits; the caller's state is not modified. `resident`:
        the batch stays on the device between blocks (None: as the runtime was made).

        An input exits at the earliest exit ramp whose max-softmax confidence is >= that ramp's
        threshold; a ramp with no threshold or one above 1 is not run. Exited rows leave the batch
        before the next block. When the range ends the model, the final head answers the rest.
        """
        limits = self._check_thresholds(thresholds)
        if self.resident if resident is None else resident:
            if self._resident is None:
                self._resident = ResidentRange.for_providers(self.providers)
            first = self.manifest.blocks[self.first_block]
            _, bucket = self._feeds(first.file, state, bucket, f"block {first.name!r}")
            _batch_size(dict(state))
            return self._resident.run(self, state, bucket, limits)
        work = dict(state)
        n = _batch_size(work)
        rows = np.arange(n)
        exits: list[RampExit] = []
        for index in range(self.first_block, self.last_block + 1):
            if rows.size == 0:
                break
            self.run_block(index, work, bucket)
            for ramp in self.manifest.ramps_in(index, index):
                if rows.size == 0:
                    break
                limit = limits.get(ramp.name)
                if not ramp.final and (limit is None or limit > 1.0):
                    continue
                logits = self.run_ramp(ramp.name, work, bucket)
                conf = softmax(logits).max(axis=-1)
                leave = np.ones(rows.size, dtype=bool) if ramp.final else conf >= limit
                for i in np.flatnonzero(leave):
                    exits.append(RampExit(int(rows[i]), ramp.name, logits[i], float(conf[i])))
                if leave.any():
                    keep = ~leave
                    rows = rows[keep]
                    work = {k: v[keep] for k, v in work.items()}
            live = self.manifest.live_after(index)
            work = {name: work[name] for name in live if name in work}
        live = [] if self.ends_model else self.manifest.live_after(self.last_block)
        out_state = {name: work[name] for name in live if name in work}
        if self.ends_model:
            rows = rows[:0]
        return RangeResult(exits=exits, rows=rows, state=out_state)


def mask_input(manifest: BundleManifest) -> str | None:
    """The model input that marks real tokens (the attention mask), if it has one."""
    return next((t.name for t in manifest.inputs if "mask" in t.name.lower()), None)


def cpu_worker_runtime(bundle: str | Path, buckets: Sequence[int], threads: int = 1) -> BundleRuntime:
    """The whole model on the CPU as a CPU worker that ends it runs it: free-length sessions (up to the longest
    of `buckets`) where it trims its batches (a sequence axis and an attention mask, classify/trim.py), else
    one fixed-shape session per bucket. What `exitplan profile` times the workers' real compute on."""
    manifest = read_manifest(Path(bundle))
    free = manifest.seq_axis is not None and mask_input(manifest) is not None
    return BundleRuntime(
        bundle,
        buckets=[max(buckets)] if free else list(buckets),
        threads=threads,
        providers=("CPUExecutionProvider",),
        free_length=free,
    )


def _batch_size(state: Mapping[str, np.ndarray]) -> int:
    sizes = {name: int(np.shape(v)[0]) for name, v in state.items() if np.ndim(v) > 0}
    if not sizes:
        raise StateError("the state holds no tensors")
    if len(set(sizes.values())) != 1:
        raise StateError(f"tensors in the state disagree on the batch size: {sizes}")
    return next(iter(sizes.values()))
