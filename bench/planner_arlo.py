"""Arlo on the shared Azure trace: length buckets + the allocation integer program + Algorithm 1,
against uniform padding to 512 and against an even allocation across the same buckets.

    python bench/planner_arlo.py [--quick]

Model: the BERT-base-like encoder of planner/synthetic.py (12 layers, no exits here) on 32 V100s,
profiled at lengths 32..512; SLO 150 ms. Lengths: the Azure LLM inference trace's context tokens
scaled so its longest is 512 (`load_trace(..., max_length=512, length_mode='scale')`); arrivals:
the trace's own, sped up to two loads: 60 % of what uniform padding to 512 can carry, and the
load at which Arlo's allocation runs at 60 % peak utilisation. Buckets: the planner's
staircase choice for this length histogram. Instances per bucket: Arlo's allocation (least peak
utilisation, demotion to longer buckets), or N / K each ("even"), or all N at 512 ("uniform").
Dispatch: Algorithm 1 (dispatch.choose_bucket) as in the router; batching as in the data plane
(planned batch, 2 ms max wait, deadline rule). Reported: mean and p98 latency of answered requests,
the share answered within the SLO, drops, and the latency ratios.
"""

from __future__ import annotations

import sys

import numpy as np

from exitplan.api.plan import Cell, Plan, SplitPlan
from exitplan.api.resources import SLO, EarlyExitServiceSpec, ModelRef, PlannerSettings, PoolRef
from exitplan.planner.arlo import allocate
from exitplan.planner.compare import plan_config
from exitplan.planner.simulator import Simulation
from exitplan.planner.synthetic import bert_base_profile, gpu_pool
from exitplan.planner.traces import default_trace_path, load_trace

N = 32
SLO_MS = 150.0
SEQ = [32, 64, 96, 128, 192, 256, 384, 512]


def plan_with(name: str, buckets: list[int], replicas: list[int], batches: list[int]) -> Plan:
    cells = [
        Cell(split=0, bucket=b, pool="v100", replicas=r, batch_size=bs)
        for b, r, bs in zip(buckets, replicas, batches)
        if r > 0
    ]
    kept = [b for b, r in zip(buckets, replicas) if r > 0]
    return Plan(
        service="arlo-bench",
        model="bert-base-ee",
        splits=[SplitPlan(index=0, first_block=0, last_block=11)],
        buckets=kept,
        cells=cells,
        thresholds={},
        reason=name,
    )


def main() -> None:
    quick = "--quick" in sys.argv
    profile = bert_base_profile("v100", seq_lens=SEQ)
    pools = {"v100": gpu_pool("v100", N)}
    trace = load_trace(default_trace_path(), max_length=512, length_mode="scale")
    spec = EarlyExitServiceSpec(
        model=ModelRef(name="bert-base-ee", bundle="x"),
        slo=SLO(latency_ms=SLO_MS),
        pools=[PoolRef(name="v100")],
        planner=PlannerSettings(max_splits=1),
    )
    arlo_plan = plan_config("arlo", "arlo-bench", spec, pools, {"v100": profile}, lengths=trace.lengths)
    buckets = arlo_plan.buckets
    problem = arlo_plan.problem
    mu = problem.rate[0, 0, 0, -1, :]  # requests/s per instance of each bucket runtime (1 split)
    batches = [int(b) for b in problem.batch[0, 0, 0, -1, :]]
    shares = problem.shares
    uniform = plan_config("vanilla", "arlo-bench", spec, pools, {"v100": profile})
    mu_uniform = float(uniform.problem.rate[0, 0, 0, -1, 0])
    unit = allocate(shares, mu, N).utilisation  # peak utilisation per 1 req/s of this mix
    loads = {
        "60 % of uniform-512's capacity": 0.6 * N * mu_uniform,
        "Arlo's allocation at 60 % peak utilisation": 0.6 / unit,
    }
    print(
        f"trace: {len(trace)} requests, lengths scaled to 512 (median {int(np.median(trace.lengths))}, p90 {int(np.percentile(trace.lengths, 90))})"
    )
    print(f"buckets (staircase): {buckets}, shares {np.round(shares, 3).tolist()}, batch sizes {batches}")
    models = {"v100": arlo_plan.inputs.models[0]}
    for label, rate in loads.items():
        alloc = allocate(rate * shares, mu, N)
        even = [N // len(buckets)] * len(buckets)
        even[-1] += N - sum(even)
        print(
            f"load: {label} = {rate:.0f} req/s; Arlo allocation {alloc.instances.tolist()} (peak utilisation {alloc.utilisation:.2f}); even {even}"
        )
        plans = {
            "arlo": plan_with("arlo", buckets, alloc.instances.tolist(), batches),
            "even": plan_with("even", buckets, even, batches),
            "uniform-512": plan_with("uniform", [512], [N], [int(uniform.problem.batch[0, 0, 0, -1, 0])]),
        }
        window = load_trace(
            default_trace_path(),
            max_length=512,
            length_mode="scale",
            speed=rate / trace.mean_rate,
            duration=None if not quick else 5.0,
        )
        out = {}
        for name, plan in plans.items():
            sim = Simulation(plan, models, SLO_MS, enabled=[False] * 11, survival=[1.0] * 11, name=name)
            res = sim.run(window.timestamps, window.lengths)
            out[name] = res
            print(
                f"  {name:<12} mean {float(np.mean(res.latencies_ms)):6.1f} ms  p98 {res.pct(98):6.1f} ms  within SLO {res.attainment:6.1%}  "
                f"drops {res.dropped}  ({len(window)} requests)"
            )
        a = out["arlo"]
        for other in ("uniform-512", "even"):
            o = out[other]
            print(
                f"  {other} / arlo: mean latency {np.mean(o.latencies_ms) / np.mean(a.latencies_ms):.2f}x, p98 {o.pct(98) / a.pct(98):.2f}x, "
                f"within-SLO {o.attainment:.1%} vs {a.attainment:.1%}"
            )


if __name__ == "__main__":
    main()
