"""Predicted against measured goodput: the planner's plan for this machine, served and searched for its capacity.

    python -P bench/plan_accuracy.py [--quick] [--service FILE ...]

For each service file (default: examples/minilm-local.yaml and a digits-CNN service on the test bundle,
built by `exitplan prepare --model digits-cnn` into artifacts/bundles/digits-cnn if missing), in one run:

1. the profile per pool (measured if missing; a cached one without serving-path costs gets them), the
   thresholds tuned under the accuracy budget, the trace's lengths (the shared Azure trace, as the demo);
2. two predictions of the same plan's goodput: the block cost model alone (no serving path: the profile's
   `serving` dropped and no shared cores, as the planner predicted before) and the whole path
   (planner/serving_path.py: the worker's own work per batch, the routers' CPU, this machine's cores);
3. the plan served on this machine (`exitplan up`'s processes: one router, the plan's workers) and its
   capacity within the SLO measured by `exitplan bench --find-capacity`'s search (>= 99 % within the SLO
   over each step and its last third).

Printed: each prediction, the measured capacity and predicted / measured. The load generator runs on the
same cores (its CPU per request is printed too): the prediction is for the service alone.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from exitplan.client.bench import BenchSetup, find_capacity
from exitplan.localrun.deployment import LocalDeployment, exitplan_command
from exitplan.localrun.ports import free_port, free_port_block
from exitplan.localrun.service_setup import (
    ensure_profiles,
    load_setup,
    on_this_machine,
    trace_lengths,
    tuned_thresholds,
)
from exitplan.planner import plan_service

REPO = Path(__file__).resolve().parents[1]
DIGITS = REPO / "artifacts" / "bundles" / "digits-cnn"


def digits_service(directory: Path) -> Path:
    """A service file for the digits CNN (built with the preset if missing): a CPU pool of two workers."""
    if not (DIGITS / "bundle.yaml").is_file():
        subprocess.run([*exitplan_command(), "prepare", "--model", "digits-cnn", "--out", str(DIGITS)], check=True)
    path = directory / "digits.yaml"
    docs = [
        {
            "apiVersion": "exitplan.io/v1alpha1",
            "kind": "GPUPool",
            "metadata": {"name": "cpu"},
            "spec": {"capacity": 2, "gpuResource": "", "memoryBytes": 4 << 30, "linkBandwidthGbps": 20},
        },
        {
            "apiVersion": "exitplan.io/v1alpha1",
            "kind": "EarlyExitService",
            "metadata": {"name": "digits"},
            "spec": {
                "model": {"name": "digits", "bundle": str(DIGITS), "task": "image-classification"},
                "slo": {"latencyMs": 100, "slackMs": 10},
                "accuracy": {"maxDrop": 0.02},
                "pools": [{"name": "cpu"}],
                "planner": {"maxSplits": 2},
            },
        },
    ]
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path


def predictions(setup, thresholds, lengths) -> tuple[object, float, float, list[str]]:
    """(the whole-path plan, its predicted goodput, the block-only prediction of the same service, notes)."""
    spec, pools = on_this_machine(setup, routers=1)
    whole = plan_service(setup.name, spec, pools, setup.profiles, thresholds=thresholds, lengths=lengths)
    bare = {name: p.model_copy(update={"serving": None}) for name, p in setup.profiles.items()}
    blocks = plan_service(setup.name, setup.spec, setup.pools, bare, thresholds=thresholds, lengths=lengths)
    notes = [n for n in whole.notes if "serving path" in n]
    return whole.plan, whole.plan.prediction.goodput_rps, blocks.plan.prediction.goodput_rps, notes


def measure(setup, plan, step_s: float, workdir: Path, reference: int | None) -> tuple[float, str, float]:
    """(capacity within the SLO, how the search ended, the load generator's CPU ms per request)."""
    dep = LocalDeployment(
        setup.bundle, plan, setup.spec, workdir, port=free_port(), base_port=free_port_block(8), restart=None
    )
    dep.start()
    try:
        bench = BenchSetup.connect(dep.url, setup.spec.model.name, setup.bundle)
        before = resource.getrusage(resource.RUSAGE_SELF)
        result = find_capacity(
            dep.url,
            setup.spec.model.name,
            setup.bundle,
            setup=bench,
            start_rps=max(1.0, plan.prediction.goodput_rps / 4),
            step_duration=step_s,
            settle_s=2.0,
            max_steps=8,
            max_rps=5000.0,
            reference_max=reference,  # the trace's p99 = the longest bucket, as the plan's lengths were scaled
        )
        after = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        dep.stop()
    sent = sum(s.report.requests for s in result.steps) or 1
    client_ms = (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / sent * 1e3
    return result.capacity_rps, result.reason, client_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--service", type=Path, action="append", help="service file(s); default: minilm + digits")
    parser.add_argument("--quick", action="store_true", help="4 s steps instead of 8 s")
    args = parser.parse_args()
    step_s = 4.0 if args.quick else 8.0
    with tempfile.TemporaryDirectory(prefix="plan-accuracy-") as tmp:
        services = args.service or [REPO / "examples" / "minilm-local.yaml", digits_service(Path(tmp))]
        rows = []
        for path in services:
            setup = load_setup(path)
            ensure_profiles(setup, print)
            thresholds = tuned_thresholds(
                setup.bundle, setup.spec.accuracy.max_drop, setup.spec.workload.length_buckets
            )
            lengths, reference = (
                trace_lengths(None, int(setup.manifest.max_length or 1)) if setup.manifest.seq_axis else (None, None)
            )
            plan, whole, blocks, notes = predictions(setup, thresholds, lengths)
            started = time.perf_counter()
            measured, how, client_ms = measure(setup, plan, step_s, Path(tmp) / setup.name, reference)
            rows.append((setup.name, plan, blocks, whole, measured, how, client_ms, notes))
            print(f"{setup.name}: measured in {time.perf_counter() - started:.0f} s; {how}", flush=True)
    print()
    print("service   plan                               blocks-only  whole path  measured  blocks/meas  whole/meas")
    for name, plan, blocks, whole, measured, _how, client_ms, notes in rows:
        cells = ", ".join(f"s{c.split} b{c.bucket} x{c.replicas} batch {c.batch_size}" for c in plan.cells)
        ratio = (lambda x: f"{x / measured:.2f}x") if measured > 0 else (lambda x: "-")
        print(
            f"{name:9s} {cells[:34]:34s} {blocks:11.1f} {whole:11.1f} {measured:9.1f} "
            f"{ratio(blocks):>12s} {ratio(whole):>11s}"
        )
        for note in notes:
            print(f"          {note}")
        print(f"          load generator: {client_ms:.2f} ms CPU per request on the same cores")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
