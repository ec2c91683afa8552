"""The operator at scale on the emulated API (tracker issue 15 part 8): apply and drift-loop costs.

Many EarlyExitServices of ~10 plan cells each, measured in one run:

- apply -> children: all services are created in one burst (through the API, as `kubectl apply -f
  dir/` would); per service, the time from its create to every child of its plan existing (plan
  ConfigMap, router Deployment + Service + control Service, split Services, one worker Deployment
  per cell, the control Secret, the routers' PodDisruptionBudget) -- p50 / p99 over services -- and
  the total, from the first create to the last service complete;
- one drift period over all services once they are Ready (every Deployment's status is marked
  ready, there is no Deployment controller): the operator process's CPU time during one
  spec.planner.periodSeconds, with the timer at its tick,
  (a) with no router reachable (nothing runs the routers in the emulated cluster: each read looks
      the routers up, finds no Pod and a control Service without ingress, tries its cluster DNS
      name, fails, and the service is left as it is), and
  (b) with every service's control Service published at the stand-in router (bench/stand_in_router.py:
      one process, a socket per service, answering the router's control routes -- a steady window
      that matches the plan with every ramp's exits and shadow agreement, the shadow feedback window,
      the thresholds in force and their pushes) so the loop does its whole read -> score (AR(1)
      survival forecast) -> decide -> status path and its re-tune once a period (the feedback read,
      the tuner, a push when it gains), without a re-plan; measured after --warmup-periods, when the
      first re-tunes' pushes have been written into the plans, over --periods periods (5: services
      created together refresh their status every 5 periods, in the same one), their mean reported;
- the loop's decision part alone, in this process, over the services' plans: one period of reads
  (--reads, the operator's `--drift-reads`; default drift.CHECKS_PER_PERIOD) per service -- since_last, the judged window, drift.assess (the AR(1)
  forecast over a full survival history), drift_policy.decide.

Plans: pools come in pairs (a fast, dear pool and a slow, cheap one: synthetic MiniLM-like profiles
built by the test suite's rule, with --ramps exit ramps, 10 by default); each service names one pair, caps the fast pool at B GPUs and has B length buckets
with maxSplits 2 and maxReplicas 2B, so its plan has 2 splits x B buckets = 2B cells over both
pools (B = cells-per-service / 2). Pool capacity leaves room for every service (capacity is shared).

The operator runs as `exitplan operator` (a process, kopf standalone, timer tick --tick); the API
server runs in a thread of this script (its CPU is that thread's), the stand-in router in a process
of its own. CPU figures are CPU time (user + system), not wall time: the machine may be shared.
Without a working cluster DNS (the usual case outside a cluster), (a)'s lookups of the control
Services' names fail -- quickly, or after the resolver's timeout when many run at once.
--profile / --profile-api write cProfile stats of the operator's main thread / the API server's.
--cpu-profile PREFIX profiles the operator's main thread by CPU time (cProfile timed by time.thread_time)
during each measured drift period, stats in PREFIX.0 (no router) and PREFIX.1 (the stand-in's periods).
--spy PREFIX samples the operator with py-spy (`py-spy` on PATH; not a dependency) during each measured
drift period only, as collapsed stacks in PREFIX-unreachable.txt / PREFIX-router.txt.

    python -P bench/operator_scale.py [--services 200] [--cells-per-service 10] [--pools 4] [--ramps 10] [--no-feedback] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))

import stand_in_router  # noqa: E402
from test_operator_support import ClusterThread  # noqa: E402

from exitplan.api.observations import Observations  # noqa: E402
from exitplan.api.plan import Plan  # noqa: E402
from exitplan.api.resources import EarlyExitServiceSpec, GPUPoolSpec  # noqa: E402
from exitplan.devcluster.apiserver import ApiServer, DevKubeAPI  # noqa: E402
from exitplan.operator import builders, disruption, drift, names  # noqa: E402
from exitplan.operator.drift_policy import HISTORY, DriftState, decide  # noqa: E402
from exitplan.operator.status import Phase  # noqa: E402

PLURALS = {
    "Deployment": "deployments",
    "Service": "services",
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "PodDisruptionBudget": "poddisruptionbudgets",
}
MODEL = "minilm"
SLO_MS = stand_in_router.SLO_MS
BATCH_GUARD = 600.0
"""Seconds one batch of API calls on the server's loop may take before the bench gives up (a loaded machine is slow)."""


class CountingAPI(DevKubeAPI):
    """The emulated API, counting requests by (action, resource plural)."""

    counts: collections.Counter

    async def _handle(self, request: Any) -> Any:
        res = request.resource
        self.counts[(request.action or request.method, getattr(res, "plural", None) or "-")] += 1
        return await super()._handle(request)


# ---------------------------------------------------------------- objects


def buckets_for(n: int) -> list[int]:
    """n length buckets evenly spread up to 128 (the synthetic profiles' longest length)."""
    return sorted({max(1, round(128 * (j + 1) / n)) for j in range(n)})


def pool_body(name: str, capacity: int, cost: float) -> dict:
    return {
        "apiVersion": "exitplan.io/v1alpha1",
        "kind": "GPUPool",
        "metadata": {"name": name},
        "spec": {"capacity": capacity, "costPerHour": cost, "nodeSelector": {"exitplan.io/pool": name}},
    }


BATCHES, SEQ_LENS = [1, 4, 16], [32, 64, 128]


def latency_table(f: float, base: float, slope: float) -> list[list[float]]:
    """latencyMs[seqLen][batch] = f * (base + slope * batch * seqLen / 32) ms (the synthetic profiles' rule)."""
    return [[round(f * (base + slope * b * s / 32), 4) for b in BATCHES] for s in SEQ_LENS]


def profile_body(namespace: str, pool: int, ramps: int) -> dict:
    """A synthetic MiniLM-like ModelProfile (tests/test_operator_data/profiles.yaml's rule: f = 1.0 on even,
    fast pools, 2.5 on odd, slow ones) with `ramps` exit ramps, one after each of the first blocks, and
    survival falling from 0.95 after the first ramp to 0.30 after the last; the blocks (at least 6, two
    more than the ramps) add up to the 6-layer model's latency."""
    f = 1.0 if pool % 2 == 0 else 2.5
    n_blocks = max(6, ramps + 2)
    per_block = f * 6 / n_blocks  # the 6-layer model's total, cut finer
    blocks = [
        {
            "name": f"layer{i}",
            "latencyMs": latency_table(per_block, 0.4, 0.02),
            "weightBytes": 7_100_000,
            "outputBytes": [1536 * s for s in SEQ_LENS],
        }
        for i in range(n_blocks)
    ]
    exits = [{"name": f"ramp{i}", "afterBlock": i, "latencyMs": latency_table(f, 0.1, 0.002)} for i in range(ramps)]
    survival = [round(0.95 * (0.30 / 0.95) ** (i / max(1, ramps - 1)), 4) for i in range(ramps)]
    return {
        "apiVersion": "exitplan.io/v1alpha1",
        "kind": "ModelProfile",
        "metadata": {"name": f"{MODEL}-pool-{pool}", "namespace": namespace},
        "spec": {
            "model": MODEL,
            "pool": f"pool-{pool}",
            "batchSizes": BATCHES,
            "seqLens": SEQ_LENS,
            "blocks": blocks,
            "ramps": exits,
            "survival": survival,
            "inputBytes": [16 * s for s in SEQ_LENS],
            "measuredOn": f"synthetic: bench/operator_scale.py, {n_blocks} blocks, {ramps} ramps",
        },
    }


def service_body(name: str, namespace: str, pair: int, n_buckets: int, period: int) -> dict:
    return {
        "apiVersion": "exitplan.io/v1alpha1",
        "kind": "EarlyExitService",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"name": MODEL, "bundle": "/models/minilm"},
            "slo": {"latencyMs": SLO_MS},
            "workload": {"rps": 2000, "lengthBuckets": buckets_for(n_buckets)},
            "pools": [{"name": f"pool-{2 * pair}", "maxGpus": n_buckets}, {"name": f"pool-{2 * pair + 1}"}],
            "planner": {"maxSplits": 2, "maxReplicas": max(2 * n_buckets, 4), "periodSeconds": period},
        },
    }


# ---------------------------------------------------------------- process measurements


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process so far."""
    return sum(proc_cpu_split(pid))


def proc_cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process so far. The system part holds the kernel's work for the
    process's syscalls -- on loopback, much of the TCP delivery of what it sends to the other processes."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def proc_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_operator(
    cluster: ClusterThread,
    tmp: Path,
    tick: float,
    profile: Path | None,
    cpu_profile: str | None = None,
    reads: int = drift.CHECKS_PER_PERIOD,
) -> tuple[Any, int]:
    health = free_port()
    exe = str(Path(sys.executable).with_name("exitplan"))
    prefix = [sys.executable, "-P", "-m", "cProfile", "-o", str(profile), exe] if profile else [exe]
    if cpu_profile:  # switched on and off around each measured drift period (measure_period)
        prefix = [sys.executable, "-P", str(REPO / "bench" / "cpu_profiled.py"), cpu_profile, exe]
        if cpu_profile.startswith("gc:"):  # the garbage collector's passes alone, no profiler
            prefix[3:4] = ["--gc-only", cpu_profile[3:]]
        if cpu_profile.startswith("sections:"):  # the CPU of the functions EXITPLAN_SECTIONS names, no profiler
            prefix[3:4] = ["--sections", cpu_profile[9:]]
        if cpu_profile.startswith("garbage:"):  # what the collector finds, by type and by the frames in it
            prefix[3:4] = ["--garbage", cpu_profile[8:]]
    cmd = [
        *prefix,
        "operator",
        "--kubeconfig",
        str(cluster.kubeconfig),
        "--tick",
        str(tick),
        "--drift-reads",
        str(reads),
        "--metrics-port",
        "0",
        "--health-port",
        str(health),
        "--allow-host-path",
        "/models",
    ]
    op = subprocess.Popen(cmd, stdout=open(tmp / "operator.log", "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if op.poll() is not None:
            sys.exit(f"the operator exited ({op.returncode}); see {tmp / 'operator.log'}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{health}/healthz", timeout=1):
                return op, health
        except OSError:
            time.sleep(0.2)
    op.kill()  # not left running behind the exit
    op.wait()
    sys.exit(f"the operator did not become live in 120 s; see {tmp / 'operator.log'}")


# ---------------------------------------------------------------- the emulated API, read in its own loop


async def _live_keys(api: DevKubeAPI) -> set[tuple[str, str | None, str]]:
    return {(res.plural, ns, name) for (res, ns, name), obj in api._objects.items() if not obj.deleted}


async def _phases(api: DevKubeAPI) -> dict[tuple[str, str], str]:
    return {
        (ns, name): ((obj.raw.get("status") or {}).get("phase") or "")
        for (res, ns, name), obj in api._objects.items()
        if res.plural == "earlyexitservices" and not obj.deleted
    }


def expected_children(body: dict, plan: Plan, pools: dict[str, GPUPoolSpec]) -> set[tuple[str, str]]:
    spec = EarlyExitServiceSpec.model_validate(body["spec"])
    children = builders.build_children(body, spec, plan, pools)
    children = disruption.with_router_budget(body, spec, plan.content_hash(), children)
    want = {(PLURALS[c["kind"]], c["metadata"]["name"]) for c in children}
    return want | {("secrets", names.control_secret_name(body["metadata"]["name"]))}


def plan_of(cluster: ClusterThread, namespace: str, name: str) -> Plan | None:
    cm = cluster.api.get_object("v1/configmaps", namespace, names.plan_configmap_name(name))
    return Plan.model_validate_json(cm["data"]["plan.json"]) if cm else None


def wait_children(
    cluster: ClusterThread, created: dict, pools: dict[str, GPUPoolSpec], timeout: float
) -> tuple[dict, dict]:
    """Poll the API's store until every service's children exist: (key -> time complete, key -> plan)."""
    done: dict[tuple[str, str], float] = {}
    want: dict[tuple[str, str], set] = {}
    plans: dict[tuple[str, str], Plan] = {}
    deadline = time.perf_counter() + timeout
    while len(done) < len(created):
        if time.perf_counter() > deadline:
            missing = sorted(set(created) - set(done))[:5]
            sys.exit(f"{len(created) - len(done)} services without all children after {timeout:.0f} s: {missing}")
        time.sleep(0.2)
        live = cluster.run(_live_keys(cluster.api), BATCH_GUARD)
        now = time.perf_counter()
        for key, (body, _t0) in created.items():
            if key in done:
                continue
            ns, name = key
            if key not in want:
                if ("configmaps", ns, names.plan_configmap_name(name)) not in live:
                    continue
                plans[key] = plan_of(cluster, ns, name)
                want[key] = expected_children(body, plans[key], pools)
            if all((plural, ns, child) in live for plural, child in want[key]):
                done[key] = now
    return done, plans


async def _mark_ready(cluster: ClusterThread, deployments: list[dict]) -> None:
    async def one(dep: dict) -> None:
        n = dep["spec"]["replicas"]
        status = {"replicas": n, "readyReplicas": n, "availableReplicas": n, "updatedReplicas": n}
        status["observedGeneration"] = dep["metadata"]["generation"]
        url = f"/apis/apps/v1/namespaces/{dep['metadata']['namespace']}/deployments/{dep['metadata']['name']}/status"
        await cluster.client.merge_patch(url, {"status": status})

    await asyncio.gather(*(one(d) for d in deployments))


def mark_all_ready(cluster: ClusterThread, services: set[tuple[str, str]], timeout: float) -> float:
    """Report every Deployment ready (no Deployment controller here); wait for every service Ready."""
    t0 = time.perf_counter()
    deps = cluster.list("Deployment")
    for i in range(0, len(deps), 64):  # one call per 64 (each within the cluster thread's 60 s on a busy machine)
        cluster.run(_mark_ready(cluster, deps[i : i + 64]), BATCH_GUARD)
    while True:
        phases = cluster.run(_phases(cluster.api), BATCH_GUARD)
        if all(phases.get(k) == Phase.ready.value for k in services):
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            stuck = collections.Counter(phases.get(k) for k in services)
            sys.exit(f"services not Ready after {timeout:.0f} s: {dict(stuck)}")
        time.sleep(0.5)


# ---------------------------------------------------------------- the stand-in router


class RouterProcess:
    """The stand-in router (bench/stand_in_router.py) in a process of its own: in this one it would share
    the GIL with the API server. `ports`: each plan's service's routers, in the plans' order."""

    def __init__(self, plans: list[Plan], period: float, tmp: Path, feedback: bool = True) -> None:
        plans_file = tmp / "stand-in-plans.json"
        plans_file.write_text(json.dumps([p.model_dump(mode="json") for p in plans]))
        cmd = [sys.executable, "-P", str(REPO / "bench" / "stand_in_router.py"), str(plans_file)]
        cmd += ["--period", str(period)] + ([] if feedback else ["--no-feedback"])
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            sys.exit(f"the stand-in router did not start (exit {self.proc.wait(30)})")
        self.ports: list[int] = json.loads(line)

    def stats(self) -> tuple[int, int]:
        """(requests served, router reads: one closed-window GET each)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ports[0]}/stats", timeout=30) as resp:
            doc = json.loads(resp.read())
        return doc["served"], doc["reads"]

    def cpu(self) -> float:
        return proc_cpu(self.proc.pid)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


async def _publish(cluster: ClusterThread, keys: list[tuple[str, str]], ports: list[int]) -> None:
    for (ns, name), port in zip(keys, ports):
        ingress = {"status": {"loadBalancer": {"ingress": [{"ip": "127.0.0.1", "ports": [{"port": port}]}]}}}
        url = f"/api/v1/namespaces/{ns}/services/{names.control_service_name(name)}/status"
        await cluster.client.merge_patch(url, ingress)


# ---------------------------------------------------------------- one drift period


def measure_period(
    cluster: ClusterThread,
    op_pid: int,
    period: float,
    warmup: float,
    router: RouterProcess | None = None,
    spy: Path | None = None,
    periods: int = 1,
    cpu_profile: bool = False,
    profile_each: bool = False,
) -> dict:
    """The operator's CPU per period over `periods` periods (after `warmup` s) -- their mean, and each
    period's -- the API server thread's, and the API requests they saw (per period); with `spy`, py-spy's
    samples of the operator over them. Several periods: the status refresh (every 5 periods) of services
    created together falls into one of them."""
    time.sleep(warmup)
    if spy is not None:  # started first: its own start-up is not in the period
        cmd = ["py-spy", "record", "--pid", str(op_pid), "--duration", str(int(period * periods) + 2), "--rate", "50"]
        cmd.append("--gil")  # the thread that holds the GIL (a thread waiting for it is not working)
        spying = subprocess.Popen([*cmd, "--format", "raw", "--output", str(spy), "--nonblocking"])
        time.sleep(1.0)
    api_clock = time.pthread_getcpuclockid(cluster._thread.ident)
    counts0 = collections.Counter(cluster.api.counts)
    served, reads = router.stats() if router else (0, 0)
    if cpu_profile:
        os.kill(op_pid, signal.SIGUSR1)  # bench/cpu_profiled.py: start
    op0, api0, t0 = proc_cpu(op_pid), time.clock_gettime(api_clock), time.perf_counter()
    sys0 = proc_cpu_split(op_pid)[1]
    each, last = [], op0
    for k in range(periods):
        time.sleep(max(0.0, t0 + (k + 1) * period - time.perf_counter()))
        now = proc_cpu(op_pid)
        each.append(now - last)
        last = now
        if cpu_profile and profile_each and k + 1 < periods:  # OUT.<n> per period (n counts on)
            os.kill(op_pid, signal.SIGUSR2)
            os.kill(op_pid, signal.SIGUSR1)
    op1, api1, t1 = last, time.clock_gettime(api_clock), time.perf_counter()
    sys1 = proc_cpu_split(op_pid)[1]
    if cpu_profile:
        os.kill(op_pid, signal.SIGUSR2)  # stop, and write OUT.<n>
    if spy is not None:
        spying.wait(60)
    if router:
        served1, reads1 = router.stats()
        served, reads = served1 - served, reads1 - reads
    requests = collections.Counter(cluster.api.counts)
    requests.subtract(counts0)
    by_action: collections.Counter = collections.Counter()
    by_kind: collections.Counter = collections.Counter()
    for (action, plural), n in requests.items():
        if n:
            by_action[str(getattr(action, "name", action)).lower()] += n
            by_kind[f"{str(getattr(action, 'name', action)).lower()} {plural}"] += n
    return {
        "periods": periods,
        "wall_s": (t1 - t0) / periods,
        "operator_cpu_s": (op1 - op0) / periods,
        "operator_cpu_each_s": each,
        "operator_system_cpu_s": (sys1 - sys0) / periods,
        "api_server_cpu_s": (api1 - api0) / periods,
        "api_requests": sum(by_action.values()) / periods,
        "api_requests_by_action": {k: v / periods for k, v in by_action.items()},
        "api_requests_by_kind": {k: v / periods for k, v in by_kind.items()},
        "router_requests": served / periods,
        "router_reads": reads / periods,
    }


def decision_cost(plans: list[Plan], spec: EarlyExitServiceSpec, period: float, reads: int) -> dict:
    """CPU of the loop's decision part for one period of reads per service, in this process: what
    check_drift does after the HTTP reads (since_last, the judged window, assess, decide), with a
    full survival history (drift_policy.HISTORY points) so the AR(1) fit is at its steady size."""
    limits = spec.planner.drift
    t_start = math.floor(time.time() / period) * period + 10 * period
    states = []
    for plan in plans:
        state = DriftState()
        state.survival = [[x * (1.0 + 0.03 * math.sin(k)) for x in plan.survival] for k in range(HISTORY - 1)]
        states.append(state)
    cpu0 = time.thread_time()  # this thread's: the API server's thread keeps serving the operator meanwhile
    replans, assess_s = 0, 0.0
    for plan, state in zip(plans, states):
        for r in range(reads + 1):  # the windows the stand-in router serves
            now = t_start + (r + 1) * period / reads
            current = Observations.model_validate(stand_in_router.steady_window(plan, period, True, now))
            closed = Observations.model_validate(stand_in_router.steady_window(plan, period, False, now))
            piece = drift.since_last([closed, current], state.seen.get("r"))
            state.seen["r"] = max([closed, current], key=lambda w: (w.since, w.until))
            if r == 0 or piece is None:  # the first read only sets where the next one starts
                continue
            state.add_slice(piece, period)
            judged = drift.recent(state.slices, period)
            t = time.thread_time()
            report = drift.assess(plan, judged, limits, spec.slo.latency_ms, list(state.survival))
            assess_s += time.thread_time() - t
            state.add_to_survival(piece, period)
            state.judged = judged
            action = decide(
                state, report, limits, now, active=True, phase=Phase.ready, proposal=None,
                last_replan_time="", period=period, ramps=current.ramps, tuning=False,
            )  # fmt: skip
            state.record(action, now)
            replans += int(action.plans)
    cpu = time.thread_time() - cpu0
    return {
        "services": len(plans),
        "reads_per_service": reads,
        "cpu_s": cpu,
        "assess_cpu_s": assess_s,
        "replans": replans,
    }


# ---------------------------------------------------------------- main


def create_world(cluster: ClusterThread, args: argparse.Namespace) -> dict[str, GPUPoolSpec]:
    pairs = args.pools // 2
    per_pair = math.ceil(args.services / pairs)
    b = max(1, args.cells_per_service // 2)
    pools = {}
    for p in range(args.pools):
        body = pool_body(f"pool-{p}", 2 * per_pair * max(2 * b, 4), 3.0 if p % 2 == 0 else 1.0)
        cluster.create(body)
        pools[body["metadata"]["name"]] = GPUPoolSpec.model_validate(body["spec"])
    for n in range(args.namespaces):
        for p in range(args.pools):
            cluster.create(profile_body(f"scale{n}", p, args.ramps))
    return pools


def apply_all(cluster: ClusterThread, args: argparse.Namespace) -> dict:
    """Create every service in one burst: key -> (created body, create time)."""
    b = max(1, args.cells_per_service // 2)
    created = {}
    for i in range(args.services):
        ns, name = f"scale{i % args.namespaces}", f"svc-{i}"
        body = service_body(name, ns, i % (args.pools // 2), b, args.period)
        t0 = time.perf_counter()
        created[(ns, name)] = (cluster.create(body), t0)
    return created


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def run(args: argparse.Namespace, tmp: Path) -> dict:
    cluster = ClusterThread(tmp)
    api = CountingAPI()
    api.counts = collections.Counter()
    cluster.server = ApiServer()
    cluster.server.api = api  # (not ApiServer(api): an emulator that has served nothing yet is falsy)
    figures: dict[str, Any] = {"services": args.services, "pools": args.pools, "namespaces": args.namespaces}
    figures.update(tick_s=args.tick, period_s=args.period, ramps=args.ramps, feedback=not args.no_feedback)
    figures.update(reads_per_period=args.reads)
    with cluster:
        api_profile = cProfile.Profile() if args.profile_api else None
        if api_profile is not None:  # the API server's event loop thread (cProfile profiles one thread)
            cluster.loop.call_soon_threadsafe(api_profile.enable)
        pools = create_world(cluster, args)
        op, _health = start_operator(cluster, tmp, args.tick, args.profile, args.cpu_profile, args.reads)
        try:
            cpu_idle = proc_cpu(op.pid)
            created = apply_all(cluster, args)
            done, plans = wait_children(cluster, created, pools, args.timeout)
            cpu_apply = proc_cpu(op.pid) - cpu_idle
            lat = [done[k] - t0 for k, (_b, t0) in created.items()]
            first = min(t0 for _b, t0 in created.values())
            cells = [len(p.cells) for p in plans.values()]
            figures["apply_to_children_s"] = {
                "p50": statistics.median(lat),
                "p99": pct(lat, 99),
                "max": max(lat),
                "total": max(done.values()) - first,
                "operator_cpu_s": cpu_apply,
            }
            figures["cells"] = {"total": sum(cells), "per_service_min": min(cells), "per_service_max": max(cells)}
            figures["splits_per_service"] = statistics.median(len(p.splits) for p in plans.values())
            figures["pools_per_service"] = statistics.median(len({c.pool for c in p.cells}) for p in plans.values())
            figures["objects"] = len(cluster.run(_live_keys(cluster.api)))
            if not args.skip_drift:
                figures.update(drift_figures(cluster, op.pid, created, plans, args, tmp))
            figures["operator_rss_mib"] = proc_rss_mib(op.pid)
        finally:
            op.terminate()
            op.wait(60)
            if api_profile is not None:
                cluster.loop.call_soon_threadsafe(api_profile.disable)
                time.sleep(0.5)
                api_profile.dump_stats(args.profile_api)
    if not args.skip_drift:  # with the operator and the API server stopped
        spec = EarlyExitServiceSpec.model_validate(next(iter(created.values()))[0]["spec"])
        figures["decision_part"] = decision_cost(list(plans.values()), spec, float(args.period), args.reads)
    return figures


def drift_figures(
    cluster: ClusterThread, pid: int, created: dict, plans: dict, args: argparse.Namespace, tmp: Path
) -> dict:
    out: dict[str, Any] = {}
    out["mark_ready_s"] = mark_all_ready(cluster, set(created), args.timeout)
    hashes = {k: p.layout_hash() for k, p in plans.items()}  # a re-tune's write does not change it
    spy = (lambda name: Path(f"{args.spy}-{name}.txt")) if args.spy else (lambda name: None)
    out["drift_period_unreachable"] = measure_period(
        cluster, pid, args.period, args.period, spy=spy("unreachable"), cpu_profile=bool(args.cpu_profile)
    )
    keys = sorted(created)
    router = RouterProcess([plans[k] for k in keys], args.period, tmp, not args.no_feedback)
    try:
        for i in range(0, len(keys), 20):  # 20 per call: each within the cluster thread's 60 s on a busy machine
            cluster.run(_publish(cluster, keys[i : i + 20], router.ports[i : i + 20]), BATCH_GUARD)
        warm = args.warmup_periods * args.period  # a full survival series; the first re-tunes' pushes settled
        cpu0 = router.cpu()
        d = measure_period(
            cluster,
            pid,
            args.period,
            warm,
            router,
            spy=spy("router"),
            periods=args.periods,
            cpu_profile=bool(args.cpu_profile),
            profile_each=args.cpu_profile_each_period,
        )
        d["reads_done"], d["reads_due"] = d["router_reads"], args.services * args.reads
        d["stand_in_cpu_s"] = router.cpu() - cpu0  # over the warm-up and the period
        out["drift_period_stand_in_router"] = d
    finally:
        router.close()
    now = {k: plan_of(cluster, *k) for k in hashes}
    out["replans_during_drift_periods"] = sum(1 for k, p in now.items() if p and p.layout_hash() != hashes[k])
    out["thresholds_written_into_plans"] = sum(1 for k, p in now.items() if p and p.thresholds != plans[k].thresholds)
    return out


def report(f: dict) -> None:
    a = f["apply_to_children_s"]
    rows = [
        ("services / namespaces / pools", f"{f['services']} / {f['namespaces']} / {f['pools']}"),
        (
            "plan cells (worker Deployments)",
            f"{f['cells']['total']} ({f['cells']['per_service_min']}-"
            f"{f['cells']['per_service_max']} per service, {f['splits_per_service']:g} splits x "
            f"{f['pools_per_service']:g} pools)",
        ),  # fmt: skip
        ("API objects after apply", f"{f['objects']}"),
        ("apply -> children, per service p50", f"{a['p50']:.2f} s"),
        ("apply -> children, per service p99", f"{a['p99']:.2f} s (max {a['max']:.2f} s)"),
        ("apply -> children, all services", f"{a['total']:.2f} s"),
        ("operator CPU during the apply", f"{a['operator_cpu_s']:.2f} s"),
    ]
    for key, what in (("drift_period_unreachable", "no router"), ("drift_period_stand_in_router", "stand-in router")):
        if key in f:
            d = f[key]
            rows.append(
                (
                    f"one drift period ({what})",
                    f"operator CPU {d['operator_cpu_s']:.2f} s in {d['wall_s']:.1f} s"
                    + (
                        f" (mean of {d['periods']}: " + " / ".join(f"{x:.2f}" for x in d["operator_cpu_each_s"]) + ") "
                        if d.get("periods", 1) > 1
                        else " "
                    )
                    + (
                        f"[{d['operator_system_cpu_s']:.2f} s of it in the kernel] "
                        if "operator_system_cpu_s" in d
                        else ""
                    )
                    + f"({100 * d['operator_cpu_s'] / d['wall_s']:.0f} % of a core; "
                    f"{1000 * d['operator_cpu_s'] / f['services']:.1f} ms/service); API {d['api_requests']:.0f} "
                    f"requests, API server CPU {d['api_server_cpu_s']:.2f} s"
                    + (f"; {d['reads_done']:.0f} of {d['reads_due']} router reads done" if "reads_due" in d else ""),
                )
            )
    if "decision_part" in f:
        d = f["decision_part"]
        rows.append(
            (
                "decision part alone, one period",
                f"{d['cpu_s']:.2f} s CPU ({1000 * d['cpu_s'] / d['services']:.1f} ms/service, "
                f"{d['reads_per_service']} reads each; drift.assess {100 * d['assess_cpu_s'] / d['cpu_s']:.0f} %; "
                f"{d['replans']} re-plans)",
            )
        )
    if "replans_during_drift_periods" in f:
        rows.append(("plans changed during the drift periods", str(f["replans_during_drift_periods"])))
        rows.append(("plans with re-tuned thresholds written in", str(f["thresholds_written_into_plans"])))
    rows.append(("operator RSS at the end", f"{f['operator_rss_mib']:.0f} MiB"))
    width = max(len(r[0]) for r in rows)
    feedback = "shadow feedback, re-tuned" if f.get("feedback", True) else "no shadow feedback"
    reads = f.get("reads_per_period", 4)  # runs before --reads: four
    print(
        f"operator at scale (tick {f['tick_s']:g} s, period {f['period_s']} s, {reads} router reads a period, "
        f"{f.get('ramps')} ramps, {feedback})"
    )
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=int, default=200, help="EarlyExitServices created in one burst")
    parser.add_argument("--cells-per-service", type=int, default=10, help="2 splits x cells/2 length buckets")
    parser.add_argument(
        "--pools", type=int, default=4, help="GPUPools, in (fast, slow) pairs; each service uses one pair"
    )
    parser.add_argument("--ramps", type=int, default=10, help="exit ramps of the model (its profiles')")
    parser.add_argument(
        "--no-feedback", action="store_true", help="the stand-in router has no shadow feedback (no re-tune)"
    )
    parser.add_argument("--namespaces", type=int, default=0, help="default: one per 20 services")
    parser.add_argument("--tick", type=float, default=5.0, help="the operator's timer tick (its default: 5 s)")
    parser.add_argument("--period", type=int, default=20, help="spec.planner.periodSeconds (>= 5)")
    parser.add_argument(
        "--reads",
        type=int,
        default=drift.CHECKS_PER_PERIOD,
        choices=range(1, drift.MAX_CHECKS_PER_PERIOD + 1),
        metavar="N",
        help="router reads per period (`exitplan operator --drift-reads`; default: the operator's)",
    )
    parser.add_argument(
        "--warmup-periods",
        type=int,
        default=3,
        help="periods the stand-in router serves before the measured one (the survival forecast fits "
        "AR(1) from 6 half-period points on: 3 periods)",
    )
    parser.add_argument(
        "--periods", type=int, default=5, help="periods measured with the stand-in router (their mean is reported)"
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="give up waiting after this many seconds")
    parser.add_argument("--skip-drift", action="store_true", help="measure the apply only")
    parser.add_argument("--profile", type=Path, help="run the operator under cProfile, stats to this file")
    parser.add_argument("--profile-api", type=Path, help="cProfile the emulated API server, stats to this file")
    parser.add_argument(
        "--cpu-profile",
        help="profile the operator's main thread by CPU time in each measured drift period (PREFIX.0: no router, "
        "PREFIX.1: the stand-in's; bench/cpu_profiled.py); gc:PREFIX: only the garbage collector's passes; "
        "sections:PREFIX: the CPU of the functions EXITPLAN_SECTIONS names (PREFIX.<n>.sections.json); "
        "garbage:PREFIX: what the collector finds in reference cycles (PREFIX.<n>.garbage.json)",
    )
    parser.add_argument(
        "--cpu-profile-each-period",
        action="store_true",
        help="with --cpu-profile: one PREFIX.<n> per measured stand-in period (PREFIX.1 to PREFIX.<periods>; each "
        "switch counts the heap's objects once: a few ms of the operator's CPU)",
    )
    parser.add_argument("--spy", help="py-spy the operator in each measured period: PREFIX-<period>.txt")
    parser.add_argument("--json", nargs="?", const="-", help="also print (or write to a file) the figures as JSON")
    args = parser.parse_args()
    if args.pools < 2:
        parser.error("--pools takes at least 2 (one fast, slow pair)")
    args.namespaces = args.namespaces or max(1, math.ceil(args.services / 20))
    with tempfile.TemporaryDirectory(prefix="exitplan-scale-") as tmp:
        try:
            figures = run(args, Path(tmp))
        finally:
            log = Path(tmp) / "operator.log"
            if log.exists():
                (Path(tempfile.gettempdir()) / "exitplan-scale-operator.log").write_bytes(log.read_bytes())
    report(figures)
    if args.json == "-":
        print(json.dumps(figures, indent=2))
    elif args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
