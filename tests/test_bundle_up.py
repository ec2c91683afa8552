"""`exitplan up` with a remote bundle (issue 16): spec.model.bundle may be s3://BUCKET/PREFIX (credentials
from the environment or `--bundle-env-file`) or an http(s) tarball with its sha256; `exitplan up` fetches it
with the storage-init code into `--bundle-cache`, verifies it against bundle.yaml's digests, plans and
serves from the copy, and reuses the copy while it is current. A source that cannot be reached, a wrong
sha256 or a file whose digest differs ends the command with one `error:` line (exit 2) before anything
starts. Against a real HTTP server and a real S3 server (moto)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml
from s3_server import bundle_with_digests, free_port, s3_server
from test_bundle_devcluster import ramp_logits, web_server

from exitplan.api.bundle import MANIFEST, bundle_files, read_manifest, record_digests
from exitplan.localrun.ports import free_port_block
from exitplan.localrun.service_setup import ServiceFileError, load_setup
from exitplan.storage.cache import cached_bundle, read_env_file
from exitplan.storage.errors import StorageError
from exitplan.storage.push import push

ROOT = Path(__file__).resolve().parents[1]
EXITPLAN = [sys.executable, "-P", "-c", "import sys; from exitplan.cli import app; sys.argv[0] = 'exitplan'; app()"]
BUCKET = "up-bundles"
GUARD = 240.0  # only stops a broken run from hanging the suite; not a performance assertion


@pytest.fixture(scope="module")
def bundle(digits_bundle, tmp_path_factory) -> Path:
    return bundle_with_digests(digits_bundle, tmp_path_factory.mktemp("src") / "digits")


@pytest.fixture(scope="module")
def web(bundle, tmp_path_factory):
    """A real HTTP server over a folder holding the bundle pushed as a tarball: (base URL, the paths it
    was asked for, the tarball's sha256)."""
    root = tmp_path_factory.mktemp("www")
    pushed = push(bundle, str(root / "digits.tar.gz"))
    with web_server(root) as (base, asked):
        yield base, asked, pushed.sha256


@pytest.fixture(scope="module")
def s3(bundle, tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("s3") / "moto.log") as server:
        server.client().make_bucket(BUCKET)
        yield server


@pytest.fixture
def no_aws_env(monkeypatch):
    """Credentials only from what the test gives (an env file), never this process's environment."""
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)


def service_file(path: Path, bundle: str, **model: str) -> Path:
    docs = [
        {"apiVersion": "exitplan.io/v1alpha1", "kind": "GPUPool", "metadata": {"name": "cpu"},
         "spec": {"capacity": 2, "costPerHour": 1.0, "gpuResource": ""}},
        {"apiVersion": "exitplan.io/v1alpha1", "kind": "EarlyExitService", "metadata": {"name": "digits"},
         "spec": {"model": {"name": "digits-cnn", "bundle": bundle, **model}, "slo": {"latencyMs": 1000},
                  "pools": [{"name": "cpu"}], "planner": {"maxSplits": 2}}},
    ]  # fmt: skip
    path.write_text(yaml.safe_dump_all(docs))
    return path


def up(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "80", "TERM": "dumb", "NO_COLOR": "1"}
    return subprocess.run([*EXITPLAN, "up", *args], capture_output=True, text=True, cwd=ROOT, env=env)


def one_error_line(proc: subprocess.CompletedProcess[str], *words: str) -> str:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=5) as answer:
            return answer.status == 200
    except OSError:
        return False


def test_up_serves_an_http_bundle_fetched_into_its_cache(bundle, web, tmp_path):
    base, asked, sha = web
    service = service_file(tmp_path / "svc.yaml", f"{base}/digits.tar.gz", bundleSha256=sha)
    cache, ports = tmp_path / "cache", free_port_block(8)
    args = [str(service), "--bundle-cache", str(cache), "--port", str(ports + 7), "--base-port", str(ports)]
    args += ["--workdir", str(tmp_path / "up"), "--no-autotune"]
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*EXITPLAN, "up", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"},
            start_new_session=True,
        )
    url, deadline = f"http://127.0.0.1:{ports + 7}", time.monotonic() + GUARD
    try:
        while not _ready(url):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.3)
        with np.load(bundle / "data" / "heldout.npz") as held:
            x = held["x"][:4].astype(np.float32)
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}
        request = urllib.request.Request(
            f"{url}/v2/models/digits-cnn/infer",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as answer:
            outputs = {o["name"]: o["data"] for o in json.loads(answer.read())["outputs"]}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    local = ramp_logits(bundle, x)  # the original bundle's answers, ramp by ramp
    assert outputs["label"] == [str(int(np.argmax(local[r][i]))) for i, r in enumerate(outputs["exit_ramp"])]
    text = log.read_text()
    assert f"fetching {base}/digits.tar.gz into {cache}" in text and "verified:" in text, text[-3000:]
    (copy,) = [p for p in cache.iterdir() if p.is_dir()]
    assert copy.name.startswith("digits-") and read_manifest(copy).digests == read_manifest(bundle).digests
    assert (copy / "profiles" / "cpu.yaml").is_file()  # measured on the copy, kept in the cache
    assert "/digits.tar.gz" in asked


def test_a_pinned_copy_is_reused_while_it_verifies_and_fetched_again_when_damaged(bundle, web, tmp_path):
    base, asked, sha = web
    said: list[str] = []
    before = asked.count("/digits.tar.gz")
    first = cached_bundle(f"{base}/digits.tar.gz", tmp_path, sha256=sha, say=said.append)
    again = cached_bundle(f"{base}/digits.tar.gz?X-Amz-Signature=s", tmp_path, sha256=sha, say=said.append)
    assert first == again and asked.count("/digits.tar.gz") == before + 1  # one download
    assert said[-1] == f"{base}/digits.tar.gz: using the verified copy in {first}"
    (first / "ramps" / "ramp0.onnx").write_bytes(b"damaged on this disk")
    cached_bundle(f"{base}/digits.tar.gz", tmp_path, sha256=sha, say=said.append)
    assert asked.count("/digits.tar.gz") == before + 2
    assert (first / "ramps" / "ramp0.onnx").read_bytes() == (bundle / "ramps" / "ramp0.onnx").read_bytes()
    with pytest.raises(StorageError, match=f"the tarball's sha256 is {sha}, not {'1' * 64}"):
        cached_bundle(f"{base}/digits.tar.gz", tmp_path, sha256="1" * 64, say=said.append)
    assert cached_bundle(str(bundle), tmp_path) == bundle  # a path is used where it lies


def test_an_s3_bundle_with_credentials_from_an_env_file(bundle, s3, no_aws_env, tmp_path, monkeypatch):
    from exitplan.cmd_up import _bundle_fetcher

    changed = tmp_path / "changed"  # a new version of the bundle: another file, another bundle.yaml
    shutil.copytree(bundle, changed)
    (changed / "data" / "report.json").write_text('{"rebuilt": true}\n')
    record_digests(changed)
    env_file = tmp_path / "s3.env"
    env_file.write_text("# the keys of the bundleSecret\n" + "".join(f"{k}='{v}'\n" for k, v in s3.env.items()))
    assert read_env_file(env_file) == s3.env
    service = service_file(tmp_path / "svc.yaml", f"s3://{BUCKET}/digits")
    said: list[str] = []
    fetcher = _bundle_fetcher(service, tmp_path / "cache", env_file, _Console(said))
    push_with_server_env(monkeypatch, s3, bundle, f"s3://{BUCKET}/digits")
    setup = load_setup(service, [], fetcher)  # this process's environment holds no AWS_ variable
    assert setup.bundle.parent == tmp_path / "cache" and setup.manifest.name == read_manifest(bundle).name
    assert any(s.startswith(f"s3://{BUCKET}/digits: verified: ") for s in said), said
    assert load_setup(service, [], fetcher).bundle == setup.bundle and "using the verified copy" in said[-1]
    push_with_server_env(monkeypatch, s3, changed, f"s3://{BUCKET}/digits")
    fresh = load_setup(service, [], fetcher)
    assert fresh.bundle == setup.bundle and "using the verified copy" not in said[-1]
    assert (fresh.bundle / "data" / "report.json").read_text() == '{"rebuilt": true}\n'
    missing = tmp_path / "missing.env"
    with pytest.raises(ServiceFileError, match=f"{service}: spec.model.bundle: {missing}"):
        load_setup(service, [], _bundle_fetcher(service, tmp_path / "c2", missing, _Console(said)))


def push_with_server_env(monkeypatch, s3, bundle: Path, uri: str) -> None:
    with monkeypatch.context() as env:
        for key, value in s3.env.items():
            env.setenv(key, value)
        push(bundle, uri)


class _Console:
    def __init__(self, said: list[str]) -> None:
        self.said = said

    def print(self, line: str, **_: object) -> None:
        self.said.append(line)


def test_up_says_in_one_line_why_a_remote_bundle_cannot_be_used(bundle, web, s3, no_aws_env, tmp_path):
    base, _, sha = web
    cache = ["--bundle-cache", str(tmp_path / "cache"), "--workdir", str(tmp_path / "up")]
    wrong = service_file(tmp_path / "wrong.yaml", f"{base}/digits.tar.gz", bundleSha256="2" * 64)
    one_error_line(up(str(wrong), *cache), str(wrong), "spec.model.bundle", f"sha256 is {sha}, not {'2' * 64}")
    port = free_port()
    gone = service_file(tmp_path / "gone.yaml", f"http://127.0.0.1:{port}/digits.tar.gz", bundleSha256=sha)
    one_error_line(up(str(gone), *cache), str(gone), f"127.0.0.1:{port}/digits.tar.gz: cannot reach the server")
    env_file = tmp_path / "s3.env"
    env_file.write_text(
        "".join(f"{k}={v}\n" for k, v in {**s3.env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}.items())
    )
    in_s3 = service_file(tmp_path / "s3.yaml", f"s3://{BUCKET}/digits")
    line = one_error_line(up(str(in_s3), *cache, "--bundle-env-file", str(env_file)), str(in_s3))
    assert f"cannot reach the S3 endpoint http://127.0.0.1:{port}" in line
    # a copy in the store whose file differs from bundle.yaml's digest: the file is named
    client = s3.client()
    for rel in [MANIFEST, *bundle_files(bundle)]:
        data = bytearray((bundle / rel).read_bytes())
        if rel == "blocks/block1.onnx":
            data[len(data) // 2] ^= 0xFF
        (tmp_path / "object").write_bytes(bytes(data))
        client.fput_object(BUCKET, f"corrupt/{rel}", str(tmp_path / "object"))
    env_file.write_text("".join(f"{k}={v}\n" for k, v in s3.env.items()))
    corrupt = service_file(tmp_path / "corrupt.yaml", f"s3://{BUCKET}/corrupt")
    line = one_error_line(up(str(corrupt), *cache, "--bundle-env-file", str(env_file)), str(corrupt))
    assert "blocks/block1.onnx has sha256" in line and "bundle.yaml records" in line
    bad_env = tmp_path / "bad.env"
    bad_env.write_text("AWS_REGION us-east-1\n")
    one_error_line(up(str(corrupt), *cache, "--bundle-env-file", str(bad_env)), f"{bad_env}: line 1 is not KEY=VALUE")
    pvc = service_file(tmp_path / "pvc.yaml", "pvc://models/digits")
    one_error_line(up(str(pvc), *cache), str(pvc), "lives in a cluster")
    assert not (tmp_path / "up").exists()  # nothing started
    assert not list((tmp_path / "cache").iterdir())  # and no half copy is left in the cache
