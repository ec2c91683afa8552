"""Bucketed static-shape sessions vs padding everything to the longest length, vs dynamic shapes;
and the in-process cost of cutting the model into splits.

For real held-out texts of each length bucket, one batch is run (no exits, whole model) by:
  own     - BundleRuntime, the batch padded to its own bucket (Arlo's polymorphing)
  max     - BundleRuntime, the batch padded to the largest bucket (one runtime for every length)
  dynamic - plain ONNX Runtime sessions without a fixed length, the batch padded to its longest input
  split3  - three BundleRuntimes over blocks 0-1, 2-3, 4-5 at the own bucket, the state passed on
The variants alternate within each repeat, so load from other processes hits them alike; the table
gives medians and the ratios max/own, dynamic/own and split3/own.

    python bench/bundles_buckets.py [--bundle artifacts/bundles/minilm] [--batch-sizes 1,8,32] [--repeats 9]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from rich.console import Console
from rich.table import Table
from tokenizers import Tokenizer

from exitplan.api.bundle import read_manifest
from exitplan.worker_image.bundle_runtime import BundleRuntime, bucket_for, pad_batch


def dynamic_sessions(bundle: Path) -> list[ort.InferenceSession]:
    manifest = read_manifest(bundle)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    files = [b.file for b in manifest.blocks] + [manifest.final_ramp().file]
    return [ort.InferenceSession(str(bundle / f), options, providers=["CPUExecutionProvider"]) for f in files]


def run_dynamic(sessions, manifest, state):
    work = dict(state)
    for session, block in zip(sessions, manifest.blocks):
        work.update(zip(block.outputs, session.run(block.outputs, {n: work[n] for n in block.inputs})))
    head = manifest.final_ramp()
    return sessions[-1].run([head.output], {n: work[n] for n in head.inputs})[0]


def run_chain(runtimes, state, bucket):
    for runtime in runtimes:
        state = runtime.run_range(state, bucket).state
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, default=Path("artifacts/bundles/minilm"))
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    manifest = read_manifest(args.bundle)
    full = BundleRuntime(args.bundle)
    largest = max(full.buckets)
    splits = [BundleRuntime(args.bundle, first_block=a, last_block=b) for a, b in ((0, 1), (2, 3), (4, 5))]
    dynamic = dynamic_sessions(args.bundle)
    tokenizer = Tokenizer.from_file(str(args.bundle / manifest.tokenizer))
    with np.load(args.bundle / "data" / "heldout.npz") as data:
        ids = [e.ids for e in tokenizer.encode_batch([str(t) for t in data["text"]])]
    ids = [s for s in ids if len(s) <= largest]
    by_bucket: dict[int, list[list[int]]] = {}
    for seq in ids:
        by_bucket.setdefault(bucket_for(len(seq), full.buckets), []).append(seq)

    console = Console(width=140)
    table = Table(
        title=f"{manifest.name}: whole model, one batch, ms (median of {args.repeats}; ONNX Runtime, 1 thread)"
    )
    for col in (
        "bucket",
        "batch",
        "mean len",
        "own",
        "max",
        "dynamic",
        "split3",
        "max/own",
        "dynamic/own",
        "split3/own",
    ):
        table.add_column(col, justify="right")
    for bucket in sorted(by_bucket):
        pool = by_bucket[bucket]
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            rows = [pool[i % len(pool)] for i in range(batch)]
            longest = max(len(s) for s in rows)
            variants = {
                "own": (lambda s=pad_batch(rows, bucket), b=bucket: full.run_range(s, b)),
                "max": (lambda s=pad_batch(rows, largest): full.run_range(s, largest)),
                "dynamic": (lambda s=pad_batch(rows, longest): run_dynamic(dynamic, manifest, s)),
                "split3": (lambda s=pad_batch(rows, bucket), b=bucket: run_chain(splits, s, b)),
            }
            samples: dict[str, list[float]] = {k: [] for k in variants}
            for _ in range(2):  # warm-up
                for fn in variants.values():
                    fn()
            for _ in range(args.repeats):
                for name, fn in variants.items():
                    start = time.perf_counter()
                    fn()
                    samples[name].append((time.perf_counter() - start) * 1e3)
            ms = {k: float(np.median(v)) for k, v in samples.items()}
            table.add_row(
                str(bucket),
                str(batch),
                f"{np.mean([len(s) for s in rows]):.1f}",
                *(f"{ms[k]:.2f}" for k in variants),
                f"{ms['max'] / ms['own']:.2f}",
                f"{ms['dynamic'] / ms['own']:.2f}",
                f"{ms['split3'] / ms['own']:.2f}",
            )
    console.print(table)


if __name__ == "__main__":
    main()
