"""Every configuration's goodput, measured the honest way, on a near-linear GPU curve and a fixed-cost-heavy one
side by side; the ratios exitplan / vanilla, / naive early exit, / naive early exit with length buckets.

    python -P bench/simulator_honesty.py [--quick]

Curves (planner/synthetic.py, both from published tables, stated there):
- near-linear: BERT-base FP16 under TensorRT on T4 (NVIDIA/TensorRT demo/BERT tables, batch 1-128): a
  batch of 32 costs 19x one, so an exit saves nearly its whole share of a batch;
- fixed-cost-heavy: BERT-base FP16 under TensorFlow on V100 (NVIDIA DeepLearningExamples, batch 1-8): a
  batch of 8 costs 1.7x one (a 4.3 ms fixed part).
Model: 12 layers, a ramp after each of the first 11 (2 % of a layer), 80:20 easy:hard (an easy input exits
after 2-5 layers, a hard one after 10-12). SLO 100 ms (p99). Equal cost within a column (the same GPUs
for every configuration).
Workloads: every input of length 128; and the Azure LLM trace's context lengths scaled to 512 (median 38),
on a profile measured at 32-512 (the TensorRT and TensorFlow rows at 128 and 384 give the length curve).

Goodput (planner/compare.py `measure`): the highest Poisson rate at which >= 99 % of requests are answered
within the SLO over a run and over the requests of its last third (drops count as misses), found on runs of
10 s and confirmed on a run of 30 s; reported as the answers within the SLO per second of that 30 s run (at
most the rate offered). Batching as in the data plane (planned batch, 2 ms max wait, deadline rule);
admission refuses beyond a queue of half the SLO (planner/simulator.py). exitplan keeps a rebatching plan
only where the simulator sustains more with it than the same planner without rebatching (e3+buckets).
The oracle: planner/oracle.py (a fluid bound: the blocks and ramps each input needs at the best batch, no
padding, within the caps and cost cap).
"""

from __future__ import annotations

import sys
import time

import numpy as np

from exitplan.api.resources import SLO, EarlyExitServiceSpec, ModelRef, PlannerSettings, PoolRef
from exitplan.planner.compare import measure_all, oracle_for, plan_all
from exitplan.planner.synthetic import bert_base_profile, gpu_pool, tensorrt_bert_base_profile
from exitplan.planner.traces import default_trace_path, load_trace

SLO_MS = 100.0
SEQ = (32, 64, 96, 128, 192, 256, 384, 512)
CURVES = {
    "near-linear (TensorRT T4)": ("t4", 6, tensorrt_bert_base_profile),
    "fixed-cost-heavy (TF V100)": ("v100", 6, bert_base_profile),
}
CONFIGS = ("vanilla", "naive-ee", "naive-ee+buckets", "e3", "e3+buckets", "arlo", "exitplan")


def spec_for(gpu: str) -> EarlyExitServiceSpec:
    return EarlyExitServiceSpec(
        model=ModelRef(name="bert-base-ee", bundle="x"),
        slo=SLO(latency_ms=SLO_MS),
        pools=[PoolRef(name=gpu)],
        planner=PlannerSettings(max_splits=4),
    )


def layout(result) -> str:
    plan = result.plan
    return " | ".join(
        f"{s.first_block}-{s.last_block}{' rb' if s.rebatch else ''}:"
        + "+".join(f"{c.replicas}x{c.bucket}/b{c.batch_size}" for c in plan.cells if c.split == s.index)
        for s in plan.splits
    )


def column(label: str, gpu: str, count: int, profile_fn, lengths: np.ndarray, quick: bool) -> dict[str, float]:
    t0 = time.perf_counter()
    seq = (128,) if len(np.unique(lengths)) == 1 else SEQ
    pools = {gpu: gpu_pool(gpu, count)}
    profiles = {gpu: profile_fn(gpu, seq_lens=seq)}
    plans = plan_all("bert", spec_for(gpu), pools, profiles, lengths=lengths, configs=CONFIGS)
    durations = {"duration_s": 3.0, "confirm_s": 10.0} if quick else {"duration_s": 10.0, "confirm_s": 30.0}
    measured = measure_all(plans, lengths, SLO_MS, **durations)
    out = {}
    print(f"  {label}: {count} x {gpu}")
    for name in CONFIGS:
        m = measured.get(name)
        if m is None:
            print(f"    {name:<17} no plan: {plans[name]}")
            continue
        g, res = m.goodput, m.goodput.run
        out[name] = g.goodput
        note = f"  [{'; '.join(g.notes)}]" if g.notes else ""
        print(
            f"    {name:<17} goodput {g.goodput:8.0f} req/s (rate {g.rate:8.0f}, planned {m.plan.plan.prediction.goodput_rps:8.0f}; "
            f"within SLO {res.attainment:.2%}, last third {res.tail_attainment:.2%}, p99 {res.pct(99):5.1f} ms)  "
            f"{layout(m.plan)}{note}"
        )
    any_plan = next(m.plan for m in measured.values())
    out["oracle"] = oracle_for(any_plan, np.resize(lengths, 20000), 1e12)
    print(f"    {'oracle':<17} {out['oracle']:8.0f} req/s (fluid bound)   [{time.perf_counter() - t0:.0f} s]")
    return out


def main() -> None:
    quick = "--quick" in sys.argv
    trace = load_trace(default_trace_path(), max_length=512, length_mode="scale")
    workloads = {"length 128": np.full(1000, 128), "Azure lengths scaled to 512": trace.lengths}
    for wl, lengths in workloads.items():
        print(f"{wl} (SLO {SLO_MS:g} ms)")
        cols = {label: column(label, g, n, fn, lengths, quick) for label, (g, n, fn) in CURVES.items()}
        print(f"  ratios ({wl}):            " + "".join(f"{label:>30}" for label in cols))
        for other in ("vanilla", "naive-ee", "naive-ee+buckets", "e3", "e3+buckets", "oracle"):
            cells = []
            for c in cols.values():
                cells.append(f"{c['exitplan'] / c[other]:29.2f}x" if c.get(other) else f"{'-':>30}")
            print(f"    exitplan / {other:<17}" + "".join(cells))


if __name__ == "__main__":
    main()
