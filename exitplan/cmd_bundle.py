"""`exitplan storage-init URI DEST`: fetch and verify a bundle (the pods' storage-init container);
`exitplan bundle push BUNDLE URI`: upload one; `exitplan bundle digest BUNDLE`: record its digests."""

from __future__ import annotations

import os
from pathlib import Path

import typer

app = typer.Typer(
    help="Move bundles: push one to S3 or into a tarball to host, record the digests of an older one.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

TERMINATION_LOG = "/dev/termination-log"
HELP_URI = (
    "Where the bundle is: s3://BUCKET/PREFIX (or .../KEY.tar.gz), https://HOST/PATH.tar.gz, http:// (see "
    "--allow-http), a path or file:// URI; pvc:// and oci:// with --verify-only. S3 endpoint and credentials "
    "come from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (AWS_SESSION_TOKEN, AWS_REGION, "
    "AWS_CA_BUNDLE)."
)


def _termination_log(path: Path | None) -> Path | None:
    """Where a failure's one-line reason goes: --termination-log, else the kubelet's file when there is one."""
    if path is not None:
        return path
    default = Path(TERMINATION_LOG)
    return default if default.exists() and os.access(default, os.W_OK) else None


def storage_init(
    uri: str = typer.Argument(..., help=HELP_URI),
    dest: Path = typer.Argument(..., help="Directory to fill (new, empty, or filled by storage-init before)."),
    sha256: str | None = typer.Option(
        None, "--sha256", help="sha256 of a tarball (required for http(s)://): spec.model.bundleSha256."
    ),
    allow_http: bool = typer.Option(
        False, "--allow-http", help="Allow plain http:// to another machine (localhost is always allowed)."
    ),
    verify_only: bool = typer.Option(
        False, "--verify-only", help="Fetch nothing: verify the bundle already at DEST (pvc://, oci://)."
    ),
    max_bytes: int | None = typer.Option(
        None,
        "--max-bytes",
        min=1,
        help="Most bytes the bundle may unpack to (default: env EXITPLAN_BUNDLE_MAX_BYTES, else 20 GiB).",
    ),
    max_files: int | None = typer.Option(
        None,
        "--max-files",
        min=1,
        help="Most members a tarball may hold (default: env EXITPLAN_BUNDLE_MAX_FILES, else 10000).",
    ),
    max_ratio: float | None = typer.Option(
        None,
        "--max-ratio",
        min=1.0,
        help="Most decompressed bytes per compressed byte (default: env EXITPLAN_BUNDLE_MAX_RATIO, else 100).",
    ),
    termination_log: Path | None = typer.Option(
        None,
        "--termination-log",
        help=f"File that receives a failure's one-line reason (default: {TERMINATION_LOG} when writable).",
    ),
) -> None:
    """Fetch a bundle into DEST and verify every file against the sha256 digests in its bundle.yaml.

    Exit 0 when the bundle is there and verified (or has no digests: "unverified"); exit 1 with a
    one-line reason (stderr and the termination log) when the source cannot be reached, a digest does
    not match (the file is named), a tarball holds a member outside DEST or passes a limit (its size,
    members or compression ratio: the limit and the bytes read before refusing are named).
    """
    import dataclasses

    from exitplan.storage.errors import StorageError
    from exitplan.storage.initializer import storage_init as run
    from exitplan.storage.limits import ArchiveLimits

    try:
        env = ArchiveLimits.from_env()
        limits = dataclasses.replace(
            env,
            max_bytes=max_bytes or env.max_bytes,
            max_files=max_files or env.max_files,
            max_ratio=max_ratio or env.max_ratio,
        )
        run(uri, dest, sha256=sha256, allow_http=allow_http, verify_only=verify_only, say=typer.echo, limits=limits)
    except StorageError as err:
        log = _termination_log(termination_log)
        if log is not None:
            log.write_text(str(err)[:4000])
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None


@app.command("push")
def push(
    bundle: Path = typer.Argument(..., help="Bundle directory (holding bundle.yaml with digests)."),
    uri: str = typer.Argument(
        ...,
        help="s3://BUCKET/PREFIX (or s3://BUCKET/KEY.tar.gz), a FILE.tar.gz, or a directory (where "
        "NAME.tar.gz and NAME.tar.gz.sha256 are written, to serve over https).",
    ),
) -> None:
    """Upload a bundle: verified against its digests first, then to S3 or into a tarball. Prints the
    spec.model fields that name it."""
    from exitplan.storage.errors import StorageError
    from exitplan.storage.push import push as run

    try:
        pushed = run(bundle, uri)
    except StorageError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"pushed {pushed.files} files to {pushed.uri}")
    if pushed.uri.startswith("s3://"):
        typer.echo(f"spec.model.bundle: {pushed.uri}  (spec.model.bundleSecret: the Secret with the store's keys)")
    if pushed.sha256:
        typer.echo(f"spec.model.bundleSha256: {pushed.sha256}")
    typer.echo(
        f"spec.model.bundleSize: {pushed.size}  (bytes it unpacks to: sizes the pods' volume and storage-init's limit)"
    )


@app.command("digest")
def digest(bundle: Path = typer.Argument(..., help="Bundle directory (holding bundle.yaml).")) -> None:
    """Record the sha256 of every file of a bundle in its bundle.yaml (`exitplan prepare` does it for
    the bundles it builds; this is for bundles prepared before, or changed by hand)."""
    from exitplan.api.bundle import BundleError, record_digests

    try:
        manifest = record_digests(bundle)
    except BundleError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{bundle}: recorded the sha256 of {len(manifest.digests)} files in bundle.yaml")
