"""A real S3-compatible server for the tests: moto in server mode (`moto_server`), run from its own venv
(.venv-s3, made by `make test` from tools/s3-test-server.txt: moto's botocore and the operator's
kubernetes client cannot share one venv), on a free port of 127.0.0.1; offline, in memory."""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERVER = Path(os.environ.get("EXITPLAN_S3_TEST_SERVER", REPO / ".venv-s3" / "bin" / "moto_server"))
START_GUARD = 60.0  # only stops a broken start from hanging the suite; not a performance assertion


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class S3Server:
    endpoint: str
    access_key: str = "exitplan-test"
    secret_key: str = "exitplan-test-secret"
    region: str = "us-east-1"

    @property
    def env(self) -> dict[str, str]:
        """The storage initializer's environment (the keys of a spec.model.bundleSecret Secret)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
        }

    def client(self):
        from exitplan.storage import s3

        return s3.connect(self.env).client


@contextmanager
def s3_server(log: Path) -> Iterator[S3Server]:
    assert SERVER.exists(), f"{SERVER}: the tests' S3 server is missing; `make test` installs it (.venv-s3)"
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(SERVER), "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_GUARD
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).close()
                break
            except (urllib.error.URLError, OSError):
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-2000:]
                time.sleep(0.1)
        yield S3Server(endpoint)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def bundle_with_digests(source: Path, target: Path) -> Path:
    """A copy of a prepared bundle with its digests recorded (the test bundles may predate them)."""
    from exitplan.api.bundle import record_digests

    shutil.copytree(source, target, ignore=shutil.ignore_patterns("profiles"))
    record_digests(target)
    return target


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def web_server(root: Path) -> Iterator[str]:
    """A real HTTP server over the directory `root` (what hosting a pushed tarball looks like); its base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
