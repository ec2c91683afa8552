"""No silent CPU fallback (worker_image/device.py): a worker or a router running split 0 that is asked to run
on the GPU (`--device gpu`, what a GPU pool's pods run) and cannot, exits 3 with one line naming what is
missing, written where Kubernetes reads the termination message; never serves on the CPU in its stead."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from exitplan.worker_image import device
from exitplan.worker_image.device import DeviceUnavailable, gpu_problem, providers_for, require

CLI = [sys.executable, "-P", "-c", "import sys; from exitplan.cli import app; sys.argv[0] = 'exitplan'; app()"]


def _run(args: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess, Path]:
    token = tmp_path / "token"
    token.write_text("t" * 32)
    log = tmp_path / "termination-log"
    env = {**os.environ, "EXITPLAN_CONTROL_TOKEN_FILE": str(token), device.TERMINATION_LOG: str(log)}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=300), log


@pytest.mark.skipif(device.DRIVER_NODE.exists(), reason="this machine has an NVIDIA driver: the refusal needs none")
def test_a_gpu_worker_without_a_gpu_exits_3_with_one_line(digits_bundle, tmp_path):
    args = ["worker", "--bundle", str(digits_bundle), "--plan", str(tmp_path / "plan.json"), "--split", "0"]
    done, log = _run([*args, "--bucket", "1", "--device", "gpu", "--port", "0"], tmp_path)
    assert done.returncode == 3
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: ProviderUnavailable: ")
    assert "/dev/nvidiactl" in done.stderr or "no CUDA provider" in done.stderr
    assert log.read_text().strip() == done.stderr.strip().removeprefix("error: ")


@pytest.mark.skipif(device.DRIVER_NODE.exists(), reason="this machine has an NVIDIA driver: the refusal needs none")
def test_a_router_running_split0_on_a_gpu_it_lacks_exits_3(digits_bundle, tmp_path):
    args = ["router", "--bundle", str(digits_bundle), "--plan", str(tmp_path / "plan.json"), "--colocate"]
    done, _ = _run([*args, "--device", "gpu", "--port", "0"], tmp_path)
    assert done.returncode == 3 and done.stderr.startswith("error: ProviderUnavailable: ")


def test_the_cause_names_the_library_that_does_not_load(tmp_path, monkeypatch):
    """With a device node but no CUDA libraries (this machine: onnxruntime-gpu, no cuBLAS), the loader's own
    message names the missing library."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("this onnxruntime build has no CUDA provider (install onnxruntime-gpu to check the library path)")
    node = tmp_path / "nvidiactl"
    node.write_text("")
    cause = gpu_problem(node)
    if cause is None:
        pytest.skip("the CUDA libraries load here: nothing is missing")
    assert cause.startswith("the CUDA provider's library does not load: ") and ".so" in cause


def test_sessions_that_fell_back_are_refused_and_gpu_sessions_pass():
    gpu = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    require("gpu", [("blocks/block0.onnx@16", gpu), ("ramps/ramp0.onnx@16", gpu)])
    with pytest.raises(DeviceUnavailable, match=r"^ProviderUnavailable: 1 session\(s\) fell back .*block1"):
        require("gpu", [("blocks/block0.onnx@16", gpu), ("blocks/block1.onnx@16", ["CPUExecutionProvider"])])
    require("auto", [("blocks/block1.onnx@16", ["CPUExecutionProvider"])])  # auto: ONNX Runtime's choice


def test_devices_and_providers(monkeypatch):
    assert providers_for("cpu", "auto") == ("CPUExecutionProvider",)
    assert providers_for("auto", "CPUExecutionProvider") == ("CPUExecutionProvider",)
    with pytest.raises(ValueError, match="--device takes auto, cpu, gpu"):
        providers_for("tpu")
    monkeypatch.setattr(device, "gpu_problem", lambda: None)
    assert providers_for("gpu", "auto") == ("CUDAExecutionProvider", "CPUExecutionProvider")
    with pytest.raises(ValueError, match="name a GPU provider"):
        providers_for("gpu", "CPUExecutionProvider")
    monkeypatch.setattr(device, "gpu_problem", lambda: "no NVIDIA device node")
    with pytest.raises(DeviceUnavailable, match="no NVIDIA device node"):
        providers_for("gpu", "auto")


@pytest.mark.skipif(device.DRIVER_NODE.exists(), reason="this machine has an NVIDIA driver: the refusal needs none")
def test_exitplan_up_on_a_gpu_pool_without_a_gpu_says_so_before_profiling(digits_bundle, tmp_path):
    service = tmp_path / "service.yaml"
    service.write_text(
        "apiVersion: exitplan.io/v1alpha1\nkind: GPUPool\nmetadata: {name: gpu}\nspec: {capacity: 2}\n---\n"
        "apiVersion: exitplan.io/v1alpha1\nkind: EarlyExitService\nmetadata: {name: digits}\n"
        f"spec: {{model: {{name: digits-cnn, bundle: {digits_bundle}}}, slo: {{latencyMs: 1000}}, pools: [{{name: gpu}}]}}\n"
    )
    done, _ = _run(["up", str(service), "--port", "0"], tmp_path)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "pool 'gpu' asks for nvidia.com/gpu" in done.stderr
    assert 'gpuResource: ""' in done.stderr and "profil" not in done.stdout


def test_a_refusal_is_read_from_a_containers_termination_message():
    from exitplan.operator.provider_health import pod_refusals, refusal

    said = "INFO starting\nerror: ProviderUnavailable: no NVIDIA device node (/dev/nvidiactl): the pod got no GPU\n"
    running = {"state": {"running": {}}, "lastState": {"terminated": {"exitCode": 3, "message": said}}}
    assert refusal(running) == "no NVIDIA device node (/dev/nvidiactl): the pod got no GPU"
    assert refusal({"state": {"terminated": {"exitCode": 1, "message": "Traceback ... KeyError"}}}) is None
    pods = [
        {
            "metadata": {"name": "w-1", "labels": {"exitplan.io/pool": "a100"}},
            "status": {"containerStatuses": [running]},
        },
        {
            "metadata": {"name": "w-2", "labels": {"exitplan.io/pool": "a100"}},
            "status": {"containerStatuses": [running]},
        },
        {"metadata": {"name": "w-3", "labels": {"exitplan.io/pool": "t4"}}, "status": {"containerStatuses": []}},
    ]
    assert pod_refusals(pods) == {"a100": "pod w-1: no NVIDIA device node (/dev/nvidiactl): the pod got no GPU"}


def test_a_profile_measured_on_the_other_kind_of_device_is_refused_for_a_pool():
    from test_planner_service import cpu_profile

    from exitplan.api.resources import GPUPoolSpec
    from exitplan.planner.costmodel import CostModel
    from exitplan.planner.errors import ProfileError

    gpu, cpu = GPUPoolSpec(capacity=2), GPUPoolSpec(capacity=2, gpu_resource="")
    measured_on_cpu = cpu_profile().model_copy(update={"providers": ["CPUExecutionProvider"]})
    measured_on_gpu = cpu_profile().model_copy(update={"providers": ["CUDAExecutionProvider", "CPUExecutionProvider"]})
    with pytest.raises(
        ProfileError, match="measured on CPUExecutionProvider but the pool's workers run on nvidia.com/gpu"
    ):
        CostModel(measured_on_cpu, "a100", gpu)
    with pytest.raises(ProfileError, match="measured on CUDAExecutionProvider but the pool's workers run on CPU cores"):
        CostModel(measured_on_gpu, "cpu", cpu)
    CostModel(measured_on_cpu, "cpu", cpu)
    CostModel(measured_on_gpu, "a100", gpu)
    CostModel(cpu_profile(), "a100", gpu)  # a profile that does not say (written by hand) plans any pool


@pytest.mark.skipif(device.DRIVER_NODE.exists(), reason="this machine has an NVIDIA driver: the refusal needs none")
def test_profiling_a_gpu_pool_without_a_gpu_exits_3(digits_bundle, tmp_path):
    done, _ = _run(
        ["profile", str(digits_bundle), "--pool", "gpu", "--out", str(tmp_path / "p.yaml"), "--device", "gpu"], tmp_path
    )
    assert done.returncode == 3 and done.stderr.startswith("error: ProviderUnavailable: ")
    assert not (tmp_path / "p.yaml").exists()


def test_the_worker_exports_the_runtime_it_serves_on():
    from prometheus_client import generate_latest

    from exitplan.worker_image.metrics import WorkerMetrics

    metrics = WorkerMetrics("svc", 0, 32, "a100")
    metrics.runtime_info(["CUDAExecutionProvider", "CPUExecutionProvider"], "float16")
    text = generate_latest(metrics.registry).decode()
    assert (
        'exitplan_worker_info{bucket="32",device="gpu",pool="a100",precision="fp16",provider="CUDAExecutionProvider",'
        'service="svc",split="0"} 1.0'
    ) in text
    cpu = WorkerMetrics("svc", 0, 32, "cpu")
    cpu.runtime_info(["CPUExecutionProvider"], "float32")
    assert 'device="cpu"' in generate_latest(cpu.registry).decode()
