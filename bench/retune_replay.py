"""The operator's threshold re-tune replayed offline on stationary feedback streams: does it keep the accuracy
budget on the inputs that follow each decision, what does it save, how often does it change the thresholds?

Each stream is a service's shadow-sampled feedback in arrival order, replayed by planner/tuning/replay.py:
every period `--per` new samples arrive, the tuner looks at the newest `--window` (the operator reads 1,024:
live_thresholds.TUNE_WINDOW) with the thresholds in force, and the period's new samples -- which no decision
saw -- are served under whatever it decided. Printed per stream and policy: agreement with the full model on those held-out samples (the budget
is kept when it is >= 1 - budget), the mean saving per input (ms), threshold changes per period (each one a
push to every router, an Event and, in time, a plan write), full savings searches per period (the tuner's
dearest step) and the tuner's CPU per look. Start: thresholds tuned once on 1,024 samples before the replay
(to half the budget less its sampling error).

Policies: `single` -- one `autotune.decide` per look at its defaults (tune to the edge of the window's
errors, no memory between looks): what the operator ran before; `live` -- `autotune.advance` with its state
and autotune.LIVE: the live loop's policy, which the operator runs now (live_thresholds._tune).

Streams (none of them the shared trace or a built-in model): `pool` -- bench/stand_in_router.py's feedback
pool (the stream bench/operator_scale.py serves), `synthetic` -- planner.tuning.synthetic_windows with its
knobs drawn per seed (classes, sharpness, noise, over-confidence, latency).

    python -P bench/retune_replay.py [--seeds 4] [--ramps 10] [--periods 60] [--budget 0.01]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import stand_in_router  # noqa: E402

from exitplan.planner.tuning import autotune  # noqa: E402
from exitplan.planner.tuning.feedback import FeedbackWindow  # noqa: E402
from exitplan.planner.tuning.replay import replay, stream_length  # noqa: E402
from exitplan.planner.tuning.synthetic_windows import synthetic_window  # noqa: E402


class SearchCounter:
    """Counts the tuner's full searches (`tune` with rounds; a repair alone runs none)."""

    def __init__(self) -> None:
        self.count = 0
        self._tune = autotune.tune

    def __call__(self, *args: object, **kwargs: object) -> object:
        if kwargs.get("max_rounds") != 0:
            self.count += 1
        return self._tune(*args, **kwargs)  # type: ignore[arg-type]


COUNTER = SearchCounter()
autotune.tune = COUNTER  # type: ignore[assignment]


def stream(kind: str, seed: int, ramps: int, n: int) -> FeedbackWindow:
    if kind == "pool":
        pool = stand_in_router.sample_pool(ramps, seed)
        rows = (np.arange(n) + 977 * seed) % stand_in_router.POOL
        return FeedbackWindow(pool.conf[rows], pool.pred[rows], pool.final[rows], pool.saving_ms, pool.cost_ms)
    return synthetic_window(np.random.default_rng(seed), n, ramps)


class Policy:
    """One policy's step (`replay.Step`), with its CPU and the tuner's full searches counted."""

    def __init__(self, name: str, budget: float, live: autotune.TuneConfig) -> None:
        self.name, self.budget, self.live = name, budget, live
        self.state, self.cpu_s, self.searches = autotune.TunerState(), 0.0, 0

    def __call__(self, look: FeedbackWindow, current: dict[str, float]) -> dict[str, float] | None:
        t0, before = time.process_time(), COUNTER.count
        names = list(current)
        if self.name == "single":
            decision = autotune.decide(look, names, current, self.budget, autotune.TuneConfig())
        else:
            decision, self.state = autotune.advance(self.state, look, current, names, self.budget, self.live)
        self.cpu_s += time.process_time() - t0
        self.searches += COUNTER.count - before
        return decision.thresholds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=4, help="streams of each kind")
    parser.add_argument("--ramps", type=int, default=10)
    parser.add_argument("--periods", type=int, default=60, help="looks per stream")
    parser.add_argument("--per", type=int, default=200, help="new samples per period")
    parser.add_argument("--window", type=int, default=1024, help="newest samples per look")
    parser.add_argument("--budget", type=float, default=0.01, help="accuracy budget (spec.accuracy.maxDrop)")
    parser.add_argument(
        "--savings-every", type=int, help="the live policy's TuneConfig.savings_every (default: autotune.LIVE's)"
    )
    args = parser.parse_args()
    live = autotune.LIVE
    if args.savings_every is not None:
        live = replace(live, savings_every=args.savings_every)
    print(f"live: autotune.LIVE with savings_every={live.savings_every}")
    n = stream_length(args.periods, args.per, args.window)
    print(
        f"{'stream':<13} {'policy':<7} {'held-out agreement':>19} {'saving ms':>10} {'changes':>8} "
        f"{'searches':>9} {'CPU/look':>9}"
    )
    broken = {"single": 0, "live": 0}
    for kind in ("pool", "synthetic"):
        for seed in range(args.seeds):
            s = stream(kind, seed, args.ramps, n)
            for name in ("single", "live"):
                policy = Policy(name, args.budget, live)
                r = replay(s, policy, args.budget, periods=args.periods, per=args.per, window=args.window)
                kept = r.agreement >= 1.0 - args.budget
                broken[name] += not kept
                print(
                    f"{kind + ' ' + str(seed):<13} {name:<7} {r.agreement:>12.4f} {'kept' if kept else 'BROKEN':>6} "
                    f"{r.saving_ms:>10.3f} {r.changes / r.looks:>8.2f} {policy.searches / r.looks:>9.2f} "
                    f"{1e3 * policy.cpu_s / r.looks:>7.2f} ms",
                    flush=True,
                )
    total = 2 * args.seeds
    print(f"budget broken on held-out samples: single {broken['single']}/{total}, live {broken['live']}/{total}")


if __name__ == "__main__":
    main()
