"""`exitplan prepare`'s engine: build a bundle once, verify it through ONNX Runtime, reuse it after.

A finished bundle holds `.complete.json` with a hash of the build options and the model it holds; a
rerun with the same options reuses it, `force=True` rebuilds, and another model's bundle is never
replaced without `force`. The build happens in a sibling temporary directory that
replaces the target only when complete, under a file lock, so concurrent builders (parallel test
sessions) never see half a bundle.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from exitplan.api.bundle import record_digests

FORMAT_VERSION = 2
"""Bump when the bundle layout or training changes, so old bundles are rebuilt."""
MARKER = ".complete.json"
REPORT = "data/report.json"
MODELS = ("minilm", "digits-cnn")
DEFAULTS = {
    "minilm": {"train_size": 8000, "heldout_size": 2000},
    "digits-cnn": {"train_size": 1437, "heldout_size": 360},
}


class PrepareError(RuntimeError):
    """A bundle that cannot be built with the options given; the message says what to change."""


@dataclass(frozen=True)
class BuildOptions:
    model: str = "minilm"
    train_size: int | None = None
    """Training inputs (None: the model's default)."""
    heldout_size: int | None = None
    seed: int = 0
    max_length: int = 128
    """Longest token sequence (MiniLM only)."""

    def resolved(self) -> BuildOptions:
        if self.model not in MODELS:
            raise PrepareError(f"unknown model {self.model!r}; choose one of {', '.join(MODELS)}")
        defaults = DEFAULTS[self.model]
        train = self.train_size if self.train_size is not None else defaults["train_size"]
        heldout = self.heldout_size if self.heldout_size is not None else defaults["heldout_size"]
        if train < 10 or heldout < 10:
            raise PrepareError(f"train size ({train}) and held-out size ({heldout}) must each be at least 10")
        if self.model == "minilm" and not 8 <= self.max_length <= 512:
            raise PrepareError(f"max length {self.max_length} must be within 8..512 (the model's position embeddings)")
        return BuildOptions(self.model, train, heldout, self.seed, self.max_length)

    def digest(self) -> str:
        payload = json.dumps({"format": FORMAT_VERSION, **asdict(self.resolved())}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass
class BuildResult:
    path: Path
    reused: bool
    report: dict[str, Any]


Bar = Callable[[int, str], Any]


def tqdm_bar(enabled: bool = True) -> Bar:
    from tqdm.auto import tqdm

    return lambda total, desc: tqdm(total=total, desc=desc, disable=not enabled, leave=False)


def is_complete(directory: Path, options: Any) -> bool:
    """True when `directory` holds a finished build of options with the same `digest()`."""
    marker = Path(directory) / MARKER
    try:
        return bool(json.loads(marker.read_text()).get("options_hash") == options.digest())
    except (OSError, ValueError):
        return False


def held_model(directory: Path) -> str | None:
    """The model a finished bundle at `directory` was built from, as its marker records it (None: no
    bundle, or one built before markers named the model)."""
    try:
        found = json.loads((Path(directory) / MARKER).read_text()).get("model")
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else None


def read_report(directory: Path) -> dict[str, Any]:
    report: dict[str, Any] = json.loads((Path(directory) / REPORT).read_text())
    return report


@contextmanager
def _locked(target: Path) -> Iterator[None]:
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{target.name}.lock"
    with lock_path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def auto_threads() -> int:
    """PyTorch threads for training: every core on an idle machine, one when others keep it busy.

    Oversubscribed cores slow small PyTorch ops several-fold (measured 3-6x on a shared 2-core box).
    """
    cores = os.cpu_count() or 1
    busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return cores if busy < 0.5 * cores else 1


def build_once(
    out: Path, options: Any, build: Callable[[Path], dict[str, Any]], *, force: bool = False, threads: int | None = None
) -> tuple[Path, bool, dict[str, Any]]:
    """Build a bundle at `out` once per set of options: (path, reused, report).

    Under a file lock (parallel test sessions share one build): reuse a finished build with the same
    `options.digest()`, else run `build(work_dir)` in a sibling directory with PyTorch limited to
    `threads` (None: `auto_threads()`), write the report and the completion marker, and swap it in.
    """
    out = Path(out)
    with _locked(out):
        if not force and is_complete(out, options):
            return out, True, read_report(out)
        if out.exists() and not (out / MARKER).exists() and any(out.iterdir()) and not (out / "bundle.yaml").exists():
            raise PrepareError(f"{out} exists and is not a bundle; choose another --out or remove it")
        held = held_model(out)
        identity = options.identity() if hasattr(options, "identity") else None
        if not force and held is not None and identity is not None and held != identity:
            raise PrepareError(
                f"{out} holds the bundle of another model, {held}, not {identity}; pass --force to replace it, "
                "or choose another --out"
            )
        work = out.parent / f".{out.name}.building"
        shutil.rmtree(work, ignore_errors=True)
        (work / "data").mkdir(parents=True)
        import torch

        previous, chosen = torch.get_num_threads(), threads or auto_threads()
        torch.set_num_threads(chosen)
        try:
            report = build(work)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        finally:
            torch.set_num_threads(previous)
        report["torch_threads"] = chosen
        (work / REPORT).write_text(json.dumps(report, indent=2))
        marker = {"options_hash": options.digest(), "options": asdict(options)}
        if hasattr(options, "identity"):
            marker["model"] = options.identity()
        (work / MARKER).write_text(json.dumps(marker, indent=2))
        record_digests(work)  # last: the sha256 of every file, in bundle.yaml (exitplan storage-init checks them)
        if out.exists():
            shutil.rmtree(out)
        work.rename(out)
    return out, False, report
