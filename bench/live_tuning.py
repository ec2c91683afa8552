"""Continual threshold tuning against one-time tuning, live, with a workload shift halfway.

The stream is labelled tweets the bundle never saw: neither trained on nor in the held-out window
the one-time thresholds were tuned on. The shift is a change of the traffic's kind that makes the
early ramps less reliable: first long tweets (>= --long-tokens tokens), then short ones
(< --short-tokens tokens). Why that shift: on a separate probe sample of unseen tweets (printed),
the one-time thresholds keep the budget on long tweets and break it on short ones; the class mix
moves the agreement far less. The same stream goes, side by side (started together; each input is
sent to every deployment at the same moment, 4 inputs in flight, so latency ratios compare like
with like on a shared machine), through three live deployments of the MiniLM bundle (router + 2 workers, buckets 32 and 128): vanilla (no exits), one-time tuning
(thresholds tuned on the bundle's held-out window, never changed) and continual tuning (the same
start, then the tuning loop of `exitplan up`, `exitplan.localrun.autotune.AutoTuner`, on shadow-sampled
feedback).

Per window of --window consecutive requests: agreement with the full model = the fraction of the
window's inputs whose served answer equals the full model's answer for that input (every input of
the window counts; the full model's answers are computed offline by running every block and the
final head with no exits), the median request latency, the share of inputs that exited early and
the thresholds in force when the window started. Writes a PNG of agreement per window and of the
thresholds over time.

    python bench/live_tuning.py [--bundle artifacts/bundles/minilm] [--long 3000] [--short 2000] [--window 1000] [--png live_tuning.png]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
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
from exitplan.localrun.autotune import AutoTuner
from exitplan.localrun.deployment import LocalDeployment
from exitplan.localrun.service_setup import tuned_thresholds
from exitplan.planner.tuning.autotune import LIVE
from exitplan.planner.tuning.thresholds import FeedbackWindow, allowed_disagreements, outcome
from exitplan.prepare.datasets import load_tweets, tweet_splits
from exitplan.worker_image.bundle_runtime import BundleRuntime, pad_batch, softmax

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
        rows = [
            i
            for i, seq in enumerate(ids)
            if len(seq) <= bucket and (bucket == BUCKETS[0] or len(seq) > BUCKETS[BUCKETS.index(bucket) - 1])
        ]
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


def cached_outputs(bundle: Path, texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """offline_outputs, kept under artifacts/live_tuning/ by a digest of the bundle and the texts."""
    digest = hashlib.sha256((str(bundle) + "\0" + "\0".join(texts)).encode()).hexdigest()[:16]
    path = Path("artifacts/live_tuning") / f"outputs-{digest}.npz"
    if path.is_file():
        with np.load(path) as data:
            return data["conf"], data["pred"], data["final"]
    conf, pred, final = offline_outputs(bundle, texts)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, conf=conf, pred=pred, final=final)
    return conf, pred, final


async def stream(
    urls: dict[str, str], model: str, texts: list[str], log_every: int, concurrency: int = 4
) -> dict[str, list[dict]]:
    """Send texts in order to every deployment side by side: `concurrency` slots each take the next
    input i and send it to every deployment at once, then wait for all their answers; so at any
    time each deployment holds at most `concurrency` requests, the same inputs as the others, on
    the same machine at the same moment. Per request: label index, latency, status, thresholds seen."""
    names = list(urls)
    out: dict[str, list[dict]] = {n: [{} for _ in texts] for n in names}
    thresholds_log: dict[str, list[tuple[int, dict]]] = {n: [] for n in names}
    next_index = 0

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        labels: dict[str, dict[str, int]] = {}
        for n in names:
            async with s.get(f"{urls[n]}/v2/models/{model}") as resp:
                labels[n] = {name: i for i, name in enumerate((await resp.json())["parameters"]["labels"])}

        async def one(i: int, n: str) -> None:
            url = urls[n]
            if i % log_every == 0:
                async with s.get(f"{url}/v2/models/{model}") as resp:  # (its metadata: no control token needed)
                    thresholds_log[n].append((i, (await resp.json())["parameters"]["thresholds"]))
            body = {
                "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [texts[i]]}],
                "parameters": {"truncate": True},
            }
            t0 = time.perf_counter()
            async with s.post(f"{url}/v2/models/{model}/infer", json=body) as resp:
                answer = await resp.json()
                r = out[n][i] = {"status": resp.status, "latency_ms": (time.perf_counter() - t0) * 1000}
                if resp.status == 200:
                    o = {x["name"]: x for x in answer["outputs"]}
                    r["label"] = labels[n][o["label"]["data"][0]]
                    r["ramp"] = o["exit_ramp"]["data"][0]

        async def slot() -> None:
            nonlocal next_index
            while next_index < len(texts):
                i = next_index
                next_index += 1
                await asyncio.gather(*(one(i, n) for n in names))

        await asyncio.gather(*(slot() for _ in range(concurrency)))
    for n in names:
        for i, t in thresholds_log[n]:
            out[n][i]["thresholds"] = t
    return out


def windows(results: list[dict], final: np.ndarray, size: int, head: str) -> list[dict]:
    rows = []
    for start in range(0, len(results), size):
        chunk = results[start : start + size]
        ok = [(start + k, r) for k, r in enumerate(chunk) if r.get("status") == 200]
        same = [r["label"] == final[i] for i, r in ok]  # the served answer vs the full model's, every answered input
        agree = np.mean(same) if ok else float("nan")
        rows.append(
            {
                "start": start,
                "answered": len(ok),
                "errors": len(chunk) - len(ok),
                "agreement": float(agree),
                "disagree": int(len(same) - sum(same)),
                "p50_ms": statistics.median(r["latency_ms"] for _, r in ok) if ok else float("nan"),
                "exited": float(np.mean([r["ramp"] != head for _, r in ok])) if ok else 0.0,
                "thresholds": chunk[0].get("thresholds", {}),
            }
        )
    return rows


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=Path("artifacts/bundles/minilm"))
    ap.add_argument("--long", type=int, default=3000, help="requests before the shift (long tweets)")
    ap.add_argument("--short", type=int, default=2000, help="requests after the shift (short tweets)")
    ap.add_argument("--long-tokens", type=int, default=32)
    ap.add_argument("--short-tokens", type=int, default=16)
    ap.add_argument("--window", type=int, default=1000)
    ap.add_argument("--budget", type=float, default=0.01)
    ap.add_argument("--shadow", type=float, default=0.5)
    ap.add_argument("--tune-seconds", type=float, default=1.0)
    ap.add_argument(
        "--headroom", type=float, default=0.25, help="AutoTuner: share of the budget's safe part to tune to"
    )
    ap.add_argument("--drift-z", type=float, default=3.3, help="AutoTuner: early-exit share test (0: off)")
    ap.add_argument(
        "--no-drift-confirm", action="store_true", help="AutoTuner: act on the first drift alarm (the old loop)"
    )
    ap.add_argument("--savings-samples", type=int, default=1000)
    ap.add_argument("--recent", type=int, default=100, help="AutoTuner: newest samples a breach is judged on")
    ap.add_argument("--alpha", type=float, default=0.05, help="AutoTuner: level of the binomial breach test")
    ap.add_argument("--port", type=int, default=18880)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--probe", type=int, default=600, help="unseen tweets (not streamed) to show the shift on")
    ap.add_argument("--runs", default="vanilla,one-time,continual")
    ap.add_argument("--png", type=Path, default=Path("live_tuning.png"))
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    bundle = args.bundle.resolve()
    manifest = read_manifest(bundle)
    ramps = [r.name for r in manifest.exit_ramps()]
    start = tuned_thresholds(bundle, args.budget, [])  # no service file: the whole window, one stratum
    print(f"one-time thresholds (tuned on the bundle's held-out window, budget {args.budget:.1%}): {start}")
    texts, shift_at = pick_stream(args, bundle, ramps, start)
    _, _, reference = cached_outputs(bundle, texts)
    raw, changes = run_side_by_side(args, bundle, manifest, ramps, start, texts)
    runs = {
        name: windows(raw[name], reference, args.window, manifest.final_ramp().name) for name in args.runs.split(",")
    }
    summary = report(args, runs, raw, shift_at)
    plot(runs, raw, ramps, args, shift_at)
    if args.json:
        head = manifest.final_ramp().name
        per_request = {
            n: [
                [
                    int(r.get("label") == reference[i]) if r.get("status") == 200 else -1,
                    int(r.get("ramp", head) != head),
                    round(r.get("latency_ms", -1.0), 2),
                ]
                for i, r in enumerate(raw[n])
            ]
            for n in runs
        }
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "runs": runs,
                    "summary": summary,
                    "changes": changes,
                    "per_request [agrees, exited, latency_ms]": per_request,
                }
            )
        )


def pick_stream(
    args: argparse.Namespace, bundle: Path, ramps: list[str], start: dict[str, float]
) -> tuple[list[str], int]:
    """(the stream's texts: --long long tweets the bundle never saw, then --short short ones; the
    request the shift starts at), after printing the one-time thresholds' agreement per length and
    class on a separate probe of unseen tweets."""
    options = json.loads((bundle / ".complete.json").read_text())["options"]
    # Tweets the bundle never saw: not in its training or held-out split.
    splits = tweet_splits(options["train_size"], options["heldout_size"], options["seed"])
    seen = set(splits.train_text) | set(splits.heldout_text)
    texts_all, labels_all = load_tweets()
    rng = np.random.default_rng(args.seed)
    unseen = np.array([i for i, t in enumerate(texts_all) if t not in seen])
    tok = Tokenizer.from_file(str(bundle / "tokenizer.json"))
    tok.no_padding()
    tokens = np.array([len(e.ids) for e in tok.encode_batch([texts_all[i] for i in unseen])])
    t = np.array([start[r] for r in ramps])
    probe_rows = rng.choice(unseen.size, size=args.probe, replace=False)
    conf, pred, final = cached_outputs(bundle, [texts_all[i] for i in unseen[probe_rows]])
    probe = FeedbackWindow(
        conf=conf, pred=pred, final=final, saving_ms=np.zeros(len(ramps)), cost_ms=np.zeros(len(ramps))
    )
    agrees = outcome(probe, t).agrees
    lengths, classes = tokens[probe_rows], labels_all[unseen[probe_rows]]
    print(f"probe ({args.probe} unseen tweets, not streamed): agreement with the full model at the one-time thresholds")
    for name, mask in [
        (f"< {args.short_tokens} tokens", lengths < args.short_tokens),
        (
            f"{args.short_tokens}..{args.long_tokens - 1} tokens",
            (lengths >= args.short_tokens) & (lengths < args.long_tokens),
        ),
        (f">= {args.long_tokens} tokens", lengths >= args.long_tokens),
    ] + [(f"class {c}", classes == k) for k, c in enumerate(("negative", "neutral", "positive"))]:
        print(f"  {name:>16}: {agrees[mask].mean():.4f} on {int(mask.sum())}")
    left = np.setdiff1d(np.arange(unseen.size), probe_rows)
    long_rows = rng.permutation(left[tokens[left] >= args.long_tokens])
    short_rows = rng.permutation(left[tokens[left] < args.short_tokens])
    if short_rows.size < args.short or long_rows.size < args.long:
        raise SystemExit(f"only {long_rows.size} long and {short_rows.size} short unseen tweets; lower --long/--short")
    phase1, phase2 = unseen[long_rows[: args.long]].tolist(), unseen[short_rows[: args.short]].tolist()
    print(
        f"stream: {len(phase1)} tweets of >= {args.long_tokens} tokens, then {len(phase2)} of < {args.short_tokens} tokens "
        f"(shift at request {len(phase1)})"
    )
    return [texts_all[i] for i in phase1 + phase2], len(phase1)


def run_side_by_side(
    args: argparse.Namespace, bundle: Path, manifest, ramps: list[str], start: dict[str, float], texts: list[str]
) -> tuple[dict[str, list[dict]], dict]:
    """Serve every run of --runs at once, the continual one with the tuning loop, stream `texts`
    through them all; (per run, per request results; the continual run's threshold changes and drift alarms)."""
    spec = EarlyExitServiceSpec.model_validate(
        {
            "model": {"name": manifest.name, "bundle": str(bundle)},
            "slo": {"latencyMs": 1000},
            "accuracy": {"maxDrop": args.budget, "shadowFraction": args.shadow},
            "pools": [{"name": "cpu"}],
            "router": {"truncate": True},
        }
    )
    changes: dict = {}
    names = args.runs.split(",")
    with contextlib.ExitStack() as stack:
        urls, deployments, tuner = {}, {}, None
        for k, name in enumerate(names):
            thresholds = {r: 2.0 for r in ramps} if name == "vanilla" else dict(start)
            plan = Plan(
                service="live",
                model=manifest.name,
                splits=[SplitPlan(index=0, first_block=0, last_block=len(manifest.blocks) - 1)],
                buckets=BUCKETS,
                cells=[Cell(split=0, bucket=b, pool="cpu", replicas=1, batch_size=8) for b in BUCKETS],
                thresholds=thresholds,
            )
            tmp = stack.enter_context(tempfile.TemporaryDirectory())
            port = args.port + 10 * k
            deployments[name] = stack.enter_context(
                LocalDeployment(bundle, plan, spec, Path(tmp), port=port, base_port=port + 1)
            )
            urls[name] = deployments[name].url
        if "continual" in urls:
            config = dataclasses.replace(
                LIVE,
                period_s=args.tune_seconds,
                window=1500,
                min_samples=100,
                recent=args.recent,
                alpha=args.alpha,
                savings_samples=args.savings_samples,
                headroom=args.headroom,
                drift_z=args.drift_z,
                drift_confirm=not args.no_drift_confirm,
            )
            continual = deployments["continual"]
            tuner = AutoTuner(
                continual.control_url, ramps, args.budget, config=config, token=continual.control_token
            ).start()
        t0 = time.time()
        raw = asyncio.run(stream(urls, manifest.name, texts, 100))
        print(f"{', '.join(names)} side by side: {len(texts)} requests each in {time.time() - t0:.0f} s")
        if tuner:
            tuner.stop()
            changes["continual"] = [
                {"reason": d.reason, "detail": d.detail, "samples": d.samples}
                for d in tuner.history
                if d.thresholds is not None
            ]
            kinds = {}
            for c in changes["continual"]:
                key = c["detail"].split(":")[0] if c["detail"] else c["reason"]
                key = "breach" if key.startswith("breach") else key
                kinds[key] = kinds.get(key, 0) + 1
            print(
                f"continual: {len(changes['continual'])} threshold changes ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))})"
            )
            for c in changes["continual"]:
                print(f"  {c['samples']:>5} samples: {c['reason']} {c['detail']}")
            print(f"continual: drift alarms: {'; '.join(tuner.state.alarm_log) or 'none'}")
            changes["drift_alarms"] = tuner.state.alarm_log
    return raw, changes


def report(args: argparse.Namespace, runs: dict[str, list[dict]], raw: dict[str, list[dict]], shift_at: int) -> dict:
    """Print the per-window table and the summary (returned): latency, errors, windows within the budget."""
    print(
        f"\nagreement with the full model per window of {args.window} requests (budget: >= {1 - args.budget:.2%}, i.e. at most "
        f"{allowed_disagreements(args.window, args.budget)} of {args.window} answers differ); the shift starts window {shift_at // args.window}"
    )
    names = list(runs)
    print(f"{'window':>6} | " + " | ".join(f"{n:>34}" for n in names))
    for k in range(len(runs[names[0]])):
        cells = [
            f"{runs[n][k]['agreement']:.4f} p50 {runs[n][k]['p50_ms']:6.1f}ms exit {runs[n][k]['exited']:.2f}"
            for n in names
        ]
        print(f"{k:>6} | " + " | ".join(f"{c:>34}" for c in cells))
    summary = {}
    for n in names:
        rows = runs[n]
        summary[n] = {
            "median_p50_ms": float(statistics.median(w["p50_ms"] for w in rows)),
            "median_latency_ms": float(statistics.median(r["latency_ms"] for r in raw[n] if r.get("status") == 200)),
            "errors": int(sum(w["errors"] for w in rows)),
        }
        if n != "vanilla":
            after = rows[1:]
            summary[n].update(
                {
                    "windows_within_budget_after_first": int(
                        sum(w["disagree"] <= allowed_disagreements(w["answered"], args.budget) for w in after)
                    ),
                    "windows_after_first": len(after),
                    "min_agreement_after_first": float(min(w["agreement"] for w in after)),
                }
            )
    for n, v in summary.items():
        print(
            f"{n:>10}: "
            + ", ".join(f"{k} {val:.4f}" if isinstance(val, float) else f"{k} {val}" for k, val in v.items())
        )
    if "vanilla" in summary:
        for n in names:
            if n != "vanilla":
                print(
                    f"median latency {n} / vanilla: {summary[n]['median_p50_ms'] / summary['vanilla']['median_p50_ms']:.3f} "
                    f"(medians of the per-window p50s; of all requests: "
                    f"{summary[n]['median_latency_ms'] / summary['vanilla']['median_latency_ms']:.3f})"
                )
    if "continual" in summary:
        c = summary["continual"]
        print(
            f"continual: every window after the first within the budget: "
            f"{'PASS' if c['windows_within_budget_after_first'] == c['windows_after_first'] else 'FAIL'}"
        )
    if "one-time" in summary:
        o = summary["one-time"]
        print(
            f"one-time: the budget breaks: {'yes' if o['windows_within_budget_after_first'] < o['windows_after_first'] else 'no'}"
        )
    return summary


def plot(runs: dict, raw: dict, ramps: list[str], args, shift_at: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7.5), sharex=True)
    for name, rows in runs.items():
        if name != "vanilla":
            x = [w["start"] + w["answered"] / 2 for w in rows]
            ax1.plot(x, [w["agreement"] for w in rows], marker="o", label=name)
    ax1.axhline(1 - args.budget, color="red", linestyle="--", label=f"budget ({1 - args.budget:.0%})")
    ax1.axvline(shift_at, color="grey", linestyle=":", label="shift: long -> short tweets")
    ax1.set_ylabel(f"agreement with the full model\n(per window of {args.window} requests)")
    ax1.legend(fontsize=8)
    if "continual" in raw:
        logged = [(i, r["thresholds"]) for i, r in enumerate(raw["continual"]) if "thresholds" in r]
        for ramp in ramps:
            ax2.step([i for i, _ in logged], [min(t.get(ramp, 2.0), 1.02) for _, t in logged], where="post", label=ramp)
    ax2.axvline(shift_at, color="grey", linestyle=":")
    ax2.set_ylabel("continual: threshold in force\n(1.02 = ramp off)")
    ax2.set_xlabel("request")
    ax2.legend(ncol=5, fontsize=8)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"plot written to {args.png}")


if __name__ == "__main__":
    main()
