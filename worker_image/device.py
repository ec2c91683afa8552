"""Which device a worker's sessions run on, and the refusal when it is not the one its pool promises.

ONNX Runtime falls back to the CPU without a word when the CUDA provider cannot load (a missing cuBLAS or
cuDNN, a driver older than the CUDA the wheel was built for, a pod given no GPU): a GPU pool would then
serve at a fraction of its planned capacity. A worker (or a router running split 0) of a pool that asks
for a GPU is started with `--device gpu`: before it serves, `require` finds what is missing and the
process exits with one line naming it (`DeviceUnavailable`), written where Kubernetes reads a container's
termination message, so the operator can put it on the service as a `ProviderUnavailable` condition.

`--device auto` keeps ONNX Runtime's choice (CUDA where this build has it and a GPU is visible, else the
CPU); `--device cpu` runs on the CPU whatever the machine has.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable
from pathlib import Path

import onnxruntime as ort

DEVICES = ("auto", "cpu", "gpu")
GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")
DRIVER_NODE = Path("/dev/nvidiactl")
TERMINATION_LOG = "EXITPLAN_TERMINATION_LOG"
"""Environment variable naming the file a refusal is written to (default /dev/termination-log, where a
container's termination message is read, when it exists)."""
REASON = "ProviderUnavailable"


class DeviceUnavailable(RuntimeError):
    """The device a process was asked to run on cannot run its sessions; the message says what is missing."""

    def __init__(self, cause: str) -> None:
        super().__init__(f"{REASON}: {cause}")
        self.cause = cause


def gpu_problem(driver_node: Path = DRIVER_NODE) -> str | None:
    """Why the CUDA provider cannot run here (None: nothing found against it): the build, the device node,
    the provider's shared libraries (the loader's own message names the missing one)."""
    available = ort.get_available_providers()
    if "CUDAExecutionProvider" not in available:
        return f"this onnxruntime build has no CUDA provider (it has {available}); the GPU image needs onnxruntime-gpu"
    if not driver_node.exists():
        return (
            f"no NVIDIA device node ({driver_node}): the process was given no GPU (the pool's gpuResource, the "
            "node's device plugin) or the driver is not loaded"
        )
    capi = Path(ort.__file__).parent / "capi"
    try:
        ctypes.CDLL(str(capi / "libonnxruntime_providers_shared.so"), mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(str(capi / "libonnxruntime_providers_cuda.so"))
    except OSError as err:
        return f"the CUDA provider's library does not load: {err} (the CUDA/cuDNN libraries, LD_LIBRARY_PATH)"
    return None


def providers_for(device: str, spec: str = "auto") -> tuple[str, ...]:
    """The execution providers a process asked to run on `device` uses (`spec`: --providers); raises
    DeviceUnavailable for a GPU that cannot run, ValueError for an unknown device or provider."""
    from exitplan.worker_image.bundle_runtime import choose_providers

    if device not in DEVICES:
        raise ValueError(f"--device takes {', '.join(DEVICES)}, not {device!r}")
    if device == "cpu":
        return ("CPUExecutionProvider",)
    if device == "auto":
        return choose_providers(spec)
    problem = gpu_problem()
    if problem is not None:
        raise DeviceUnavailable(problem)
    if spec.strip() == "auto":
        return ("CUDAExecutionProvider", "CPUExecutionProvider")
    chosen = choose_providers(spec)
    if not any(p in GPU_PROVIDERS for p in chosen):
        raise ValueError(f"--device gpu with --providers {spec!r}: name a GPU provider ({', '.join(GPU_PROVIDERS)})")
    return chosen


def require(device: str, sessions: Iterable[tuple[str, list[str]]]) -> None:
    """On `device` gpu, every session must run on a GPU provider first: (name, its active providers) each;
    raises DeviceUnavailable naming the sessions that fell back."""
    if device != "gpu":
        return
    fell_back = [
        (name, providers) for name, providers in sessions if not providers or providers[0] not in GPU_PROVIDERS
    ]
    if fell_back:
        name, providers = fell_back[0]
        raise DeviceUnavailable(
            f"{len(fell_back)} session(s) fell back from the GPU (e.g. {name} runs on {providers}); ONNX Runtime "
            f"could not place them on the CUDA provider: its log above says why"
        )


def report(err: DeviceUnavailable) -> None:
    """Write the refusal where Kubernetes reads the container's termination message (best effort)."""
    path = Path(os.environ.get(TERMINATION_LOG, "/dev/termination-log"))
    if os.environ.get(TERMINATION_LOG) or path.exists():
        try:
            path.write_text(str(err) + "\n")
        except OSError:
            pass
