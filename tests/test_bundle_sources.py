"""Bundle sources (issue 16): a bundle pushed to a real S3-compatible server (moto's server mode) and
to a real HTTP server, fetched back with `exitplan storage-init`, verified file by file against the
sha256 digests that `exitplan prepare` records in bundle.yaml, and served (loaded by BundleRuntime,
answering like the original). The failures say what is wrong in one line: a wrong digest names the
file, an unreachable endpoint names the endpoint, a tarball member outside the bundle is refused."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import yaml
from s3_server import bundle_with_digests, free_port, s3_server, web_server

from exitplan.api.bundle import read_manifest, record_digests
from exitplan.api.bundle_source import parse_bundle_uri
from exitplan.storage import https
from exitplan.storage.errors import DigestMismatch, StorageError
from exitplan.storage.initializer import storage_init
from exitplan.storage.push import push
from exitplan.worker_image.bundle_runtime import BundleRuntime

EXITPLAN = [sys.executable, "-P", "-c", "from exitplan.cli import app; app()"]
BUCKET = "bundles"


@pytest.fixture(scope="module")
def bundle(digits_bundle, tmp_path_factory) -> Path:
    return bundle_with_digests(digits_bundle, tmp_path_factory.mktemp("src") / "digits")


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("s3") / "moto.log") as server:
        server.client().make_bucket(BUCKET)
        yield server


@pytest.fixture
def s3_env(s3, monkeypatch):
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    return s3


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    """A real HTTP server over a directory (what hosting a pushed tarball looks like)."""
    root = tmp_path_factory.mktemp("www")
    with web_server(root) as base:
        yield root, base


def answers(directory: Path, n: int = 48) -> tuple[np.ndarray, np.ndarray]:
    """The bundle's answers on its held-out inputs (the final head, loaded from `directory`), and the
    answers `exitplan prepare` recorded."""
    runtime = BundleRuntime(directory)
    with np.load(directory / "data" / "heldout.npz") as held:
        x, expected = held["x"][:n], held["full_pred"][:n]
    result = runtime.run_range({"x": x.astype(np.float32)})
    got = np.empty(n, dtype=np.int64)
    for done in result.exits:
        got[done.row] = int(np.argmax(done.logits))
    return got, expected


def test_prepare_records_the_digest_of_every_file_last(bundle, tmp_path):
    """build_once (every prepare path) writes the digests after the report and the completion marker."""
    from dataclasses import dataclass

    from exitplan.prepare.build import MARKER, REPORT, build_once

    @dataclass
    class Options:
        name: str = "copy"

        def digest(self) -> str:
            return "options-of-the-test"

    def build(work: Path) -> dict:
        for rel in ["bundle.yaml", *read_manifest(bundle).digests]:
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(bundle / rel, work / rel)
        return {"built": True}

    out, reused, _ = build_once(tmp_path / "out", Options(), build, threads=1)
    digests = read_manifest(out).digests
    assert not reused and MARKER in digests and REPORT in digests and "blocks/block0.onnx" in digests
    assert digests[REPORT] == hashlib.sha256((out / REPORT).read_bytes()).hexdigest()
    assert "bundle.yaml" not in digests
    result = storage_init(str(out), tmp_path / "copy", say=lambda _: None)
    assert result.has_digests and result.verified == len(digests) and not result.uncovered


def test_s3_push_then_storage_init_verifies_and_serves(bundle, s3_env, tmp_path):
    pushed = push(bundle, f"s3://{BUCKET}/models/digits")
    keys = {o.object_name for o in s3_env.client().list_objects(BUCKET, prefix="models/digits/", recursive=True)}
    assert (
        pushed.files == len(keys) and "models/digits/bundle.yaml" in keys and "models/digits/blocks/block0.onnx" in keys
    )
    said: list[str] = []
    dest = tmp_path / "pod" / "bundle"
    result = storage_init(f"s3://{BUCKET}/models/digits", dest, say=said.append)
    assert result.has_digests and result.verified == len(read_manifest(bundle).digests)
    assert "verified" in said[-1] and "unverified" not in said[-1]
    got, expected = answers(dest)
    assert (got == expected).all()
    # a second run (a restarted init container) empties and fills the directory it filled before
    (dest / "blocks" / "stale.onnx").write_bytes(b"left over")
    again = storage_init(f"s3://{BUCKET}/models/digits", dest, say=said.append)
    assert again.verified == result.verified and not (dest / "blocks" / "stale.onnx").exists()


def test_s3_tarball_object_is_pinned_by_its_sha256(bundle, s3_env, tmp_path):
    pushed = push(bundle, f"s3://{BUCKET}/tarballs/digits.tar.gz")
    assert pushed.sha256 and len(pushed.sha256) == 64
    result = storage_init(f"s3://{BUCKET}/tarballs/digits.tar.gz", tmp_path / "a", sha256=pushed.sha256, say=print)
    assert result.verified == len(read_manifest(bundle).digests)
    with pytest.raises(StorageError, match="tarball's sha256 is"):
        storage_init(f"s3://{BUCKET}/tarballs/digits.tar.gz", tmp_path / "b", sha256="0" * 64, say=print)


def test_https_like_tarball_with_sha256_verifies_and_serves(bundle, web, tmp_path):
    root, base = web
    pushed = push(bundle, str(root / "models"))
    tarball = Path(pushed.uri)
    assert tarball.name == "digits-cnn.tar.gz" and pushed.sha256 == hashlib.sha256(tarball.read_bytes()).hexdigest()
    assert (root / "models" / "digits-cnn.tar.gz.sha256").read_text().split()[0] == pushed.sha256
    assert push(bundle, str(tmp_path / "again.tar.gz")).sha256 == pushed.sha256  # the same bytes every time
    dest = tmp_path / "dest"
    result = storage_init(f"{base}/models/digits-cnn.tar.gz", dest, sha256=pushed.sha256, say=print)
    assert result.has_digests and result.verified == len(read_manifest(bundle).digests)
    got, expected = answers(dest)
    assert (got == expected).all()
    with pytest.raises(StorageError, match="tarball's sha256 is"):
        storage_init(f"{base}/models/digits-cnn.tar.gz", tmp_path / "bad", sha256="f" * 64, say=print)


def test_a_wrong_digest_fails_naming_the_file(bundle, s3_env, tmp_path):
    push(bundle, f"s3://{BUCKET}/corrupt/digits")
    data = bytearray((bundle / "blocks" / "block1.onnx").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / "block1.onnx").write_bytes(bytes(data))
    s3_env.client().fput_object(BUCKET, "corrupt/digits/blocks/block1.onnx", str(tmp_path / "block1.onnx"))
    with pytest.raises(DigestMismatch) as err:
        storage_init(f"s3://{BUCKET}/corrupt/digits", tmp_path / "dest", say=print)
    assert "blocks/block1.onnx" in str(err.value) and "\n" not in str(err.value)
    # the CLI: exit 1, and the same one line in the termination log a kubelet reads
    log = tmp_path / "termination-log"
    out = subprocess.run(
        [
            *EXITPLAN,
            "storage-init",
            f"s3://{BUCKET}/corrupt/digits",
            str(tmp_path / "cli"),
            "--termination-log",
            str(log),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1 and "blocks/block1.onnx" in out.stderr
    message = log.read_text()
    assert "blocks/block1.onnx" in message and "bundle.yaml records" in message and "\n" not in message


def test_a_missing_file_and_an_uncovered_file(bundle, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(bundle, copy)
    (copy / "profiles").mkdir()
    (copy / "profiles" / "cpu.yaml").write_text("measured later\n")
    result = storage_init(str(copy), tmp_path / "a", say=print)
    assert result.uncovered == ["profiles/cpu.yaml"] and "not covered" in result.summary()
    (copy / "ramps" / "ramp0.onnx").unlink()
    with pytest.raises(StorageError, match="ramp0.onnx"):
        storage_init(str(copy), tmp_path / "b", say=print)


def test_a_bundle_without_digests_loads_and_is_reported_unverified(digits_bundle, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(digits_bundle, old, ignore=shutil.ignore_patterns("profiles"))
    doc = yaml.safe_load((old / "bundle.yaml").read_text())
    doc.pop("digests", None)  # as `exitplan prepare` wrote bundles before digests
    (old / "bundle.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    said: list[str] = []
    result = storage_init(f"file://{old}", tmp_path / "dest", say=said.append)
    assert not result.has_digests and said[-1].endswith(result.summary()) and "unverified" in said[-1]
    got, expected = answers(tmp_path / "dest")
    assert (got == expected).all()
    with pytest.raises(StorageError, match="no digests"):
        push(old, str(tmp_path / "x.tar.gz"))  # receivers could not verify it
    record_digests(old)  # `exitplan bundle digest`
    assert push(old, str(tmp_path / "x.tar.gz")).sha256


def test_unreachable_sources_fail_with_one_line(bundle, s3_env, web, tmp_path, monkeypatch):
    closed = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", closed)
    with pytest.raises(StorageError) as err:
        storage_init(f"s3://{BUCKET}/models/digits", tmp_path / "a", say=print)
    assert f"cannot reach the S3 endpoint {closed}" in str(err.value) and "\n" not in str(err.value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env.endpoint)
    with pytest.raises(StorageError, match="NoSuchBucket"):
        storage_init("s3://no-such-bucket/x", tmp_path / "b", say=print)
    with pytest.raises(StorageError, match="no objects under that prefix"):
        storage_init(f"s3://{BUCKET}/nothing/here", tmp_path / "c", say=print)
    with pytest.raises(StorageError, match="cannot reach the server"):
        storage_init(f"{closed}/b.tar.gz", tmp_path / "d", sha256="0" * 64, say=print)
    _, base = web
    with pytest.raises(StorageError, match="answered HTTP 404") as missing:
        storage_init(f"{base}/missing.tar.gz?X-Amz-Signature=secret", tmp_path / "e", sha256="0" * 64, say=print)
    assert "secret" not in str(missing.value)  # a presigned URL's signature never reaches a message


def _tarball(path: Path, members: list[tuple[str, bytes | None, str]]) -> str:
    """A tarball with (name, data, kind) members, kind 'file', 'symlink' or 'dir'; its sha256."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data, kind in members:
            info = tarfile.TarInfo(name)
            if kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
                tar.addfile(info)
            elif kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data or b"")
                tar.addfile(info, io.BytesIO(data or b""))
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize(
    "member,kind,said",
    [
        ("../x", "file", "outside the bundle"),
        ("/etc/x", "file", "outside the bundle"),
        ("ok/../../x", "file", "outside"),
        ("link", "symlink", "is a link"),
    ],
)
def test_tar_members_outside_the_bundle_are_refused(web, tmp_path, member, kind, said):
    root, base = web
    name = f"evil-{abs(hash(member))}.tar.gz"
    digest = _tarball(root / name, [("bundle.yaml", b"name: x\n", "file"), (member, b"pwned", kind)])
    dest = tmp_path / "inner" / "dest"
    with pytest.raises(StorageError) as err:
        storage_init(f"{base}/{name}", dest, sha256=digest, say=print)
    assert said in str(err.value) and repr(member) in str(err.value)
    assert not (tmp_path / "inner" / "x").exists() and not (tmp_path / "x").exists()
    assert not (dest / "bundle.yaml").exists()  # refused before anything was unpacked


def test_a_tarball_of_one_folder_is_unpacked_from_inside_it(bundle, web, tmp_path):
    root, base = web
    with tarfile.open(root / "folder.tar.gz", "w:gz") as tar:
        tar.add(bundle, arcname="digits-cnn")
    digest = hashlib.sha256((root / "folder.tar.gz").read_bytes()).hexdigest()
    result = storage_init(f"{base}/folder.tar.gz", tmp_path / "dest", sha256=digest, say=print)
    assert result.verified == len(read_manifest(bundle).digests) and (tmp_path / "dest" / "bundle.yaml").exists()


def test_plain_http_only_to_this_machine_or_when_allowed(tmp_path):
    https.check_scheme("https://models.example.com/b.tar.gz", allow_http=False)
    https.check_scheme("http://127.0.0.1:8000/b.tar.gz", allow_http=False)
    https.check_scheme("http://localhost/b.tar.gz", allow_http=False)
    https.check_scheme("http://models.internal/b.tar.gz", allow_http=True)
    with pytest.raises(StorageError, match="--allow-http"):
        https.check_scheme("http://models.internal/b.tar.gz", allow_http=False)
    with pytest.raises(StorageError, match="needs its sha256"):
        storage_init("https://models.example.com/b.tar.gz", tmp_path / "a", say=print)


def test_storage_init_never_empties_a_directory_it_did_not_fill(bundle, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    with pytest.raises(StorageError, match="not empty"):
        storage_init(str(bundle), home, say=print)
    assert (home / "notes.txt").read_text() == "mine"
    with pytest.raises(StorageError, match="notes.txt"):  # a local failure is one line too, not a traceback
        storage_init(str(bundle), home / "notes.txt", say=print)


def test_pvc_and_oci_are_verified_where_they_lie(bundle, tmp_path):
    with pytest.raises(StorageError, match="--verify-only"):
        storage_init("oci://ghcr.io/acme/digits:1", tmp_path / "x", say=print)
    result = storage_init("pvc://models/digits", bundle, verify_only=True, say=print)
    assert result.verified == len(read_manifest(bundle).digests)


def test_uri_forms_and_their_errors():
    assert parse_bundle_uri("s3://bundles/models/digits/").path == "models/digits"
    assert parse_bundle_uri("pvc://models").path == "" and parse_bundle_uri("pvc://models/a/b").path == "a/b"
    assert (
        parse_bundle_uri("oci://registry.local:5000/acme/digits:1.0").location == "registry.local:5000/acme/digits:1.0"
    )
    assert parse_bundle_uri("https://h.example/x.tgz?sig=1").tarball and not parse_bundle_uri("s3://bkt/x").tarball
    assert not parse_bundle_uri("/var/lib/exitplan/bundles/x").remote and parse_bundle_uri("pvc://c/x").remote
    for bad, said in [
        ("ftp://host/x", "unknown scheme"),
        ("HTTPS://h/x.tar.gz", "unknown scheme"),
        ("s3://b/../x", "bucket name"),
        ("s3://bucket/a/../x", "plain relative path"),
        ("pvc://Claim/x", "PersistentVolumeClaim"),
        ("https://h.example/bundle.zip", "tarball URL"),
        ("oci://Not A Ref", "image reference"),
    ]:
        with pytest.raises(ValueError, match=said):
            parse_bundle_uri(bad)


def test_the_worker_image_runs_storage_init():
    """The data-plane images (worker extra + operator extra) import what `exitplan storage-init` runs,
    with the other extras' packages blocked (the probe of test_dockerfile.py)."""
    from test_dockerfile import TARGETS, _command_imports, probe

    modules = sorted(
        {"exitplan.cli", "exitplan.storage.s3", *_command_imports("cmd_bundle", "storage_init")}
        - {"__future__:annotations"}
    )
    out = probe(TARGETS["worker-cpu"], [*modules, "minio", "certifi"], [["storage-init"], ["bundle", "push"]])
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
    blocked = probe({"operator"}, ["minio"], [])
    assert blocked.returncode != 0 and "minio is not installed in this image" in blocked.stderr


def test_the_cli_prints_what_the_spec_needs(bundle, tmp_path):
    out = subprocess.run(
        [*EXITPLAN, "bundle", "push", str(bundle), str(tmp_path / "b.tar.gz")], capture_output=True, text=True
    )
    digest = hashlib.sha256((tmp_path / "b.tar.gz").read_bytes()).hexdigest()
    assert out.returncode == 0 and f"spec.model.bundleSha256: {digest}" in out.stdout, out.stderr
    size = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    assert f"spec.model.bundleSize: {size} " in out.stdout  # what storage-init's --max-bytes and the volume get
    bad = subprocess.run(
        [*EXITPLAN, "bundle", "push", str(bundle), "oci://ghcr.io/a/b:1"], capture_output=True, text=True
    )
    assert bad.returncode == 1 and bad.stderr.startswith("error: ") and "oci://" in bad.stderr
    copy = tmp_path / "copy"
    shutil.copytree(bundle, copy)
    doc = yaml.safe_load((copy / "bundle.yaml").read_text())
    doc["digests"] = {}
    (copy / "bundle.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    done = subprocess.run([*EXITPLAN, "bundle", "digest", str(copy)], capture_output=True, text=True)
    assert done.returncode == 0 and read_manifest(copy).digests == read_manifest(bundle).digests, done.stderr
    assert json.dumps(read_manifest(copy).digests, sort_keys=True) == json.dumps(
        read_manifest(bundle).digests, sort_keys=True
    )
