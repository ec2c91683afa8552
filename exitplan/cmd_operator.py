"""`exitplan operator`: run the operator (kopf) against the current kubeconfig;
`exitplan operator publish-profile FILE`: publish a measured profile as a ModelProfile resource;
`exitplan operator publish-bundle-info DIR`: publish a bundle's bundle.yaml and generation measurements
as a ConfigMap (a remote generation bundle's, for the operator to plan from)."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from exitplan.cli_common import fail

app = typer.Typer(
    help="Run the exitplan operator, or publish a profile to the cluster.",
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help, wrapped to the terminal (exitplan/cli.py)
)

HELP_ALLOW = (
    "Node directory under which spec.model.bundle may be a host path (repeatable; default: env "
    "EXITPLAN_ALLOWED_HOST_PATHS, comma-separated, else none: absolute bundle paths are refused)."
)
HELP_METRICS_PORT = "Port of the Prometheus /metrics endpoint (0: off)."
HELP_HEALTH = "Port of the liveness endpoint /healthz (0: off); it fails when the operator's event loop is stuck."
HELP_LISTEN = (
    "Address the /metrics and /healthz ports listen on: 127.0.0.1 (this machine only), or 0.0.0.0 in a pod "
    "(the chart sets it, for Prometheus and the kubelet's probe)."
)
HELP_ATTEMPTS = "Profiling Jobs per pool and spec generation before the service is left ProfilingFailed."
HELP_RETRY = "Backoff after the first failed profiling Job (doubled after each further failure)."
HELP_DRIFT_READS = (
    "Reads of each service's routers per spec.planner.periodSeconds, 1-12 (default 2; at most one per --tick): "
    "4 detect a length shift a quarter of a period sooner, at ~1.4x the operator's CPU per period."
)
HELP_NETPOL = (
    "Give each EarlyExitService its own NetworkPolicies (operator/network_policies.py); the chart turns it on "
    "with networkPolicy.perService, beside its namespace-wide DNS, metrics and bundle-store policies."
)


@app.callback(invoke_without_command=True)
def command(
    ctx: typer.Context,
    kubeconfig: Path = typer.Option(
        None, help="Kubeconfig to use (default: in-cluster, then $KUBECONFIG or ~/.kube/config)."
    ),
    namespace: list[str] = typer.Option([], "--namespace", "-n", help="Serve only these namespaces (default: all)."),
    peering: str = typer.Option(
        "", help="Leader election: the kopf peering name shared by the replicas (empty: standalone)."
    ),
    priority: int = typer.Option(
        0, help="Peering priority: the replica with the highest priority serves, others wait."
    ),
    metrics_port: int = typer.Option(
        9464, min=0, max=65535, envvar="EXITPLAN_OPERATOR_METRICS_PORT", help=HELP_METRICS_PORT
    ),
    health_port: int = typer.Option(8081, min=0, max=65535, envvar="EXITPLAN_OPERATOR_HEALTH_PORT", help=HELP_HEALTH),
    listen: str = typer.Option("127.0.0.1", envvar="EXITPLAN_OPERATOR_LISTEN", help=HELP_LISTEN),
    tick: float = typer.Option(5.0, min=0.1, help="Seconds between timer ticks (readiness; drift once per period)."),
    allow_host_path: list[str] = typer.Option([], help=HELP_ALLOW),
    profile_attempts: int = typer.Option(3, min=1, envvar="EXITPLAN_PROFILE_ATTEMPTS", help=HELP_ATTEMPTS),
    profile_retry_seconds: float = typer.Option(
        30.0, min=0.1, envvar="EXITPLAN_PROFILE_RETRY_SECONDS", help=HELP_RETRY
    ),
    network_policies: bool = typer.Option(
        False, "--network-policies/--no-network-policies", envvar="EXITPLAN_NETWORK_POLICIES", help=HELP_NETPOL
    ),
    drift_reads: int | None = typer.Option(None, min=1, max=12, envvar="EXITPLAN_DRIFT_READS", help=HELP_DRIFT_READS),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at debug level."),
) -> None:
    """Run the operator: reconcile EarlyExitServices, profile missing pools, re-plan on drift."""
    if ctx.invoked_subcommand is not None:
        return
    import asyncio
    import logging

    if kubeconfig is not None:
        if not kubeconfig.exists():
            fail(
                f"--kubeconfig {kubeconfig} does not exist; run `exitplan dev-cluster` or pass "
                "a kubeconfig that kubectl can use"
            )
        os.environ["KUBECONFIG"] = str(kubeconfig)
    os.environ["EXITPLAN_TICK_SECONDS"] = str(tick)
    _export_settings(allow_host_path, namespace, profile_attempts, profile_retry_seconds, drift_reads)
    os.environ["EXITPLAN_NETWORK_POLICIES"] = "true" if network_policies else "false"  # operator/guards.py
    import kopf

    import exitplan.operator.handlers  # noqa: F401  (registers the handlers)
    from exitplan.operator import http_ports
    from exitplan.operator.peering import ensure_peering

    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not verbose:
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    if peering:
        asyncio.run(ensure_peering(peering, os.environ.get("KUBECONFIG")))
    # /metrics and /healthz: served by the operator's startup handler, behind the data plane's guard
    os.environ.update(
        {http_ports.ENV_METRICS_PORT: str(metrics_port), http_ports.ENV_HEALTH_PORT: str(health_port)}
        | {http_ports.ENV_LISTEN: listen}
    )
    import uvloop

    # uvloop's event loop (libuv: polling and transports in C), as `kopf run` itself picks when uvloop is
    # installed (kopf/_kits/loops.py): on the standard loop, polling and socket writes were a quarter of the
    # operator's CPU in a drift period at 200 services (bench/operator_scale.py)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        logging.getLogger("exitplan.operator").info("event loop: %s", type(runner.get_loop()).__module__)
        kopf.run(
            loop=runner.get_loop(),
            clusterwide=not namespace,
            namespaces=list(namespace),
            standalone=not peering,
            peering_name=peering or None,
            priority=priority,
        )


def _export_settings(
    allow_host_path: list[str],
    namespace: list[str],
    attempts: int,
    retry_seconds: float,
    drift_reads: int | None = None,
) -> None:
    """The operator's guard-rail settings, in the env its handlers read at startup (operator/guards.py), and that
    this process is the operator's own: its heap is kept frozen (operator/heap.py)."""
    from exitplan.operator import guards, heap

    os.environ[heap.ENV_FREEZE] = "true"

    bad = [p for p in allow_host_path if not p.startswith("/")]
    if bad:
        fail(f"--allow-host-path takes absolute paths, got {bad}")
    if allow_host_path:
        os.environ[guards.ENV_ALLOWED] = ",".join(allow_host_path)
    os.environ[guards.ENV_NAMESPACES] = ",".join(namespace)  # pool capacity is accounted over these (empty: all)
    os.environ[guards.ENV_PROFILE_ATTEMPTS] = str(attempts)
    os.environ[guards.ENV_PROFILE_RETRY] = str(retry_seconds)
    if drift_reads is not None:
        os.environ[guards.ENV_DRIFT_READS] = str(drift_reads)


@app.command("publish-profile")
def publish_profile(
    file: Path = typer.Argument(
        ..., help="Profile YAML written by `exitplan profile` (a ModelProfile document or its spec)."
    ),
    namespace: str = typer.Option("default", help="Namespace of the ModelProfile."),
    name: str = typer.Option("", help="ModelProfile name (default: <model>-<pool>)."),
    model: str = typer.Option("", help="Model name to publish under (must match the file when the file names one)."),
    pool: str = typer.Option("", help="GPUPool name to publish under (must match the file when the file names one)."),
    kubeconfig: Path = typer.Option(None, help="Kubeconfig (default: in-cluster, then $KUBECONFIG)."),
) -> None:
    """Create or update a ModelProfile resource from a profile file (the profiling Job's last step)."""
    import asyncio

    import yaml
    from pydantic import ValidationError
    from rich.console import Console
    from rich.table import Table

    from exitplan.api.resources import API_VERSION, ModelProfileSpec
    from exitplan.operator import builders
    from exitplan.operator.apply import ApplyReport, apply_one
    from exitplan.operator.kube import ApiError, KubeClient

    try:
        doc = yaml.safe_load(file.read_text())
        raw = doc.get("spec", doc) if isinstance(doc, dict) else None
        if not isinstance(raw, dict):
            raise ValueError("expected a mapping (a ModelProfile document or its spec)")
        for key, value in (("model", model), ("pool", pool)):
            if value and raw.get(key) and raw[key] != value:
                raise ValueError(f"the file is for {key} {raw[key]!r}, not {value!r}")
            if value:
                raw[key] = value
        spec = ModelProfileSpec.model_validate(raw)
    except (OSError, ValueError, yaml.YAMLError, ValidationError) as err:
        fail(f"{file}: {err}")
    name = name or builders.profile_name(spec.model, spec.pool)
    body = {
        "apiVersion": API_VERSION,
        "kind": "ModelProfile",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec.dump(),
    }

    async def publish() -> ApplyReport:
        async with KubeClient.from_config(str(kubeconfig) if kubeconfig else None) as client:
            report = ApplyReport()
            await apply_one(client, body, report)
            return report

    try:
        report = asyncio.run(publish())
    except ApiError as err:
        fail(f"publishing ModelProfile {namespace}/{name} failed: {err}", 1)
    table = Table(title="ModelProfile published")
    for col in ("namespace", "name", "model", "pool", "blocks", "ramps", "result"):
        table.add_column(col)
    result = "created" if report.created else "updated" if report.patched else "unchanged"
    table.add_row(namespace, name, spec.model, spec.pool, str(len(spec.blocks)), str(len(spec.ramps)), result)
    Console().print(table)


@app.command("publish-bundle-info")
def publish_bundle_info(
    bundle: Path = typer.Argument(..., help="The bundle directory (fetched and verified by storage-init)."),
    namespace: str = typer.Option("default", help="Namespace of the ConfigMap."),
    name: str = typer.Option(..., help="ConfigMap name (the operator reads `<service>-bundle-info`)."),
    service: str = typer.Option("", help="The EarlyExitService it is read for (label exitplan.io/bundle-info-of)."),
    service_uid: str = typer.Option("", help="That service's uid: the ConfigMap's owner (deleted with it)."),
    source: str = typer.Option("", help="Annotation exitplan.io/bundle-source: which spec.model it was read from."),
    kubeconfig: Path = typer.Option(None, help="Kubeconfig (default: in-cluster, then $KUBECONFIG)."),
) -> None:
    """Publish a bundle's bundle.yaml and generation measurements (profiles/generation-<pool>.json) as a
    ConfigMap: the operator plans a generation service with a remote bundle from it (the last step of
    its bundle-info Job, operator/bundle_info.py)."""
    import asyncio

    from exitplan.api.bundle import BundleError
    from exitplan.operator import bundle_info
    from exitplan.operator.apply import ApplyReport
    from exitplan.operator.kube import ApiError, KubeClient

    try:
        texts = bundle_info.read_dir(bundle)
        body = bundle_info.configmap(texts, namespace, name, service, service_uid, source)
    except (OSError, ValueError, BundleError) as err:
        fail(f"{bundle}: {err}" if str(bundle) not in str(err) else err)

    size = sum(len(k.encode()) + len(v.encode()) for k, v in body["data"].items())
    files = ", ".join(sorted(body["data"]))

    async def publish() -> ApplyReport:
        async with KubeClient.from_config(str(kubeconfig) if kubeconfig else None) as client:
            return await bundle_info.publish(client, body)

    try:
        report = asyncio.run(publish())
    except ApiError as err:
        fail(f"publishing ConfigMap {namespace}/{name} failed: {err}", 1)
    result = "created" if report.created else "updated" if report.patched else "unchanged"
    typer.echo(f"ConfigMap {namespace}/{name} {result}: {files} ({size} bytes)")
