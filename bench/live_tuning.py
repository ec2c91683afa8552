"""Continual threshold tuning against one-time tuning, live, with a workload shift halfway (issue 4).

The stream is labelled tweets the bundle never saw (neither trained on nor tuned on): the first
half drawn from the whole corpus, the second half from one source only — the corpus is several
tweet collections in file order (airlines, self-driving cars, sports, ...), and the second half
comes from the block of the file whose early answers agree least with the full model at the
one-time thresholds (measured on a separate probe sample, printed). The same stream goes, in order, through three live deployments of the MiniLM bundle
(router + 2 workers, buckets 32 and 128): vanilla (no exits), one-time tuning (thresholds tuned on
the bundle's held-out window, never changed) and continual tuning (the same start, then the
`exitplan up` tuning loop on shadow-sampled feedback). Per window of requests: agreement with the
full model (reference answers computed offline with the whole model), median latency, and the
thresholds in force. Writes a PNG of agreement per window and of the thresholds over time.

    python bench/live_tuning.py [--bundle artifacts/bundles/minilm] [--per-phase 2400] [--window 400] [--png live_tuning.png]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
from tokenizers import Tokenizer

from exitplan.api.bundle import read_manifest
from exitplan.api.plan import Cell, Plan, SplitPlan
from exitplan.api.resources import EarlyExitServiceSpec
from exitplan.autotune import AutoTuner
from exitplan.local import LocalDeployment
from exitplan.planner.thresholds import Window, evaluate
from exitplan.planning import tuned_thresholds
from exitplan.prepare.datasets import load_tweets, tweet_splits
from exitplan.worker.bundle_runtime import BundleRuntime, pad_batch, softmax

BUCKETS = [32, 128]


def offline_outputs(bundle: Path, texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(conf [N,R], pred [N,R], final [N]) of every exit ramp and the head, whole model, no exits."""
    manifest = read_manifest(bundle)
    ramps = [r.name for r in manifest.exit_ramps()]
    tok = Tokenizer.from_file(str(bundle / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(BUCKETS[-1])
    runtime = BundleRuntime(bundle, buckets=BUCKETS)
    ids = [e.ids for e in tok.encode_batch(texts)]
    conf = np.zeros((len(texts), len(ramps)), np.float32)
    pred = np.zeros((len(texts), len(ramps)), np.int64)
    final = np.zeros(len(texts), np.int64)
    for bucket in BUCKETS:
        rows = [i for i, seq in enumerate(ids) if len(seq) <= bucket and (bucket == BUCKETS[0] or len(seq) > BUCKETS[BUCKETS.index(bucket) - 1])]
        for start in range(0, len(rows), 64):
            chunk = rows[start : start + 64]
            state = pad_batch([ids[i] for i in chunk], bucket)
            for b in range(len(manifest.blocks)):
                runtime.run_block(b, state, bucket)
                for ramp in manifest.ramps_in(b, b):
                    probs = softmax(runtime.run_ramp(ramp.name, state, bucket))
                    if ramp.final:
                        final[chunk] = probs.argmax(1)
                    else:
                        r = ramps.index(ramp.name)
                        conf[chunk, r], pred[chunk, r] = probs.max(1), probs.argmax(1)
    return conf, pred, final


async def stream(url: str, model: str, texts: list[str], window: int, concurrency: int = 4) -> list[dict]:
    """Send texts in order, `concurrency` at a time; per request: label index, latency, status, thresholds seen."""
    out: list[dict] = [{} for _ in texts]
    labels: dict[str, int] = {}
    next_index = 0
    thresholds_log: list[tuple[int, dict]] = []

    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/v2/models/{model}") as resp:
            labels = {name: i for i, name in enumerate((await resp.json())["parameters"]["labels"])}

        async def worker() -> None:
            nonlocal next_index
            while next_index < len(texts):
                i = next_index
                next_index += 1
                if i % window == 0:
                    async with s.get(f"{url}/v1/thresholds") as resp:
                        thresholds_log.append((i, (await resp.json())["thresholds"]))
                body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [texts[i]]}], "parameters": {"truncate": True}}
                t0 = time.perf_counter()
                async with s.post(f"{url}/v2/models/{model}/infer", json=body) as resp:
                    answer = await resp.json()
                    out[i] = {"status": resp.status, "latency_ms": (time.perf_counter() - t0) * 1000}
                    if resp.status == 200:
                        o = {x["name"]: x for x in answer["outputs"]}
                        out[i]["label"] = labels[o["label"]["data"][0]]
                        out[i]["ramp"] = o["exit_ramp"]["data"][0]

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    for i, t in thresholds_log:
        out[i]["thresholds"] = t
    return out


def windows(results: list[dict], final: np.ndarray, size: int, head: str) -> list[dict]:
    rows = []
    for start in range(0, len(results), size):
        chunk = results[start : start + size]
        ok = [(start + k, r) for k, r in enumerate(chunk) if r.get("status") == 200]
        agree = np.mean([r["label"] == final[i] for i, r in ok]) if ok else float("nan")
        rows.append({
            "start": start, "answered": len(ok), "errors": len(chunk) - len(ok), "agreement": float(agree),
            "p50_ms": statistics.median(r["latency_ms"] for _, r in ok) if ok else float("nan"),
            "exited": float(np.mean([r["ramp"] != head for _, r in ok])) if ok else 0.0,
            "thresholds": chunk[0].get("thresholds", {}),
        })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=Path("artifacts/bundles/minilm"))
    ap.add_argument("--per-phase", type=int, default=2400)
    ap.add_argument("--window", type=int, default=400)
    ap.add_argument("--budget", type=float, default=0.01)
    ap.add_argument("--shadow", type=float, default=0.3)
    ap.add_argument("--tune-seconds", type=float, default=3.0)
    ap.add_argument("--port", type=int, default=18880)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block", type=int, default=4000, help="rows of the corpus file per source block")
    ap.add_argument("--probe", type=int, default=300, help="probe tweets per block to pick the shift")
    ap.add_argument("--png", type=Path, default=Path("live_tuning.png"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    bundle = args.bundle.resolve()
    options = json.loads((bundle / ".complete.json").read_text())["options"]
    manifest = read_manifest(bundle)
    ramps = [r.name for r in manifest.exit_ramps()]

    # Tweets the bundle never saw: not in its training or held-out split.
    splits = tweet_splits(options["train_size"], options["heldout_size"], options["seed"])
    seen = set(splits.train_text) | set(splits.heldout_text)
    texts_all, labels_all = load_tweets()
    rng = np.random.default_rng(args.seed)
    unseen = np.array([i for i, t in enumerate(texts_all) if t not in seen])
    start = tuned_thresholds(bundle, args.budget)
    print(f"one-time thresholds (tuned on the bundle's held-out window, budget {args.budget:.1%}): {start}")
    t = np.array([start[r] for r in ramps])
    blocks = [unseen[(unseen >= lo) & (unseen < lo + args.block)] for lo in range(0, len(texts_all), args.block)]
    probe_agreement, probes = [], []
    for block in blocks:
        probe = rng.choice(block, size=min(args.probe, len(block)), replace=False)
        probes.append(set(probe.tolist()))
        conf, pred, final = offline_outputs(bundle, [texts_all[i] for i in probe])
        w = Window(conf=conf, pred=pred, final=final, saving_ms=np.zeros(len(ramps)), cost_ms=np.zeros(len(ramps)))
        probe_agreement.append(evaluate(w, t)[0])
    worst = int(np.argmin(probe_agreement))
    print("probe agreement per block of the file at the one-time thresholds: "
          + ", ".join(f"rows {k * args.block}+ {a:.4f}" for k, a in enumerate(probe_agreement))
          + f" -> the shift goes to rows {worst * args.block}..{(worst + 1) * args.block - 1}")
    used = set().union(*probes)
    shifted = [i for i in blocks[worst] if i not in used]
    rng.shuffle(shifted)
    mixed = [i for i in unseen if i not in used and i not in set(shifted)]
    rng.shuffle(mixed)
    per_phase = min(args.per_phase, len(shifted))
    phase1, phase2 = mixed[:per_phase], shifted[:per_phase]
    order = phase1 + phase2
    texts = [texts_all[i] for i in order]
    shift_class = f"rows {worst * args.block}..{(worst + 1) * args.block - 1}"
    per_class = {f"rows {k * args.block}+": a for k, a in enumerate(probe_agreement)}
    print(f"stream: {len(phase1)} tweets from the whole corpus, then {len(phase2)} from {shift_class}")
    _, _, reference = offline_outputs(bundle, texts)

    spec = EarlyExitServiceSpec.model_validate({
        "model": {"name": manifest.name, "bundle": str(bundle)}, "slo": {"latencyMs": 1000},
        "accuracy": {"maxDrop": args.budget, "shadowFraction": args.shadow}, "pools": [{"name": "cpu"}],
        "router": {"truncate": True},
    })
    runs = {}
    for name in ("vanilla", "one-time", "continual"):
        thresholds = {r: 2.0 for r in ramps} if name == "vanilla" else dict(start)
        plan = Plan(service="live", model=manifest.name, splits=[SplitPlan(index=0, first_block=0, last_block=len(manifest.blocks) - 1)],
                    buckets=BUCKETS, cells=[Cell(split=0, bucket=b, pool="cpu", replicas=1, batch_size=8) for b in BUCKETS],
                    thresholds=thresholds)
        with tempfile.TemporaryDirectory() as tmp:
            with LocalDeployment(bundle, plan, spec, Path(tmp), port=args.port, base_port=args.port + 1) as dep:
                tuner = AutoTuner(dep.url, ramps, args.budget, period=args.tune_seconds, window=1500, min_samples=150, recent=200).start() if name == "continual" else None
                t0 = time.time()
                results = asyncio.run(stream(dep.url, manifest.name, texts, args.window))
                if tuner:
                    tuner.stop()
                print(f"{name}: {len(texts)} requests in {time.time() - t0:.0f} s")
        runs[name] = windows(results, reference, args.window, manifest.final_ramp().name)

    print(f"\nagreement with the full model per window of {args.window} requests (budget: >= {1 - args.budget:.2%}); shift after window {len(phase1) // args.window}")
    print(f"{'window':>6} | " + " | ".join(f"{n:>20}" for n in runs))
    for k in range(len(runs["vanilla"])):
        cells = [f"{runs[n][k]['agreement']:.4f} p50 {runs[n][k]['p50_ms']:5.1f}ms" for n in runs]
        print(f"{k:>6} | " + " | ".join(f"{c:>20}" for c in cells))
    summary = {}
    for n in ("one-time", "continual"):
        after_first = [w["agreement"] for w in runs[n][1:]]
        summary[n] = {
            "windows_over_budget_after_first": int(sum(a < 1 - args.budget for a in after_first)),
            "min_agreement_after_first": float(min(after_first)),
            "median_p50_ms": float(statistics.median(w["p50_ms"] for w in runs[n])),
        }
    summary["vanilla"] = {"median_p50_ms": float(statistics.median(w["p50_ms"] for w in runs["vanilla"]))}
    for n, v in summary.items():
        print(f"{n:>10}: " + ", ".join(f"{k} {val:.4f}" if isinstance(val, float) else f"{k} {val}" for k, val in v.items()))
    print(f"median latency continual / vanilla: {summary['continual']['median_p50_ms'] / summary['vanilla']['median_p50_ms']:.3f}")
    plot(runs, ramps, args, len(phase1) / args.window)
    if args.json:
        args.json.write_text(json.dumps({"shift_class": shift_class, "per_class": per_class, "runs": runs, "summary": summary}, indent=2))


def plot(runs: dict, ramps: list[str], args, shift_window: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for name, rows in runs.items():
        if name != "vanilla":
            ax1.plot([r["agreement"] for r in rows], marker="o", label=name)
    ax1.axhline(1 - args.budget, color="red", linestyle="--", label=f"budget ({1 - args.budget:.0%})")
    ax1.axvline(shift_window - 0.5, color="grey", linestyle=":", label="shift")
    ax1.set_ylabel("agreement with the full model")
    ax1.legend()
    for r in ramps:
        ax2.plot([min(w["thresholds"].get(r, 2.0), 1.05) for w in runs["continual"]], marker=".", label=r)
    ax2.axvline(shift_window - 0.5, color="grey", linestyle=":")
    ax2.set_ylabel("threshold (continual; >1 = off)")
    ax2.set_xlabel(f"window ({args.window} requests)")
    ax2.legend(ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"plot written to {args.png}")


if __name__ == "__main__":
    main()
