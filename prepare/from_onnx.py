"""`exitplan prepare --onnx MODEL.onnx --data DATA.npz`: any ONNX classifier to an early-exit bundle.

The pipeline (Apparate's, on a model nobody wrote ramps for):

1. read the model and the data (one array per model input, keyed by name; `label` optional) and
   run the model on every sample: its answers are the reference the ramps learn and are judged by;
2. find the cut vertices of the graph (:mod:`exitplan.prepare.graph_cuts`), keep up to
   `candidates` of them spread by cumulative compute (or the user's `--cuts`), split the graph there;
3. train one ramp per candidate on the model's own answers (pooling from the activation's shape,
   then a linear layer or a small MLP), on the training rows, from activations computed once;
4. measure every block and ramp on this machine and tune thresholds on the held-out rows; keep the
   ramps whose utility pays (latency saved minus overhead, greedily, at most `max_ramps`);
5. split again at the kept cuts only and write the bundle: blocks, ramps, the model's own head,
   held-out data keyed by input name, the calibration window; chained blocks must reproduce the
   source model (max absolute difference <= `tolerance`) or nothing is written. With `tokenizer` (and
   `texts`, the text of each data row), the bundle takes texts: the tokenizer is copied in and the
   held-out rows keep their `text` and token `length` (--hf, :mod:`exitplan.prepare.from_hf`).

The build runs in a sibling directory that replaces the target only when complete (build.py).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from exitplan.prepare.build import Bar, BuildResult, PrepareError, build_once, tqdm_bar
from exitplan.prepare.user_data import DataError, InputInfo, UserData, load_data, model_inputs

FORMAT_VERSION = 2
TOKENIZER = "tokenizer.json"
TEXT_INPUTS = {"input_ids", "attention_mask"}
"""What the router feeds a bundle that takes texts."""


@dataclass(frozen=True)
class OnnxOptions:
    model: str
    """Path of the ONNX classifier."""
    data: str
    """Path of DATA.npz."""
    labels: str | None = None
    """File with one class name a line (default: 0..C-1)."""
    name: str | None = None
    """Model name (default: the model file's stem, lower-cased)."""
    max_ramps: int = 3
    candidates: int = 8
    """Cut vertices tried as ramp locations (spread by cumulative compute)."""
    cuts: tuple[str, ...] = ()
    """Tensor names to place ramps at, instead of the automatic choice."""
    seq_axis: int | None = -1
    """Sequence axis of the inputs; -1: detect (integer [N, L] inputs are token sequences); None: none."""
    budget: float = 0.01
    """Accuracy budget the placement tunes thresholds to (agreement with the model's own answers)."""
    ramp_hidden: int = 0
    """0: linear ramps; > 0: an MLP with one hidden layer of this width."""
    overhead_frac: float = 0.05
    """The kept ramps together cost at most this fraction of a whole-model pass."""
    heldout_fraction: float = 0.25
    heldout_last: int = 0
    """> 0: the data's last `heldout_last` rows are the held-out rows (split beforehand, e.g. stratified),
    instead of a random `heldout_fraction` of them."""
    tolerance: float = 1e-4
    seed: int = 0
    tokenizer: str | None = None
    """A `tokenizers` JSON file, copied into the bundle (no padding, no truncation) so the router takes texts."""
    pad_token_id: int = 0
    """The token id that pads token sequences (with `tokenizer`)."""
    texts: str | None = None
    """A JSON file with a list of texts, the text of each data row (with `tokenizer`): held-out rows keep theirs."""
    source: str | None = None
    """What reports call the model (default: the model file)."""
    extras: tuple[str, ...] = ()
    """Files copied into the bundle's data/ folder as they are (e.g. a head trained by --hf, for references)."""
    fingerprint: str = field(default="", compare=False)
    """sha256 of the model and data files (set by `resolved`), so a changed file rebuilds."""

    def files(self) -> tuple[str | None, ...]:
        return (self.model, self.data, self.labels, self.tokenizer, self.texts)

    def resolved(self) -> OnnxOptions:
        for what, path in zip(("onnx", "data", "labels", "tokenizer", "texts"), self.files(), strict=True):
            if path is not None and not Path(path).is_file():
                raise PrepareError(f"--{what} {path}: no such file")
        missing = [path for path in self.extras if not Path(path).is_file()]
        if missing:
            raise PrepareError(f"extra bundle files {missing}: no such file")
        if self.max_ramps < 0 or self.candidates < 1:
            raise PrepareError(f"--max-ramps ({self.max_ramps}) must be >= 0 and candidates ({self.candidates}) >= 1")
        if not 0.0 < self.heldout_fraction < 1.0 or not 0.0 <= self.budget < 1.0:
            raise PrepareError("the held-out fraction must be in (0, 1) and the accuracy budget in [0, 1)")
        digest = hashlib.sha256()
        for path in (*self.files(), *self.extras):
            digest.update(b"-" if path is None else Path(path).read_bytes())
        resolved = {**asdict(self), "cuts": tuple(self.cuts), "extras": tuple(self.extras)}
        return OnnxOptions(**{**resolved, "fingerprint": digest.hexdigest()[:16]})

    def digest(self) -> str:
        """The files by content (`fingerprint`), not by path: a model exported again to another temporary
        directory (--torch, --hf) reuses the bundle; the name, which may come from the path, counts."""
        paths = {"model", "data", "labels", "tokenizer", "texts"}
        options = {k: v for k, v in asdict(self).items() if k not in paths}
        options["extras"] = [Path(path).name for path in self.extras]
        payload = json.dumps({"format": FORMAT_VERSION, **options, "name": _name(self)}, sort_keys=True, default=str)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def from_onnx(
    model: str | Path,
    data: str | Path,
    out: str | Path,
    *,
    force: bool = False,
    bar: Bar | None = None,
    threads: int | None = None,
    **options: Any,
) -> BuildResult:
    """Build (or reuse) an early-exit bundle at `out` from an ONNX classifier and its data (see
    :class:`OnnxOptions` for `options`). Raises PrepareError, DataError or GraphError with a message
    that says what to change; nothing is left at `out` unless the bundle is complete."""
    opts = OnnxOptions(model=str(model), data=str(data), **options).resolved()
    progress = bar or tqdm_bar()
    path, reused, report = build_once(
        Path(out), opts, lambda work: _build(opts, work, progress), force=force, threads=threads
    )
    return BuildResult(path, reused, report)


# ------------------------------------------------------------------------------ the model's answers


@dataclass
class Source:
    """The model, its inputs, the data and the model's answers on it."""

    model: Any
    inputs: list[InputInfo]
    data: UserData
    logits: np.ndarray
    labels: list[str]
    seq_axis: int | None
    mask: str | None
    """The input that masks sequence positions (pooled over), if any."""

    @property
    def answers(self) -> np.ndarray:
        return self.logits.argmax(axis=1)


def _detect_seq_axis(option: int | None, inputs: list[InputInfo]) -> int | None:
    if option is None or option >= 0:
        return option
    tokens = all(i.dtype.kind in "iu" and len(i.shape) == 2 for i in inputs)
    return 1 if tokens else None


def _widths(data: UserData, inputs: list[InputInfo], seq_axis: int | None, mask: str | None) -> np.ndarray | None:
    """Per sample, the sequence width that holds its tokens (the mask's last 1), when the model's sequence
    axis is free on every sequence input (padding beyond it changes no answer): batches are then run
    trimmed, several times faster on short texts padded to a long width. None: run as given."""
    if seq_axis != 1 or mask is None:
        return None
    if any(len(i.shape) > 1 and isinstance(i.shape[1], int) for i in inputs if data.inputs[i.name].ndim > 1):
        return None
    held = data.inputs[mask] != 0
    last = held.shape[1] - np.argmax(held[:, ::-1], axis=1)
    return np.where(held.any(axis=1), last, 1)


def _run_source(model: Any, data: UserData, widths: np.ndarray | None = None, batch: int = 64) -> np.ndarray:
    """The model's first output for every sample; with `widths`, samples sorted by width and each batch
    trimmed to its widest."""
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    name = session.get_outputs()[0].name
    order = np.arange(len(data)) if widths is None else np.argsort(widths, kind="stable")
    outputs: list[np.ndarray] = []
    for start in range(0, len(data), batch):
        rows = order[start : start + batch]
        feeds = {k: v[rows] for k, v in data.inputs.items()}
        if widths is not None:
            width = int(widths[rows].max())
            feeds = {k: v[:, :width] if v.ndim > 1 else v for k, v in feeds.items()}
        outputs.append(session.run([name], feeds)[0])
    logits = np.concatenate(outputs).astype(np.float32)
    answer = np.empty_like(logits)
    answer[order] = logits
    return answer


def _labels(path: str | None, classes: int) -> list[str]:
    if path is None:
        return [str(i) for i in range(classes)]
    names = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    if len(names) != classes:
        raise PrepareError(f"--labels {path}: {len(names)} class names, but the model scores {classes} classes")
    return names


def load_source(opts: OnnxOptions) -> Source:
    """The model, its data and its answers, checked: a class score vector per sample, at least as
    many samples as classes."""
    from exitplan.prepare.graph_cuts import load_model

    model = load_model(Path(opts.model))
    inputs = model_inputs(model)
    data = load_data(Path(opts.data), inputs)
    seq_axis = _detect_seq_axis(opts.seq_axis, inputs)
    mask = next((i.name for i in inputs if "mask" in i.name.lower()), None) if seq_axis is not None else None
    logits = _run_source(model, data, _widths(data, inputs, seq_axis, mask))
    if logits.ndim != 2 or logits.shape[1] < 2:
        raise PrepareError(
            f"{opts.model}: the first output has shape {list(logits.shape)}; a classifier must output class "
            "scores [batch, classes] with at least 2 classes"
        )
    n, classes = logits.shape
    if n < classes:
        raise DataError(f"{opts.data}: {n} samples for {classes} classes; give at least one sample per class")
    if opts.tokenizer and (seq_axis != 1 or not {"input_ids"} <= {i.name for i in inputs} <= TEXT_INPUTS):
        raise PrepareError(
            f"{opts.model}: a bundle with a tokenizer takes token sequences as the router feeds them, inputs "
            f"`input_ids` and optionally `attention_mask` [batch, seq]; this model takes "
            f"{', '.join(i.describe() for i in inputs)}"
        )
    return Source(model, inputs, data, logits, _labels(opts.labels, classes), seq_axis, mask)


def heldout_texts(opts: OnnxOptions, src: Source, rows: np.ndarray) -> dict[str, np.ndarray]:
    """`text` and `length` (tokens, no truncation) of the held-out `rows` when the data comes with its
    texts (`opts.texts`); each text must tokenize, truncated at the sequence width, to its row's ids."""
    if not opts.texts or not opts.tokenizer:
        return {}
    from tokenizers import Tokenizer

    texts = json.loads(Path(opts.texts).read_text())
    if not isinstance(texts, list) or len(texts) != len(src.data):
        raise PrepareError(f"{opts.texts}: expected a JSON list of {len(src.data)} texts, one per data row")
    held = [str(texts[r]) for r in rows]
    tokenizer = Tokenizer.from_file(opts.tokenizer)
    tokenizer.no_padding()
    tokenizer.no_truncation()
    lengths = np.array([len(e.ids) for e in tokenizer.encode_batch(held)], dtype=np.int64)
    ids = src.data.inputs["input_ids"]
    tokenizer.enable_truncation(max_length=int(ids.shape[1]))
    mask = src.data.inputs.get("attention_mask")
    for row, encoded in zip(rows, tokenizer.encode_batch(held), strict=True):
        used = int((mask[row] != 0).sum()) if mask is not None else len(encoded.ids)
        if list(ids[row, :used]) != encoded.ids:
            raise PrepareError(
                f"{opts.texts}: text {int(row)} ({str(texts[row])[:40]!r}) tokenizes to {encoded.ids[:12]}... but its "
                f"input_ids are {ids[row, :used][:12].tolist()}...; the texts and the ids must agree"
            )
    return {"text": np.asarray(held), "length": lengths}


# ------------------------------------------------------------------------------ bundle files


def _tensor_spec(info: InputInfo, seq_axis: int | None) -> Any:
    from exitplan.api.bundle import TensorSpec

    shape: list[int | str] = [
        "batch" if axis == 0 else "seq" if axis == seq_axis else (d if isinstance(d, int) and d > 0 else 1)
        for axis, d in enumerate(info.shape)
    ]
    return TensorSpec(name=info.name, dtype=info.dtype.name, shape=shape)


def _name(opts: OnnxOptions) -> str:
    import re

    raw = opts.name or Path(opts.model).stem
    name = re.sub(r"[^a-z0-9-]+", "-", raw.lower()).strip("-")[:63] or "model"
    return name


def _manifest(opts: OnnxOptions, src: Source, blocks: list[Any], ramps: list[Any]) -> Any:
    """bundle.yaml for blocks (graph_cuts.BlockFile) and ramps (RampSpec, the head last)."""
    from exitplan.api.bundle import BlockSpec, BundleManifest
    from exitplan.api.resources import Task

    max_length = None
    if src.seq_axis is not None:
        max_length = int(next(iter(src.data.inputs.values())).shape[src.seq_axis])
    return BundleManifest(
        name=_name(opts),
        task=Task.text_classification if src.seq_axis is not None else Task.image_classification,
        labels=src.labels,
        inputs=[_tensor_spec(i, src.seq_axis) for i in src.inputs],
        blocks=[
            BlockSpec(name=f"block{i}", file=b.file, inputs=list(b.inputs), outputs=list(b.outputs))
            for i, b in enumerate(blocks)
        ],
        ramps=ramps,
        seq_axis=src.seq_axis,
        max_length=max_length,
        tokenizer=TOKENIZER if opts.tokenizer else None,
        pad_token_id=opts.pad_token_id,
    )


def _write_manifest(directory: Path, manifest: Any, opts: OnnxOptions | None = None) -> None:
    import yaml

    if opts is not None and opts.tokenizer:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(opts.tokenizer)
        tokenizer.no_padding()
        tokenizer.no_truncation()  # the router decides: reject over-long inputs, or truncate when asked
        tokenizer.save(str(directory / TOKENIZER))
    (directory / "bundle.yaml").write_text(
        yaml.safe_dump(manifest.model_dump(mode="json", exclude_none=True), sort_keys=False)
    )


def _head(directory: Path, block: Any, after: int) -> Any:
    """The model's own output as the final ramp (`ramps/head.onnx`)."""
    import onnx

    from exitplan.api.bundle import RampSpec
    from exitplan.prepare.exit_ramps import head_model

    (directory / "ramps").mkdir(exist_ok=True)
    source = block.outputs[0]
    output = "logits" if source != "logits" else "head_logits"  # a graph cannot read and write one name
    model = head_model(source, list(block.output_shape), block.output_type, output=output)
    onnx.save(model, directory / "ramps" / "head.onnx")
    return RampSpec(name="head", after=after, file="ramps/head.onnx", inputs=[source], output=output, final=True)


def _write_split(directory: Path, opts: OnnxOptions, src: Source, cuts: list[Any], ramps: list[Any]) -> Any:
    """Blocks split at `cuts`, the given exit ramps and the head: the manifest, written."""
    from exitplan.prepare.graph_split import split

    example = {k: v[:2] for k, v in src.data.inputs.items()}
    blocks = split(src.model, [c.tensor for c in cuts], directory, seq_axis=src.seq_axis, example_inputs=example)
    head = _head(directory, blocks[-1], len(blocks) - 1)
    manifest = _manifest(opts, src, blocks, [*ramps, head])
    _write_manifest(directory, manifest, opts)
    return manifest


# ------------------------------------------------------------------------------ ramps


@dataclass
class Candidate:
    cut: Any
    """graph_cuts.Cut"""
    after: int
    """Block the ramp follows."""
    weights: Any = None
    train_accuracy: float = 0.0


def _heldout(src: Source, rows: np.ndarray, manifest: Any) -> Any:
    from exitplan.prepare.measure import Heldout, sequence_lengths

    arrays = {k: v[rows] for k, v in src.data.inputs.items()}
    label = src.data.label[rows] if src.data.label is not None else src.answers[rows]
    return Heldout(label=label, inputs=arrays, lengths=sequence_lengths(manifest, arrays), full_pred=src.answers[rows])


def _features(directory: Path, src: Source, manifest: Any, candidates: list[Candidate]) -> list[np.ndarray]:
    """Pooled activations at every candidate cut for every sample: [N, features] per candidate."""
    from exitplan.prepare.exit_ramps import pool
    from exitplan.prepare.measure import heldout_batches
    from exitplan.worker.bundle_runtime import BundleRuntime

    runtime = BundleRuntime(directory)
    everyone = _heldout(src, np.arange(len(src.data)), manifest)
    out: list[np.ndarray | None] = [None] * len(candidates)
    for rows, state, bucket in heldout_batches(runtime, everyone):
        for index in range(len(manifest.blocks) - 1):
            runtime.run_block(index, state, bucket)
            c = next(i for i, cand in enumerate(candidates) if cand.after == index)
            kind = candidates[c].cut.kind
            features = pool(kind, state[manifest.blocks[index].outputs[0]], state.get(src.mask) if src.mask else None)
            if out[c] is None:
                out[c] = np.zeros((len(src.data), features.shape[1]), dtype=np.float32)
            out[c][rows] = features
    return [f for f in out if f is not None]


def _ramp_spec(directory: Path, src: Source, manifest: Any, cand: Candidate, name: str) -> Any:
    import onnx
    from onnx import helper

    from exitplan.api.bundle import RampSpec
    from exitplan.prepare.exit_ramps import ramp_model

    block = manifest.blocks[cand.after]
    source = block.outputs[0]
    onnx_type = helper.np_dtype_to_tensor_dtype(np.dtype(cand.cut.dtype))
    shape = list(cand.cut.dims)
    mask = None
    inputs = [source]
    if cand.cut.kind == "sequence" and src.mask is not None:
        info = next(i for i in src.inputs if i.name == src.mask)
        spec = _tensor_spec(info, src.seq_axis)
        mask = (info.name, list(spec.shape), helper.np_dtype_to_tensor_dtype(info.dtype))
        inputs.append(info.name)
    output = "logits" if "logits" not in inputs else "ramp_logits"
    model = ramp_model(cand.cut.kind, source, shape, onnx_type, cand.weights, mask=mask, output=output)
    (directory / "ramps").mkdir(exist_ok=True)
    onnx.save(model, directory / "ramps" / f"{name}.onnx")
    return RampSpec(name=name, after=cand.after, file=f"ramps/{name}.onnx", inputs=inputs, output=output)


def _train(
    src: Source, features: list[np.ndarray], candidates: list[Candidate], train: np.ndarray, opts: OnnxOptions
) -> None:
    from exitplan.prepare.exit_ramps import train_ramp

    targets = src.answers
    for cand, feats in zip(candidates, features, strict=True):
        cand.weights, cand.train_accuracy = train_ramp(
            feats[train], targets[train], len(src.labels), hidden=opts.ramp_hidden, seed=opts.seed
        )


# ------------------------------------------------------------------------------ placement


def _candidates(src: Source, opts: OnnxOptions) -> list[Any]:
    """The cuts to try: the user's `--cuts`, or up to `candidates` cut vertices spread by compute."""
    from exitplan.prepare.graph_cuts import GraphError, find_cuts, no_cut_message, spread

    example = {k: v[:2] for k, v in src.data.inputs.items()}
    # Cuts placed by hand may sit anywhere between input and output; the automatic choice skips the ends.
    ends = {"margin": 0.0} if opts.cuts else {}
    cuts = find_cuts(src.model, example, seq_axis=src.seq_axis, **ends)
    if opts.cuts:
        by_name = {c.tensor: c for c in cuts}
        unknown = [name for name in opts.cuts if name not in by_name]
        if unknown:
            names = ", ".join(c.tensor for c in cuts[:30]) or "none"
            raise PrepareError(f"--cuts {unknown}: not cut vertices of {opts.model}; its cut vertices: {names}")
        return sorted((by_name[n] for n in dict.fromkeys(opts.cuts)), key=lambda c: c.index)
    if not cuts:
        raise GraphError(no_cut_message(src.model))
    return spread(cuts, opts.candidates)


def _place(
    directory: Path, src: Source, manifest: Any, held_rows: np.ndarray, opts: OnnxOptions
) -> tuple[list[int], dict[str, Any]]:
    """Indices of the candidate ramps to keep, and the placement's figures."""
    from exitplan.planner.tuning.feedback import FeedbackWindow
    from exitplan.planner.tuning.placement import place_ramps
    from exitplan.prepare.measure import all_ramp_logits, batch_state, time_chain
    from exitplan.prepare.window import build_window
    from exitplan.worker.bundle_runtime import BundleRuntime

    runtime = BundleRuntime(directory)
    held = _heldout(src, held_rows, manifest)
    window = build_window(runtime, held, all_ramp_logits(runtime, held))
    feedback = FeedbackWindow(
        conf=window.conf, pred=window.pred, final=window.final, saving_ms=window.saving_ms, cost_ms=window.cost_ms
    )
    timing = time_chain(runtime, batch_state(runtime, held, 4, window.bucket), window.bucket, repeats=3)
    whole_ms = float(sum(timing.block_ms) + timing.ramp_ms[manifest.final_ramp().name])
    figures: dict[str, Any] = {
        "candidate_saving_ms": window.saving_ms.tolist(),
        "candidate_cost_ms": window.cost_ms.tolist(),
        "candidate_agreement": window.agreement(),
        "whole_model_ms": whole_ms,
    }
    if opts.cuts:
        return list(range(len(window.ramps))), figures
    placed = place_ramps(feedback, opts.budget, opts.max_ramps, overhead_ms=opts.overhead_frac * whole_ms)
    figures.update(placement_saving_ms=placed.saving_ms, placement_agreement=placed.agreement)
    return list(placed.ramps), figures


# ------------------------------------------------------------------------------ the build


def _candidate_bundle(
    work: Path, src: Source, opts: OnnxOptions, train: np.ndarray
) -> tuple[Path, Any, list[Candidate]]:
    """A scratch bundle split at every candidate with a trained ramp at each."""
    scratch = work / ".candidates"
    scratch.mkdir()
    cuts = _candidates(src, opts)
    manifest = _write_split(scratch, opts, src, cuts, [])
    candidates = [Candidate(cut, after=i) for i, cut in enumerate(cuts)]
    _train(src, _features(scratch, src, manifest, candidates), candidates, train, opts)
    ramps = [_ramp_spec(scratch, src, manifest, c, f"cand{i}") for i, c in enumerate(candidates)]
    manifest = manifest.model_copy(update={"ramps": [*ramps, manifest.final_ramp()]})
    _write_manifest(scratch, manifest)
    return scratch, manifest, candidates


def _final_bundle(work: Path, src: Source, opts: OnnxOptions, kept: list[Candidate]) -> Any:
    manifest = _write_split(work, opts, src, [c.cut for c in kept], [])
    placed = [Candidate(c.cut, after=i, weights=c.weights, train_accuracy=c.train_accuracy) for i, c in enumerate(kept)]
    ramps = [_ramp_spec(work, src, manifest, c, f"ramp{i}") for i, c in enumerate(placed)]
    manifest = manifest.model_copy(update={"ramps": [*ramps, manifest.final_ramp()]})
    _write_manifest(work, manifest)
    return manifest


def _verify_and_measure(
    work: Path, src: Source, manifest: Any, held_rows: np.ndarray, opts: OnnxOptions, texts: dict[str, np.ndarray]
) -> dict[str, Any]:
    """Chained blocks against the source model on the held-out rows; held-out data and window written."""
    from exitplan.prepare.measure import all_ramp_logits
    from exitplan.prepare.window import build_window
    from exitplan.worker.bundle_runtime import BundleRuntime

    runtime = BundleRuntime(work)
    held = _heldout(src, held_rows, manifest)
    logits = all_ramp_logits(runtime, held)
    diff = float(np.abs(logits[manifest.final_ramp().name] - src.logits[held_rows]).max())
    if not diff <= opts.tolerance:
        raise PrepareError(
            f"the split model differs from {opts.model} by {diff:.3g} (max absolute difference of the outputs on the "
            f"held-out data, tolerance {opts.tolerance:g}); report the model, or place ramps by hand with --cuts"
        )
    np.savez_compressed(
        work / manifest.data.heldout, **held.inputs, label=held.label, full_pred=held.full_pred, **texts
    )
    window = build_window(runtime, held, logits)
    window.save(work / "data" / "window.npz")
    return {
        "chain_max_abs_diff": diff,
        "ramp_agreement": dict(zip(window.ramps, window.agreement(), strict=True)),
        "saving_ms": dict(zip(window.ramps, window.saving_ms.tolist(), strict=True)),
        "cost_ms": dict(zip(window.ramps, window.cost_ms.tolist(), strict=True)),
        "window_bucket": window.bucket,
    }


def split_rows(n: int, heldout_fraction: float, seed: int, last: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(held-out rows, training rows) of `n` samples, sorted: the split every build of these options makes
    (the last `last` rows held out when `last` > 0)."""
    if last > 0:
        if last >= n:
            raise PrepareError(f"{last} held-out rows leave none of the {n} samples to train on")
        return np.arange(n - last, n), np.arange(n - last)
    order = np.random.default_rng(seed).permutation(n)
    n_held = max(1, int(round(heldout_fraction * n)))
    return np.sort(order[:n_held]), np.sort(order[n_held:])


def _build(opts: OnnxOptions, work: Path, bar: Bar) -> dict[str, Any]:
    started = time.perf_counter()
    steps = bar(5, "prepare --onnx")
    src = load_source(opts)
    steps.update(1)
    held_rows, train = split_rows(len(src.data), opts.heldout_fraction, opts.seed, opts.heldout_last)
    texts = heldout_texts(opts, src, held_rows)
    scratch, manifest, candidates = _candidate_bundle(work, src, opts, train)
    steps.update(1)
    kept_idx, figures = _place(scratch, src, manifest, held_rows, opts)
    steps.update(1)
    kept = [candidates[i] for i in kept_idx]
    shutil.rmtree(scratch)
    final = _final_bundle(work, src, opts, kept)
    steps.update(1)
    measured = _verify_and_measure(work, src, final, held_rows, opts, texts)
    for path in opts.extras:
        shutil.copyfile(path, work / "data" / Path(path).name)
    steps.update(1)
    steps.close()
    accuracy = None if src.data.label is None else float((src.answers == src.data.label).mean())
    return {
        "source": opts.source or opts.model,
        "samples": len(src.data),
        "heldout_size": int(held_rows.size),
        "model_accuracy": accuracy,
        "seq_axis": src.seq_axis,
        "candidates": [
            {
                "tensor": c.cut.tensor,
                "kind": c.cut.kind,
                "compute_before": c.cut.compute_before,
                "train_agreement": c.train_accuracy,
            }
            for c in candidates
        ],
        "kept": [c.cut.tensor for c in kept],
        **figures,
        **measured,
        "total_seconds": time.perf_counter() - started,
    }
