"""E3's setting, simulated: a BERT-base 12-block early-exit model on V100-class GPUs.

    python -P bench/planner_e3.py [--quick] [--het e3|exitplan]

Profile: planner/synthetic.py (NVIDIA's published BERT-base FP16 V100 figures, batch 1-8; P100
and K80 scaled from datasheet rates; GCP per-GPU prices; all stated there).
Workload: 80:20 easy:hard; an easy input exits after 2-5 of the 12 blocks, a hard one after 10-12
(uniform), all inputs of length 128; SLO 100 ms (p99). Goodput = the answers within the SLO per
second at the largest Poisson rate at which >= 99 % of requests are answered within the SLO (drops
count as misses), over the whole run and over the requests of its last third (a steady state, not a
queue still building), found in the discrete-event simulator (planner/compare.py `measure`: search
runs of the stated seconds, then a 30 s run) with the data plane's batching and dispatch rules (fusion queues launch
on a full batch or when the oldest deadline needs it; the data plane's extra 2 ms max wait is off,
see MAX_WAIT_MS). Naive early exit = exits inside one unsplit model: a batch runs each later block
at the size that remains (E3's account); a second row shows the variant where exited rows keep
their slots until the whole batch is done.

Part 1, 16 V100s (equal cost for every configuration): vanilla, naive early exit, E3 (split and
replicate, no rebatching), exitplan (everything: E3's DP on the rebatching cost tables, every split
keeps a fusion queue per block; Arlo's buckets are moot here since every input has one length),
and the oracle bound; then the same with batches up to 32 extrapolated linearly past the published
batch 8 (sensitivity).
Part 2, heterogeneous at equal cost: the cost of 16 V100s per hour spent on V100 only, P100 only,
K80 only, or any mix of the three (the planner chooses; E3's DP with GPU types), every type
available in any number.
Part 3: the same budget as a cap when each type is scarce (8 V100, 16 P100, 24 K80 available), so
no single type can spend it.
Parts 2 and 3 plan every row (homogeneous and mix alike) with the configuration `--het` names:
exitplan (default, with rebatching) or e3 (without).
"""

from __future__ import annotations

import sys
import time

import numpy as np

from exitplan.api.resources import SLO, EarlyExitServiceSpec, ModelRef, PlannerSettings, PoolRef
from exitplan.planner.compare import oracle_for, plan_config, simulate_plan, sustainable_rate
from exitplan.planner.errors import PlanInfeasible
from exitplan.planner.simulator import poisson_arrivals
from exitplan.planner.synthetic import GPUS, bert_base_profile, gpu_pool

SLO_MS = 100.0
MAX_WAIT_MS = float("inf")
"""Fusion queues launch on a full batch or when the oldest deadline needs it (no fixed max wait):
GPU latency is flat for small batches, so launching partial batches early wastes a replica's cycle."""
LENGTHS = np.array([128])


def spec_for(pools: list[str], cost_cap: float | None = None) -> EarlyExitServiceSpec:
    return EarlyExitServiceSpec(
        model=ModelRef(name="bert-base-ee", bundle="x"),
        slo=SLO(latency_ms=SLO_MS),
        pools=[PoolRef(name=p) for p in pools],
        # E3's settings run up to 88 K80s: above the default maxReplicas (64) that caps a service
        planner=PlannerSettings(max_splits=4, cost_cap_per_hour=cost_cap, max_replicas=1000),
    )


def measure(label: str, result, duration: float, iters: int, compact_exits: bool = True) -> float:
    t = time.perf_counter()
    rate, res = sustainable_rate(
        result, LENGTHS, SLO_MS, duration_s=duration, max_wait_ms=MAX_WAIT_MS, compact_exits=compact_exits
    )
    plan = result.plan
    layout = " | ".join(
        f"{s.first_block}-{s.last_block}{' rebatch' if s.rebatch else ''}:"
        + "+".join(f"{c.replicas}x{c.pool}/b{c.batch_size}" for c in plan.cells if c.split == s.index)
        for s in plan.splits
    )
    print(
        f"  {label:<10} goodput {rate:8.0f} req/s (planned {plan.prediction.goodput_rps:8.0f}; p99 {res.pct(99):5.1f} ms, "
        f"cost {plan.prediction.cost_per_hour:5.2f}/h)  {layout}  [{time.perf_counter() - t:.0f} s]"
    )
    return rate


SWEEP = (0.1, 0.3, 0.5, 0.7, 0.9)


def sweep(label: str, result, rate: float, duration: float) -> float:
    """SLO attainment below the measured goodput (the search above only probes near it): at each
    fraction of `rate`, a run of `duration` seconds of Poisson arrivals. Returns the lowest."""
    out = []
    for f in SWEEP:
        n = max(2000, int(rate * f * duration))
        arrivals = poisson_arrivals(np.random.default_rng(11), rate * f, n)
        out.append(simulate_plan(result, arrivals, np.full(n, 128), SLO_MS, max_wait_ms=MAX_WAIT_MS).attainment)
    print(
        f"  {label:<10} within SLO at " + ", ".join(f"{f:.0%}: {a:.2%}" for f, a in zip(SWEEP, out)) + " of its goodput"
    )
    return min(out)


def main() -> None:
    quick = "--quick" in sys.argv
    het_cfg = sys.argv[sys.argv.index("--het") + 1] if "--het" in sys.argv else "exitplan"
    if het_cfg not in ("e3", "exitplan"):
        raise SystemExit(f"--het must be e3 or exitplan, got {het_cfg!r}")
    duration, iters = (1.0, 7) if quick else (3.0, 10)
    print(
        "Part 1: 16 x V100, SLO 100 ms, 80:20 easy:hard (e3: split and replicate; exitplan: the same DP on rebatching splits)"
    )
    pools = {"v100": gpu_pool("v100", 16)}
    profiles = {"v100": bert_base_profile("v100")}
    spec = spec_for(["v100"])
    rates = {}
    plans = {}
    for cfg in ("vanilla", "naive-ee", "e3", "exitplan"):
        plans[cfg] = plan_config(cfg, "bert", spec, pools, profiles, lengths=np.full(1000, 128))
        rates[cfg] = measure(cfg, plans[cfg], duration, iters)
    padded = measure("naive-ee, exited rows keep their slots", plans["naive-ee"], duration, iters, compact_exits=False)
    oracle = oracle_for(plans["e3"], np.full(20000, 128), 1e12)
    print(
        f"  {'oracle':<10} goodput {oracle:8.0f} req/s (fluid bound: every GPU busy on exactly the blocks each input needs, best batch, free exits)"
    )
    print("  ratios:")
    for cfg in ("exitplan", "e3"):
        best = rates[cfg]
        print(
            f"    {cfg:<8} / naive-ee = {best / rates['naive-ee']:.2f}x (E3 paper: 1.44x), / vanilla = {best / rates['vanilla']:.2f}x "
            f"(E3 paper: 1.30x), / oracle = {best / oracle:.0%}, / naive-ee with slots kept = {best / padded:.2f}x"
        )
    print(f"    exitplan / e3 = {rates['exitplan'] / rates['e3']:.2f}x (rebatching on top of split and replicate)")
    print("  below the goodput (target 99 % within the SLO at every load):")
    for cfg in ("e3", "exitplan"):
        sweep(cfg, plans[cfg], rates[cfg], duration)
    print("Part 1b (sensitivity): batches up to 32, extrapolated linearly past the published batch 8")
    wide = {"v100": bert_base_profile("v100", batch_sizes=(1, 2, 4, 8, 16, 24, 32))}
    rates_w = {}
    for cfg in ("vanilla", "naive-ee", "e3", "exitplan"):
        rates_w[cfg] = measure(
            cfg, plan_config(cfg, "bert", spec, pools, wide, lengths=np.full(1000, 128)), duration, iters
        )
    oracle_w = oracle_for(
        plan_config("e3", "bert", spec, pools, wide, lengths=np.full(1000, 128)), np.full(20000, 128), 1e12
    )
    print(f"  oracle {oracle_w:.0f} req/s; ratios:")
    for cfg in ("exitplan", "e3"):
        print(
            f"    {cfg:<8} / naive-ee = {rates_w[cfg] / rates_w['naive-ee']:.2f}x, / vanilla = {rates_w[cfg] / rates_w['vanilla']:.2f}x, "
            f"/ oracle = {rates_w[cfg] / oracle_w:.0%}"
        )

    budget = 16 * GPUS["v100"].cost_per_hour
    print(f"Part 2 ({het_cfg}): equal cost {budget:.2f}/h (16 x V100) as V100 only, P100 only, K80 only, or a mix")
    counts = {g: int(budget // GPUS[g].cost_per_hour + 1e-9) for g in ("v100", "p100", "k80")}
    homo = {}
    for g, n in counts.items():
        try:
            res = plan_config(het_cfg, "bert", spec_for([g], budget), {g: gpu_pool(g, n)}, {g: bert_base_profile(g)})
        except PlanInfeasible as err:
            print(f"  {f'{n} x {g}':<10} no plan: {err}")
            continue
        homo[g] = measure(f"{n} x {g}", res, duration, iters)
    t = time.perf_counter()
    mix = plan_config(
        het_cfg,
        "bert",
        spec_for(list(counts), budget),
        {g: gpu_pool(g, n) for g, n in counts.items()},
        {g: bert_base_profile(g) for g in counts},
    )
    solve = time.perf_counter() - t
    het = measure("mix", mix, duration, iters)
    best_g = max(homo, key=homo.get)
    print(f"  heterogeneous / best homogeneous ({best_g}) = {het / homo[best_g]:.2f}x  (plan solved in {solve:.2f} s)")

    print(f"Part 3 ({het_cfg}): the same budget when each type is scarce (at most 8 V100, 16 P100, 24 K80 available)")
    avail = {"v100": 8, "p100": 16, "k80": 24}
    homo = {}
    for g, n in avail.items():
        try:
            res = plan_config(het_cfg, "bert", spec_for([g], budget), {g: gpu_pool(g, n)}, {g: bert_base_profile(g)})
        except PlanInfeasible as err:
            print(f"  {f'{n} x {g}':<10} no plan: {err}")
            continue
        homo[g] = measure(f"{n} x {g}", res, duration, iters)
    mix = plan_config(
        het_cfg,
        "bert",
        spec_for(list(avail), budget),
        {g: gpu_pool(g, n) for g, n in avail.items()},
        {g: bert_base_profile(g) for g in avail},
    )
    het = measure("mix", mix, duration, iters)
    best_g = max(homo, key=homo.get)
    print(f"  heterogeneous / best homogeneous ({best_g}) = {het / homo[best_g]:.2f}x within the same cost cap")


if __name__ == "__main__":
    main()
