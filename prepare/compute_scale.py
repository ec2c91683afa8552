"""What a CPU worker's compute really costs against the profile's tables (`serving.computeScale`).

The tables hold each block's and ramp's fastest repeat on fixed-shape sessions (prepare/measure.py
`time_chain`: robust on a busy machine). A CPU worker spends its mean time, and one that trims its batches
(an attention mask and a sequence axis: worker_image/classify/trim.py) runs free-length sessions: on the
2-core dev machine MiniLM's whole model costs 1.05-1.3x the tables' figure. Per profiled length, the model
at the profile's first batch size (held-out inputs padded to the length, every block and the final head, no
exits) is run on the sessions such a worker runs, and the ratio of its mean time to the tables' sum there
is the scale the planner puts on a CPU pool's tables (planner/costmodel.py). CPU time with one intra-op
thread (other processes' load does not count), wall time with more (CPU time would count every thread).
"""

from __future__ import annotations

import time
from pathlib import Path

from exitplan.api.resources import ModelProfileSpec
from exitplan.prepare.measure import batch_state, load_heldout
from exitplan.worker_image.bundle_runtime import cpu_worker_runtime

SECONDS = 0.5
"""Time spent per profiled length (at least RUNS runs, at most 200)."""
RUNS = 10


def compute_scale(bundle: Path, profile: ModelProfileSpec, threads: int = 1) -> list[float]:
    """Per entry of the profile's seqLens: the model's mean time per batch there as a CPU worker runs it over
    the profile's block and final-head times (see the module's docstring)."""
    runtime = cpu_worker_runtime(bundle, list(profile.seq_lens), threads)
    heldout = load_heldout(bundle, runtime.manifest)
    head = runtime.manifest.final_ramp().name
    ramps = {r.name: r for r in profile.ramps}
    clock = time.process_time if threads == 1 else time.perf_counter
    batch, top = profile.batch_sizes[0], max(runtime.buckets)
    lengths = profile.seq_lens if runtime.manifest.seq_axis is not None else list(runtime.buckets)
    scales = []
    for i, length in enumerate(lengths):
        table = sum(b.latency_ms[i][0] for b in profile.blocks) + (
            ramps[head].latency_ms[i][0] if head in ramps else 0.0
        )
        state = batch_state(runtime, heldout, batch, length)
        bucket = top if runtime.free_length else length
        started = clock()
        runtime.run_range(state, bucket)  # warm, and how long one takes
        runs = max(RUNS, min(200, int(SECONDS / max(clock() - started, 1e-6))))
        started = clock()
        for _ in range(runs):
            runtime.run_range(state, bucket)
        measured = (clock() - started) / runs * 1e3
        scales.append(round(measured / table, 4) if table > 0 else 1.0)
    return scales
