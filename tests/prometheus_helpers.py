"""Prometheus for the tests: the `prometheus` and `promtool` binaries (Debian's `prometheus` package,
which `make install` installs when apt is there), a real Prometheus server on a free port with a
scrape configuration of the test's choosing, and its HTTP query API.

A missing binary fails the test with the command that installs it: these tests are never skipped.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "charts" / "exitplan" / "rules" / "exitplan-alerts.yaml"
INSTALL = "apt-get install -y --no-install-recommends prometheus (as root; `make install` runs it when apt is there)"
HANG_GUARD = 60.0
"""Only stops a broken start from hanging the suite; not a performance assertion."""


def binary(name: str) -> str:
    """The path of a Prometheus binary (prometheus, promtool); fails naming the install command."""
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"`{name}` is not on PATH: install Prometheus: {INSTALL}", pytrace=False)
    return found


def promtool(*args: str, stdin: bytes | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [binary("promtool"), *args], input=stdin, capture_output=True, cwd=cwd, timeout=120, check=False
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_job(name: str, targets: list[tuple[str, dict[str, str]]], honor_labels: bool = False) -> dict[str, Any]:
    """A static scrape job; `targets` are (host:port, target labels) pairs."""
    job: dict[str, Any] = {
        "job_name": name,
        "static_configs": [{"targets": [address], "labels": labels} for address, labels in targets],
    }
    if honor_labels:
        job["honor_labels"] = True
    return job


class PrometheusServer:
    """`prometheus` run directly (no service manager): a temporary config and TSDB under `workdir`,
    scraping `jobs` every `interval`, with the chart's rules loaded."""

    def __init__(self, workdir: Path, jobs: list[dict[str, Any]], interval: str = "1s") -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval, "scrape_timeout": interval},
            "rule_files": [str(RULES)],
            "scrape_configs": jobs,
        }
        self.config = workdir / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log = workdir / "prometheus.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> PrometheusServer:
        exe = binary("prometheus")
        check = promtool("check", "config", str(self.config))
        assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    exe,
                    f"--config.file={self.config}",
                    f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + HANG_GUARD
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"prometheus did not start: {self.log.read_text()[-3000:]}")
            time.sleep(0.1)
        return self

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>: the `data` of a successful answer (an error answer fails the test)."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as err:
            raise AssertionError(f"{path} {params}: {err.code} {err.read().decode()[:500]}") from None
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's vector (a scalar comes back as one unlabelled sample)."""
        data = self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def value(self, expr: str) -> float | None:
        """The value of a query that yields one sample (None when it yields none)."""
        result = self.query(expr)
        assert len(result) <= 1, f"{expr}: {len(result)} series"
        return float(result[0]["value"][1]) if result else None
