"""Operator latencies on the emulated API, measured side by side in one run:

- apply -> children: `kubectl apply` of an EarlyExitService until every child the plan needs
  exists (ConfigMap, router Deployment + Service, split Services, one Deployment per cell);
- drift -> re-plan applied: from the moment a router's observation window shows a length shift
  until the new plan is in the plan ConfigMap and every worker Deployment has its new replicas
  (period = 5 s, the smallest spec.planner.periodSeconds; cooldown 0).

The operator runs as `exitplan operator` (a process, kopf standalone, tick 1 s); profiles are the
synthetic ones of the tests; observations come from a small HTTP server (a crafted window).

    python bench/operator_latency.py [--services 5] [--drift-reads N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from test_operator_integration import ObservationServer, publish_endpoint, window  # noqa: E402
from test_operator_support import ClusterThread, install_profiles, pool, service, wait_for  # noqa: E402

from exitplan.api.plan import Plan  # noqa: E402
from exitplan.operator import names  # noqa: E402


def children_complete(cluster: ClusterThread, ns: str, name: str) -> bool:
    cm = cluster.get("ConfigMap", ns, names.plan_configmap_name(name))
    if not cm:
        return False
    plan = Plan.model_validate_json(cm["data"]["plan.json"])
    deps = {d["metadata"]["name"] for d in cluster.list("Deployment", ns)}
    svcs = {s["metadata"]["name"] for s in cluster.list("Service", ns)}
    want_deps = {names.worker_name(name, c) for c in plan.cells} | {names.router_name(name)}
    want_svcs = {names.dns_name(name)} | {names.split_service_name(name, s.index) for s in plan.splits}
    return want_deps <= deps and want_svcs <= svcs


def replan_applied(cluster: ClusterThread, ns: str, name: str) -> bool:
    cm = cluster.get("ConfigMap", ns, names.plan_configmap_name(name))
    plan = Plan.model_validate_json(cm["data"]["plan.json"])
    if plan.reason != "length-drift":
        return False
    deps = {d["metadata"]["name"]: d["spec"]["replicas"] for d in cluster.list("Deployment", ns)}
    return all(deps.get(names.worker_name(name, c)) == c.replicas for c in plan.cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=int, default=5, help="services measured (one namespace each)")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    parser.add_argument("--drift-reads", type=int, help="router reads a period (`exitplan operator --drift-reads`)")
    args = parser.parse_args()
    if shutil.which("kubectl") is None:
        sys.exit("kubectl is needed (the measurement starts at `kubectl apply`)")
    tmp = Path(subprocess.check_output(["mktemp", "-d"], text=True).strip())
    apply_s, drift_s = [], []
    with ClusterThread(tmp) as cluster:
        cluster.create(pool("gpu-a", 4, 3.0))
        cluster.create(pool("gpu-b", 6, 1.0))
        op = subprocess.Popen(
            [
                str(Path(sys.executable).with_name("exitplan")),
                "operator",
                "--kubeconfig",
                str(cluster.kubeconfig),
                "--tick",
                "1",
                "--metrics-port",
                "0",
                "--health-port",
                "0",
                "--allow-host-path",  # the services' bundle is /models/minilm (tests/test_operator_support.service)
                "/models",
                *(["--drift-reads", str(args.drift_reads)] if args.drift_reads else []),
            ],
            stdout=open(tmp / "operator.log", "wb"),
            stderr=subprocess.STDOUT,
        )
        obs = ObservationServer()
        try:
            for i in range(args.services):
                ns = f"bench{i}"
                install_profiles(cluster, ns)
                # two replicas each: the services share the pools' 10 GPUs (capacity is accounted over services)
                drift = {"periodSeconds": 5, "maxReplicas": 2, "drift": {"cooldownSeconds": 0, "maxMoveFraction": 1.0}}
                manifest = tmp / f"svc{i}.yaml"
                manifest.write_text(json.dumps(service("minilm", ns, planner=drift)))
                t0 = time.perf_counter()
                subprocess.run(
                    [
                        "kubectl",
                        f"--kubeconfig={cluster.kubeconfig}",
                        f"--cache-dir={tmp / 'kc'}",
                        "apply",
                        "--validate=false",
                        "-f",
                        str(manifest),
                    ],
                    check=True,
                    capture_output=True,
                )
                wait_for("children created", lambda: children_complete(cluster, ns, "minilm"), 120)
                apply_s.append(time.perf_counter() - t0)
                obs.window = window(950, 50)
                t1 = time.perf_counter()
                publish_endpoint(cluster, ns, "minilm", obs)
                wait_for("re-plan applied", lambda: replan_applied(cluster, ns, "minilm"), 120)
                drift_s.append(time.perf_counter() - t1)
        finally:
            obs.close()
            op.terminate()
            op.wait(30)
    figures = {
        "services": args.services,
        "apply_to_children_s": {"median": statistics.median(apply_s), "max": max(apply_s), "all": apply_s},
        "drift_to_replan_applied_s": {
            "median": statistics.median(drift_s),
            "max": max(drift_s),
            "all": drift_s,
            "period_s": 5,
        },
    }
    print(
        f"kubectl apply -> all children created: median {figures['apply_to_children_s']['median']:.2f} s, "
        f"max {figures['apply_to_children_s']['max']:.2f} s over {args.services} services"
    )
    print(
        f"drift visible -> re-plan applied:      median {figures['drift_to_replan_applied_s']['median']:.2f} s, "
        f"max {figures['drift_to_replan_applied_s']['max']:.2f} s (period 5 s; ratio to period "
        f"{figures['drift_to_replan_applied_s']['median'] / 5:.2f})"
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
