"""The README's dev-cluster section, run as written: its two bash blocks, line by line, in a folder laid
out like the repository root (`examples/` as committed, `artifacts/bundles/minilm` the MiniLM test
bundle), with `exitplan` and `kubectl` on the PATH. Background lines (`... &`) are started and stopped
at the end, `export` sets the environment of the lines after it, a `kubectl get ... -w` is polled
until its comment's last phase shows, and the lines whose comments promise a state are waited for:
the example applied with kubectl as written is refused (BundleRefused, naming spec.model.bundle and
the fix), `exitplan apply` of the same file makes it Ready, `kubectl describe` lists the service's
events, the router's port answers an inference, and the GPU example is refused for its node path.

Only the operator's two listening ports are changed, by their environment variables (0: off), so that
test sessions running side by side do not take each other's ports."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from test_operator_support import wait_for

ROOT = Path(__file__).resolve().parents[1]
GUARD = 900.0  # only stops a broken run from hanging the suite (profiling MiniLM on a busy machine); not a performance assertion
SECTION = "## The operator without a cluster (`exitplan dev-cluster`)"


def readme_blocks() -> list[list[str]]:
    """The bash blocks of the README's dev-cluster section, as command lines without their comments."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(SECTION) :]
    section = section[: section.index("\n## ", 1)] if "\n## " in section[1:] else section
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [[c for c in (re.sub(r"\s+#\s.*$", "", line).strip() for line in b.splitlines()) if c] for b in blocks]


def comment_of(line: str) -> str:
    text = (ROOT / "README.md").read_text()
    found = re.search(re.escape(line) + r"\s+#\s(.*)", text)
    return found[1] if found else ""


@pytest.fixture(scope="module")
def checkout(tmp_path_factory, minilm_bundle):
    """A folder laid out as the README's commands expect the repository root."""
    root = tmp_path_factory.mktemp("readme")
    shutil.copytree(ROOT / "examples", root / "examples")
    shutil.copytree(minilm_bundle, root / "artifacts" / "bundles" / "minilm")
    return root


class Shell:
    """Runs README lines in `root` as bash would, keeping `export`s and background processes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.env = {
            **os.environ,
            "PWD": str(root),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "EXITPLAN_OPERATOR_METRICS_PORT": "0",
            "EXITPLAN_OPERATOR_HEALTH_PORT": "0",
            "PYTHONUNBUFFERED": "1",
        }
        self.env.pop("KUBECONFIG", None)
        self.background: list[tuple[str, subprocess.Popen[bytes]]] = []

    def __call__(self, line: str) -> str:
        if line.endswith("&"):
            log = (self.root / f"background-{len(self.background)}.log").open("wb")
            proc = subprocess.Popen(
                ["bash", "-c", "exec " + line[:-1]],
                cwd=self.root,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self.background.append((line, proc))
            if "dev-cluster" in line:  # the kubeconfig appears once the API serves (cluster.py)
                config = self.root / line.split("--kubeconfig")[1].split()[0]
                wait_for("the dev cluster's kubeconfig", config.exists, 120)
            return ""
        if line.startswith("export "):
            key, _, value = line.removeprefix("export ").partition("=")
            self.env[key] = os.path.expandvars(value.replace("$PWD", str(self.root)))
            return ""
        done = subprocess.run(["bash", "-c", line], cwd=self.root, env=self.env, capture_output=True, text=True)
        assert done.returncode == 0, (line, done.stdout, done.stderr)
        return done.stdout

    def output(self, line: str) -> str:
        done = subprocess.run(["bash", "-c", line], cwd=self.root, env=self.env, capture_output=True, text=True)
        return done.stdout + done.stderr

    def stop(self) -> None:
        for _line, proc in reversed(self.background):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for index, (line, _) in enumerate(self.background):
            tail = (self.root / f"background-{index}.log").read_text(errors="replace").splitlines()[-30:]
            print(f"---- {line} ----\n" + "\n".join(tail))


def service(shell: Shell, namespace: str = "default") -> dict:
    text = shell.output(f"kubectl -n {namespace} get ees minilm -o json")
    return json.loads(text) if text.startswith("{") else {}


def refused(shell: Shell, namespace: str, *words: str) -> dict | None:
    status = service(shell, namespace).get("status") or {}
    conditions = {c["type"]: c for c in status.get("conditions", [])}
    infeasible = conditions.get("PlanInfeasible", {})
    if infeasible.get("reason") != "BundleRefused" or status.get("phase") != "Infeasible":
        return None
    return infeasible if all(w in infeasible.get("message", "") for w in words) else None


def infer(port: str) -> dict:
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["what a lovely day"]}]}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v2/models/minilm/infer",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as rsp:
        return json.loads(rsp.read())


def check(shell: Shell, line: str, out: str) -> None:
    """What the line's comment in the README promises, waited for where it takes time."""
    if line == "kubectl apply --validate=false -f examples/minilm-local.yaml":
        condition = wait_for("the example as written is refused", lambda: refused(shell, "default"), GUARD)
        assert "spec.model.bundle artifacts/bundles/minilm is a relative path" in condition["message"]
        assert "exitplan apply" in condition["message"] and str(shell.root / "artifacts") in condition["message"]
        events = shell.output("kubectl get events --field-selector involvedObject.name=minilm")
        assert "BundleRefused" in events and "relative path" in events, events
    elif line.startswith("exitplan apply"):
        assert f"spec.model.bundle resolved to {shell.root}/artifacts/bundles/minilm" in out, out
    elif line.endswith(" -w"):
        final = comment_of(line).split("(")[0].split("->")[-1].strip()
        assert final == "Ready"
        poll = line.removesuffix(" -w") + " -o jsonpath={.status.phase}"
        wait_for(f"{line}: {final}", lambda: shell.output(poll) == final, GUARD)
        assert service(shell)["spec"]["model"]["bundle"] == f"{shell.root}/artifacts/bundles/minilm"
    elif line.startswith("kubectl describe ees"):
        events = out[out.index("\nEvents:") :]
        assert "BundleRefused" in events and "relative path" in events, events
        assert "Applied" in events, events  # the plan the service runs now
    elif line.startswith("kubectl get svc minilm"):
        answer = infer(out.strip())
        assert answer["outputs"][0]["name"] == "label", answer
    elif line == "kubectl -n ml-serving get ees minilm":
        condition = wait_for(
            "the GPU example is refused",
            lambda: refused(shell, "ml-serving", "/var/lib/exitplan/bundles/minilm", "--allow-host-path"),
            GUARD,
        )
        assert "spec.model.bundle" in condition["message"]
        assert "BundleRefused" in shell.output(line)


def test_the_readme_dev_cluster_section_runs_as_written(checkout):
    blocks = readme_blocks()
    assert len(blocks) == 2 and any(line.startswith("exitplan apply") for line in blocks[0]), blocks
    shell = Shell(checkout)
    try:
        for line in [*blocks[0], *blocks[1]]:
            out = shell(line) if not line.endswith(" -w") else ""
            check(shell, line, out)
    finally:
        shell.stop()
