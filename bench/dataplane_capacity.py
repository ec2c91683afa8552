"""Zero lost requests up to 1.2x the measured capacity, explicit overload errors above it.

Serves a bundle with a real router and real worker processes (one split, one worker per length
bucket), measures its capacity with `find_capacity` (the highest offered rate at which >= 99 % of
requests finish within the SLO, over a step and its last third), then replays the trace open-loop at fixed multiples of that capacity,
all in one run, and prints per load: offered rate, goodput, latency, results, overload errors
(429/503, with or without Retry-After), other errors and lost requests.

    python bench/dataplane_capacity.py [--bundle artifacts/bundles/minilm] [--slo-ms 500] \
        [--loads 0.5,0.8,1.0,1.2,2,4] [--duration 20] [--thresholds tuned|off|0.9] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from exitplan.api.bundle import read_manifest
from exitplan.api.resources import EarlyExitServiceSpec
from exitplan.client.bench import BenchSetup, find_capacity, run_bench
from exitplan.localrun.deployment import LocalDeployment
from exitplan.localrun.service_setup import ServiceSetup, single_split_plan, tuned_thresholds


def thresholds_for(bundle: Path, how: str, budget: float, bounds: list[int]) -> dict[str, float]:
    ramps = [r.name for r in read_manifest(bundle).exit_ramps()]
    if how == "tuned":
        return tuned_thresholds(bundle, budget, bounds)
    if how == "off":
        return {r: 2.0 for r in ramps}
    return {r: float(how) for r in ramps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=Path("artifacts/bundles/minilm"))
    ap.add_argument("--trace", type=Path, default=None, help="default: the shared Azure trace")
    ap.add_argument("--slo-ms", type=float, default=500.0)
    ap.add_argument("--buckets", default="32,128")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--thresholds", default="tuned", help="tuned (1%% budget), off, or one number for every ramp")
    ap.add_argument("--start-rps", type=float, default=5.0)
    ap.add_argument("--step-duration", type=float, default=10.0)
    ap.add_argument("--loads", default="0.5,0.8,1.0,1.2,2,4")
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--length-mode", default="scale", choices=["scale", "clip"])
    ap.add_argument("--reference-max", type=int, default=None)
    ap.add_argument("--port", type=int, default=18580)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    console = Console()

    bundle = args.bundle.resolve()
    manifest = read_manifest(bundle)
    buckets = [int(b) for b in args.buckets.split(",")] if manifest.seq_axis is not None else []
    spec = EarlyExitServiceSpec.model_validate(
        {
            "model": {"name": manifest.name, "bundle": str(bundle)},
            "slo": {"latencyMs": args.slo_ms},
            "pools": [{"name": "cpu"}],
            "workload": {"lengthBuckets": buckets},
        }
    )
    setup = ServiceSetup("capacity", spec, bundle, manifest)
    thresholds = thresholds_for(bundle, args.thresholds, spec.accuracy.max_drop, spec.workload.length_buckets)
    plan = single_split_plan(setup, thresholds=thresholds, replicas=1, batch_size=args.batch, reason="bench")
    loads = [float(x) for x in args.loads.split(",")]
    common = dict(slo_ms=args.slo_ms, length_mode=args.length_mode, reference_max=args.reference_max)
    console.print(
        f"bundle {bundle}, buckets {plan.buckets}, thresholds {thresholds}, SLO {args.slo_ms:g} ms, "
        f"load average before: {os.getloadavg()[0]:.2f}"
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        with LocalDeployment(bundle, plan, spec, Path(tmp), port=args.port, base_port=args.port + 1) as dep:
            bench = BenchSetup.connect(dep.url, manifest.name, bundle)
            capacity = find_capacity(
                dep.url,
                manifest.name,
                bundle,
                args.trace,
                setup=bench,
                start_rps=args.start_rps,
                step_duration=args.step_duration,
                progress=True,
                **common,
            )
            console.print(capacity.table())
            for load in loads:
                rps = load * capacity.capacity_rps
                report = run_bench(
                    dep.url,
                    manifest.name,
                    bundle,
                    args.trace,
                    setup=bench,
                    rps=rps,
                    duration=args.duration,
                    progress=True,
                    **common,
                )
                rows.append((load, report))
    table = Table(
        title=f"{manifest.name}: loads relative to the measured capacity of {capacity.capacity_rps:.1f} rps "
        f"(SLO {args.slo_ms:g} ms, {args.duration:g} s each)"
    )
    for col in (
        "load",
        "offered rps",
        "goodput rps",
        "p50 ms",
        "p99 ms",
        "results",
        "overload",
        "no Retry-After",
        "other errors",
        "lost",
    ):
        table.add_column(col, justify="right")
    for load, r in rows:
        other = r.error_total - r.errors["overload"]
        table.add_row(
            f"{load:g}x",
            f"{r.offered_rps:.1f}",
            f"{r.goodput_rps:.1f}",
            f"{r.latency['p50'] or 0:.1f}",
            f"{r.latency['p99'] or 0:.1f}",
            str(r.results),
            str(r.errors["overload"]),
            str(r.overload_without_retry_after),
            str(other),
            str(r.lost),
        )
    console.print(table)
    upto = [r for load, r in rows if load <= 1.2]
    above = [r for load, r in rows if load > 1.2]
    console.print(
        f"lost at loads <= 1.2x: {sum(r.lost for r in upto)} of {sum(r.requests for r in upto)} requests; "
        f"above: {sum(r.lost for r in above)} of {sum(r.requests for r in above)}; "
        f"overload errors above 1.2x: {sum(r.errors['overload'] for r in above)}; "
        f"other errors anywhere: {sum(r.error_total - r.errors['overload'] for _, r in rows)}; "
        f"load average after: {os.getloadavg()[0]:.2f}"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "capacity": capacity.to_dict(),
                    "loads": [{"load": load, **r.to_dict()} for load, r in rows],
                    "thresholds": thresholds,
                    "buckets": plan.buckets,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
