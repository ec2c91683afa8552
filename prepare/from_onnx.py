"""`exitplan prepare --onnx MODEL.onnx --data DATA.npz`: any ONNX classifier to an early-exit bundle.

The pipeline (Apparate's, on a model nobody wrote ramps for):

1. read the model and the data (one array per model input, keyed by name; `label` optional), choose
   the output to serve, and run the model on every sample: its answers are the reference the ramps
   learn and are judged by (:mod:`exitplan.prepare.onnx_source`);
2. find the cut vertices of the graph (:mod:`exitplan.prepare.graph_cuts`), keep up to
   `candidates` of them spread by cumulative compute (or the user's `--cuts`), split the graph there;
3. train one ramp per candidate on the model's own answers (pooling from the activation's shape,
   then a linear layer or a small MLP), on the training rows, from activations computed once;
4. keep the ramps that pay, decided on the held-out rows in compute (FLOPs from the graph: the
   compute saved by exits minus the ramps' own; :mod:`exitplan.prepare.exit_report`), greedily, at
   most `max_ramps`, so the choice does not depend on how busy the machine is;
5. split again at the kept cuts only and write the bundle: blocks, ramps, the model's own head,
   held-out data keyed by input name, the calibration window (measured latencies, for the tuner);
   chained blocks must reproduce the source model (max absolute difference <= `tolerance`) or nothing
   is written. With `tokenizer` (and `texts`, the text of each data row), the bundle takes texts: the
   tokenizer is copied in and the held-out rows keep their `text` and token `length`.

The build runs in a sibling directory that replaces the target only when complete (build.py).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from exitplan.prepare.build import Bar, BuildResult, PrepareError, build_once, tqdm_bar
from exitplan.prepare.onnx_options import OnnxOptions, bundle_name
from exitplan.prepare.onnx_source import Source, heldout_texts, load_source, tokenizer_pad_id
from exitplan.prepare.user_data import InputInfo

__all__ = ["TOKENIZER", "from_onnx", "split_rows"]

TOKENIZER = "tokenizer.json"


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


# ------------------------------------------------------------------------------ bundle files


def _tensor_spec(info: InputInfo, seq_axis: int | None) -> Any:
    from exitplan.api.bundle import TensorSpec
    from exitplan.api.dtypes import UnknownDType, by_numpy

    shape: list[int | str] = [
        "batch" if axis == 0 else "seq" if axis == seq_axis else (d if isinstance(d, int) and d > 0 else 1)
        for axis, d in enumerate(info.shape)
    ]
    try:
        dtype = by_numpy(info.dtype.name).numpy
    except UnknownDType as err:
        raise PrepareError(f"model input {info.describe()}: {err}") from err
    return TensorSpec(name=info.name, dtype=dtype, shape=shape)


def _manifest(opts: OnnxOptions, src: Source, blocks: list[Any], ramps: list[Any]) -> Any:
    """bundle.yaml for blocks (graph_cuts.BlockFile) and ramps (RampSpec, the head last)."""
    from exitplan.api.bundle import BlockSpec, BundleManifest
    from exitplan.api.resources import Task

    max_length = None
    if src.seq_axis is not None:
        max_length = int(next(iter(src.data.inputs.values())).shape[src.seq_axis])
    return BundleManifest(
        name=bundle_name(opts),
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
        pad_token_id=_pad_token_id(opts),
        source_output=src.output,
    )


def _pad_token_id(opts: OnnxOptions) -> int:
    if opts.pad_token_id is not None or not opts.tokenizer:
        return opts.pad_token_id or 0
    from tokenizers import Tokenizer

    return tokenizer_pad_id(Tokenizer.from_file(opts.tokenizer))


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
    from exitplan.worker_image.bundle_runtime import BundleRuntime

    runtime = BundleRuntime(directory)
    everyone = _heldout(src, np.arange(len(src.data)), manifest)
    out: list[np.ndarray | None] = [None] * len(candidates)
    for rows, state, bucket in heldout_batches(runtime, everyone):
        for index in range(len(manifest.blocks) - 1):
            runtime.run_block(index, state, bucket)
            c = next(i for i, cand in enumerate(candidates) if cand.after == index)
            kind = candidates[c].cut.kind
            features = pool(kind, state[manifest.blocks[index].outputs[0]], state.get(src.mask) if src.mask else None)
            pooled = out[c]
            if pooled is None:
                pooled = out[c] = np.zeros((len(src.data), features.shape[1]), dtype=np.float32)
            pooled[rows] = features
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
    from exitplan.prepare.graph_cuts import find_cuts, no_cut_message, spread
    from exitplan.prepare.onnx_graph import GraphError

    example = {k: v[:2] for k, v in src.data.inputs.items()}
    # Cuts placed by hand may sit anywhere between input and output; the automatic choice skips the ends.
    if opts.cuts:
        cuts = find_cuts(src.model, example, seq_axis=src.seq_axis, margin=0.0)
    else:
        cuts = find_cuts(src.model, example, seq_axis=src.seq_axis)
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


def _compute_window(manifest: Any, logits: dict[str, np.ndarray], cands: list[Candidate]) -> Any:
    """The compute window of the bundle's exit ramps (at `cands`) on the held-out rows' `logits`."""
    from exitplan.prepare.exit_ramps import ramp_flops
    from exitplan.prepare.exit_report import compute_window
    from exitplan.prepare.window import ramp_window

    conf, pred, final = ramp_window(manifest, logits)
    places = [c.cut.compute_before for c in cands]
    costs = [ramp_flops(c.cut.kind, tuple(c.cut.shape[1:]), c.weights) / max(c.cut.model_flops, 1.0) for c in cands]
    return compute_window(conf, pred, final, places, costs)


def _place(
    directory: Path, src: Source, manifest: Any, held_rows: np.ndarray, opts: OnnxOptions, cands: list[Candidate]
) -> tuple[list[int], dict[str, Any]]:
    """Indices of the candidate ramps to keep, and the placement's figures (fractions of the compute)."""
    from exitplan.planner.tuning.placement import place_ramps
    from exitplan.prepare.exit_report import oracle_saving
    from exitplan.prepare.measure import all_ramp_logits
    from exitplan.worker_image.bundle_runtime import BundleRuntime

    runtime = BundleRuntime(directory)
    window = _compute_window(manifest, all_ramp_logits(runtime, _heldout(src, held_rows, manifest)), cands)
    figures: dict[str, Any] = {
        "candidate_agreement": [float(v) for v in (window.pred == window.final[:, None]).mean(axis=0)],
        "candidate_cost": window.cost_ms.tolist(),
        "candidates_oracle_compute_saved": oracle_saving(window),
    }
    if opts.cuts:
        return list(range(window.n_ramps)), figures
    placed = place_ramps(window, opts.budget, opts.max_ramps, overhead_ms=opts.overhead_frac)
    figures.update(placement_compute_saved=placed.saving_ms, placement_agreement=placed.agreement)
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


def _final_bundle(work: Path, src: Source, opts: OnnxOptions, kept: list[Candidate]) -> tuple[Any, list[Candidate]]:
    manifest = _write_split(work, opts, src, [c.cut for c in kept], [])
    placed = [Candidate(c.cut, after=i, weights=c.weights, train_accuracy=c.train_accuracy) for i, c in enumerate(kept)]
    ramps = [_ramp_spec(work, src, manifest, c, f"ramp{i}") for i, c in enumerate(placed)]
    manifest = manifest.model_copy(update={"ramps": [*ramps, manifest.final_ramp()]})
    _write_manifest(work, manifest)
    return manifest, placed


def _verify_and_measure(
    work: Path, src: Source, manifest: Any, placed: list[Candidate], held_rows: np.ndarray, opts: OnnxOptions
) -> dict[str, Any]:
    """Chained blocks against the source model on the held-out rows; held-out data and window written;
    what the exits buy (exit_report.exit_summary)."""
    from exitplan.prepare.exit_report import exit_summary
    from exitplan.prepare.measure import all_ramp_logits
    from exitplan.prepare.window import build_window
    from exitplan.worker_image.bundle_runtime import BundleRuntime

    runtime = BundleRuntime(work)
    held = _heldout(src, held_rows, manifest)
    logits = all_ramp_logits(runtime, held)
    diff = float(np.abs(logits[manifest.final_ramp().name] - src.logits[held_rows]).max())
    if not diff <= opts.tolerance:
        raise PrepareError(
            f"the split model differs from {opts.model} by {diff:.3g} (max absolute difference of the outputs on the "
            f"held-out data, tolerance {opts.tolerance:g}); report the model, or place ramps by hand with --cuts"
        )
    texts = heldout_texts(opts, src, held_rows)
    # allow_pickle: numpy's default, named so that the stubs match the arrays' names to **kwds alone
    np.savez_compressed(
        work / manifest.data.heldout,
        allow_pickle=True,
        **held.inputs,
        label=held.label,
        full_pred=held.full_pred,
        **texts,
    )
    window = build_window(runtime, held, logits)
    window.save(work / "data" / "window.npz")
    names = [r.name for r in manifest.exit_ramps()]
    flops = _compute_window(manifest, logits, placed) if placed else None
    exits = exit_summary(names, flops, [c.cut.compute_before for c in placed], opts.budget)
    return {
        "chain_max_abs_diff": diff,
        "ramp_agreement": dict(zip(window.ramps, window.agreement(), strict=True)),
        "saving_ms": dict(zip(window.ramps, window.saving_ms.tolist(), strict=True)),
        "cost_ms": dict(zip(window.ramps, window.cost_ms.tolist(), strict=True)),
        "window_bucket": window.bucket,
        "exits": exits,
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
    try:
        src = load_source(opts)
        steps.update(1)
        held_rows, train = split_rows(len(src.data), opts.heldout_fraction, opts.seed, opts.heldout_last)
        heldout_texts(opts, src, held_rows)  # the texts must agree with the ids before any work
        scratch, manifest, candidates = _candidate_bundle(work, src, opts, train)
        steps.update(1)
        kept_idx, figures = _place(scratch, src, manifest, held_rows, opts, candidates)
        steps.update(1)
        kept = [candidates[i] for i in kept_idx]
        shutil.rmtree(scratch)
        final, placed = _final_bundle(work, src, opts, kept)
        steps.update(1)
        measured = _verify_and_measure(work, src, final, placed, held_rows, opts)
        for path in opts.extras:
            shutil.copyfile(path, work / "data" / Path(path).name)
        steps.update(1)
    finally:
        steps.close()  # before any error is printed: the message gets a line of its own
    accuracy = None if src.data.label is None else float((src.answers == src.data.label).mean())
    return {
        "source": opts.source or opts.model,
        "samples": len(src.data),
        "heldout_size": int(held_rows.size),
        "model_accuracy": accuracy,
        "seq_axis": src.seq_axis,
        "output": src.output,
        "outputs_not_served": src.not_served,
        "shape_reads_rewritten": src.shape_reads,
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
