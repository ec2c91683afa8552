"""Early-exit generation (EE-LLM) against full-model decoding, side by side in one run.

For held-out tweets (never trained on), the first `--prompt-chars` characters are the prompt and the
model generates up to `--max-tokens` bytes (stopping at <eos>). Every configuration decodes every
prompt, interleaved prompt by prompt so load changes on a shared machine hit all alike:

- `full`: plain greedy decoding with a full KV cache (every token through every block, final head);
- `recompute @ t`: KV recomputation in one worker, exit threshold t;
- `pipeline @ t`: the pipeline-based mode over in-process split stages (threads), threshold t;
- `--remote`: `pipeline-remote @ t`, the coordinator engine in this process over stage processes;
- `--router`: `router-recompute @ t` and `router-pipeline @ t`, the serving path: `exitplan router` and
  `exitplan generate-stage` processes as `exitplan up` starts them (one recompute stage; `--splits`
  pipeline stages), each token read by this client from the router's server-sent events (time per
  token = the gap between two token events as the client receives them).

Reported per configuration: time per token (prompt pass excluded), tokens/s (everything included),
the share of tokens each head chose, the agreement of each generated token with the token the full
model picks after the same prefix, the share of whole outputs equal to full decoding's, and the
held-out bits per byte of the early-exit rule (teacher forced: each position takes the first head
whose confidence reaches t).

    python bench/generation_speed.py --bundle artifacts/bundles/tweet-decoder
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from exitplan.worker_image.generate.decoder import DecoderModel, RecomputeEngine, full_greedy
from exitplan.worker_image.generate.local_pipeline import PipelineEngine


def bits_per_byte(model: DecoderModel, texts: list[str], thresholds: list[float]) -> dict[float, float]:
    """Teacher-forced bits per byte on `texts` when each position takes the first confident head."""
    from exitplan.prepare.decoder import encode_bytes

    heads = [h.name for h in model.heads]
    totals = {t: 0.0 for t in thresholds}
    count = 0
    for text in texts:
        ids = encode_bytes(text, model.spec.max_context)
        logits = model.full_forward(ids[:-1]).logits
        targets = np.asarray(ids[1:])
        logp = {}
        conf = {}
        for name in heads:
            z = logits[name].astype(np.float64)
            z = z - z.max(axis=1, keepdims=True)
            lp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
            logp[name] = lp[np.arange(len(targets)), targets]
            conf[name] = np.exp(lp.max(axis=1))
        for t in thresholds:
            chosen = logp[heads[-1]].copy()
            decided = np.zeros(len(targets), dtype=bool)
            for name in heads[:-1]:
                take = ~decided & (conf[name] >= t) & (t < 1.0)
                chosen[take] = logp[name][take]
                decided |= take
            totals[t] += float(-chosen.sum() / np.log(2))
        count += len(targets)
    return {t: totals[t] / count for t in thresholds}


def start_stages(bundle: Path, splits: list[tuple[int, int]]):
    """One `exitplan generate-stage` process per split on free local ports; returns (processes, URLs)."""
    import socket
    import subprocess
    import sys
    import urllib.request

    ports = []
    for _ in splits:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs = []
    for i, (first, last) in enumerate(splits):
        nxt = ["--next", urls[i + 1]] if i + 1 < len(splits) else []
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "from exitplan.cli import app; app()",
                    "generate-stage",
                    "--bundle",
                    str(bundle),
                    "--first",
                    str(first),
                    "--last",
                    str(last),
                    "--port",
                    str(ports[i]),
                    *nxt,
                ],
                stdout=subprocess.DEVNULL,
            )
        )
    for url in urls:
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/v2/health/ready", timeout=1).read()
                break
            except OSError:
                time.sleep(0.1)
    return procs, urls


class RouterClient:
    """`generate()` over a router's generate_stream (an `exitplan up`-style LocalDeployment of a fixed plan)."""

    def __init__(self, bundle: Path, stages: int, workdir: Path) -> None:
        import socket

        from exitplan.api.resources import EarlyExitServiceSpec, GPUPoolSpec
        from exitplan.localrun.deployment import LocalDeployment
        from exitplan.planner.generation import plan_generation

        manifest = DecoderModel(bundle, last_block=0).manifest
        spec = EarlyExitServiceSpec.model_validate(
            {
                "model": {"name": "bench", "bundle": str(bundle), "task": "text-generation"},
                "slo": {"latencyMs": 1000},
                "pools": [{"name": "cpu"}],
            }
        )
        plan = plan_generation(
            "bench",
            spec,
            {"cpu": GPUPoolSpec(capacity=stages)},
            n_blocks=len(manifest.blocks),
            exit_ramps=[r.name for r in manifest.exit_ramps()],
            max_context=manifest.decoder.max_context,
            stages=stages,
        ).plan
        ports = []
        for _ in range(2):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                ports.append(sock.getsockname()[1])
        self.deployment = LocalDeployment(bundle, plan, spec, workdir, port=ports[0], base_port=ports[1])
        self.deployment.start()
        self.url = f"{self.deployment.url}/v2/models/bench/generate_stream"

    def generate(self, prompt: str, max_tokens: int, threshold: float):
        import urllib.request
        from types import SimpleNamespace

        body = json.dumps(
            {"text_input": prompt, "parameters": {"max_tokens": max_tokens, "threshold": threshold}}
        ).encode()
        request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        last = time.perf_counter()
        with urllib.request.urlopen(request, timeout=120) as response:
            for line in response:
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[6:])
                if event.get("done"):
                    break
                now = time.perf_counter()
                yield SimpleNamespace(
                    token_id=event["token_id"], exit=event["exit"], block=event["block"], seconds=now - last
                )
                last = now

    def close(self) -> None:
        self.deployment.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, default=Path("artifacts/bundles/tweet-decoder"))
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--prompt-chars", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--thresholds", type=float, nargs="+", default=[1.0, 0.9, 0.8, 0.6, 0.4])
    parser.add_argument("--splits", type=int, default=2)
    parser.add_argument("--max-pending", type=int, default=8)
    parser.add_argument(
        "--remote", action="store_true", help="also run the pipeline across stage processes (exitplan generate-stage)"
    )
    parser.add_argument(
        "--router", action="store_true", help="also run the serving path: exitplan router + generate-stage processes"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    console = Console(width=170)
    model = DecoderModel(args.bundle)
    heldout = json.loads((args.bundle / "data" / "heldout.json").read_text())
    texts = [t for t in heldout if len(t) > args.prompt_chars + 8][: args.prompts]
    prompts = [t[: args.prompt_chars] for t in texts]
    recompute = RecomputeEngine(model, max_pending=args.max_pending)
    pipeline = PipelineEngine(args.bundle, splits=args.splits)
    engines = {"recompute": recompute, "pipeline": pipeline}
    stage_procs = []
    if args.remote:
        from exitplan.worker_image.generate.remote_pipeline import RemotePipelineEngine

        stage_procs, urls = start_stages(args.bundle, pipeline.splits)
        engines["pipeline-remote"] = RemotePipelineEngine(args.bundle, urls)
    if args.router:
        import tempfile

        workdir = Path(tempfile.mkdtemp(prefix="gen-bench-"))
        engines["router-recompute"] = RouterClient(args.bundle, 1, workdir / "recompute")
        engines["router-pipeline"] = RouterClient(args.bundle, args.splits, workdir / "pipeline")
    configs = [("full", 1.0)] + [(mode, t) for mode in engines for t in args.thresholds]
    stats = {
        c: {
            "step_s": 0.0,
            "steps": 0,
            "total_s": 0.0,
            "tokens": 0,
            "exits": {},
            "agree": 0,
            "same_output": 0,
            "blocks": 0,
        }
        for c in configs
    }
    full_outputs: dict[int, list[int]] = {}
    for mode, threshold in configs[1:]:  # warm-up: first runs of each session shape are slow
        engine = engines[mode]
        list(engine.generate(heldout[-1][: args.prompt_chars], 8, threshold))
    full_greedy(model, model.codec.encode(heldout[-1][: args.prompt_chars]), 8)
    for i, prompt in enumerate(prompts):
        for mode, threshold in configs:
            s = stats[(mode, threshold)]
            started = time.perf_counter()
            if mode == "full":
                t0 = time.perf_counter()
                ids = model.codec.encode(prompt)
                seconds: list[float] = []
                tokens, _, _ = full_greedy(model, ids, args.max_tokens, step_seconds=seconds)
                s["total_s"] += time.perf_counter() - t0
                s["step_s"] += sum(seconds[1:])
                s["steps"] += len(seconds) - 1
                s["blocks"] += model.n_blocks * (len(seconds) - 1)
                full_outputs[i] = tokens
                s["tokens"] += len(tokens)
                s["exits"]["head"] = s["exits"].get("head", 0) + len(tokens)
                continue
            engine = engines[mode]
            events = list(engine.generate(prompt, args.max_tokens, threshold))
            s["total_s"] += time.perf_counter() - started
            tokens = [e.token_id for e in events]
            s["tokens"] += len(tokens)
            s["step_s"] += sum(e.seconds for e in events[1:])
            s["steps"] += len(events) - 1
            s["blocks"] += sum(e.block + 1 for e in events[1:])
            for e in events:
                s["exits"][e.exit] = s["exits"].get(e.exit, 0) + 1
            # agreement: the full model's choice after the same prefix
            sequence = model.codec.encode(prompt) + tokens
            final = model.full_forward(sequence[:-1]).logits[model.manifest.final_ramp().name]
            start = len(sequence) - len(tokens) - 1
            s["agree"] += int((final[start:].argmax(axis=1) == np.asarray(tokens)).sum())
            s["same_output"] += int(tokens == full_outputs[i])
    for engine in engines.values():
        close = getattr(engine, "close", None)
        if close:
            close()
    for proc in stage_procs:
        proc.terminate()
        proc.wait()
    full_step = stats[("full", 1.0)]
    bpb = bits_per_byte(model, heldout[: args.prompts * 5], sorted(set(args.thresholds) | {1.0}))

    full = stats[("full", 1.0)]
    full_tps = full["tokens"] / full["total_s"]
    reference_ms = 1000 * full_step["step_s"] / full_step["steps"] if full_step else float("nan")
    table = Table(
        title=f"{len(prompts)} held-out prompts, up to {args.max_tokens} tokens, {model.n_blocks} blocks; "
        "speedups against full decoding"
    )
    for col in (
        "mode",
        "threshold",
        "ms/token",
        "speedup/token",
        "blocks/token",
        "tokens/s",
        "vs full tokens/s",
        "heads (share)",
        "agree w/ full",
        "same output",
        "bits/byte",
    ):
        table.add_column(col, justify="left" if col in ("mode", "heads (share)") else "right")
    rows = []
    for (mode, threshold), s in stats.items():
        tps = s["tokens"] / s["total_s"]
        ms = 1000 * s["step_s"] / s["steps"] if s["steps"] else float("nan")
        share = {k: v / s["tokens"] for k, v in sorted(s["exits"].items())}
        agree = 1.0 if mode == "full" else s["agree"] / s["tokens"]
        same = 1.0 if mode == "full" else s["same_output"] / len(prompts)
        row = {
            "mode": mode,
            "threshold": threshold,
            "ms_per_token": ms,
            "speedup_per_token": reference_ms / ms,
            "tokens_per_s": tps,
            "vs_full_tokens_per_s": tps / full_tps,
            "head_share": share,
            "agreement": agree,
            "same_output": same,
            "blocks_per_token": s["blocks"] / s["steps"],
            "bits_per_byte": bpb[threshold] if mode != "full" else bpb[1.0],
            "tokens": s["tokens"],
        }
        rows.append(row)
        table.add_row(
            mode,
            f"{threshold:.2f}",
            f"{ms:.2f}",
            f"{row['speedup_per_token']:.2f}x",
            f"{row['blocks_per_token']:.2f}",
            f"{tps:.0f}",
            f"{row['vs_full_tokens_per_s']:.2f}x",
            " ".join(f"{k}:{v:.2f}" for k, v in share.items()),
            f"{agree:.3f}",
            f"{same:.2f}",
            f"{row['bits_per_byte']:.3f}",
        )
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
