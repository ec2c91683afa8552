"""Pure manifest builders of a generation service (task text-generation, a decoder bundle).

The children differ from a classification service's (builders.py) only in the workers:

| object | name | what |
|---|---|---|
| ConfigMap | `<svc>-plan` | the plan, as for every service (builders.build_configmap) |
| Deployment | `<svc>-s<S>-b<B>-<pool>` | stage S: `exitplan generate-stage` on blocks first..last of split S, `--next` the headless Service of split S+1; `--mode recompute` when the plan has one split |
| headless Service | `<svc>-split-<S>` | the stage of split S (what the previous stage's `--next` and the router's `--peers` resolve) |
| Deployment + Service | `<svc>-router`, `<svc>` | `exitplan router`, which serves generate / generate_stream for a decoder bundle |

A stage keeps the KV cache of every sequence it runs, so each runs exactly one replica, and its
Deployment is replaced with the Recreate strategy (a rolling update would run two pods of a stage
at once, and a sequence's hops could land on either). Labels, annotations, ownership, security and
placement are pod_template.py's, the names names.py's.
"""

from __future__ import annotations

from exitplan.api.manifest import Manifest
from exitplan.api.plan import Cell, Plan
from exitplan.api.resources import EarlyExitServiceSpec, GPUPoolSpec, Task
from exitplan.operator import builders, pod_template
from exitplan.operator.names import L_SERVICE, L_SPLIT, PORT, bundle_path, selector_labels, split_host, worker_name
from exitplan.operator.ownership import adopt


def is_generation(spec: EarlyExitServiceSpec) -> bool:
    return spec.model.task == Task.text_generation


def stage_args(service: str, namespace: str, spec: EarlyExitServiceSpec, plan: Plan, cell: Cell) -> list[str]:
    """The `exitplan generate-stage` arguments of the stage of `cell`."""
    split = plan.splits[cell.split]
    last = cell.split == len(plan.splits) - 1
    args = [
        "--bundle",
        bundle_path(spec.model.bundle),
        "--first",
        str(split.first_block),
        "--last",
        str(split.last_block),
        "--host",
        "0.0.0.0",
        "--port",
        str(PORT),
        "--mode",
        "recompute" if len(plan.splits) == 1 else "pipeline",
    ]
    if not last:
        args += ["--next", split_host(service, namespace, cell.split + 1)]
    return args


def build_stage(
    service: str, namespace: str, spec: EarlyExitServiceSpec, plan: Plan, cell: Cell, pool: GPUPoolSpec
) -> Manifest:
    """The Deployment of one stage: split `cell.split` on `cell.pool`, one replica, replaced by Recreate."""
    if cell.replicas != 1:
        raise ValueError(
            f"a generation stage runs exactly one replica (it holds the sequences' KV cache); "
            f"cell of split {cell.split} asks for {cell.replicas}"
        )
    labels = selector_labels(service, "worker", cell)
    spread = {L_SERVICE: service, L_SPLIT: str(cell.split)}
    parts = pod_template.on_pool(service, spec.model, pool, spread)
    args = stage_args(service, namespace, spec, plan, cell)
    ports: list[Manifest] = [{"name": "http", "containerPort": PORT}]
    stage = pod_template.container(
        "stage", parts, service, namespace, command=["exitplan", "generate-stage"], args=args, ports=ports
    )
    deployment = pod_template.deployment(
        worker_name(service, cell), namespace, labels, plan.layout_hash(), 1, stage, parts
    )
    deployment["spec"]["strategy"] = {"type": "Recreate"}
    return deployment


def build_children(
    owner: Manifest, spec: EarlyExitServiceSpec, plan: Plan, pools: dict[str, GPUPoolSpec]
) -> list[Manifest]:
    """Every child of a planned generation service, adopted by `owner`, in apply order: the ConfigMap,
    the stages from the last split back (each one's next exists first), the Services, the router last."""
    service = owner["metadata"]["name"]
    namespace = owner["metadata"]["namespace"]
    missing = sorted({c.pool for c in plan.cells} - set(pools))
    if missing:
        raise ValueError(f"plan places stages on pools {missing} that are not given")
    if sorted(c.split for c in plan.cells) != [s.index for s in plan.splits]:
        raise ValueError("a generation plan has exactly one cell (stage) per split")
    stages = [
        build_stage(service, namespace, spec, plan, cell, pools[cell.pool])
        for cell in sorted(plan.cells, key=lambda c: -c.split)
    ]
    router, router_svc = builders.build_router(service, namespace, spec, plan)
    children = [
        builders.build_configmap(service, namespace, plan),
        *stages,
        *builders.build_split_services(service, namespace, plan),
        builders.build_control_service(service, namespace, plan),
        router_svc,
        router,
    ]
    adopt(children, owner=owner)
    return children
