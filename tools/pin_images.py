"""Pin the Dockerfile's base images to digests: `make pin-images` (or `python3 tools/pin_images.py`).

Every external FROM in the Dockerfile names a global build ARG (`FROM ${PYTHON_IMAGE} AS ...`) whose
default is `IMAGE:TAG` or, pinned, `IMAGE:TAG@sha256:DIGEST`. This script asks each image's registry
which manifest TAG names now (an anonymous pull token, then `HEAD /v2/<repository>/manifests/<tag>`,
reading the Docker-Content-Digest header) and rewrites the ARG defaults to `IMAGE:TAG@sha256:DIGEST`.
The digest is that of the multi-platform index where the tag has one, so one pin serves every platform.
Docker then pulls exactly that content: a tag that is later moved to a rebuilt image changes nothing
until the pins are renewed, which is what this script is for.

To move to another tag (a new Python patch release, a new CUDA), edit the TAG in the ARG and run the
script again: it resolves the new tag and replaces the old digest. `--check` changes nothing and exits
1 when an ARG has no digest or its digest is not the one the tag names now (a scheduled job's check).

Only the standard library is used, so any python3 runs it. `--endpoint REGISTRY=URL` sends a
registry's API requests elsewhere (a mirror; the tests' local registry).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

DOCKER_HUB = "docker.io"
DEFAULT_ENDPOINTS = {DOCKER_HUB: "https://registry-1.docker.io"}
# Ask for the multi-platform index (list) first: its digest is what `docker buildx imagetools inspect`
# shows for a tag and what a pull by digest resolves on any platform.
ACCEPT = ", ".join(
    [
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.docker.distribution.manifest.v2+json",
    ]
)
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
TAG = re.compile(r"^[\w][\w.-]{0,127}$")
TIMEOUT_S = 30


class PinError(Exception):
    """A base image that cannot be resolved or a Dockerfile that cannot be pinned."""


@dataclass(frozen=True)
class Reference:
    """An image reference `[REGISTRY/]REPOSITORY:TAG[@sha256:DIGEST]` as Docker reads it."""

    name: str  # as written, without tag and digest: python, nvidia/cuda, nvcr.io/nvidia/cuda
    registry: str  # docker.io, nvcr.io, localhost:5000
    repository: str  # library/python, nvidia/cuda
    tag: str
    digest: str | None

    def pinned(self, digest: str) -> str:
        return f"{self.name}:{self.tag}@{digest}"

    def __str__(self) -> str:
        return f"{self.name}:{self.tag}" + (f"@{self.digest}" if self.digest else "")


def parse_reference(ref: str) -> Reference:
    name, _, digest = ref.partition("@")
    if digest and not DIGEST.match(digest):
        raise PinError(f"{ref}: {digest!r} is not a sha256 digest")
    last = name.rsplit("/", 1)[-1]
    if ":" not in last:
        raise PinError(f"{ref}: no tag (the pin keeps IMAGE:TAG readable, so write the tag too)")
    name, _, tag = name.rpartition(":")
    if not TAG.match(tag):
        raise PinError(f"{ref}: {tag!r} is not a tag")
    first, sep, rest = name.partition("/")
    # Docker's rule: the first component names a registry when it has a dot or a port, or is localhost.
    if sep and ("." in first or ":" in first or first == "localhost"):
        registry, repository = first, rest
    else:
        registry, repository = DOCKER_HUB, name
    if registry in ("index.docker.io", "registry-1.docker.io"):
        registry = DOCKER_HUB
    if registry == DOCKER_HUB and "/" not in repository:
        repository = f"library/{repository}"
    if not re.match(r"^[a-z0-9]+(?:[._-]+[a-z0-9]+)*(?:/[a-z0-9]+(?:[._-]+[a-z0-9]+)*)*$", repository):
        raise PinError(f"{ref}: {repository!r} is not a repository name")
    return Reference(name, registry, repository, tag, digest or None)


@dataclass(frozen=True)
class BaseImageArg:
    arg: str  # PYTHON_IMAGE
    value: str  # its default as written (quotes removed)
    line: int  # 0-based line number of the ARG


def base_image_args(text: str) -> list[BaseImageArg]:
    """The global ARGs (before the first FROM) that FROM lines use as their base image."""
    lines = text.splitlines()
    globals_: dict[str, tuple[str, int]] = {}
    stages: set[str] = set()
    used: list[str] = []
    seen_from = False
    for number, raw in enumerate(lines):
        line = raw.strip()
        words = line.split()
        if not words or line.startswith("#"):
            continue
        op = words[0].upper()
        if op == "ARG" and not seen_from and len(words) >= 2:
            key, eq, value = words[1].partition("=")
            if eq:
                globals_[key] = (value.strip("\"'"), number)
        elif op == "FROM":
            seen_from = True
            args = [w for w in words[1:] if not w.startswith("--")]
            if not args:
                raise PinError(f"line {number + 1}: FROM without an image")
            base = args[0]
            if len(args) >= 3 and args[1].upper() == "AS":
                stages.add(args[2])
            match = re.fullmatch(r"\$\{(\w+)\}|\$(\w+)", base)
            if match:
                key = match.group(1) or match.group(2)
                if key not in globals_:
                    raise PinError(f"line {number + 1}: FROM {base}: no global ARG {key} with a default")
                if key not in used:
                    used.append(key)
            elif base not in stages and base != "scratch":
                raise PinError(f"line {number + 1}: FROM {base} names its image directly; give it a build ARG")
    return [BaseImageArg(key, globals_[key][0], globals_[key][1]) for key in used]


# ---------------------------------------------------------------------------- the registry API


def _request(url: str, method: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, err.read()


def _token(challenge: str, repository: str) -> str:
    """An anonymous pull token for a `WWW-Authenticate: Bearer realm=...,service=...` challenge."""
    scheme, _, params = challenge.partition(" ")
    if scheme.lower() != "bearer":
        raise PinError(f"the registry asks for {scheme} authentication, which needs credentials")
    fields = dict(re.findall(r'(\w+)="([^"]*)"', params))
    if "realm" not in fields:
        raise PinError(f"no realm in the registry's challenge {challenge!r}")
    query = {"scope": fields.get("scope") or f"repository:{repository}:pull"}
    if "service" in fields:
        query["service"] = fields["service"]
    url = fields["realm"] + ("&" if "?" in fields["realm"] else "?") + urllib.parse.urlencode(query)
    status, _, body = _request(url, "GET", {"Accept": "application/json"})
    if status != 200:
        raise PinError(f"token request to {fields['realm']} answered {status}")
    payload = json.loads(body)
    token = payload.get("token") or payload.get("access_token")
    if not token:
        raise PinError(f"no token in the answer of {fields['realm']}")
    return str(token)


def resolve_digest(ref: Reference, endpoints: dict[str, str]) -> str:
    """The digest the registry serves for ref's tag now."""
    base = endpoints.get(ref.registry) or DEFAULT_ENDPOINTS.get(ref.registry) or f"https://{ref.registry}"
    url = f"{base.rstrip('/')}/v2/{ref.repository}/manifests/{urllib.parse.quote(ref.tag)}"
    headers = {"Accept": ACCEPT}
    status, answer, _ = _request(url, "HEAD", headers)
    if status == 401 and "www-authenticate" in answer:
        headers["Authorization"] = f"Bearer {_token(answer['www-authenticate'], ref.repository)}"
        status, answer, _ = _request(url, "HEAD", headers)
    if status == 404:
        raise PinError(f"{ref.name}:{ref.tag}: the registry has no such tag ({url})")
    if status != 200:
        raise PinError(f"{ref.name}:{ref.tag}: HEAD {url} answered {status}")
    digest = answer.get("docker-content-digest", "")
    if not digest:
        # A registry may leave the header out of HEAD answers: the digest is the hash of the manifest.
        status, answer, body = _request(url, "GET", headers)
        if status != 200:
            raise PinError(f"{ref.name}:{ref.tag}: GET {url} answered {status}")
        digest = answer.get("docker-content-digest") or "sha256:" + hashlib.sha256(body).hexdigest()
    if not DIGEST.match(digest):
        raise PinError(f"{ref.name}:{ref.tag}: the registry answered digest {digest!r}")
    return digest


# ---------------------------------------------------------------------------- rewriting


def rewrite(text: str, pins: dict[str, str]) -> str:
    """text with the defaults of the global ARGs in pins replaced (everything else kept byte for byte)."""
    lines = text.splitlines(keepends=True)
    for item in base_image_args(text):
        if item.arg not in pins:
            continue
        line = lines[item.line]
        pattern = re.compile(r"^(\s*ARG\s+" + re.escape(item.arg) + r"=)([\"']?)(\S+?)\2(\s*)$", re.IGNORECASE)
        match = pattern.match(line)
        if not match:
            raise PinError(f"line {item.line + 1}: cannot rewrite {line.strip()!r}")
        quote = match.group(2)
        lines[item.line] = f"{match.group(1)}{quote}{pins[item.arg]}{quote}{match.group(4)}"
    return "".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dockerfile", type=Path, default=Path("Dockerfile"))
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a pin is missing or stale")
    parser.add_argument(
        "--endpoint",
        action="append",
        default=[],
        metavar="REGISTRY=URL",
        help="send REGISTRY's API requests to URL (e.g. docker.io=https://mirror.example)",
    )
    opts = parser.parse_args(argv)
    endpoints: dict[str, str] = {}
    for item in opts.endpoint:
        registry, eq, url = item.partition("=")
        if not eq or not url.startswith(("http://", "https://")):
            parser.error(f"--endpoint {item!r}: expected REGISTRY=http(s)://HOST[:PORT]")
        endpoints[registry] = url
    try:
        text = opts.dockerfile.read_text()
        images = base_image_args(text)
        if not images:
            raise PinError(f"{opts.dockerfile}: no FROM uses a build ARG")
        pins: dict[str, str] = {}
        stale: list[str] = []
        for item in images:
            ref = parse_reference(item.value)
            try:
                digest = resolve_digest(ref, endpoints)
            except (OSError, ValueError) as err:  # unreachable registry, a token answer that is not JSON
                raise PinError(f"{ref.name}:{ref.tag} ({ref.registry}): {err}") from err
            pins[item.arg] = ref.pinned(digest)
            if ref.digest == digest:
                print(f"{item.arg}: {ref.name}:{ref.tag} is pinned to {digest}")
            else:
                stale.append(item.arg)
                was = f"was {ref.digest}" if ref.digest else "was not pinned"
                print(f"{item.arg}: {ref.name}:{ref.tag} -> {digest} ({was})")
    except (PinError, OSError, ValueError) as err:
        print(f"pin_images: {err}", file=sys.stderr)
        return 2
    if opts.check:
        if stale:
            print(f"stale or missing pins: {', '.join(stale)} (run `make pin-images`)", file=sys.stderr)
            return 1
        return 0
    new = rewrite(text, pins)
    if new != text:
        opts.dockerfile.write_text(new)
        print(f"rewrote {opts.dockerfile}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
