"""Predicted against measured capacity: vanilla, naive early exit and the planner's plan, on this machine.

    python -P bench/plan_accuracy.py [--quick] [--repeats N] [--json FILE] [--reuse-profile] [--service FILE ...]

For each service file (default: examples/minilm-local.yaml and a digits-CNN service on the test bundle,
built by `exitplan prepare --model digits-cnn` into artifacts/bundles/digits-cnn if missing), in one run:

1. the profile per pool (measured again first unless `--reuse-profile`: a cached one may have been
   written under other load; a cached one without serving-path costs gets them), the
   thresholds tuned under the accuracy budget, the trace's lengths (the shared Azure trace, as the demo),
   and the profile's survival curve read again at those thresholds from the bundle's calibration window
   (the profiler measures it at 0.9 for every ramp; the configurations serve the tuned thresholds);
2. the demo's three configurations (localrun/demo.py `build_plans`): vanilla (the whole model, one
   bucket at the longest length, no exits), naive early exit (the same with the tuned exits) and the
   planner's plan for this machine (1 router, the CPU pool's workers sharing its cores);
3. two predictions of each configuration's capacity, both from the planner's code:
   - fluid: `plan_service`'s predicted goodput for the configuration (planner/compare.py `plan_config`,
     split 0 in the routers where the served plan runs it there: the solver's rate at full batches,
     capped by the routers' CPU and the shared cores, planner/serving_path.py);
   - simulated: the planner's capacity as served (planner/predict.py `serving_capacity`): its simulator
     replaying the very steps the measurement replays (`exitplan.client.bench.schedule`: the trace's first
     seconds rescaled to each rate, with their lengths) through the plan with the serving path -- the
     routers' CPU per request (the profile's `serving.routerMs`, or `colocatedMs`) on single-threaded
     routers, the router's own admission limit, the CPU workers' trimming, the load generator as the
     one process that sends every request (its CPU per request measured during that configuration's
     search), and the machine's two cores shared by all of them; the highest rate (bisected to 1 %) at which >= 99 % of the requests finish
     within the SLO over the step and its last third;
4. the configuration served on this machine (`exitplan up`'s processes) and its capacity within the SLO
   measured by `exitplan bench --find-capacity`'s search (>= 99 % within the SLO over each step and its
   last third; 4 s of trace at a rate that passed before the first step and after each miss, as the
   demo), starting at a quarter of the simulated capacity.

With `--repeats N` every configuration is measured N times, in rounds (each time predicted again with the
load generator's CPU and the other load of that search), and the table gives the medians, the range of the
measured capacities and how many single measurements land within +-20 % of their own prediction.

Printed: each step, then one row per configuration with both predictions (the simulated one also without
the load generator on the cores: "no client", what `exitplan plan` prints as served), the measured capacity
and predicted / measured; under each, the share of answers that ran the whole model (the calibration
window's at the tuned thresholds, and measured at capacity), the input lengths sent against the trace's,
and the CPU per request of the routers, the workers and the load generator over the search (read from
/proc and the routers' request counters).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from exitplan.api.plan import Plan
from exitplan.client.bench import BenchSetup, find_capacity
from exitplan.localrun.demo import CONFIGS, build_plans, describe_plan
from exitplan.localrun.deployment import LocalDeployment, exitplan_command
from exitplan.localrun.ports import free_port, free_port_block
from exitplan.localrun.prediction import answered, background_cores, measured_search, served_capacity
from exitplan.localrun.service_setup import (
    ServiceSetup,
    at_thresholds,
    ensure_profiles,
    load_setup,
    on_this_machine,
    trace_lengths,
    tuned_thresholds,
)
from exitplan.localrun.serving_costs import _cpu_seconds
from exitplan.planner.compare import plan_config
from exitplan.planner.service import PlanResult

REPO = Path(__file__).resolve().parents[1]
DIGITS = REPO / "artifacts" / "bundles" / "digits-cnn"
SETTLE_S = 4.0
"""Seconds of trace at a rate that passed before the first step and after each miss, not counted (as the demo)."""


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


# ---------------------------------------------------------------------------- what the planner predicts


def planner_results(setup: ServiceSetup, thresholds, lengths) -> tuple[dict[str, PlanResult], dict[str, Plan]]:
    """Per configuration: the planner's PlanResult for it (`plan_config` on this machine's spec and pools,
    split 0 in the routers exactly where the served plan runs it there) and the plan served (the demo's
    `build_plans`)."""
    spec, pools = on_this_machine(setup, routers=1)
    served = build_plans(setup, thresholds, lengths)
    results = {}
    for name in CONFIGS:
        colocate = "on" if served[name].colocate else "off"
        as_served = spec.model_copy(update={"planner": spec.planner.model_copy(update={"colocate": colocate})})
        results[name] = plan_config(
            name, setup.name, as_served, pools, setup.profiles, lengths=lengths, thresholds=thresholds
        )
    return results, served


def same_cells(a: Plan, b: Plan) -> bool:
    """Whether two plans run the same splits, buckets and cells (replicas and batch sizes) the same way."""

    def key(p: Plan) -> tuple:
        return (
            p.colocate,
            [(s.first_block, s.last_block, s.rebatch) for s in p.splits],
            sorted((c.split, c.bucket, c.pool, c.replicas, c.batch_size) for c in p.cells),
        )

    return key(a) == key(b)


def simulated_capacity(
    result: PlanResult,
    served: Plan,
    setup: ServiceSetup,
    reference: int | None,
    step_s: float,
    client_ms: float,
    background: float = 0.0,
) -> tuple[float, float, float]:
    """(the planner's capacity as served of the served plan on the measurement's own steps, the mean batch
    the simulated workers ran at it, the routers' CPU per request it counted): localrun/prediction.py
    `served_capacity` (one router, as `exitplan up` here; a co-locating plan as many as it needs) with the
    load generator as its sender, `background` cores' worth of other load beside them."""
    got = served_capacity(
        result,
        served,
        setup.spec.slo.latency_ms,
        trace=None,
        reference=reference,
        step_s=step_s,
        sender_ms=client_ms,
        background=background,
    )
    return got.rate_rps, (got.run.mean_batch if got.run is not None else 0.0), got.path.router_ms


# ---------------------------------------------------------------------------- what the machine serves


@dataclass
class Measured:
    capacity_rps: float
    failed_rps: float | None
    how: str
    client_ms: float
    """The load generator's CPU per request sent (this process's user + system time; with several routers
    it also runs the local front that balances connections over them)."""
    process_ms: dict[str, float]
    """CPU per request sent of the service's processes over the whole search: "routers", "workers"."""
    head_share: float | None
    """The share of answers at capacity that ran the whole model (the final head answered)."""
    lengths: tuple[float, float] | None
    """(mean length of the trace window at capacity, mean length of the inputs sent)."""


def show_step(step) -> None:
    r = step.report
    last = "-" if r.last_third_within_slo_share is None else f"{r.last_third_within_slo_share:.1%}"
    p50, p99 = (r.latency_ms.get(q) for q in ("p50", "p99"))
    print(
        f"  {r.offered_rps:7.1f} rps offered: {r.within_slo_share:6.1%} within the SLO (last third {last}), "
        f"p50 {p50 or 0:.0f} p99 {p99 or 0:.0f} ms, errors {r.error_total}, lost {r.lost} "
        f"-> {'pass' if step.passed else 'miss'}",
        flush=True,
    )


def process_cpu(dep: LocalDeployment) -> dict[str, float]:
    """CPU seconds the deployment's routers and workers have used so far."""
    routers = {p.name for p in dep.router_procs()}
    out = {"routers": 0.0, "workers": 0.0}
    for p in dep.procs:
        if p.popen is not None:
            out["routers" if p.name in routers else "workers"] += _cpu_seconds(p.popen.pid)
    return out


def measure(setup: ServiceSetup, plan: Plan, start_rps: float, step_s: float, workdir: Path, reference) -> Measured:
    """Serve `plan` with `exitplan up`'s processes and search its capacity within the SLO."""
    dep = LocalDeployment(
        setup.bundle, plan, setup.spec, workdir, port=free_port(), base_port=free_port_block(8), restart=None
    )
    dep.start()
    try:
        bench = BenchSetup.connect(dep.url, setup.spec.model.name, setup.bundle)
        cpu0, sent0 = process_cpu(dep), answered(dep)
        result, client_ms = measured_search(
            dep,
            lambda: find_capacity(
                dep.url,
                setup.spec.model.name,
                setup.bundle,
                setup=bench,
                start_rps=max(1.0, start_rps),
                step_duration=step_s,
                settle_s=SETTLE_S,
                max_steps=8,
                max_rps=5000.0,
                reference_max=reference,  # the trace's p99 = the longest bucket, as the plan's lengths were scaled
                on_step=show_step,
            ),
        )
        cpu1, sent = process_cpu(dep), max(answered(dep) - sent0, 1.0)  # the settling runs included
    finally:
        dep.stop()
    process_ms = {k: (cpu1[k] - cpu0[k]) / sent * 1e3 for k in cpu0}
    at = result.at_capacity
    head = setup.manifest.final_ramp().name
    inputs = at.run.get("inputs", {}) if at else {}
    lengths = (inputs["target_length_mean"], inputs["sent_length_mean"]) if "sent_length_mean" in inputs else None
    return Measured(
        result.capacity_rps,
        result.failed_rps,
        result.reason,
        client_ms,
        process_ms,
        at.exit_share.get(head) if at else None,
        lengths,
    )


# ---------------------------------------------------------------------------- one service, the table


@dataclass
class Trial:
    """One measurement of a configuration and the prediction made with what it measured."""

    simulated: float
    sim_batch: float
    router_ms: float
    background: float
    """Cores' worth of other load before the search."""
    measured: Measured

    @property
    def ratio(self) -> float:
        return self.simulated / self.measured.capacity_rps if self.measured.capacity_rps > 0 else 0.0


@dataclass
class Row:
    service: str
    config: str
    plan: str
    fluid: float
    alone: float
    """The simulated capacity without the load generator on the cores (what `exitplan plan` prints)."""
    trials: list[Trial]
    notes: list[str]

    @property
    def simulated(self) -> float:
        return statistics.median(t.simulated for t in self.trials)

    @property
    def measured(self) -> float:
        return statistics.median(t.measured.capacity_rps for t in self.trials)


def trial(
    setup: ServiceSetup,
    config: str,
    result: PlanResult,
    plan: Plan,
    reference,
    step_s: float,
    start: float,
    workdir: Path,
) -> Trial:
    """Measure the configuration once, then predict it with the load generator's CPU and the other load
    that measurement saw."""
    started = time.perf_counter()
    background = background_cores()
    measured = measure(setup, plan, start, step_s, workdir, reference)
    print(
        f"{setup.name} {config}: measured in {time.perf_counter() - started:.0f} s; {measured.how}",
        flush=True,
    )
    simulated, batch, router_ms = simulated_capacity(
        result, plan, setup, reference, step_s, measured.client_ms, background
    )
    print(
        f"  predicted {simulated:.1f} req/s: {simulated / max(measured.capacity_rps, 1e-9):.2f}x the measured",
        flush=True,
    )
    return Trial(simulated, batch, router_ms, background, measured)


def trial_notes(result: PlanResult, trials: list[Trial]) -> list[str]:
    """What the table prints under a configuration: exits, lengths and CPU per request (last trial)."""
    last = trials[-1]
    measured = last.measured
    ran_all = result.inputs.survival[-1] if result.inputs.survival else 1.0
    got = "-" if measured.head_share is None else f"{measured.head_share:.2f}"
    notes = [f"share answered by the whole model: {ran_all:.2f} planned, {got} measured at capacity"]
    if measured.lengths is not None:
        notes.append(f"mean input length at capacity: trace {measured.lengths[0]:.1f}, sent {measured.lengths[1]:.1f}")
    cpu = measured.process_ms
    notes.append(
        f"CPU per request over the search: routers {cpu['routers']:.2f} ms (profiled {last.router_ms:.2f}), "
        f"workers {cpu['workers']:.2f}, load generator {measured.client_ms:.2f}; other load before it "
        f"{last.background:.2f} cores; simulated mean batch {last.sim_batch:.2f}"
    )
    if len(trials) > 1:
        runs = ", ".join(f"{t.simulated:.1f}/{t.measured.capacity_rps:.1f} = {t.ratio:.2f}x" for t in trials)
        notes.append(f"each measurement, predicted/measured: {runs}")
    return notes


def run_service(path: Path, step_s: float, workdir: Path, repeats: int = 1, reuse_profile: bool = False) -> list[Row]:
    """Every configuration measured `repeats` times, in rounds (vanilla, naive early exit, exitplan, then
    again), so the machine's other load falls on each of them alike. The profile is measured first (written
    to the bundle's cache), unless `reuse_profile` and one is cached."""
    setup = load_setup(path)
    ensure_profiles(setup, print, remeasure=not reuse_profile)
    thresholds = tuned_thresholds(setup.bundle, setup.spec.accuracy.max_drop, setup.spec.workload.length_buckets)
    lengths, reference = (
        trace_lengths(None, int(setup.manifest.max_length or 1)) if setup.manifest.seq_axis else (None, None)
    )
    setup = at_thresholds(setup, thresholds)
    results, served = planner_results(setup, thresholds, lengths)
    # each search starts at a quarter of the simulated capacity without the load generator (well below the
    # capacity: a first step near it misses on the fresh processes' warm-up and the search never goes back)
    guesses = {
        c: simulated_capacity(results[c], served[c], setup, reference, step_s, 0.0)[0]
        or results[c].plan.prediction.goodput_rps
        for c in CONFIGS
    }
    trials: dict[str, list[Trial]] = {c: [] for c in CONFIGS}
    for n in range(repeats):
        for config in CONFIGS:
            where = workdir / f"{setup.name}-{config}-{n}"
            trials[config].append(
                trial(setup, config, results[config], served[config], reference, step_s, guesses[config] / 4, where)
            )
    rows = []
    for config in CONFIGS:
        result, plan = results[config], served[config]
        notes = [n for n in result.notes if "serving path" in n]
        if not same_cells(result.plan, plan):
            notes.append(f"the planner sizes this configuration as {describe_plan(result.plan)}")
        notes.extend(trial_notes(result, trials[config]))
        fluid = result.plan.prediction.goodput_rps
        rows.append(Row(setup.name, config, describe_plan(plan), fluid, guesses[config], trials[config], notes))
    return rows


def ratio(x: float, measured: float) -> str:
    return f"{x / measured:.2f}x" if measured > 0 else "-"


def print_table(rows: list[Row]) -> None:
    """One row per configuration; with several measurements, the medians of each (predicted and measured)."""
    print()
    print(
        f"{'service':8s} {'config':9s} {'plan':42s} {'fluid':>8s} {'no client':>9s} {'simulated':>9s} {'measured':>8s} "
        f"{'range':>15s} {'fluid/meas':>10s} {'sim/meas':>8s}"
    )
    for r in rows:
        caps = [t.measured.capacity_rps for t in r.trials]
        span = f"{min(caps):.1f}-{max(caps):.1f}" if len(caps) > 1 else "-"
        print(
            f"{r.service:8s} {r.config:9s} {r.plan[:42]:42s} {r.fluid:8.1f} {r.alone:9.1f} {r.simulated:9.1f} "
            f"{r.measured:8.1f} {span:>15s} {ratio(r.fluid, r.measured):>10s} {ratio(r.simulated, r.measured):>8s}"
        )
        for note in r.notes:
            print(f"{'':19s}{note}")
    within = [abs(r.simulated / r.measured - 1) <= 0.2 for r in rows if r.measured > 0]
    fluid = [abs(r.fluid / r.measured - 1) <= 0.2 for r in rows if r.measured > 0]
    each = [abs(t.ratio - 1) <= 0.2 for r in rows for t in r.trials if t.measured.capacity_rps > 0]
    print(
        f"\nwithin +-20 % of the measured capacity (medians): fluid {sum(fluid)}/{len(fluid)}, "
        f"simulated {sum(within)}/{len(within)}; each measurement against its own prediction: {sum(each)}/{len(each)}"
    )
    sys.stdout.flush()


def write_json(rows: list[Row], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1, default=float))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--service", type=Path, action="append", help="service file(s); default: minilm + digits")
    parser.add_argument("--quick", action="store_true", help="4 s steps instead of 8 s")
    parser.add_argument(
        "--repeats", type=int, default=1, help="measurements per configuration (in rounds); the table gives medians"
    )
    parser.add_argument("--json", type=Path, help="also write the rows (every measurement) to this file")
    parser.add_argument(
        "--reuse-profile",
        action="store_true",
        help="plan with the bundle's cached profile (default: measure it again first: a profile written at "
        "another time, under other load, predicts another machine)",
    )
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    step_s = 4.0 if args.quick else 8.0
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="plan-accuracy-") as tmp:
        services = args.service or [REPO / "examples" / "minilm-local.yaml", digits_service(Path(tmp))]
        for path in services:
            rows.extend(run_service(path, step_s, Path(tmp), args.repeats, args.reuse_profile))
    print_table(rows)
    if args.json:
        write_json(rows, args.json)


if __name__ == "__main__":
    main()
