"""What a CPU worker of the longest bucket computes a batch at: the bucket, the next default bucket, its longest row.

    python -P bench/trim_lengths.py [--bundle artifacts/bundles/minilm] [--batches 1,4,8] [--repeats 80]

Batches of real held-out texts drawn at the shared Azure trace's lengths (scaled as the demo scales them),
the whole model, no exits, one ONNX Runtime thread, the three variants alternating on the same batch:

- `bucket`: padded to the worker's bucket (the bundle's longest length), one fixed-shape session set;
- `default`: cut to the shortest default bucket (16, 32, 64, ...) holding the batch's longest row, a
  fixed-shape session set per bucket (how trimming workers ran before);
- `exact`: cut to the longest row rounded up to TRIM_STEP tokens, one free-length session set (how a
  trimming worker runs now, worker_image/classify/trim.py).

Printed per batch size: mean and median ms per batch of each, and the ratios to `bucket` and `default`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from exitplan.api.bundle import read_manifest
from exitplan.client.texts import build_inputs, load_pool
from exitplan.localrun.service_setup import trace_lengths
from exitplan.worker_image.bundle_runtime import BundleRuntime, default_buckets
from exitplan.worker_image.classify.decode import decode_inputs, parse_request
from exitplan.worker_image.classify.trim import TRIM_STEP, longest_row, trimmed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=Path("artifacts/bundles/minilm"))
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--repeats", type=int, default=80)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    manifest = read_manifest(args.bundle)
    if manifest.max_length is None or manifest.tokenizer is None:
        raise SystemExit(f"{args.bundle}: a text bundle with a sequence axis is needed (it has none)")
    longest = int(manifest.max_length)
    buckets = default_buckets(longest)
    fixed = BundleRuntime(args.bundle, buckets=buckets)
    free = BundleRuntime(args.bundle, buckets=[longest], free_length=True)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(args.bundle / manifest.tokenizer))
    lengths, _ = trace_lengths(None, longest)
    rng = np.random.default_rng(args.seed)
    pool = load_pool(args.bundle)
    axes = {name: 1 for name in ("input_ids", "attention_mask", "token_type_ids")}
    print(f"{args.bundle} ({manifest.name}), bucket {longest}, default buckets {list(buckets)}, step {TRIM_STEP}")
    for batch in [int(x) for x in args.batches.split(",")]:
        times: dict[str, list[float]] = {"bucket": [], "default": [], "exact": []}
        for _ in range(args.repeats):
            targets = rng.choice(lengths, batch)
            bodies = build_inputs(pool, np.asarray(targets), max_length=longest).bodies
            rows = [decode_inputs(parse_request(b, None), manifest, tokenizer, [longest], False) for b in bodies]
            state = {
                k: np.concatenate([r.state_for([0], longest)[k] for r in rows]) for k in rows[0].state_for([0], longest)
            }
            seq = {k: v for k, v in axes.items() if k in state}
            need = longest_row(state["attention_mask"], 1)
            short = next(b for b in buckets if b >= need)
            to_default = {k: v[:, :short] if k in seq else v for k, v in state.items()}
            to_exact, _ = trimmed(state, "attention_mask", seq, longest)
            for name, run in (
                ("bucket", lambda: fixed.run_range(state, longest)),
                ("default", lambda: fixed.run_range(to_default, short)),
                ("exact", lambda: free.run_range(to_exact, longest)),
            ):
                t0 = time.perf_counter()
                run()
                times[name].append((time.perf_counter() - t0) * 1e3)
        mean = {k: statistics.fmean(v) for k, v in times.items()}
        median = {k: statistics.median(v) for k, v in times.items()}
        print(
            f"batch {batch:2d}: mean ms bucket {mean['bucket']:.2f}, default {mean['default']:.2f}, exact {mean['exact']:.2f}"
            f" | median {median['bucket']:.2f} / {median['default']:.2f} / {median['exact']:.2f}"
            f" | exact / default {mean['exact'] / mean['default']:.3f}, exact / bucket {mean['exact'] / mean['bucket']:.3f}"
        )


if __name__ == "__main__":
    main()
