"""A GPU pool whose node cannot run the CUDA provider, end to end in the dev cluster: `exitplan dev-cluster`
and `exitplan operator` as processes. The worker pods the operator builds on a pool with a gpuResource run
`exitplan worker --device gpu`; on this machine (no NVIDIA driver) each exits 3 with one line naming what is
missing, the pod runner reports it as the container's termination message, as a kubelet does, and at its
next readiness refresh the operator marks the service Degraded with reason ProviderUnavailable, naming the
pool and the cause, with a Warning event -- not a crash loop without a reason, and never a silent CPU
fallback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from devcluster_stack import stop_and_print
from test_generation_devcluster import Api
from test_operator_support import wait_for

from exitplan.operator.kube import path
from exitplan.worker_image import device

EXITPLAN = [sys.executable, "-P", "-c", "from exitplan.cli import app; app()"]
GUARD = 240.0  # only stops a broken run from hanging the suite; not a performance assertion
NS = "default"

pytestmark = pytest.mark.skipif(
    device.DRIVER_NODE.exists(), reason="this machine has an NVIDIA driver: the refusal it shows needs none"
)


def _profile_without_providers(bundle: Path, out: Path) -> dict:
    """A measured profile of the digits model for pool `gpu`, its providers removed: a profile written by
    hand, as the planner takes for any pool (a measured CPU one would be refused for a GPU pool)."""
    done = subprocess.run(
        [*EXITPLAN, "profile", str(bundle), "--pool", "gpu", "--out", str(out), "--no-serving"]
        + ["--batch-sizes", "1,2,4", "--repeats", "2"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    doc = yaml.safe_load(out.read_text())
    doc["spec"].pop("providers", None)
    doc["metadata"] = {"name": "digits-cnn-gpu", "namespace": NS}
    return doc


@pytest.fixture(scope="module")
def stack(tmp_path_factory, digits_bundle):
    tmp = tmp_path_factory.mktemp("provider-dev")
    bundle = tmp / "digits"
    shutil.copytree(digits_bundle, bundle, ignore=shutil.ignore_patterns("profiles"))
    profile = _profile_without_providers(bundle, tmp / "profile.yaml")
    kubeconfig = tmp / "kubeconfig"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    logs = {name: (tmp / f"{name}.log").open("wb") for name in ("dev-cluster", "operator")}
    procs = [
        subprocess.Popen(
            [*EXITPLAN, "dev-cluster", "--kubeconfig", str(kubeconfig), "--workdir", str(tmp / "work")],
            stdout=logs["dev-cluster"],
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    ]
    try:
        wait_for("the dev-cluster's kubeconfig", kubeconfig.exists, 60)
        operator = ["operator", "--kubeconfig", str(kubeconfig), "--tick", "1", "--metrics-port", "0"]
        procs.append(
            subprocess.Popen(
                [*EXITPLAN, *operator, "--allow-host-path", str(tmp)],
                stdout=logs["operator"],
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        )
        api = Api(kubeconfig)
        yield {"api": api, "bundle": bundle, "profile": profile}
        api.close()
    finally:
        stop_and_print(procs, logs, tmp)


def test_workers_that_cannot_use_their_pools_gpu_make_the_service_provider_unavailable(stack):
    api: Api = stack["api"]
    pool = {"capacity": 2, "gpuResource": "nvidia.com/gpu", "cpu": "1", "memory": "1Gi"}
    api(
        api.client.create(
            {"apiVersion": "exitplan.io/v1alpha1", "kind": "GPUPool", "metadata": {"name": "gpu"}, "spec": pool}
        )
    )
    api(api.client.create(stack["profile"]))
    spec = {
        "model": {"name": "digits-cnn", "bundle": str(stack["bundle"])},
        "slo": {"latencyMs": 1000},
        "pools": [{"name": "gpu"}],
        "router": {"replicas": 1},
        "planner": {"colocate": "off", "maxSplits": 1},
    }
    api(
        api.client.create(
            {
                "apiVersion": "exitplan.io/v1alpha1",
                "kind": "EarlyExitService",
                "metadata": {"name": "digits", "namespace": NS},
                "spec": spec,
            }
        )
    )

    def provider_unavailable():
        status = (api.get("EarlyExitService", "digits") or {}).get("status") or {}
        return next(
            (
                c
                for c in status.get("conditions") or []
                if c["type"] == "Degraded" and c["reason"] == "ProviderUnavailable"
            ),
            None,
        )

    condition = wait_for("the Degraded/ProviderUnavailable condition", provider_unavailable, GUARD)
    assert condition["status"] == "True"
    assert condition["message"].startswith("pool gpu: pod digits-")
    assert "/dev/nvidiactl" in condition["message"] or "no CUDA provider" in condition["message"]
    worker = api(
        api.client.list(path("Deployment", NS), "exitplan.io/service=digits,app.kubernetes.io/component=worker")
    )
    assert worker and worker[0]["spec"]["template"]["spec"]["containers"][0]["args"][-2:] == ["--device", "gpu"]
    events = api(api.client.list(path("Event", NS)))
    assert any(e.get("reason") == "ProviderUnavailable" for e in events)
