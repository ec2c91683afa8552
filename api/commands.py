"""The command lines of the data plane's processes, as their starters write them.

`exitplan worker` runs one plan cell (split, bucket, pool). Two places start workers: the operator's
worker Deployments (operator/builders.py) and `exitplan up`'s local processes (localrun/deployment.py).
Both take the arguments that name the cell from `worker_args`, and add their own (the control token
file and the next split's Service in a pod; the thread count, the batching wait and the next split's
addresses on this machine).
"""

from __future__ import annotations

from exitplan.api.plan import Cell
from exitplan.api.resources import GPUPoolSpec

__all__ = ["CPU_MAX_WAIT_MS", "batching_args", "device_args", "worker_args"]

CPU_MAX_WAIT_MS = 2.0
"""How long a CPU worker's oldest input waits for its batch to fill. On a CPU, batch latency grows with
the batch, so waiting for a full one buys little throughput and costs latency: at low load every input
would wait until its deadline nearly runs out. The planner's simulator assumes the same wait."""


def device_args(pool: GPUPoolSpec | None) -> list[str]:
    """`--device gpu` for a process running a model on a pool that asks for accelerators (a gpuResource):
    it refuses to serve on the CPU in their stead (worker_image/device.py); nothing on a CPU pool."""
    return ["--device", "gpu"] if pool is not None and pool.gpu_resource else []


def batching_args(pool: GPUPoolSpec | None) -> list[str]:
    """`--max-wait-ms` for a worker on a CPU pool (no gpuResource): launch a partial batch once its oldest
    input waited CPU_MAX_WAIT_MS. A GPU pool's workers wait for a full batch or the oldest deadline (E3)."""
    return [] if pool is not None and pool.gpu_resource else ["--max-wait-ms", str(CPU_MAX_WAIT_MS)]


def worker_args(bundle: str, plan: str, cell: Cell, port: int, *, host: str | None = None) -> list[str]:
    """`exitplan worker`'s arguments that every worker has: the bundle directory, the plan file, the
    cell it runs, and where it listens (`host` left out: the worker's default, every interface)."""
    where = ["--host", host] if host is not None else []
    return [
        "--bundle",
        bundle,
        "--plan",
        plan,
        "--split",
        str(cell.split),
        "--bucket",
        str(cell.bucket),
        "--pool",
        cell.pool,
        *where,
        "--port",
        str(port),
    ]
