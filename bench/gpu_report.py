"""The GPU proof's markdown: the device's name, then one table per section, then the issue's targets read
off the figures (each one met, missed, or not measured, with the figure)."""

from __future__ import annotations

from collections import defaultdict


def _f(value, digits: int = 2, unit: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def markdown(results: dict) -> str:
    sections = results.get("sections", {})
    device = results.get("device_name", "unknown device")
    lines = [
        f"# exitplan GPU proof on {device}",
        "",
        f"`{results.get('command', '')}` (started {results.get('started')})",
        "",
    ]
    for name, entry in sections.items():
        state = "ok" if entry.get("ok") else entry.get("skipped") or entry.get("error", "failed")
        lines.append(f"- {name}: {state} ({entry.get('seconds', '-')} s)")
    lines.append("")
    env = sections.get("env", {})
    if env.get("ok"):
        lines += [
            "## Environment",
            "",
            "| | |",
            "|---|---|",
            *(
                f"| {k} | {env.get(k)} |"
                for k in (
                    "device_name",
                    "device_memory_bytes",
                    "python",
                    "cpus",
                    "onnxruntime",
                    "torch",
                    "cuda_provider",
                    "available_providers",
                )
            ),
            "",
        ]
    if results.get("precision"):
        p = results["precision"]
        lines += [
            f"fp16 bundle: final answers agree with fp32 on {p['final_agreement']:.2%} of {p['heldout_rows']} held-out "
            f"inputs (largest score difference {p['max_score_diff']:.2e}; checked on {p['checked_with']})",
            "",
        ]
    lines += _curves(sections.get("curves", {}))
    lines += _floors(sections.get("floors", {}))
    lines += _capacity(sections.get("capacity", {}))
    lines += _targets(sections)
    return "\n".join(lines) + "\n"


def _curves(entry: dict) -> list[str]:
    points = entry.get("points") or []
    if not points:
        return []
    out = ["## Whole chain, ms per batch (inputs/s)", ""]
    grouped: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for p in points:
        grouped[(p["precision"], p["bucket"])].append(p)
    modes = list(dict.fromkeys(p["mode"] for p in points))
    for (precision, bucket), rows in grouped.items():
        out += [
            f"{precision}, bucket {bucket}:",
            "",
            "| batch | " + " | ".join(modes) + " |",
            "|---" * (len(modes) + 1) + "|",
        ]
        for batch in sorted({r["batch"] for r in rows}):
            cells = []
            for mode in modes:
                r = next((x for x in rows if x["batch"] == batch and x["mode"] == mode), None)
                if r is None or r.get("ms") is None:
                    cells.append("-" if r is None or not r.get("error") else "n/a")
                else:
                    diff = r.get("max_abs_diff")
                    flag = " (!)" if diff is not None and diff > (5e-2 if precision != "fp32" else 1e-3) else ""
                    cells.append(f"{r['ms']:.2f} ({r['inputs_per_s']:.0f}){flag}")
            out.append(f"| {batch} | " + " | ".join(cells) + " |")
        out.append("")
    for precision, m in (entry.get("device_memory") or {}).items():
        out.append(
            f"- device memory, {precision}: {m['sessions_bytes'] / 2**20:.0f} MiB for the sessions of buckets "
            f"{m['buckets']}, {m['peak_bytes'] / 2**20:.0f} MiB after every mode ran"
        )
    errors = {(p["mode"], p["error"]) for p in points if p.get("error") and not p["error"].startswith("not in")}
    out += [f"- {mode}: {error}" for mode, error in sorted(errors)]
    return [*out, ""]


def _floors(entry: dict) -> list[str]:
    rows = entry.get("rows") or []
    if not rows:
        return []
    out = [
        "## Floors (whole model, no router), ms per batch",
        "",
        "| floor | precision | bucket | batch | ms |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['floor']} | {r['precision']} | {r['bucket']} | {r['batch']} | {_f(r.get('ms')) if 'error' not in r else r['error'][:80]} |"
        )
    return [*out, ""]


def _capacity(entry: dict) -> list[str]:
    caps = entry.get("capacities") or {}
    if not caps:
        return []
    out = [
        f"## Capacity within the {entry.get('slo_ms')} ms SLO ({entry.get('precision')}, {entry.get('routers')} router(s), "
        f"{entry.get('step_s')} s steps)",
        "",
        "| config | what runs | capacity rps | predicted rps | predicted / measured | p99 ms | agreement | load generator ms/req |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for config, row in caps.items():
        cap, pred = row.get("capacity_rps"), row.get("predicted_rps")
        ratio = pred / cap if pred and cap else None
        out.append(
            f"| {config} | {row.get('plan')} | {_f(cap, 1)} | {_f(pred, 1)} | {_f(ratio)} | {_f(row.get('p99_ms'), 1)} | "
            f"{_f(row.get('agreement'), 4)} | {_f(row.get('client_ms'))} |"
        )
    ratios = entry.get("ratios") or {}
    out += ["", "ratios: " + ", ".join(f"{k} {_f(v)}x" for k, v in ratios.items()), ""]
    return out


def _targets(sections: dict) -> list[str]:
    """The issue's targets on a GPU, read off the figures."""
    out = ["## Targets", ""]
    caps = sections.get("capacity", {}).get("capacities") or {}

    def ratio(a: str, b: str) -> float | None:
        x, y = caps.get(a, {}).get("capacity_rps"), caps.get(b, {}).get("capacity_rps")
        return x / y if x and y else None

    def verdict(value: float | None, ok) -> str:
        return "not measured" if value is None else ("met" if ok(value) else "missed")

    r1, r2 = ratio("exitplan", "naive-ee-buckets"), ratio("exitplan", "vanilla")
    out.append(f"- exitplan >= 1.5x naive early exit + buckets: {_f(r1)}x, {verdict(r1, lambda v: v >= 1.5)}")
    out.append(f"- exitplan >= 2x vanilla: {_f(r2)}x, {verdict(r2, lambda v: v >= 2.0)}")
    errs = [
        row["predicted_rps"] / row["capacity_rps"]
        for row in caps.values()
        if row.get("predicted_rps") and row.get("capacity_rps")
    ]
    worst = max((abs(e - 1) for e in errs), default=None)
    out.append(
        f"- predicted within +-20 % of measured for all: worst {_f(worst)}, {verdict(worst, lambda v: v <= 0.2 and len(errs) == len(caps))}"
    )
    points = sections.get("curves", {}).get("points") or []
    best = [
        p["ms"] for p in points if p["precision"] == "fp16" and p["bucket"] == 128 and p["batch"] == 64 and p.get("ms")
    ]
    floor = [
        r["ms"]
        for r in sections.get("floors", {}).get("rows") or []
        if r["floor"] == "torch-eager" and r["bucket"] == 128 and r["batch"] == 64 and r.get("ms")
    ]
    f16 = min(best) / floor[0] if best and floor else None
    out.append(
        f"- fp16 batch 64 length 128 within 1.5x of PyTorch fp16 eager: {_f(f16)}x, {verdict(f16, lambda v: v <= 1.5)}"
    )
    return [*out, ""]
