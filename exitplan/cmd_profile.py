"""`exitplan profile BUNDLE`: measure a bundle on this machine and write a ModelProfile (YAML)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from exitplan import cli_pods
from exitplan.cli_common import fail, positive_ints
from exitplan.cli_common import table as make_table
from exitplan.worker_image.device import DeviceUnavailable, providers_for, require

if TYPE_CHECKING:
    from rich.console import Console

    from exitplan.api.bundle import BundleManifest
    from exitplan.api.resources import ModelProfile, ModelProfileSpec, ServingCosts


def command(
    bundle: Path = typer.Argument(..., help="Bundle directory (holding bundle.yaml), e.g. artifacts/bundles/minilm."),
    pool: str = typer.Option(
        ..., "--pool", help="Name of the GPUPool this profile describes (the profile's spec.pool)."
    ),
    out: Path = typer.Option(..., "--out", help="Where to write the ModelProfile resource (YAML)."),
    batch_sizes: str = typer.Option(
        "1,2,4,8,16,32,64", "--batch-sizes", help="Comma-separated batch sizes to measure."
    ),
    seq_lens: str | None = typer.Option(
        None,
        "--seq-lens",
        help="Comma-separated sequence lengths (length buckets); default: 16,32,64,...,max_length. Ignored for fixed-size models.",
    ),
    repeats: int = typer.Option(
        5,
        "--repeats",
        help="Timed runs per cell (median taken) after one warm-up; batches over 1,024 tokens use half, over 4,096 use 2.",
    ),
    threads: int = typer.Option(1, "--threads", help="ONNX Runtime intra-op threads (use what the workers will use)."),
    thresholds: Path | None = typer.Option(
        None, "--thresholds", help="JSON {ramp: threshold} for the survival curve (default: 0.9 at every exit ramp)."
    ),
    providers: str = typer.Option(
        "auto",
        "--providers",
        help="Comma-separated ONNX Runtime execution providers in order of preference (e.g. CUDAExecutionProvider,CPUExecutionProvider); auto: what a worker picks, CUDA first where onnxruntime-gpu sees a GPU (a profiling Job on a GPU pool measures the GPU).",
    ),
    model_name: str | None = typer.Option(
        None,
        "--model-name",
        help="The profile's spec.model (default: the bundle's name); match the EarlyExitService's model.name.",
    ),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the profile document as JSON."),
    device: str = cli_pods.DEVICE,
    serving: bool = typer.Option(
        True,
        "--serving/--no-serving",
        help="Also measure the serving path's own CPU per request and per batch by running one router and one worker on this machine (a few seconds); the planner counts them.",
    ),
) -> None:
    """Measure per-block and per-ramp latency (batch x sequence length) with ONNX Runtime on this machine,
    activation and weight bytes, and the survival curve on the bundle's held-out window; write a ModelProfile."""
    from rich.console import Console

    from exitplan.prepare.profile import profile_document

    console = Console()
    providers = _on_device(device, providers)
    sizes = positive_ints(batch_sizes, "--batch-sizes") or []
    lengths = positive_ints(seq_lens, "--seq-lens")
    manifest, profile, elapsed = _measure(
        console,
        bundle,
        pool=pool,
        sizes=sizes,
        lengths=lengths,
        repeats=repeats,
        threads=threads,
        thresholds=thresholds,
        model_name=model_name,
        providers=providers,
    )
    try:
        require(device, [("the profiled sessions", profile.spec.providers)])
    except DeviceUnavailable as err:
        cli_pods.device_refused(err)
    if serving:
        on_cpu = _providers(providers) == ("CPUExecutionProvider",)
        profile.spec.serving = _serving_costs(console, bundle, profile.spec, threads, compute_scale=on_cpu)
    _write(profile_document(profile), out, json_path)
    _print_table(console, profile.spec, manifest)
    console.print(f"profile written to {out} in {elapsed:.1f} s ({profile.spec.measured_on})")


def _measure(
    console: Console,
    bundle: Path,
    *,
    pool: str,
    sizes: list[int],
    lengths: list[int] | None,
    repeats: int,
    threads: int,
    thresholds: Path | None,
    model_name: str | None,
    providers: str,
) -> tuple[BundleManifest, ModelProfile, float]:
    """(manifest, profile, seconds taken): profile the bundle with a progress bar, or exit 2 on its error."""
    import time

    from rich.progress import Progress

    from exitplan.api.bundle import BundleError, read_manifest
    from exitplan.prepare.profile import ProfileError, ProfileOptions, profile_bundle, read_thresholds

    try:
        manifest = read_manifest(bundle)
        options = ProfileOptions(
            pool=pool,
            batch_sizes=sizes,
            seq_lens=lengths if manifest.seq_axis is not None else None,
            repeats=repeats,
            threads=threads,
            thresholds=read_thresholds(thresholds) if thresholds else None,
            model_name=model_name,
            providers=_providers(providers),
        )
        n_lengths = len(lengths) if lengths and manifest.seq_axis is not None else None
        started = time.perf_counter()
        with Progress(console=console, transient=True) as bar:
            total = (n_lengths or _default_lengths(manifest)) * len(set(sizes))
            task = bar.add_task("profiling", total=total)
            profile = profile_bundle(
                bundle, options, lambda n, what: bar.update(task, advance=n, description=f"profiling {what}")
            )
        elapsed = time.perf_counter() - started
    except (BundleError, ProfileError) as err:
        fail(err)
    return manifest, profile, elapsed


def _serving_costs(
    console: Console, bundle: Path, spec: ModelProfileSpec, threads: int, *, compute_scale: bool = True
) -> ServingCosts:
    """The serving path's costs (localrun/serving_costs.py), or exit 2 with the reason; with `compute_scale`
    (a CPU pool's profile) also the workers' real compute over the tables (an accelerator's tables are its
    own fixed-shape runs: the planner never scales them)."""
    from exitplan.localrun.serving_costs import ServingCostError, measure_serving_costs
    from exitplan.prepare.compute_scale import compute_scale as measure_scale

    with console.status("measuring the serving path (one router and one worker, then a router running the model)"):
        try:
            costs = measure_serving_costs(bundle.resolve(), spec, threads=threads)
        except ServingCostError as err:
            fail(f"{err} (or pass --no-serving to skip this measurement)")
    if compute_scale:
        with console.status("timing the model as a CPU worker runs it (serving.computeScale)"):
            costs.compute_scale = measure_scale(bundle.resolve(), spec, threads)
    console.print(
        f"serving path: router {costs.router_ms:.2f} ms CPU per request, worker {costs.hop_ms:.2f} ms per batch "
        f"beyond the model; a router running the model {costs.colocated_ms:.2f} ms per request beyond it "
        f"({costs.requests} requests, {costs.cores} core(s)); the workers' compute "
        + ("/".join(f"{x:.2f}" for x in costs.compute_scale) or "1")
        + "x the tables (serving.computeScale, per length)"
    )
    return costs


def _on_device(device: str, providers: str) -> str:
    """--providers as --device allows them (gpu: exit 3 with the reason where the GPU cannot run)."""
    try:
        return ",".join(providers_for(device, providers)) if device != "auto" else providers
    except DeviceUnavailable as err:
        cli_pods.device_refused(err)
    except ValueError as err:
        fail(err)


def _providers(text: str) -> tuple[str, ...]:
    """The providers to measure with: `auto` as a worker chooses them (bundle_runtime.choose_providers)."""
    if text.strip() == "auto":
        from exitplan.worker_image.bundle_runtime import choose_providers

        return choose_providers("auto")
    return tuple(p.strip() for p in text.split(",") if p.strip())


def _write(document: dict[str, Any], out: Path, json_path: Path | None) -> None:
    """The ModelProfile document as YAML at `out` (and as JSON at `json_path` when given)."""
    import yaml

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(document, sort_keys=False))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(document, indent=2))


def _print_table(console: Console, spec: ModelProfileSpec, manifest: BundleManifest) -> None:
    """Latency per block and ramp (first / last batch size) per sequence length, with each ramp's survival."""

    first, last = spec.batch_sizes[0], spec.batch_sizes[-1]
    lengths = [f"seq {n}" if manifest.seq_axis is not None else "fixed size" for n in spec.seq_lens]
    table = make_table(
        "block / ramp",
        "survival",
        *lengths,
        title=f"{spec.model} on pool {spec.pool}: latency ms at batch {first} / {last}",
    )
    for block in spec.blocks:
        table.add_row(block.name, "", *[f"{row[0]:.2f}/{row[-1]:.1f}" for row in block.latency_ms])
    for ramp, survival in zip(spec.ramps, spec.survival):
        table.add_row(ramp.name, f"{survival:.2f}", *[f"{row[0]:.2f}/{row[-1]:.2f}" for row in ramp.latency_ms])
    console.print(table)


def _default_lengths(manifest: BundleManifest) -> int:
    from exitplan.worker_image.bundle_runtime import default_buckets

    if manifest.seq_axis is None or manifest.max_length is None:  # the manifest requires max_length with seq_axis
        return 1
    return len(default_buckets(manifest.max_length))
