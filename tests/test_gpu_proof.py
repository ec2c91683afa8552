"""The GPU proof (bench/gpu_proof.py) end to end on the CPU, as `--cpu` runs it: every section on a small
grid and the MiniLM test bundle -- the fp16 conversion and its agreement, the IO-bound chain against the
data plane's numpy chain, the floors, `exitplan profile` for both precisions, and the capacity searches of
the four configurations through real routers and workers with the planner's predictions. On a GPU the same
code adds CUDA graphs and TensorRT and measures the figures; here it must run, and its numbers must hold
together."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from exitplan.api.resources import ModelProfile

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ("vanilla", "naive-ee", "naive-ee-buckets", "exitplan")


@pytest.fixture(scope="module")
def proof(minilm_bundle, shared_trace, tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("gpu-proof")
    work = tmp_path_factory.mktemp("gpu-proof-work")
    cmd = [sys.executable, "-P", str(REPO / "bench" / "gpu_proof.py"), "--cpu", "--bundle", str(minilm_bundle)]
    cmd += ["--out", str(out), "--trace", str(shared_trace), "--max-steps", "2", "--configs", ",".join(CONFIGS)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**_env(), "EXITPLAN_GPU_PROOF_WORK": str(work)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "gpu_proof.json").read_text()), out


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "OUT"}


def test_every_section_ran(proof):
    results, out = proof
    for name in ("env", "curves", "floors", "profiles", "capacity"):
        assert results["sections"][name]["ok"] is True, results["sections"][name]
    assert results["device_name"].startswith("CPU")
    text = (out / "gpu_proof.md").read_text()
    assert text.startswith(f"# exitplan GPU proof on {results['device_name']}")
    assert "## Whole chain" in text and "## Capacity within" in text and "## Targets" in text


def test_the_fp16_bundle_agrees_with_fp32_and_the_io_bound_chain_with_the_data_plane(proof):
    results, _ = proof
    assert results["precision"]["name"] == "fp16" and results["precision"]["final_agreement"] >= 0.995
    points = results["sections"]["curves"]["points"]
    for precision in ("fp32", "fp16"):
        for bucket in (16, 32):
            for batch in (1, 4):
                got = {
                    p["mode"]: p
                    for p in points
                    if (p["precision"], p["bucket"], p["batch"]) == (precision, bucket, batch)
                }
                assert set(got) == {"numpy", "iobinding"}  # CUDA graphs and TensorRT need the GPU
                assert got["numpy"]["ms"] > 0 and got["iobinding"]["ms"] > 0
                assert got["numpy"]["max_abs_diff"] == 0.0
                assert got["iobinding"]["max_abs_diff"] <= 1e-5  # the same sessions, IO-bound: the same logits


def test_the_floors_run_the_whole_model_in_onnxruntime_and_pytorch(proof):
    rows = proof[0]["sections"]["floors"]["rows"]
    kinds = {(r["floor"], r["precision"]) for r in rows if r.get("ms")}
    assert kinds == {("onnxruntime-whole", "fp32"), ("onnxruntime-whole", "fp16"), ("torch-eager", "fp32")}


def test_the_profiles_describe_the_pool_for_both_precisions(proof):
    _, out = proof
    for precision in ("fp32", "fp16"):
        spec = ModelProfile.model_validate(yaml.safe_load((out / f"profile-{precision}.yaml").read_text())).spec
        assert spec.pool == "gpu" and spec.batch_sizes == [1, 4] and spec.seq_lens == [16, 32]
        assert spec.serving is not None and spec.serving.router_ms > 0
        assert all(ms > 0 for block in spec.blocks for row in block.latency_ms for ms in row)


def test_each_configuration_has_a_measured_capacity_and_a_prediction(proof):
    cap = proof[0]["sections"]["capacity"]
    assert list(cap["capacities"]) == list(CONFIGS)
    for config, row in cap["capacities"].items():
        assert row["capacity_rps"] > 0 and row["predicted_rps"] > 0, (config, row)
        assert row["lost"] == 0
    assert set(cap["ratios"]) == {"exitplan/vanilla", "exitplan/naive-ee", "exitplan/naive-ee-buckets"}
    naive_buckets = cap["plans"]["naive-ee-buckets"]
    assert len(naive_buckets["splits"]) == 1  # one split; the buckets are the planner's
    assert len(cap["plans"]["vanilla"]["buckets"]) == 1
