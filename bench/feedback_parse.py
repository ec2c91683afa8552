"""A router's feedback answer parsed by the operator's re-tune, side by side in one run: the npz (`GET
/v1/window.npz`, the `exitplan tune` format) against the same arrays as safetensors (`?format=safetensors`, what
the operator asks for), both through `FeedbackArrays.from_body`, at the ~200 new samples of a followed read and
the 1,024 of a whole window (10 ramps); alternated rounds, CPU time per parse.

    python -P bench/feedback_parse.py [--rounds 3] [--parses 300]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from exitplan.worker_image.control_bodies import FeedbackArrays

RAMPS = 10


def window(n: int, seed: int) -> FeedbackArrays:
    rng = np.random.default_rng(seed)
    conf = rng.uniform(0.5, 1.0, (n, RAMPS)).astype(np.float32)
    pred, final = rng.integers(0, 2, (n, RAMPS)), rng.integers(0, 2, n)
    return FeedbackArrays(conf, pred, final, np.linspace(20.0, 2.0, RAMPS), np.full(RAMPS, 0.2), 5000 + n, "ring-a")


def per_parse_us(body: bytes, parses: int) -> float:
    start = time.process_time()
    for _ in range(parses):
        FeedbackArrays.from_body(body)
    return (time.process_time() - start) / parses * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parses", type=int, default=300)
    args = parser.parse_args()
    for r in range(args.rounds):
        for n in (200, 1024):
            arrays = window(n, r)
            npz, st = arrays.to_npz(), arrays.to_safetensors()
            a, b = per_parse_us(npz, args.parses), per_parse_us(st, args.parses)
            print(
                f"round {r}, {n:5d} samples: npz {a:6.0f} us ({len(npz)} B), safetensors {b:5.0f} us ({len(st)} B): {a / b:.1f}x"
            )


if __name__ == "__main__":
    main()
