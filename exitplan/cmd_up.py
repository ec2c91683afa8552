"""`exitplan up SERVICE.yaml`: plan, then run the router and workers as local processes."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import typer

ROUTERS = typer.Option(
    1,
    min=1,
    max=16,
    help="Router processes; with more than one, a front on --port balances connections over the ready ones (as the router Service in a cluster).",
)

BUNDLE_CACHE = typer.Option(
    Path("artifacts/bundle-cache"),
    help="Where an s3:// or https:// spec.model.bundle is fetched and verified (kept for the next run).",
)
BUNDLE_ENV_FILE = typer.Option(
    None,
    dir_okay=False,
    help="KEY=VALUE lines over the environment for an s3:// bundle: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
    "AWS_ENDPOINT_URL, AWS_REGION, ... (the keys of the spec.model.bundleSecret Secret in a cluster).",
)


def command(
    service: Path = typer.Argument(
        ...,
        dir_okay=False,
        help="YAML with an EarlyExitService (and its GPUPools, optionally ModelProfiles).",
    ),
    resources: list[Path] = typer.Option(
        [], "--resources", "-f", help="More YAML files with GPUPools / ModelProfiles."
    ),
    plan: Path | None = typer.Option(None, help="Serve this plan file instead of planning."),
    trace: Path | None = typer.Option(
        None, help="Size the length buckets from this trace's input lengths (scaled: its p99 = the model's max length)."
    ),
    port: int = typer.Option(8080, help="Router port on localhost."),
    base_port: int = typer.Option(9100, help="First port for worker processes."),
    routers: int = ROUTERS,
    control_port: int = typer.Option(
        0, min=0, help="The router's control port on localhost (0: a free port); answers only this run's token."
    ),
    workdir: Path = typer.Option(Path("artifacts/up"), help="Where the plan file and process logs go."),
    threads: int = typer.Option(1, min=1, help="ONNX Runtime threads per worker process."),
    window_seconds: float = typer.Option(30.0, min=0.5, help="Router observation window."),
    autotune: bool = typer.Option(
        True, help="Re-tune exit thresholds continually from the router's shadow-sampled feedback."
    ),
    tune_seconds: float = typer.Option(
        2.0, min=0.5, help="Period of the threshold tuning loop (a shift is caught within a period or two of feedback)."
    ),
    bundle_cache: Path = BUNDLE_CACHE,
    bundle_env_file: Path | None = BUNDLE_ENV_FILE,
) -> None:
    """Plan the service, start its router and workers on this machine (the same commands pods run), serve until Ctrl-C."""
    from rich.console import Console

    from exitplan.localrun.deployment import LocalDeployment, StartError

    console = Console()
    setup, the_plan = _plan(service, resources, plan, trace, console, (bundle_cache, bundle_env_file), routers)
    deployment = LocalDeployment(
        setup.bundle,
        the_plan,
        setup.spec,
        workdir / setup.name,
        port=port,
        base_port=base_port,
        threads=threads,
        window_seconds=window_seconds,
        routers=routers,
        on_event=lambda message: console.print(f"[yellow]{message}[/yellow]"),
        control_port=control_port,
    )
    console.print(_plan_table(the_plan, setup.name))
    console.print(f"thresholds: {the_plan.thresholds}")
    with console.status("starting workers and router..."):
        try:
            deployment.start()
        except StartError as err:
            from exitplan.cli import fail

            fail(err, 1)
    verb = "generate" if setup.manifest.decoder is not None else "infer"
    console.print(
        f"[green]serving[/green] {the_plan.model} at {deployment.url}/v2/models/{the_plan.model}/{verb}  (logs: {deployment.workdir / 'logs'})"
    )
    console.print(
        f"control endpoints (/v1/thresholds, /v1/observations, ...) at {deployment.control_url}, "
        f"token in {deployment.token_path}"
    )
    console.print("Ctrl-C stops every process.")
    tuner = None
    if autotune and setup.manifest.decoder is None:  # generation: one threshold from the plan (POST /v1/thresholds)
        tuner = _start_tuner(setup, deployment, tune_seconds, console)
    try:
        _serve_until_stopped(deployment, console)
    finally:
        if tuner:
            tuner.stop()
        with console.status("stopping..."):
            deployment.stop()
        console.print("stopped.")


def _bundle_fetcher(service: Path, cache: Path, env_file: Path | None, console):
    """spec.model's bundle as a local directory: a path as it is; s3://, https:// fetched into `cache` and
    verified against its digests (exitplan.storage.cache); a failure is the service file's error, one line."""

    def fetch(model) -> Path:
        from exitplan.localrun.service_setup import ServiceFileError
        from exitplan.storage.cache import cached_bundle, read_env_file
        from exitplan.storage.errors import StorageError

        try:
            env = read_env_file(env_file) if env_file is not None else None
            return cached_bundle(
                model.bundle,
                cache,
                sha256=model.bundle_sha256,
                env=env,
                say=lambda line: console.print(line, markup=False, highlight=False),
            )
        except StorageError as err:
            raise ServiceFileError(f"{service}: spec.model.bundle: {err}") from err

    return fetch


def _plan(
    service: Path,
    resources: list[Path],
    plan: Path | None,
    trace: Path | None,
    console,
    bundle_from: tuple[Path, Path | None] = (BUNDLE_CACHE.default, None),
    routers: int = 1,
):
    """(the service setup, the plan to serve): `plan` if given, else planned here for `routers` router
    processes on this machine's cores; a user error exits 2. `bundle_from`: the cache a remote bundle is
    fetched into, the env file with its store's credentials."""
    from exitplan.api import SpecError
    from exitplan.api.bundle import BundleError
    from exitplan.api.plan import Plan
    from exitplan.localrun.service_setup import (
        ServiceFileError,
        ensure_profiles,
        load_setup,
        planned,
        trace_lengths,
        tuned_thresholds,
    )

    try:
        setup = load_setup(service, list(resources), _bundle_fetcher(service, *bundle_from, console))
        if plan is not None:
            return setup, Plan.from_file(plan)
        if setup.manifest.decoder is not None:  # a generative bundle: its own measurements and planner
            from exitplan.localrun.generation import plan_generation_service

            return setup, plan_generation_service(setup, console.print)
        ensure_profiles(setup, console.print)
        thresholds = tuned_thresholds(setup.bundle, setup.spec.accuracy.max_drop, setup.spec.workload.length_buckets)
        lengths = trace_lengths(trace, int(setup.manifest.max_length or 1))[0] if trace else None
        return setup, planned(setup, thresholds, lengths=lengths, routers=routers)
    except (SpecError, ServiceFileError, BundleError, ValueError) as err:
        from exitplan.cli import fail

        fail(err)


def _plan_table(plan, name: str):
    from exitplan.cli import table as make_table

    where = "; split 0 runs in the router(s)" if plan.colocate else ""
    table = make_table(
        "split", "blocks", "bucket", "pool", "replicas", "batch", title=f"plan {plan.content_hash()} for {name}{where}"
    )
    for cell in sorted(plan.cells, key=lambda c: (c.split, c.bucket)):
        sp = plan.splits[cell.split]
        table.add_row(
            str(cell.split),
            f"{sp.first_block}-{sp.last_block}",
            str(cell.bucket),
            cell.pool,
            str(cell.replicas),
            str(cell.batch_size),
        )
    return table


def _serve_until_stopped(deployment, console) -> None:
    """Until SIGTERM or Ctrl-C. A process of the deployment that exits is restarted meanwhile, after a
    back-off (localrun/supervisor.py); its exit and restart are printed (`deployment.on_event`)."""
    stop = {"now": False}

    def _stop(*_):
        stop["now"] = True

    # Both explicitly: a process started in the background by a non-interactive shell (`exitplan up &` in a
    # script, a CI job) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt for it.
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    while not stop["now"]:
        time.sleep(0.5)


def _start_tuner(setup, deployment, period_s: float, console):
    """The threshold tuning loop (exitplan.localrun.autotune.AutoTuner, the live settings, every
    `period_s` seconds) on the deployment's router (its control endpoints, with the run's token), started."""
    from dataclasses import replace

    from exitplan.localrun.autotune import AutoTuner
    from exitplan.planner.tuning.autotune import LIVE

    ramps = [r.name for r in setup.manifest.exit_ramps()]
    return AutoTuner(
        deployment.control_url,
        ramps,
        setup.spec.accuracy.max_drop,
        config=replace(LIVE, period_s=period_s),
        on_change=lambda d: console.print(f"thresholds re-tuned ({d.reason}): {d.thresholds}"),
        token=deployment.control_token,
    ).start()
