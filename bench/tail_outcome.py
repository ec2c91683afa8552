"""The live tuner's look with a tail's outcome read off its window's, side by side in one run (alternated rounds)
against the same looks with every tail's outcome computed from its own samples (the window link that
`FeedbackWindow.tail` leaves is dropped for those rounds). The looks are bench/retune_cpu.py's: the stand-in
router's feedback stream, 10 ramps, 40 looks of the newest 1,024 samples, 200 new ones each, through
live_thresholds._tune (autotune.advance with autotune.LIVE). The decisions must be the same in both.

    python -P bench/tail_outcome.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import retune_cpu  # noqa: E402

from exitplan.operator.live_thresholds import _tune  # noqa: E402
from exitplan.planner.tuning import autotune, feedback  # noqa: E402
from exitplan.worker_image.control_bodies import FeedbackArrays  # noqa: E402

LINKED_TAIL = feedback.FeedbackWindow.tail


def unlinked_tail(self: feedback.FeedbackWindow, k: int) -> feedback.FeedbackWindow:
    """FeedbackWindow.tail without the link to its window: its outcomes are computed from its samples."""
    out = LINKED_TAIL(self, k)
    if out is not self:
        out.__dict__.pop(feedback._PARENT, None)
    return out


def looks(arrays: list[FeedbackArrays]) -> tuple[float, list[str]]:
    """CPU per look (s) and the decisions, as (reason, thresholds) strings."""
    ramps = [f"ramp{i}" for i in range(retune_cpu.RAMPS)]
    state, current, said = autotune.TunerState(), {r: 1.01 for r in ramps}, []
    start = time.process_time()
    for a in arrays:
        decision, state = _tune(a, ramps, current, retune_cpu.BUDGET, state)
        said.append(f"{decision.reason} {decision.thresholds}")
        current = decision.thresholds or current
    return (time.process_time() - start) / len(arrays), said


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    arrays = retune_cpu.windows()
    looks(arrays)  # warm
    for r in range(args.rounds):
        linked, said_linked = looks(arrays)
        feedback.FeedbackWindow.tail = unlinked_tail  # type: ignore[method-assign]
        try:
            alone, said_alone = looks(arrays)
        finally:
            feedback.FeedbackWindow.tail = LINKED_TAIL  # type: ignore[method-assign]
        print(
            f"round {r + 1}: a look {1e3 * alone:.2f} ms with tails computed alone, {1e3 * linked:.2f} ms with them "
            f"read off the window ({alone / linked:.2f}x); the same decisions: {said_linked == said_alone}"
        )
    print(f"decisions: {dict(collections.Counter(s.split()[0] for s in said_linked))}")


if __name__ == "__main__":
    main()
