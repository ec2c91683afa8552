"""Bundle archives within limits (issue 28 item 6): a tarball is unpacked as one stream and refused the
moment it passes its total size, member count or compression ratio (storage/limits.py), with the limit,
the bytes read before refusing and how to raise it named; a normal bundle still unpacks and verifies.
The refusal reaches the service as storage-init's termination message (operator/bundle_health.py)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from s3_server import bundle_with_digests, web_server

from exitplan.api.bundle import read_manifest
from exitplan.operator import bundle_health
from exitplan.storage import archive
from exitplan.storage.errors import StorageError
from exitplan.storage.initializer import storage_init
from exitplan.storage.limits import RATIO_FLOOR, ArchiveLimitError, ArchiveLimits
from exitplan.storage.verify import FETCH_MARKER

EXITPLAN = [sys.executable, "-P", "-c", "from exitplan.cli import app; app()"]
MB = 1000 * 1000


class _Zeros(io.RawIOBase):
    """`size` zero bytes, read in chunks (a bomb's member, never held in memory at once)."""

    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def]
        n = min(len(buffer), self.left)
        buffer[:n] = bytes(n)
        self.left -= n
        return n


def zeros_tarball(path: Path, members: list[tuple[str, int]]) -> Path:
    """A gzipped tarball of `members` (name, size of zeros), bundle.yaml first."""
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as gz:
        with tarfile.open(fileobj=gz, mode="w") as tar:
            tar.addfile(_info("bundle.yaml", 8), io.BytesIO(b"name: x\n"))
            for name, size in members:
                tar.addfile(_info(name, size), io.BufferedReader(_Zeros(size)))
    return path


def _info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode = size, 0o644
    return info


@pytest.fixture(scope="module")
def bomb(tmp_path_factory) -> Path:
    """About 200 KB of tar.gz that inflates to 200 MB."""
    return zeros_tarball(tmp_path_factory.mktemp("bomb") / "bomb.tar.gz", [("weights.onnx", 200 * MB)])


def test_an_archive_bomb_is_refused_after_a_few_mib_read(bomb, tmp_path):
    compressed = bomb.stat().st_size
    assert compressed < 250_000  # the attack: about 200 KB on the wire
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(ArchiveLimitError) as err:
        archive.extract_tarball(bomb, dest, "https://h/bomb.tar.gz")
    said = str(err.value)
    print(f"bomb: {compressed} B compressed, 200 MB inside; refused: {said}")
    assert "above the limit of 100:1" in said and "--max-ratio" in said and "EXITPLAN_BUNDLE_MAX_RATIO" in said
    read = int(said.split("(read ")[1].split(" ")[0])
    assert RATIO_FLOOR <= read <= 2 * RATIO_FLOOR  # refused after about 1 MiB, not 200 MB
    assert list(dest.iterdir()) == []  # nothing landed, the staging folder is gone


def test_the_bomb_is_refused_by_size_when_the_ratio_allows_it(bomb, tmp_path):
    limits = ArchiveLimits(max_bytes=50 * MB, max_ratio=2000)
    with pytest.raises(ArchiveLimitError) as err:
        archive.extract_tarball(bomb, tmp_path, "s3://b/bomb.tar.gz", limits)
    said = str(err.value)
    assert f"its members declare {200 * MB + 8} bytes, above the limit of {50 * MB} bytes" in said
    assert "spec.model.bundleSize" in said and "--max-bytes" in said
    read = int(said.split("(read ")[1].split(" ")[0])
    assert read <= 2 * tarfile.RECORDSIZE  # refused on the member's header, before its data
    assert [p.name for p in tmp_path.iterdir()] == []


def test_too_many_files_are_refused(tmp_path):
    many = zeros_tarball(tmp_path / "many.tar.gz", [(f"f/{i}.txt", 1) for i in range(60)])
    dest = tmp_path / "dest"
    with pytest.raises(ArchiveLimitError, match="more than 50 members, the limit.*--max-files"):
        archive.extract_tarball(many, dest, "many", ArchiveLimits(max_files=50))
    assert not (dest / "bundle.yaml").exists()
    archive.extract_tarball(many, dest, "many", ArchiveLimits(max_files=62))  # bundle.yaml, f/, 60 files
    assert len(list((dest / "f").iterdir())) == 60


def test_the_ratio_limit_is_a_setting(tmp_path):
    zeros = zeros_tarball(tmp_path / "z.tar.gz", [("w.bin", 8 * MB)])  # about 1000:1
    with pytest.raises(ArchiveLimitError, match="above the limit of 100:1"):
        archive.extract_tarball(zeros, tmp_path / "a", "z")
    archive.extract_tarball(zeros, tmp_path / "b", "z", ArchiveLimits(max_ratio=2000))
    assert (tmp_path / "b" / "w.bin").stat().st_size == 8 * MB
    small = zeros_tarball(tmp_path / "s.tar.gz", [("w.bin", RATIO_FLOOR // 2)])  # below the floor: not judged
    archive.extract_tarball(small, tmp_path / "c", "s")
    assert (tmp_path / "c" / "w.bin").stat().st_size == RATIO_FLOOR // 2


def test_a_real_bundle_unpacks_within_the_defaults(digits_bundle, tmp_path):
    bundle = bundle_with_digests(digits_bundle, tmp_path / "src" / "digits")
    tarball = tmp_path / "digits.tar.gz"
    archive.write_tarball(bundle, tarball)
    dest = tmp_path / "dest"
    dest.mkdir()
    archive.extract_tarball(tarball, dest, "digits", ArchiveLimits())
    for rel in read_manifest(bundle).digests:
        assert (dest / rel).read_bytes() == (bundle / rel).read_bytes()
    unpacked = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print(f"digits bundle: {tarball.stat().st_size} B compressed, {unpacked} B unpacked")
    with pytest.raises(ArchiveLimitError):  # its exact size passes, a byte less does not
        archive.extract_tarball(tarball, tmp_path / "x", "digits", ArchiveLimits(max_bytes=unpacked - 1))
    archive.extract_tarball(tarball, tmp_path / "y", "digits", ArchiveLimits(max_bytes=unpacked))


def test_storage_init_refuses_the_bomb_and_the_service_is_told(bomb, tmp_path):
    """The CLI the pods run: exit 1, the reason in the termination log; the operator's reading of a pod
    whose storage-init failed so (bundle_health) names the limit and how to raise it."""
    root = tmp_path / "www"
    root.mkdir()
    (root / "b.tar.gz").write_bytes(bomb.read_bytes())
    digest = hashlib.sha256(bomb.read_bytes()).hexdigest()
    log = tmp_path / "termination-log"
    with web_server(root) as base:
        args = [f"{base}/b.tar.gz", str(tmp_path / "dest"), "--sha256", digest, "--termination-log", str(log)]
        run = subprocess.run([*EXITPLAN, "storage-init", *args], capture_output=True, text=True, check=False)
        assert run.returncode == 1 and "above the limit of 100:1" in log.read_text(), run.stderr
        assert [p.name for p in (tmp_path / "dest").iterdir()] == [FETCH_MARKER]  # the tarball and staging gone
        with pytest.raises(StorageError, match="above the limit of 10:1"):
            storage_init(f"{base}/b.tar.gz", tmp_path / "d2", sha256=digest, limits=ArchiveLimits(max_ratio=10))
    status = {
        "name": "storage-init",
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": 1, "message": log.read_text()}},
    }
    pod = {"metadata": {"name": "svc-router-0"}, "status": {"initContainerStatuses": [status]}}
    (failure,) = bundle_health.pod_failures([pod])
    assert "exited 1:" in failure and "above the limit of 100:1" in failure and "--max-ratio" in failure
    print(json.dumps({"condition message": failure}))
