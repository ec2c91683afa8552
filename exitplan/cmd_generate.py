"""`exitplan prepare-decoder`, `exitplan generate` and `exitplan generate-server`: early-exit generation (EE-LLM)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from exitplan.cli_common import fail

if TYPE_CHECKING:
    from exitplan.worker_image.generate.decoder import RecomputeEngine
    from exitplan.worker_image.generate.local_pipeline import PipelineEngine
    from exitplan.worker_image.generate.remote_pipeline import RemotePipelineEngine

DEFAULT_BUNDLE = Path("artifacts") / "bundles" / "tweet-decoder"


def _engine(
    bundle: Path, mode: str, splits: int, max_pending: int, threads: int, stage_urls: list[str] | None = None
) -> RecomputeEngine | PipelineEngine | RemotePipelineEngine:
    from exitplan.worker_image.generate.decoder import DecoderModel, GenerationError, RecomputeEngine
    from exitplan.worker_image.generate.local_pipeline import PipelineEngine

    if stage_urls:
        from exitplan.worker_image.generate.remote_pipeline import RemotePipelineEngine

        return RemotePipelineEngine(bundle, stage_urls)
    if mode == "recompute":
        return RecomputeEngine(DecoderModel(bundle, threads=threads), max_pending=max_pending)
    if mode == "pipeline":
        return PipelineEngine(bundle, splits=splits, threads=threads)
    raise GenerationError(f"unknown mode {mode!r}; choose recompute or pipeline")


def prepare_command(
    out: Path = typer.Option(DEFAULT_BUNDLE, "--out", help="Bundle directory."),
    layers: int = typer.Option(
        4, "--layers", help="Decoder layers (one block each; an exit head after every block but the last)."
    ),
    hidden: int = typer.Option(128, "--hidden", help="Hidden size."),
    heads: int = typer.Option(4, "--heads", help="Attention heads."),
    context: int = typer.Option(128, "--context", help="Most positions (prompt + generated) a sequence holds."),
    steps: int = typer.Option(1500, "--steps", help="Training steps."),
    batch: int = typer.Option(16, "--batch", help="Tweets per training step."),
    seed: int = typer.Option(0, "--seed", help="Seed of the split and the training."),
    force: bool = typer.Option(
        False, "--force", help="Rebuild even if a finished bundle with the same options exists."
    ),
    threads: int | None = typer.Option(
        None, "--threads", min=1, help="PyTorch threads (default: every core when idle, 1 when busy)."
    ),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the build report as JSON."),
) -> None:
    """Train a byte-level early-exit decoder on the tweets (EE-LLM: weighted sum of every exit's LM loss) and export
    it per layer with an explicit KV cache (past_key/past_value in, present_key/present_value out) to a bundle."""
    from rich.console import Console
    from rich.table import Table

    from exitplan.api.bundle import BundleError
    from exitplan.prepare.datasets import DatasetError
    from exitplan.prepare.decoder import DecoderBuildError, DecoderOptions, build_decoder_bundle

    console = Console()
    options = DecoderOptions(
        layers=layers, hidden=hidden, heads=heads, context=context, steps=steps, batch=batch, seed=seed
    )
    try:
        result = build_decoder_bundle(options, out, force=force, threads=threads)
    except (DecoderBuildError, DatasetError, BundleError) as err:
        fail(err)
    report = result.report
    state = "reused (same options; --force rebuilds)" if result.reused else f"built in {report['total_seconds']:.0f} s"
    console.print(f"bundle [bold]{result.path}[/bold]: {state}")
    table = Table(title="training loss per head (last 10 % of steps)")
    table.add_column("head")
    table.add_column("loss weight", justify="right")
    table.add_column("train loss (nats/byte)", justify="right")
    for i, (weight, loss) in enumerate(zip(report["loss_weights"], report["final_train_loss_per_head"])):
        table.add_row("head" if i == len(report["loss_weights"]) - 1 else f"exit{i}", f"{weight:.3f}", f"{loss:.3f}")
    console.print(table)
    console.print(f"ONNX vs PyTorch max |logit diff|: {report['onnx_vs_torch_max_abs_diff']:.2e}")
    if json_path is not None:
        json_path.write_text(json.dumps({"path": str(result.path), "reused": result.reused, **report}, indent=2))


def command(
    prompt: str = typer.Argument(..., help="The prompt."),
    bundle: Path = typer.Option(
        DEFAULT_BUNDLE, "--bundle", help="Generative bundle directory (exitplan prepare-decoder)."
    ),
    max_tokens: int = typer.Option(48, "--max-tokens", help="Tokens to generate at most."),
    threshold: float = typer.Option(0.8, "--threshold", help="Exit confidence threshold in 0..1 (1 never exits)."),
    mode: str = typer.Option(
        "recompute", "--mode", help="recompute (KV recomputation, one worker) or pipeline (split stages)."
    ),
    splits: int = typer.Option(2, "--splits", help="Pipeline stages (pipeline mode)."),
    max_pending: int = typer.Option(
        8, "--max-pending", help="KV recomputation: force a full pass when this many positions lack entries."
    ),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the tokens and their exits as JSON."),
) -> None:
    """Generate from a prompt with early exits, and show which head chose each token."""
    from rich.console import Console
    from rich.table import Table

    from exitplan.api.bundle import BundleError
    from exitplan.worker_image.generate.decoder import GenerationError

    console = Console()
    try:
        engine = _engine(bundle, mode, splits, max_pending, 1)
        events = list(engine.generate(prompt, max_tokens, threshold))
    except (GenerationError, BundleError) as err:
        fail(err)
    finally:
        if "engine" in locals() and hasattr(engine, "close"):
            engine.close()
    console.print(f"[bold]{prompt}[/bold]{''.join(e.text for e in events)}")
    table = Table(title=f"{len(events)} tokens, mode {mode}, threshold {threshold}")
    table.add_column("head")
    table.add_column("tokens", justify="right")
    table.add_column("mean ms/token", justify="right")
    for head in dict.fromkeys(e.exit for e in events):
        chosen = [e for e in events if e.exit == head]
        table.add_row(head, str(len(chosen)), f"{1000 * sum(e.seconds for e in chosen) / len(chosen):.2f}")
    console.print(table)
    if json_path is not None:
        from dataclasses import asdict

        json_path.write_text(json.dumps([asdict(e) for e in events], indent=2))


def server_command(
    bundle: Path = typer.Option(
        DEFAULT_BUNDLE, "--bundle", help="Generative bundle directory (exitplan prepare-decoder)."
    ),
    port: int = typer.Option(8080, "--port", help="Port to listen on."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind."),
    model_name: str | None = typer.Option(
        None, "--model-name", help="Name served at /v2/models/{name} (default: the bundle's name)."
    ),
    threshold: float = typer.Option(
        1.0, "--threshold", help="The service's exit threshold (requests may send their own)."
    ),
    mode: str = typer.Option(
        "recompute", "--mode", help="recompute (KV recomputation) or pipeline (split stages in-process)."
    ),
    splits: int = typer.Option(2, "--splits", help="Pipeline stages (pipeline mode)."),
    max_pending: int = typer.Option(8, "--max-pending", help="KV recomputation bound before a forced full pass."),
    threads: int = typer.Option(1, "--threads", min=1, help="ONNX Runtime threads per session."),
    stage_urls: list[str] = typer.Option(
        [],
        "--stage-url",
        help="Pipeline across stage servers (exitplan generate-stage), first stage first; overrides --mode.",
    ),
) -> None:
    """Serve early-exit generation: POST /v2/models/{name}/generate and /generate_stream (server-sent events),
    GET /metrics, /v2/health/ready."""
    from rich.console import Console

    from exitplan.api.bundle import BundleError
    from exitplan.worker_image.generate.decoder import GenerationError
    from exitplan.worker_image.generate.routes import generation_app
    from exitplan.worker_image.serve import serve

    console = Console()
    if not 0.0 <= threshold <= 1.0:
        fail(f"--threshold must be in 0..1, got {threshold}")
    try:
        engine = _engine(bundle, mode, splits, max_pending, threads, stage_urls)
    except (GenerationError, BundleError) as err:
        fail(err)
    name = model_name or engine.model.manifest.name
    app = generation_app(engine, name, threshold=threshold)
    console.print(f"serving {name!r} ({engine.mode}) on http://{host}:{port}/v2/models/{name}/generate")
    serve(app, host, port)  # behind the same guard as every exitplan server (worker_image/server_guard.py)


def stage_command(
    bundle: Path = typer.Option(DEFAULT_BUNDLE, "--bundle", help="Generative bundle directory."),
    first: int = typer.Option(..., "--first", help="First block this stage runs."),
    last: int = typer.Option(..., "--last", help="Last block this stage runs."),
    port: int = typer.Option(8090, "--port", help="Port to listen on (EXITPLAN_PORT overrides)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind."),
    next_url: str | None = typer.Option(
        None, "--next", help="The next stage: a URL or host:port (a headless Service); none for the last stage."
    ),
    mode: str = typer.Option(
        "pipeline",
        "--mode",
        help="pipeline (a split of the pipeline-based mode) or recompute (KV recomputation: the stage holds every block).",
    ),
    max_pending: int = typer.Option(
        8, "--max-pending", min=1, help="recompute: force a full pass when this many positions lack entries."
    ),
    threads: int = typer.Option(1, "--threads", min=1, help="ONNX Runtime threads per session."),
) -> None:
    """Serve one stage of early-exit generation: blocks FIRST..LAST with their heads and KV cache, in the
    pipeline-based mode, or the whole model with KV recomputation (--mode recompute); a coordinator
    (the router of a generation service, or generate-server --stage-url ...) sends tokens to the first stage."""
    from rich.console import Console

    from exitplan.api.bundle import BundleError
    from exitplan.worker_image.generate.decoder import DecoderModel, GenerationError
    from exitplan.worker_image.generate.remote_pipeline import RecomputeStageServer, StageServer
    from exitplan.worker_image.serve import port_from_env, serve

    console = Console()
    port = port_from_env(port)
    try:
        model = DecoderModel(bundle, first_block=first, last_block=last, threads=threads)
        server: RecomputeStageServer | StageServer
        if mode == "recompute":
            if next_url is not None:
                raise GenerationError("a recompute stage runs every block: give no --next")
            server = RecomputeStageServer(model, max_pending=max_pending)
        elif mode == "pipeline":
            server = StageServer(model, next_url)
        else:
            raise GenerationError(f"--mode must be pipeline or recompute, got {mode!r}")
    except (BundleError, GenerationError) as err:
        fail(err)
    if mode == "pipeline" and (next_url is None) != (last == model.n_blocks - 1):
        fail(f"only the stage ending at block {model.n_blocks - 1} has no --next; this one runs {first}..{last}")
    console.print(
        f"stage blocks {first}..{last} ({mode}) on http://{host}:{port}"
        + (f" -> {next_url}" if next_url else " (last)")
    )
    serve(server.app(), host, port)  # the guard (server_guard.py), as a classifier's worker port


def plan_command(
    bundle: Path = typer.Option(DEFAULT_BUNDLE, "--bundle", help="Generative bundle directory."),
    stages: int = typer.Option(2, "--stages", help="Pipeline stages to split the blocks into."),
    threshold: float = typer.Option(
        0.8, "--threshold", help="Exit threshold the shares of decided tokens are measured at."
    ),
    hop_ms: float = typer.Option(
        0.0, "--hop-ms", help="Time to hand a token from one stage to the next (e.g. measured HTTP hop)."
    ),
    texts: int = typer.Option(100, "--texts", help="Held-out tweets to measure the exit shares on."),
    json_path: Path | None = typer.Option(
        None, "--json", help="Also write the profile and every candidate split as JSON."
    ),
) -> None:
    """Plan the pipeline splits for generation (E3-style): measure block/head times and exit shares on this machine,
    then rank every contiguous split by predicted time per token."""
    from rich.console import Console
    from rich.table import Table

    from exitplan.api.bundle import BundleError
    from exitplan.planner.generation import GenerationPlanError, GenerationProfile, plan_splits
    from exitplan.worker_image.generate.decoder import DecoderModel, GenerationError
    from exitplan.worker_image.generate.measure import measure_profile

    console = Console()
    try:
        model = DecoderModel(bundle)
        heldout_path = bundle / "data" / "heldout.json"
        sample = json.loads(heldout_path.read_text())[:texts] if heldout_path.is_file() else []
        profile = GenerationProfile.load(measure_profile(model, sample, threshold, hop_ms=hop_ms))
        plan = plan_splits(profile, stages)
    except (GenerationError, GenerationPlanError, BundleError) as err:
        fail(err)
    table = Table(title=f"{stages} stages, threshold {threshold}, hop {hop_ms} ms (best first)")
    for col in ("splits", "decision ms", "bottleneck ms", "ms/token"):
        table.add_column(col, justify="left" if col == "splits" else "right")
    for c in plan.candidates[:10]:
        table.add_row(
            " | ".join(f"{a}-{b}" for a, b in c.splits),
            f"{c.decision_ms:.3f}",
            f"{c.bottleneck_ms:.3f}",
            f"{c.time_per_token_ms:.3f}",
        )
    console.print(table)
    console.print(
        "decided per head: " + ", ".join(f"after block {b}: {p:.2f}" for b, p in sorted(profile.decide_share.items()))
    )
    if json_path is not None:
        json_path.write_text(
            json.dumps(
                {
                    "profile": profile.dump(),
                    "candidates": [
                        {
                            "splits": c.splits,
                            "decision_ms": c.decision_ms,
                            "bottleneck_ms": c.bottleneck_ms,
                            "time_per_token_ms": c.time_per_token_ms,
                        }
                        for c in plan.candidates
                    ],
                },
                indent=2,
            )
        )
