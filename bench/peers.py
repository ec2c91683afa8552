"""The peers, side by side: the same full MiniLM model on KServe, MLServer and Ray Serve, beside exitplan.

In one run, on the same machine, trace, SLO and cores, each system's capacity within the SLO is
measured by the same search (`exitplan.client.capacity`: the highest offered rate at which >= 99 %
of the requests finish within the SLO, over the step and its last third; refused, failed and lost
requests are misses):

    vanilla, naive-ee, exitplan   exitplan's three configurations, exactly as `make demo` runs them
                                  (`exitplan.localrun.demo.run_demo`)
    kserve    KServe's Python model server, a custom kserve.Model (bench/peers/kserve_server.py)
    mlserver  Seldon MLServer, a custom MLModel runtime with adaptive batching (bench/peers/mlserver_runtime.py)
    ray       Ray Serve, one deployment with @serve.batch and a V2 HTTP adapter (bench/peers/ray_server.py)

Every peer runs the bundle's blocks and final head composed into ONE ONNX file
(bench/peers/onnx_full.py; checked here against the bundle's chain before anything is measured) on
ONNX Runtime's CPU provider, with as many model replicas as exitplan has worker processes (the pool's
capacity), the same intra-op threads per replica as exitplan's workers, and (MLServer, Ray Serve)
the same batch size as vanilla and exitplan's batch wait. Each peer answers the same Open Inference
Protocol JSON the load generator sends exitplan's router (a BYTES `text` input; label / scores /
exit_ramp outputs) and tokenizes with the bundle's tokenizer.json inside its model code, as the
router does. The peers' searches start at vanilla's measured capacity, as exitplan's do.

Each peer runs from its own virtual environment (.bench-venvs/<name>, `tools/peers-venvs.sh`), as a
subprocess started, checked ready, measured and stopped by this script.

    .venv/bin/python -P bench/peers.py [--step-duration 8] [--peers kserve,mlserver,ray] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PEERS_DIR = Path(__file__).resolve().parent / "peers"
VENVS = ROOT / ".bench-venvs"
PEERS = ("kserve", "mlserver", "ray")
READY_TIMEOUT_S = 240.0


def load_onnx_full():
    """bench/peers/onnx_full.py as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("exitplan_bench_onnx_full", PEERS_DIR / "onnx_full.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_composed(bundle: Path, model: Path, texts: list[str], threads: int = 1) -> float:
    """The largest absolute difference between the composed model's logits and the bundle chain's
    final-head logits (`BundleRuntime`, no exits) on `texts`, each run alone; AssertionError past 1e-4."""
    from exitplan.worker_image.bundle_runtime import BundleRuntime, bucket_for, pad_batch

    onnx_full = load_onnx_full()
    full = onnx_full.FullModel(model, threads)
    runtime = BundleRuntime(bundle)
    final = runtime.manifest.final_ramp().name
    worst = 0.0
    for text in texts:
        ids, mask = full.tokenize([text])
        bucket = int(bucket_for(ids.shape[1], runtime.buckets))
        result = runtime.run_range(pad_batch([list(ids[0])], bucket, full.pad), bucket, thresholds=None)
        chain = next(ex.logits for ex in result.exits if ex.ramp == final)
        worst = max(worst, float(np.abs(np.asarray(chain) - full.logits(ids, mask)[0]).max()))
    # a batch padded to its longest input answers each row as alone
    ids, mask = full.tokenize(texts)
    batched = full.logits(ids, mask)
    for row, text in enumerate(texts):
        worst = max(worst, float(np.abs(batched[row] - full.logits(*full.tokenize([text]))[0]).max()))
    assert worst < 1e-4, f"the composed model differs from the bundle's chain by {worst:.2e}"
    return worst


# ---------------------------------------------------------------------------- the peer servers


@dataclass
class PeerOptions:
    model: Path
    name: str
    replicas: int
    threads: int
    batch: int
    batch_wait_ms: float
    workdir: Path


def peer_command(peer: str, opts: PeerOptions, port: int) -> list[str]:
    python = str(VENVS / peer / "bin" / "python")
    common = [
        "--model",
        str(opts.model),
        "--name",
        opts.name,
        "--port",
        str(port),
        "--replicas",
        str(opts.replicas),
        "--threads",
        str(opts.threads),
    ]
    batching = ["--max-batch-size", str(opts.batch), "--max-batch-time-ms", str(opts.batch_wait_ms)]
    if peer == "kserve":
        return [python, "-P", str(PEERS_DIR / "kserve_server.py"), *common]
    if peer == "mlserver":
        workdir = str(opts.workdir / "mlserver" / "repository")
        return [python, "-P", str(PEERS_DIR / "mlserver_runtime.py"), *common, *batching, "--workdir", workdir]
    if peer == "ray":
        return [python, "-P", str(PEERS_DIR / "ray_server.py"), *common, *batching]
    raise ValueError(f"unknown peer {peer!r} (known: {', '.join(PEERS)})")


def describe_peer(peer: str, opts: PeerOptions) -> str:
    base = f"full model, one ONNX file, {opts.replicas} replicas x {opts.threads} thread"
    if peer == "kserve":
        return f"{base}, no batching (KServe's Python server has none)"
    if peer == "mlserver":
        return f"{base}, adaptive batching max {opts.batch} / {opts.batch_wait_ms:g} ms"
    return f"{base}, @serve.batch max {opts.batch} / {opts.batch_wait_ms:g} ms"


def missing_venvs(peers: list[str]) -> list[str]:
    return [p for p in peers if not (VENVS / p / "bin" / "python").is_file()]


class PeerServer:
    """One peer as a subprocess in a session of its own (stopped with its whole process group)."""

    def __init__(self, peer: str, opts: PeerOptions, port: int) -> None:
        self.peer, self.opts, self.port = peer, opts, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = opts.workdir / peer / "server.log"
        self.popen: subprocess.Popen | None = None

    def start(self) -> None:
        cwd = self.opts.workdir / self.peer  # not the repository root: its operator/ would shadow the stdlib's
        cwd.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(self.opts.threads)}
        env.pop("PYTHONPATH", None)
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(
                peer_command(self.peer, self.opts, self.port),
                cwd=cwd,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_ready(self, text: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until the server says it is ready and answers `text` on several fresh connections (each replica warm)."""
        assert self.popen is not None
        body = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [text]}]}).encode()
        deadline = time.monotonic() + timeout_s
        answered = 0
        last = ""
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(
                    f"{self.peer} exited ({self.popen.returncode}) before it was ready; log {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            try:
                urllib.request.urlopen(f"{self.url}/v2/health/ready", timeout=5).read()
                request = urllib.request.Request(
                    f"{self.url}/v2/models/{self.opts.name}/infer",
                    data=body,
                    headers={"Content-Type": "application/json"},
                )
                doc = json.loads(urllib.request.urlopen(request, timeout=30).read())
                if {o["name"] for o in doc["outputs"]} >= {"label", "scores", "exit_ramp"}:
                    answered += 1
                    if answered >= 4 * self.opts.replicas:
                        return
                    continue
                last = f"answer without label/scores/exit_ramp: {str(doc)[:200]}"
            except (urllib.error.URLError, OSError, ValueError, KeyError) as err:
                last = str(err)
            time.sleep(1.0)
        raise RuntimeError(
            f"{self.peer} was not ready within {timeout_s:.0f} s ({last}); log {self.log_path}:\n{self.log_tail()}"
        )

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the server (it stops its own workers), then SIGKILL to whatever is left of its group."""
        if self.popen is None:
            return
        pgid = self.popen.pid  # its own session: process group id = its pid
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left of it (workers, Ray's daemons)
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.popen.poll() is None:
            self.popen.wait(timeout=10)


# ---------------------------------------------------------------------------- one capacity search


def peer_search(peer, setup, demo_opts, start_rps, slo_ms, reference, console):
    """A peer's capacity search: `exitplan.client.bench.find_capacity`'s steps and settling, with the
    peer's fixed metadata (peers publish no exitplan metadata: labels and longest input from the bundle)."""
    from exitplan.client.bench import DEFAULT_TIMEOUT_S, run_bench_async
    from exitplan.client.capacity import search_capacity

    def probe(rps: float, duration: float = demo_opts.step_duration):
        return asyncio.run(
            run_bench_async(
                setup,
                demo_opts.trace,
                rps=rps,
                duration=duration,
                slo_ms=slo_ms,
                seed=demo_opts.seed,
                length_mode="scale",
                reference_max=reference,
                timeout_s=DEFAULT_TIMEOUT_S,
            )
        )

    def show(step) -> None:
        r = step.report
        last = "-" if r.last_third_within_slo_share is None else f"{r.last_third_within_slo_share:.1%}"
        console.print(
            f"  {peer:9s} {r.offered_rps:6.1f} rps offered: {r.within_slo_share:6.1%} within the SLO "
            f"(last third {last}), p50 {_ms(r.latency_ms['p50'])} p99 {_ms(r.latency_ms['p99'])} ms, "
            f"errors {r.error_total}, lost {r.lost} -> {'pass' if step.passed else 'miss'}"
        )

    settle = demo_opts.settle_s
    return search_capacity(
        probe,
        start_rps=start_rps,
        max_rps=demo_opts.max_rps,
        resolution=demo_opts.resolution,
        max_steps=demo_opts.max_steps,
        on_step=show,
        settle=(lambda rps: probe(rps, settle)) if settle > 0 else None,
    )


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


# ---------------------------------------------------------------------------- the run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--service", type=Path, default=Path("examples/minilm-local.yaml"))
    ap.add_argument("--trace", type=Path, default=None, help="default: the shared Azure LLM inference trace")
    ap.add_argument("--peers", default=",".join(PEERS), help="comma-separated, of " + ", ".join(PEERS))
    ap.add_argument("--no-exitplan", action="store_true", help="measure the peers only (they start at --start-rps)")
    ap.add_argument("--step-duration", type=float, default=8.0, help="seconds of trace per search step")
    ap.add_argument("--settle-s", type=float, default=4.0)
    ap.add_argument("--start-rps", type=float, default=8.0)
    ap.add_argument("--resolution", type=float, default=0.05)
    ap.add_argument("--max-steps", type=int, default=10)
    ap.add_argument("--batch-wait-ms", type=float, default=None, help="peers' batch wait (default: exitplan's)")
    ap.add_argument("--peer-port", type=int, default=0, help="first peer port (default: a free block)")
    ap.add_argument("--workdir", type=Path, default=Path("artifacts/peers"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 200)
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        sys.exit(f"unknown peers {unknown}; known: {', '.join(PEERS)}")
    missing = missing_venvs(peers)
    if missing:
        sys.exit(
            f"no bench virtual environment for {', '.join(missing)} under {VENVS}: run tools/peers-venvs.sh "
            f"(or `make peers-venvs`), or leave them out with --peers"
        )

    from exitplan.client.bench import BenchSetup, ModelInfo
    from exitplan.client.texts import load_pool
    from exitplan.localrun.demo import DemoOptions, DemoResult, baseline_batch, capacity_row, run_demo
    from exitplan.localrun.deployment import LocalDeployment
    from exitplan.localrun.ports import free_port_block
    from exitplan.localrun.service_setup import ensure_profiles, load_setup, trace_lengths

    setup = load_setup(args.service)
    if not (setup.bundle / "bundle.yaml").is_file():
        sys.exit(f"no bundle at {setup.bundle}: build it with `exitplan prepare --model minilm` (or `make demo`)")
    ensure_profiles(setup, console.print)
    workdir = args.workdir.resolve()
    defaults = LocalDeployment.__dataclass_fields__
    threads = int(defaults["threads"].default)
    wait_ms = args.batch_wait_ms if args.batch_wait_ms is not None else float(defaults["max_wait_ms"].default)
    replicas = setup.spec.pools[0].max_gpus or setup.pools[setup.spec.pools[0].name].capacity
    opts = PeerOptions(
        model=workdir / f"{setup.spec.model.name}-full.onnx",
        name=setup.spec.model.name,
        replicas=int(replicas),
        threads=threads,
        batch=baseline_batch(setup),
        batch_wait_ms=wait_ms,
        workdir=workdir,
    )

    console.rule("the full model as one ONNX file")
    load_onnx_full().compose(setup.bundle, opts.model)
    pool = load_pool(setup.bundle)
    probe_texts = [pool.texts[i] for i in np.argsort(pool.lengths)[:: max(1, len(pool) // 12)]][:12]
    worst = check_composed(setup.bundle, opts.model, probe_texts, threads)
    console.print(f"{opts.model}: equals the bundle's chain on {len(probe_texts)} texts (max |logit diff| {worst:.1e})")

    demo_opts = DemoOptions(
        service_file=args.service,
        trace=args.trace,
        step_duration=args.step_duration,
        settle_s=args.settle_s,
        start_rps=args.start_rps,
        resolution=args.resolution,
        max_steps=args.max_steps,
        workdir=workdir / "exitplan",
    )
    if args.no_exitplan:
        result = DemoResult(thresholds={}, slo_ms=setup.spec.slo.latency_ms)
    else:
        result = run_demo(demo_opts, console)
    slo = result.slo_ms
    _, reference = trace_lengths(args.trace, int(setup.manifest.max_length or 1))
    start = result.capacity("vanilla") or args.start_rps
    labels = list(setup.manifest.labels)
    longest = int(setup.manifest.max_length or 1)
    failures: dict[str, str] = {}
    bench_setup: BenchSetup | None = None
    base_port = args.peer_port or free_port_block(3 * len(peers))
    for index, peer in enumerate(peers):
        port = base_port + 3 * index  # MLServer also takes the next two (gRPC, metrics)
        server = PeerServer(peer, opts, port)
        console.rule(f"{peer}: {describe_peer(peer, opts)}")
        try:
            with console.status(f"starting {peer}..."):
                server.start()
                server.wait_ready(probe_texts[0])
            info = ModelInfo(server.url, opts.name, labels, [longest], ["head"], slo)
            if bench_setup is None:
                bench_setup = BenchSetup(info, pool)
            else:
                references = bench_setup.references
                bench_setup = BenchSetup(info, pool)
                bench_setup.references = references
            cap = peer_search(peer, bench_setup, demo_opts, start, slo, reference, console)
            result.capacities[peer] = capacity_row(peer, describe_peer(peer, opts), cap)
            console.print(f"{peer}: capacity {cap.capacity_rps:.1f} rps within the SLO ({cap.reason})")
        except Exception as err:  # one peer that cannot run must not stop the others
            failures[peer] = f"{type(err).__name__}: {err}"
            console.print(f"[red]{peer} failed[/red]: {failures[peer]}")
        finally:
            with console.status(f"stopping {peer}..."):
                server.stop()

    console.print(peers_table(result, failures))
    if args.json:
        doc = {
            **result.to_dict(),
            "peer_failures": failures,
            "conditions": {
                "replicas": opts.replicas,
                "intra_op_threads": opts.threads,
                "batch": opts.batch,
                "batch_wait_ms": opts.batch_wait_ms,
                "step_duration_s": args.step_duration,
                "settle_s": args.settle_s,
                "cpus": os.cpu_count(),
                "loadavg_end": os.getloadavg(),
            },
        }
        args.json.write_text(json.dumps(doc, indent=2))
        console.print(f"results written to {args.json}")


def peers_table(result, failures: dict[str, str]):
    from rich.table import Table

    table = Table(
        title=f"capacity within the {result.slo_ms:.0f} ms SLO (>= 99 % of requests within it, over the step and "
        f"its last third; errors and lost requests are misses), same trace, same machine, one run"
    )
    cols = ["system", "what runs", "capacity rps", "missed at rps", "p50 ms", "p99 ms", "within SLO (last third)"]
    cols += ["agreement", "errors", "lost", "x vanilla", "exitplan / it"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("system", "what runs") else "right")
    base = result.capacity("vanilla") if "vanilla" in result.capacities else 0.0
    ours = result.capacity("exitplan") if "exitplan" in result.capacities else 0.0
    for name, row in result.capacities.items():
        cap = row["capacity_rps"]
        table.add_row(
            name,
            row["plan"],
            f"{cap:.1f}",
            "-" if row["failed_rps"] is None else f"{row['failed_rps']:.1f}",
            _ms(row["p50_ms"]),
            _ms(row["p99_ms"]),
            f"{_pct(row['within_slo_share'])} ({_pct(row['last_third_within_slo_share'])})",
            _pct(row["agreement"]),
            "-" if row["errors"] is None else str(row["errors"]),
            "-" if row["lost"] is None else str(row["lost"]),
            f"{cap / base:.2f}" if base > 0 else "-",
            f"{ours / cap:.2f}" if ours > 0 and cap > 0 else "-",
        )
    for name, why in failures.items():
        table.add_row(name, f"[red]did not run[/red]: {why[:120]}", *["-"] * (len(cols) - 2))
    notes = []
    for name in result.capacities:
        if name != "exitplan" and "exitplan" in result.capacities:
            bounds = result.ratio_bounds("exitplan", name)
            if bounds:
                notes.append(f"exitplan / {name} between {bounds[0]:.2f}x and {bounds[1]:.2f}x given the search steps")
        ended = result.capacities[name]["ended"]
        if ended != "bracketed":
            notes.append(f"{name}: search ended {ended} ({result.capacities[name]['reason']})")
    table.caption = "\n".join(notes)
    return table


if __name__ == "__main__":
    main()
