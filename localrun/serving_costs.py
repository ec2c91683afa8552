"""The serving path's own costs on this machine, measured with the real processes (`exitplan profile`).

The block tables say what the model costs; a request also costs its router (read, decode and tokenize,
admission, the hop out, the answer) and its worker something beyond the model (the hop in, decoding
and checking the tensors, the answer back). Both are measured here as the plan runs them: one router
and one worker (`exitplan router`, `exitplan worker`, the commands pods run) serving the whole model
in one split at batch 1 and the shortest profiled length that holds real held-out inputs, no exits;
requests are sent over CONCURRENT keep-alive connections at once (a router at capacity always holds
several: one at a time, each would pay a whole event-loop wake-up, a third more on the digits CNN's
router), and each process's CPU time is read from /proc before and after:

router_ms   the router's CPU time per request;
colocated_ms  the CPU time per request, less its compute, of a router that runs the model itself
            (`exitplan router --colocate`, measured the same way right after);
hop_ms      the worker's CPU time per batch less its compute: the same requests decoded as the router
            decodes them and run through the same blocks in this process, timed in the process's CPU
            time (every intra-op thread's; wall time would count the time other processes hold the
            cores). On a GPU pool the reference still computes on the CPU, so there the figure is
            only a lower bound of the worker's own work (0 when the GPU takes the compute off the CPU).

The model's compute subtracted above is timed on the sessions the worker ran, each batch cut as it cut
them (classify/trim.py), so that the router's and the hop's figures hold no compute, and the profile's
`computeScale` (prepare/compute_scale.py, measured beside these by `exitplan profile`) holds all of what
the tables miss.

CPU time, not wall time: on a machine the processes share, what one request takes from the others is
its CPU; the planner counts it against the cores (planner/serving_path.py). Linux only (/proc).
"""

from __future__ import annotations

import http.client
import math
import os
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from exitplan.api.bundle import read_manifest
from exitplan.api.plan import Cell, Plan, SplitPlan
from exitplan.api.resources import EarlyExitServiceSpec, ModelProfileSpec, ServingCosts
from exitplan.client.texts import build_inputs, load_pool
from exitplan.localrun.deployment import LocalDeployment
from exitplan.localrun.ports import free_port, free_port_block

WARMUP = 20
"""Requests sent before the clocks are read (sessions, allocators and connections warm up)."""
MIN_REQUESTS = 100
CONCURRENT = 4
"""Requests in flight while the clocks run (one per keep-alive connection)."""
MODEL = "serving-costs"


class ServingCostError(RuntimeError):
    """The serving path could not be measured; the message says why."""


@dataclass
class _Sample:
    router_cpu_s: float
    worker_cpu_s: float
    batches: float


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by the cgroup's CPU quota (a pod's limit)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (/proc/PID/stat fields 14 and 15)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _worker_batches(url: str) -> float:
    """Batches the worker has run: the count of its exitplan_worker_batch_seconds histogram."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    count = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "exitplan_worker_batch_seconds":
            for sample in family.samples:
                if sample.name.endswith("_count"):
                    count += sample.value
    return count


def _bodies(bundle: Path, profile: ModelProfileSpec, n: int) -> tuple[int, list[bytes]]:
    """(the bucket, `n` request bodies of held-out inputs that fit it): texts, the shortest profiled length
    that holds at least a tenth of them; held-out arrays, the shortest that holds every row that fits the
    longest (fixed-size models: their one bucket)."""
    pool = load_pool(bundle)
    if pool.lengths is None:  # held-out arrays: rows cut to their mask's length (fixed-size: length 1)
        inputs = build_inputs(pool, np.ones(n, dtype=np.int64), max_length=1)
        longest = profile.seq_lens[-1]
        fits = [i for i, length in enumerate(inputs.lengths) if length <= longest]
        if not fits:
            raise ServingCostError(f"no held-out input fits the longest profiled length {longest}")
        bucket = next(b for b in profile.seq_lens if b >= max(int(inputs.lengths[i]) for i in fits))
        return bucket, [inputs.bodies[fits[i % len(fits)]] for i in range(n)]
    lengths = np.sort(pool.lengths)
    enough = max(1, len(lengths) // 10)
    shortest = next((b for b in profile.seq_lens if np.searchsorted(lengths, b, side="right") >= enough), None)
    if shortest is None:
        raise ServingCostError(
            f"no profiled length ({profile.seq_lens}) holds a tenth of the bundle's held-out texts; "
            "profile longer lengths (--seq-lens)"
        )
    fitting = lengths[lengths <= shortest]
    targets = np.resize(fitting, n)
    return shortest, build_inputs(pool, targets, max_length=shortest).bodies


def measure_serving_costs(
    bundle: Path,
    profile: ModelProfileSpec,
    *,
    threads: int = 1,
    seconds: float = 3.0,
    workdir: Path | None = None,
) -> ServingCosts:
    """Run one router and one worker of `bundle` on this machine and measure the CPU they spend per request
    beyond the model (see the module's docstring). Raises ServingCostError when they cannot run."""
    manifest = read_manifest(bundle)
    bucket, bodies = _bodies(bundle, profile, MIN_REQUESTS + WARMUP)
    plan = Plan(
        service=MODEL,
        model=MODEL,
        splits=[SplitPlan(index=0, first_block=0, last_block=len(manifest.blocks) - 1)],
        buckets=[bucket],
        cells=[Cell(split=0, bucket=bucket, pool=profile.pool, replicas=1, batch_size=1)],
        thresholds={r.name: 2.0 for r in manifest.ramps},  # above 1: no ramp exits, every input runs the model
    )
    spec = EarlyExitServiceSpec.model_validate(
        {
            "model": {"name": MODEL, "bundle": str(bundle)},
            "slo": {"latencyMs": 60000},
            "pools": [{"name": profile.pool}],
        }
    )
    with tempfile.TemporaryDirectory(prefix="exitplan-serving-costs-", dir=workdir) as tmp:
        sample, sent = _serve_and_drive(bundle, plan, spec, Path(tmp) / "apart", bodies, seconds, threads, False)
        co = _serve_and_drive(bundle, plan, spec, Path(tmp) / "co", bodies, seconds, threads, True)
    router = sample.router_cpu_s / sent * 1e3
    compute_ms = _compute_cpu_ms(bundle, bucket, bodies[WARMUP:], threads)
    hop = max(0.0, sample.worker_cpu_s / sample.batches * 1e3 - compute_ms)  # both count every ORT thread
    colocated = max(0.0, co[0].router_cpu_s / co[1] * 1e3 - compute_ms)  # one request per batch, as above
    return ServingCosts(
        router_ms=round(router, 4),
        hop_ms=round(hop, 4),
        colocated_ms=round(colocated, 4),
        threads=threads,
        cores=usable_cores(),
        requests=sent,
    )


def _serve_and_drive(
    bundle: Path,
    plan: Plan,
    spec: EarlyExitServiceSpec,
    workdir: Path,
    bodies: list[bytes],
    seconds: float,
    threads: int,
    colocate: bool,
) -> tuple[_Sample, int]:
    """Start the router and worker (or the router alone, running the model: `colocate`), drive them, stop them."""
    deployment = LocalDeployment(
        bundle=bundle,
        plan=plan,
        spec=spec,
        workdir=workdir,
        port=free_port(),
        base_port=free_port_block(2),
        threads=threads,
        max_wait_ms=0.0,
        restart=None,
        colocate=colocate,
    )
    what = "the router running the model" if colocate else "the router and worker"
    try:
        deployment.start()
    except Exception as err:  # StartError, OSError: the processes did not come up
        raise ServingCostError(f"{what} did not start: {err}") from err
    try:
        sample, sent = _drive(deployment, bodies, seconds)
    finally:
        deployment.stop()
    if sent == 0 or sample.batches <= 0:
        raise ServingCostError(f"no request was answered by {what}; see the processes' logs")
    return sample, sent


def _compute_cpu_ms(bundle: Path, bucket: int, bodies: list[bytes], threads: int) -> float:
    """CPU ms of the model's own compute per request: the bodies decoded as the router decodes them and
    run one at a time through every block and the final head (no exits), as the worker runs them (each cut
    to its longest row where it trims)."""
    from exitplan.worker_image.bundle_runtime import cpu_worker_runtime, mask_input
    from exitplan.worker_image.classify.decode import decode_inputs, parse_request
    from exitplan.worker_image.classify.trim import trimmed

    runtime = cpu_worker_runtime(bundle, [bucket], threads)
    mask = mask_input(runtime.manifest) if runtime.free_length else None
    seq_axis = runtime.manifest.seq_axis  # a free-length (trimming) runtime has one
    axes = {t.name: seq_axis for t in runtime.manifest.inputs} if mask and seq_axis is not None else {}
    tokenizer = None
    if runtime.manifest.tokenizer:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(bundle / runtime.manifest.tokenizer))
    states = []
    for body in bodies[:MIN_REQUESTS]:
        batch = decode_inputs(parse_request(body, None), runtime.manifest, tokenizer, [bucket], False)
        state = batch.state_for([0], bucket)
        states.append(trimmed(state, mask, axes, bucket)[0] if mask else state)
    runtime.run_range(states[0], bucket)  # warm
    started = time.process_time()
    for state in states:
        runtime.run_range(state, bucket)
    return (time.process_time() - started) / len(states) * 1e3


def _drive(deployment: LocalDeployment, bodies: list[bytes], seconds: float) -> tuple[_Sample, int]:
    """Send the warm-up one at a time, then requests over CONCURRENT connections at once for `seconds` (and at
    least MIN_REQUESTS); the CPU and batches they took, and how many were counted."""
    router = next(p for p in deployment.procs if p.name == "router")
    worker = next((p for p in deployment.procs if p.name.startswith("worker")), router)  # co-located: the router
    assert router.popen is not None and worker.popen is not None
    worker_url = f"http://{worker.address}"
    path = f"/v2/models/{MODEL}/infer"
    rest = bodies[WARMUP:]
    lock = threading.Lock()
    count = [0]
    started = [0.0]

    def send(conn: http.client.HTTPConnection, body: bytes) -> None:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        reply = conn.getresponse()
        data = reply.read()
        if reply.status != 200:
            raise ServingCostError(f"the router answered {reply.status}: {data[:200]!r}")

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", deployment.port, timeout=60)
        try:
            while True:
                with lock:
                    n = count[0]
                    if n >= MIN_REQUESTS and time.perf_counter() - started[0] >= seconds:
                        return
                    count[0] += 1
                send(conn, rest[n % len(rest)])
        finally:
            conn.close()

    conn = http.client.HTTPConnection("127.0.0.1", deployment.port, timeout=60)
    try:
        for body in bodies[:WARMUP]:
            send(conn, body)
    finally:
        conn.close()
    batches0 = _worker_batches(worker_url)
    cpu0 = (_cpu_seconds(router.popen.pid), _cpu_seconds(worker.popen.pid))
    started[0] = time.perf_counter()
    with ThreadPoolExecutor(CONCURRENT) as pool:
        for done in [pool.submit(client) for _ in range(CONCURRENT)]:
            done.result()  # a failed request raises here
    cpu1 = (_cpu_seconds(router.popen.pid), _cpu_seconds(worker.popen.pid))
    batches1 = _worker_batches(worker_url)
    return _Sample(cpu1[0] - cpu0[0], cpu1[1] - cpu0[1], batches1 - batches0), count[0]
