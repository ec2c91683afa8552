"""`exitplan up SERVICE.yaml`: plan, then run the router and workers as local processes."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from exitplan.cli_common import fail
from exitplan.cli_common import table as make_table

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from exitplan.api.plan import Plan
    from exitplan.api.resources import GPUPoolSpec, ModelRef
    from exitplan.localrun.autotune import AutoTuner
    from exitplan.localrun.deployment import LocalDeployment
    from exitplan.localrun.service_setup import BundleFetcher, ServiceSetup

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


HELP_CONTROL_PORT = (
    "The router's control port on localhost (0: a free port; with --routers N the next routers take the ports "
    "after it); answers only this run's token."
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
    control_port: int = typer.Option(0, min=0, help=HELP_CONTROL_PORT),
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
        pools=setup.pools,
    )
    console.print(_plan_table(the_plan, setup.name))
    console.print(f"thresholds: {the_plan.thresholds}")
    with console.status("starting workers and router..."):
        try:
            deployment.start()
        except StartError as err:
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
    tuner = _start_tuner(setup, deployment, tune_seconds, console) if autotune else None
    try:
        _serve_until_stopped(deployment, console)
    finally:
        if tuner:
            tuner.stop()
        with console.status("stopping..."):
            deployment.stop()
        console.print("stopped.")


def _check_gpu_pools(service: Path, pools: dict[str, GPUPoolSpec], used: list[str]) -> None:
    """The processes of a pool that asks for accelerators run with `--device gpu`: where this machine cannot
    run the CUDA provider, say so once, naming the pool, before anything is profiled or started."""
    from exitplan.worker_image.device import gpu_problem

    wanting = sorted({p for p in used if p in pools and pools[p].gpu_resource})
    cause = gpu_problem() if wanting else None
    if cause is not None:
        name = wanting[0]
        fail(
            f"{service}: pool {name!r} asks for {pools[name].gpu_resource} (its workers refuse to run on the CPU in "
            f"its stead) but this machine cannot run the CUDA provider: {cause}. For a pool of this machine's CPU "
            f'cores write gpuResource: "" in its GPUPool'
        )


def _bundle_fetcher(service: Path, cache: Path, env_file: Path | None, console: Console) -> BundleFetcher:
    """spec.model's bundle as a local directory: a path as it is; s3://, https:// fetched into `cache` and
    verified against its digests (exitplan.storage.cache); a failure is the service file's error, one line."""

    def fetch(model: ModelRef) -> Path:
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
    console: Console,
    bundle_from: tuple[Path, Path | None] = (BUNDLE_CACHE.default, None),
    routers: int = 1,
) -> tuple[ServiceSetup, Plan]:
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
        _check_gpu_pools(service, setup.pools, [p.name for p in setup.spec.pools])
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
        fail(err)


def _plan_table(plan: Plan, name: str) -> Table:

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


def _serve_until_stopped(deployment: LocalDeployment, console: Console) -> None:
    """Until SIGTERM or Ctrl-C. A process of the deployment that exits is restarted meanwhile, after a
    back-off (localrun/supervisor.py); its exit and restart are printed (`deployment.on_event`)."""
    stop = {"now": False}

    def _stop(*_: object) -> None:
        stop["now"] = True

    # Both explicitly: a process started in the background by a non-interactive shell (`exitplan up &` in a
    # script, a CI job) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt for it.
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    while not stop["now"]:
        time.sleep(0.5)


def _start_tuner(
    setup: ServiceSetup, deployment: LocalDeployment, period_s: float, console: Console
) -> AutoTuner | None:
    """The threshold tuning loop (exitplan.localrun.autotune.AutoTuner, the live settings, every
    `period_s` seconds) on the deployment's routers (their control endpoints, with the run's token), started;
    None for a generation bundle (one threshold from the plan, POST /v1/thresholds) and for a bundle with
    no exit ramp (the plain model: nothing to tune, said once)."""
    from dataclasses import replace

    from exitplan.localrun.autotune import AutoTuner
    from exitplan.planner.tuning.autotune import LIVE, Decision

    ramps = [r.name for r in setup.manifest.exit_ramps()]
    if setup.manifest.decoder is not None:
        return None
    if not ramps:
        console.print(
            f"bundle {setup.manifest.name!r} has no exit ramp: the plain model is served (no exits, no tuning)"
        )
        return None
    tuner = AutoTuner(
        [f"http://127.0.0.1:{p}" for p in deployment.control_ports] or deployment.control_url,
        ramps,
        setup.spec.accuracy.max_drop,
        config=replace(LIVE, period_s=period_s),
        token=deployment.control_token,
    )

    def changed(d: Decision) -> None:
        """Said, and written into plan.json with its version: a router that restarts starts from it."""
        console.print(f"thresholds re-tuned ({d.reason}), version {tuner.version}: {d.thresholds}")
        if d.thresholds is not None:
            update = {"thresholds": dict(d.thresholds), "thresholds_version": tuner.version}
            deployment.write_plan(deployment.plan.model_copy(update=update))

    tuner.on_change = changed
    return tuner.start()
