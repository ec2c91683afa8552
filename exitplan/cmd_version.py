"""`exitplan version`: the versions of exitplan and the runtimes it drives."""

from __future__ import annotations

import typer


def command() -> None:
    """Print exitplan's version and the versions of the runtimes it uses."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("exitplan", "onnxruntime-gpu", "onnxruntime", "kopf", "torch"):
        try:
            typer.echo(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            pass
