"""Generation services on this machine: `exitplan up` with a decoder bundle.

- `plan_generation_service`: measure the bundle here once (block and head times, one stage-to-stage
  hop, the threshold table on held-out text; cached in `<bundle>/profiles/generation-<pool>.json`,
  which the operator also reads when it can see the bundle) and ask the planner for the Plan;
- `stage_commands`: the processes of such a plan: one `exitplan generate-stage` per split (the last
  first, so each knows the next one's address; `--mode recompute` when there is one split) and
  `exitplan router`, which recognises the decoder bundle and coordinates the stages.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import TYPE_CHECKING

from exitplan.api.plan import Plan
from exitplan.localrun.processes import Proc, exitplan_command

if TYPE_CHECKING:
    from exitplan.localrun.deployment import LocalDeployment
    from exitplan.localrun.service_setup import Echo, ServiceSetup

HELD_OUT_TEXTS = 100


def measure(bundle: Path, pool: str, echo: Echo = print) -> Path:
    """Measure the bundle here unless its measurements file exists; returns the file."""
    from exitplan.planner.generation import measurements_file
    from exitplan.worker_image.generate.decoder import DecoderModel
    from exitplan.worker_image.generate.measure import (
        measure_hop,
        measure_recompute_ratio,
        measure_thresholds,
        measure_times,
    )

    path = measurements_file(bundle, pool)
    if path.is_file():
        return path
    echo(f"no generation measurements for pool {pool!r}: measuring the bundle on this machine -> {path}")
    model = DecoderModel(bundle)
    heldout = bundle / "data" / "heldout.json"
    texts = json.loads(heldout.read_text())[:HELD_OUT_TEXTS] if heldout.is_file() else []
    if not texts:
        raise ValueError(f"{heldout}: the bundle has no held-out texts to measure the exit threshold on")
    block_ms, head_ms = measure_times(model)
    profile = {
        "block_ms": block_ms,
        "head_ms": head_ms,
        "decide_share": {model.n_blocks - 1: 1.0},
        "hop_ms": measure_hop(model),
        "recompute_ratio": measure_recompute_ratio(model),
    }
    data = {
        "profile": profile,
        "thresholds": measure_thresholds(model, texts),
        "measured_on": f"{platform.node()} {platform.processor() or platform.machine()}, ONNX Runtime CPU, 1 thread",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)
    return path


def plan_generation_service(setup: ServiceSetup, echo: Echo = print, *, stages: int | None = None) -> Plan:
    """The Plan of a generation service from measurements on this machine (see the module docstring)."""
    from exitplan.planner.generation import plan_bundle_generation, read_measurements

    manifest = setup.manifest
    if manifest.decoder is None:
        raise ValueError(f"{setup.bundle}: not a generative bundle (no decoder section)")
    profile, points = read_measurements(measure(setup.bundle, setup.spec.pools[0].name, echo))
    result = plan_bundle_generation(
        setup.name, setup.spec, setup.pools, manifest, profile=profile, thresholds=points, stages=stages
    )
    predicted = f", predicted {result.predicted_ms_per_token:.3f} ms/token" if result.predicted_ms_per_token else ""
    echo(
        f"generation plan: {result.mode}, {len(result.plan.splits)} stage(s), threshold {result.threshold}{predicted}"
        + (f" ({result.note})" if result.note else "")
    )
    return result.plan


def is_generation_bundle(bundle: Path) -> bool:
    from exitplan.api.bundle import read_manifest

    return read_manifest(bundle).decoder is not None


def stage_commands(deployment: LocalDeployment) -> list[Proc]:
    """The stage processes (last split first) and the router of a generation plan."""
    cli = exitplan_command()
    logs = deployment.workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    plan = deployment.plan
    recompute = len(plan.splits) == 1
    stages: list[Proc] = []
    port = deployment.base_port
    for split in reversed(plan.splits):
        name = f"stage-s{split.index}-blocks{split.first_block}-{split.last_block}"
        args = [
            *cli,
            "generate-stage",
            "--bundle",
            str(deployment.bundle),
            "--first",
            str(split.first_block),
            "--last",
            str(split.last_block),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--threads",
            str(deployment.threads),
            "--mode",
            "recompute" if recompute else "pipeline",
        ]
        if stages:
            args += ["--next", stages[0].address]
        stages.insert(0, Proc(name, args, port, logs / f"{name}.log"))
        port += 1
    router = [
        *cli,
        "router",
        "--bundle",
        str(deployment.bundle),
        "--plan",
        str(deployment.plan_path),
        "--peers",
        stages[0].address,
        "--host",
        "127.0.0.1",
        "--port",
        str(deployment.port),
        "--control-port",
        str(deployment.control_port),
    ]
    return [*reversed(stages), Proc("router", router, deployment.port, logs / "router.log")]
