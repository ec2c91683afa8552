"""The planner and the drift loop at fleet scale (issue 31): E3's search, a whole plan, a drift period.

    python -P bench/planner_scale.py [--repeats 5] [--operator 50,100,200] [--json PATH]

Instance: BERT-large, 24 blocks, a ramp after every layer (planner/synthetic.py
`tensorrt_bert_large_profile`: NVIDIA's published TensorRT BERT-base FP16 tables scaled to BERT-large, V100 as
A100 x 2.5, stated there), pools A100 / V100 / T4 with G/3 GPUs each, batches 1-64, lengths 128 and 384,
80:20 easy:hard exits (thresholds 0.9 on every ramp), SLO 100 ms, at most 4 splits, spec.planner.maxReplicas
at its default (64: the issue's instance) and lifted (10,000: every GPU usable, the pools' caps bind).
Lengths: 80 % of 128 tokens, 20 % of 384.

All times are CPU seconds of this process (time.process_time), the least of --repeats runs (other jobs on a
shared machine only add to a run):

1. E3 search (`planner.e3.max_goodput`) on the problem `plan_service` builds, buckets [128] and [128, 384], at
   64 / 128 / 192 / 384 GPUs: probes, probes the DP settled, CPU; side by side with every probe left to the
   exact DP (the certificates of planner/e3_bounds.py switched off: the search as it probed before them).
2. Whole `plan_service` (inputs, bucket sets, options, search, placement, the plan as served): cold (an empty
   OptionCache), and re-plans of the same service keeping its cache: the pools' capacity changed (every
   option reused), and the survival curve drifted (options again; the previous plan warm-starts the search).
3. The drift loop's decision part per period, in this process (bench/operator_scale.py `decision_cost`:
   since_last, the judged window, drift.assess with the survival forecast over a full history, decide) at
   50 / 200 / 1,000 services, with the AR(1) forecaster (the default) and, at 50 services, statsmodels'
   ARIMA (the reference it replaced); 1,000 services measured, not extrapolated.
4. With --operator N1,N2,...: bench/operator_scale.py at each count (the operator process on the emulated
   API, routers answering: its whole read -> score -> decide -> status path; minutes per count), the
   operator's CPU per 20 s drift period, a least-squares line through them, and 1,000 services
   extrapolated from that line (said so in the output).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from operator_scale import decision_cost  # noqa: E402

from exitplan.api.plan import Plan  # noqa: E402
from exitplan.api.resources import SLO, EarlyExitServiceSpec, ModelRef, PlannerSettings, PoolRef  # noqa: E402
from exitplan.operator import drift  # noqa: E402
from exitplan.planner import e3, forecast  # noqa: E402
from exitplan.planner.e3_bounds import Verdict  # noqa: E402
from exitplan.planner.inputs import resolve_inputs  # noqa: E402
from exitplan.planner.problem import OptionCache, build_problem, rebatching  # noqa: E402
from exitplan.planner.service import plan_service  # noqa: E402
from exitplan.planner.synthetic import gpu_pool, tensorrt_bert_large_profile  # noqa: E402

GPUS = ("a100", "v100", "t4")
SIZES = (64, 128, 192, 384)
LENGTHS = np.r_[np.full(80, 128), np.full(20, 384)]
TARGET_DP_S, TARGET_PLAN_S, TARGET_PERIOD_S = 0.1, 0.2, 2.0


def world(total_gpus: int, max_replicas: int | None):
    """(spec, pools, profiles, thresholds) of the instance at `total_gpus` (a third on each pool)."""
    planner = (
        PlannerSettings(max_splits=4)
        if max_replicas is None
        else PlannerSettings(max_splits=4, max_replicas=max_replicas)
    )
    spec = EarlyExitServiceSpec(
        model=ModelRef(name="bert-large-ee", bundle="x"),
        slo=SLO(latency_ms=100),
        pools=[PoolRef(name=g) for g in GPUS],
        planner=planner,
    )
    pools = {g: gpu_pool(g, total_gpus // len(GPUS)) for g in GPUS}
    profiles = {g: tensorrt_bert_large_profile(g) for g in GPUS}
    thresholds = {r.name: 0.9 for r in profiles["t4"].ramps}
    return spec, pools, profiles, thresholds


def least_cpu(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeats):
        c = time.process_time()
        out = fn()
        best = min(best, time.process_time() - c)
    return best, out


def dp_only(*_args: Any, **_kwargs: Any) -> Verdict:
    return Verdict()  # no certificate: the exact DP settles every probe


def search_rows(repeats: int) -> list[dict[str, Any]]:
    rows = []
    for max_replicas in (None, 10_000):
        for total in SIZES:
            spec, pools, profiles, thresholds = world(total, max_replicas)
            inp = resolve_inputs(spec, pools, profiles, thresholds=thresholds, lengths=LENGTHS)
            for buckets in ([128], [128, 384]):
                problem = build_problem(inp, buckets, 4, rebatch=rebatching(spec, inp))
                cpu, sol = least_cpu(lambda p=problem: e3.max_goodput(p), repeats)
                settle = e3.settle
                e3.settle = dp_only
                try:
                    cpu_dp, sol_dp = least_cpu(lambda p=problem: e3.max_goodput(p), max(1, repeats // 2))
                finally:
                    e3.settle = settle
                assert (sol.goodput, sol.cost) == (sol_dp.goodput, sol_dp.cost), "the certificates changed the optimum"
                by_dp = next((int(n.split("(")[1].split()[0]) for n in sol.notes if "settled by the DP" in n), -1)
                rows.append(
                    {
                        "max_replicas": max_replicas or 64,
                        "gpus": total,
                        "buckets": buckets,
                        "cpu_s": cpu,
                        "probes": sol.probes,
                        "probes_by_dp": by_dp,
                        "dp_only_cpu_s": cpu_dp,
                        "dp_only_probes": sol_dp.probes,
                        "goodput": sol.goodput,
                        "splits": sol.splits,
                    }
                )
                print(
                    f"  maxReplicas {max_replicas or 64:>5}  {total:>3} GPUs  buckets {str(buckets):<10}  "
                    f"search {cpu * 1e3:7.1f} ms CPU, {sol.probes:>2} probes ({by_dp} by the DP)   "
                    f"every probe by the DP {cpu_dp * 1e3:7.1f} ms, {sol_dp.probes:>2} probes   "
                    f"x{cpu_dp / cpu:5.1f}   goodput {sol.goodput:,.0f} req/s, {sol.splits} splits",
                    flush=True,
                )
    return rows


def replan_cpu(world_: tuple[Any, ...], repeats: int, pools: Any = None, profiles: Any = None) -> float:
    """The least CPU of a re-plan of the same service (its OptionCache kept from its previous plan, which is
    passed as `previous`) with other pools or profiles."""
    spec, pools0, profiles0, thresholds = world_
    best = float("inf")
    for _ in range(repeats):
        cache = OptionCache()
        first = plan_service("bert", spec, pools0, profiles0, thresholds=thresholds, lengths=LENGTHS, cache=cache)
        c = time.process_time()
        plan_service(
            "bert", spec, pools or pools0, profiles or profiles0, thresholds=thresholds, lengths=LENGTHS, cache=cache,
            previous=first.plan, reason="drift",
        )  # fmt: skip
        best = min(best, time.process_time() - c)
    return best


def plan_rows(repeats: int) -> list[dict[str, Any]]:
    rows = []
    for max_replicas in (None, 10_000):
        for total in SIZES:
            world_ = spec, pools, profiles, thresholds = world(total, max_replicas)
            cold, first = least_cpu(
                lambda: plan_service(
                    "bert", spec, pools, profiles, thresholds=thresholds, lengths=LENGTHS, cache=OptionCache()
                ),
                repeats,
            )
            more = {g: p.model_copy(update={"capacity": p.capacity + 3}) for g, p in pools.items()}
            drifted = {
                g: p.model_copy(update={"survival": [0.95 * s for s in p.survival]}) for g, p in profiles.items()
            }
            capacity = replan_cpu(world_, repeats, pools=more)
            survival = replan_cpu(world_, repeats, profiles=drifted)
            rows.append(
                {
                    "max_replicas": max_replicas or 64,
                    "gpus": total,
                    "cold_cpu_s": cold,
                    "replan_capacity_cpu_s": capacity,
                    "replan_survival_cpu_s": survival,
                    "buckets": first.plan.buckets,
                    "goodput": first.plan.prediction.goodput_rps,
                }
            )
            print(
                f"  maxReplicas {max_replicas or 64:>5}  {total:>3} GPUs  whole plan cold {cold * 1e3:6.1f} ms CPU   "
                f"re-plan, capacity changed {capacity * 1e3:6.1f} ms   re-plan, survival drifted {survival * 1e3:6.1f} ms   "
                f"buckets {first.plan.buckets}, goodput {first.plan.prediction.goodput_rps:,.0f} req/s",
                flush=True,
            )
    return rows


def small_plans(n: int) -> tuple[list[Plan], EarlyExitServiceSpec]:
    """n copies of one BERT-large plan (10 ramps' survival is what the forecast reads; the decision part's
    cost does not depend on which plan), and its spec."""
    spec, pools, profiles, thresholds = world(64, None)
    base = plan_service("bert", spec, pools, profiles, thresholds=thresholds, lengths=LENGTHS).plan
    ten = base.model_copy(update={"survival": base.survival[:10]})  # 10 ramps, as the services
    return [ten.model_copy(update={"service": f"svc-{i}"}) for i in range(n)], spec


def decision_rows(period: float = 20.0) -> list[dict[str, Any]]:
    rows = []
    try:
        for predictor, counts in (("ar1", (50, 200, 1000)), ("arima", (50,))):
            drift.planner_forecast = lambda series, name=predictor: forecast.forecast_survival(series, name)
            for n in counts:
                plans, spec = small_plans(n)
                d = decision_cost(plans, spec, period)  # the stand-in router's windows name every ramp
                rows.append({"predictor": predictor, **d})
                print(
                    f"  {predictor:<5} {n:>5} services x 10 ramps, {d['reads_per_service']} reads each: {d['cpu_s']:7.3f} s "
                    f"CPU per period ({1e3 * d['cpu_s'] / n:6.2f} ms/service; drift.assess "
                    f"{100 * d['assess_cpu_s'] / d['cpu_s']:.0f} %)",
                    flush=True,
                )
    finally:
        drift.planner_forecast = forecast.forecast_survival
    return rows


def operator_rows(counts: list[int]) -> dict[str, Any]:
    measured = []
    for n in counts:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            cmd = [
                sys.executable,
                "-P",
                str(REPO / "bench" / "operator_scale.py"),
                "--services",
                str(n),
                "--json",
                out.name,
            ]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            f = json.loads(Path(out.name).read_text())
        d = f["drift_period_stand_in_router"]
        measured.append({"services": n, "operator_cpu_s": d["operator_cpu_s"], "wall_s": d["wall_s"],
                         "reads_done": d["reads_done"], "reads_due": d["reads_due"]})  # fmt: skip
        print(
            f"  {n:>5} services: operator CPU {d['operator_cpu_s']:.2f} s per {d['wall_s']:.0f} s drift period "
            f"({d['reads_done']:.0f} of {d['reads_due']} router reads done, per period)",
            flush=True,
        )
    x = np.asarray([m["services"] for m in measured], dtype=float)
    y = np.asarray([m["operator_cpu_s"] for m in measured])
    slope, intercept = np.polyfit(x, y, 1) if len(x) > 1 else (y[0] / x[0], 0.0)
    at_1000 = intercept + slope * 1000
    print(
        f"  line through the measured points: {intercept:.3f} s + {1e3 * slope:.2f} ms per service; "
        f"1,000 services EXTRAPOLATED from it: {at_1000:.1f} s CPU per period"
    )
    return {"measured": measured, "intercept_s": intercept, "per_service_s": slope, "extrapolated_1000_s": at_1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per figure; the least CPU is reported")
    parser.add_argument("--operator", default="", help="service counts for bench/operator_scale.py, e.g. 50,100,200")
    parser.add_argument("--json", help="also write the figures as JSON to this file")
    args = parser.parse_args()
    figures: dict[str, Any] = {}
    print("1. E3 search on the BERT-large instance (CPU, least of the runs):")
    figures["search"] = search_rows(args.repeats)
    print("2. Whole plan_service (CPU, least of the runs):")
    figures["plan"] = plan_rows(args.repeats)
    print("3. The drift loop's decision part per 20 s period, in this process:")
    figures["decision"] = decision_rows()
    if args.operator:
        print("4. The operator on the emulated API (bench/operator_scale.py), routers answering:")
        figures["operator"] = operator_rows([int(x) for x in args.operator.split(",")])
    at192 = [r for r in figures["search"] if r["gpus"] == 192 and r["max_replicas"] == 64]
    plan192 = [r for r in figures["plan"] if r["gpus"] == 192 and r["max_replicas"] == 64]
    print(
        f"targets at 192 GPUs (maxReplicas 64): E3 search <= {TARGET_DP_S * 1e3:.0f} ms CPU: "
        + ", ".join(f"{r['buckets']} {r['cpu_s'] * 1e3:.0f} ms" for r in at192)
        + f"; whole plan <= {TARGET_PLAN_S * 1e3:.0f} ms CPU: {plan192[0]['cold_cpu_s'] * 1e3:.0f} ms cold"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2, default=float))


if __name__ == "__main__":
    main()
