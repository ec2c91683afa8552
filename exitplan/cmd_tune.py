"""`exitplan tune WINDOW.npz`: threshold tuning (Apparate's greedy) on a recorded feedback window."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path

import typer

from exitplan.cli_common import fail
from exitplan.cli_common import table as make_table


class MethodOption(str, Enum):
    profile = "profile"
    steps = "steps"


def _parse_thresholds(text: str) -> list[float]:
    from exitplan.planner.tuning.thresholds import WindowError

    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise WindowError("start", f"expected comma-separated numbers, got {text!r}") from None


def command(
    window: Path = typer.Argument(
        ...,
        dir_okay=False,
        help="Recorded window (.npz with conf [N,R], pred [N,R], final [N], saving_ms [R], cost_ms [R]).",
    ),
    budget: float = typer.Option(
        0.01,
        "--budget",
        help="Accuracy budget: the largest fraction of inputs that may disagree with the full model, in [0, 1).",
    ),
    start: str | None = typer.Option(
        None,
        "--start",
        help="Current thresholds, comma-separated, one per ramp (> 1 = disabled); default: all disabled.",
    ),
    method: MethodOption = typer.Option(
        MethodOption.profile,
        "--method",
        help="profile: every ramp proposes its best move over all distinct confidences; steps: Apparate's adaptive steps.",
    ),
    refine: bool = typer.Option(
        True,
        "--refine/--no-refine",
        help="Finish with coordinate ascent (each ramp at its exact best given the others).",
    ),
    json_path: Path | None = typer.Option(
        None, "--json", dir_okay=False, help="Write {thresholds, agreement, saving_ms} as JSON here."
    ),
) -> None:
    """Tune exit thresholds on a recorded window so agreement with the full model stays >= 1 - budget while the latency saving is largest; print a table per ramp."""
    import time

    from rich.console import Console

    from exitplan.planner.tuning.thresholds import FeedbackWindow, WindowError, outcome, tune

    console = Console()
    try:
        w = FeedbackWindow.load(window)
        start_t = _parse_thresholds(start) if start is not None else None
        began = time.perf_counter()
        result = tune(w, budget, start_t, method=method.value, refine_pass=refine)
        took_ms = (time.perf_counter() - began) * 1e3
    except WindowError as exc:
        fail(exc)
    out = outcome(w, result.thresholds)
    columns = ("ramp", "threshold", "reached", "exits", "share", "agree", "saving_ms", "cost_ms")
    table = make_table(*columns, title=f"{window.name}: {w.n_inputs} inputs, {w.n_ramps} ramps, budget {budget:g}")
    for r in range(w.n_ramps):
        on = result.thresholds[r] <= 1.0
        exits = int(out.exits[r])
        table.add_row(
            w.ramps[r],
            f"{result.thresholds[r]:.4f}" if on else "off",
            str(int(out.reached[r])),
            str(exits),
            f"{exits / w.n_inputs:.1%}",
            f"{out.exit_agree[r] / exits:.1%}" if exits else "-",
            f"{w.saving_ms[r]:.3f}",
            f"{w.cost_ms[r]:.3f}",
        )
    table.add_row(
        "(full model)", "", "", str(int(out.exits[-1])), f"{out.exits[-1] / w.n_inputs:.1%}", "100.0%", "0", ""
    )
    console.print(table)
    console.print(
        f"agreement {result.agreement:.4f} (needs >= {1 - budget:.4f}), saving {result.saving_ms:.3f} ms per input "
        f"(start: agreement {result.start_agreement:.4f}, saving {result.start_saving_ms:.3f} ms"
        f"{', repaired: the start broke the budget' if result.repaired else ''}); "
        f"{len(result.moves)} moves, {took_ms:.1f} ms"
    )
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result.to_json(), indent=2))
