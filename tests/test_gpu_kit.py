"""The GPU kit (bench/gpu_kit.py): what travels to the GPU machine in parts of at most 56 MiB, checked there
part by part and archive by archive before anything runs, and the import tree that runs this checkout there
without installing it (bench/gpu_proof.py starts itself again inside it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import gpu_kit  # noqa: E402


def _wheel(folder: Path) -> Path:
    """A real wheel's layout: a package and its dist-info."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "kitprobe-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("kitprobe/__init__.py", "VALUE = 42\n")
        zf.writestr("kitprobe-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: kitprobe\nVersion: 1.0\n")
    return path


@pytest.fixture()
def kit(digits_bundle, shared_trace, tmp_path) -> tuple[Path, dict]:
    _wheel(tmp_path / "wheels")
    out = tmp_path / "kit"
    out.mkdir()
    sources = gpu_kit.KitSources(bundle=digits_bundle, trace=shared_trace, hf_config=None)
    # parts of 64 KiB: a small bundle cut into several, as the real one is into 56 MiB parts
    manifest = gpu_kit.build(out, sources, wheels_from=tmp_path / "wheels", part_bytes=64 * 2**10)
    return out, manifest


def test_a_kit_unpacks_to_what_went_in(kit, digits_bundle, shared_trace, tmp_path):
    out, manifest = kit
    parts = [p for a in manifest["archives"].values() for p in a["parts"]]
    assert all(p["bytes"] <= 64 * 2**10 for p in parts) and len(manifest["archives"]["bundle"]["parts"]) > 1
    folders = gpu_kit.unpack(out, tmp_path / "unpacked")
    assert (folders["site"] / "kitprobe" / "__init__.py").read_text() == "VALUE = 42\n"
    assert (folders["extra"] / shared_trace.name).read_bytes() == shared_trace.read_bytes()
    for rel in ("bundle.yaml", "blocks/block0.onnx", "data/heldout.npz"):
        assert (folders["bundle"] / rel).read_bytes() == (digits_bundle / rel).read_bytes()
    assert gpu_kit.unpack(out, tmp_path / "unpacked") == folders  # a second call keeps what is extracted


def test_each_device_call_stays_within_what_a_call_carries(kit):
    _, manifest = kit
    calls = gpu_kit.call_plan(manifest, call_mib=1)
    sizes = {f".gpu-kit/parts/{p['file']}": p["bytes"] for a in manifest["archives"].values() for p in a["parts"]}
    assert sorted(p for c in calls for p in c[1:]) == sorted(sizes)
    assert all(c[0] == ".gpu-kit/manifest.json" and sum(sizes[p] for p in c[1:]) <= 2**20 for c in calls)


def test_a_missing_or_corrupt_part_is_named_with_the_call_that_brings_it(kit, tmp_path):
    out, manifest = kit
    first, second = manifest["archives"]["bundle"]["parts"][:2]
    (out / "parts" / first["file"]).unlink()
    corrupt = out / "parts" / second["file"]
    corrupt.write_bytes(b"x" + corrupt.read_bytes()[1:])
    with pytest.raises(gpu_kit.KitError) as err:
        gpu_kit.unpack(out, tmp_path / "unpacked")
    text = str(err.value)
    assert f"{first['file']} is missing (device call" in text
    assert f"{second['file']} does not match its sha256 (carry it again: device call" in text
    assert not (tmp_path / "unpacked" / "bundle").exists()


def test_the_cli_says_a_kit_is_missing_in_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, "-P", str(REPO / "bench" / "gpu_kit.py"), "unpack", "--kit", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and "make gpu-kit" in done.stderr and done.stderr.count("\n") == 1


def test_the_source_farm_imports_this_checkout_and_runs_its_cli(tmp_path):
    farm = gpu_kit.source_farm(REPO, tmp_path / "farm")
    env = {**os.environ, "PYTHONPATH": str(farm), "PYTHONSAFEPATH": "1"}
    code = (
        "import exitplan.worker_image.bundle_runtime as m, exitplan.planner as p; print(m.__file__); print(p.__file__)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    runtime, planner = done.stdout.split()
    assert Path(runtime).resolve() == (REPO / "worker_image" / "bundle_runtime.py").resolve()
    assert Path(planner).resolve().parent == (REPO / "planner").resolve()
    help_text = subprocess.run([str(farm / "bin" / "exitplan"), "--help"], capture_output=True, text=True, env=env)
    assert help_text.returncode == 0 and "profile" in help_text.stdout


def test_the_proof_starts_itself_again_inside_the_kit(kit, digits_bundle, tmp_path):
    """--kit: unpack, then run again with the kit's packages, this checkout and the CUDA libraries on the
    paths (here the kit's probe package stands for onnxruntime-gpu and the rest)."""
    out_kit, _ = kit
    kit_dir = tmp_path / ".gpu-kit"
    out_kit.rename(kit_dir)
    out = tmp_path / "out"
    cmd = [sys.executable, "-P", str(REPO / "bench" / "gpu_proof.py"), "--kit", str(kit_dir), "--cpu"]
    cmd += ["--out", str(out), "--sections", "env"]
    done = subprocess.run(cmd, capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != "OUT"})
    assert done.returncode == 0, done.stderr[-2000:]
    env = json.loads((out / "gpu_proof.json").read_text())["sections"]["env"]
    assert env["ok"] and env["bundle"] == str((kit_dir / "unpacked" / "bundle").resolve())
    assert env["kit"]["bundle"] == digits_bundle.name
