"""Starting a real local deployment (router + worker processes) of a bundle for data-plane tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from exitplan.api.bundle import read_manifest
from exitplan.api.plan import Cell, Plan, SplitPlan
from exitplan.api.resources import EarlyExitServiceSpec
from exitplan.localrun.deployment import LocalDeployment
from exitplan.localrun.ports import free_port_block  # noqa: F401  (tests import it from here)


def service_spec(
    bundle: Path, *, slo_ms: float = 500.0, shadow: float = 0.05, max_body: int = 1 << 20
) -> EarlyExitServiceSpec:
    return EarlyExitServiceSpec.model_validate(
        {
            "model": {"name": "minilm", "bundle": str(bundle)},
            "slo": {"latencyMs": slo_ms},
            "accuracy": {"maxDrop": 0.01, "shadowFraction": shadow},
            "pools": [{"name": "cpu"}],
            "router": {"maxBodyBytes": max_body},
        }
    )


def two_split_plan(
    ramps: list[str], thresholds: float, replicas: dict[tuple[int, int], int], buckets=(32, 128)
) -> Plan:
    cells = [
        Cell(split=s, bucket=b, pool="cpu", replicas=replicas.get((s, b), 1), batch_size=8)
        for s in (0, 1)
        for b in buckets
    ]
    return Plan(
        service="test",
        model="minilm",
        splits=[SplitPlan(index=0, first_block=0, last_block=2), SplitPlan(index=1, first_block=3, last_block=5)],
        buckets=list(buckets),
        cells=cells,
        thresholds={r: thresholds for r in ramps},
    )


def deployment(bundle: Path, plan: Plan, spec: EarlyExitServiceSpec, workdir: Path, **env: str) -> LocalDeployment:
    n = sum(c.replicas for c in plan.cells) + 1
    base = free_port_block(n + 1)
    return LocalDeployment(
        bundle, plan, spec, workdir, port=base + n, base_port=base, window_seconds=3600, env=dict(env)
    )


def control_headers(dep: LocalDeployment) -> dict[str, str]:
    """The header that opens the deployment's control endpoints (its run's token)."""
    return {"Authorization": f"Bearer {dep.control_token}"}


def ramp_names(bundle: Path) -> list[str]:
    return [r.name for r in read_manifest(bundle).exit_ramps()]


def heldout_texts(bundle: Path, n: int) -> list[str]:
    """The first `n` texts of the bundle's held-out set."""
    with np.load(bundle / "data" / "heldout.npz", allow_pickle=True) as data:
        return [str(t) for t in data["text"][:n]]


def one_cell_plan(model: str, blocks: int, bucket: int, batch: int = 8) -> Plan:
    """One split over all `blocks` blocks, one bucket, one worker fusing up to `batch` inputs."""
    return Plan(
        service="one-cell",
        model=model,
        splits=[SplitPlan(index=0, first_block=0, last_block=blocks - 1)],
        buckets=[bucket],
        cells=[Cell(split=0, bucket=bucket, pool="cpu", replicas=1, batch_size=batch)],
    )
