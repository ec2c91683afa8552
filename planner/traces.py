"""Request traces: arrivals and input lengths (DESIGN.md "Traces").

Two formats: the Azure LLM inference CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`) and JSON lines
with `timestamp` (seconds) and `input_length`. Lengths are fitted to a model's range by a stated
option: `scale` maps the trace's largest length onto `max_length` proportionally, `clip` caps
lengths at `max_length`. Arrivals can be sped up (rate x `speed`) and cut to a window.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

LengthMode = Literal["scale", "clip"]


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class Trace:
    timestamps: np.ndarray
    """Arrival times in seconds from the first request (float64, non-decreasing)."""
    lengths: np.ndarray
    """Input lengths in tokens after fitting to the model's range (int64, >= 1)."""
    source: str = ""

    def __len__(self) -> int:
        return len(self.timestamps)

    @property
    def duration(self) -> float:
        return float(self.timestamps[-1]) if len(self) else 0.0

    @property
    def mean_rate(self) -> float:
        return len(self) / self.duration if self.duration > 0 else float(len(self))


def _read_azure_csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
    times: list[float] = []
    lengths: list[int] = []
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        if reader.fieldnames is None or not {"TIMESTAMP", "ContextTokens"} <= set(reader.fieldnames):
            raise TraceError(f"{path}: expected the columns TIMESTAMP,ContextTokens[,GeneratedTokens]")
        for lineno, row in enumerate(reader, start=2):
            try:
                stamp = row["TIMESTAMP"]
                # Python's fromisoformat takes at most 6 fractional digits; the trace has 7.
                if "." in stamp:
                    head, frac = stamp.split(".", 1)
                    stamp = f"{head}.{frac[:6]}"
                times.append(datetime.fromisoformat(stamp).timestamp())
                lengths.append(int(row["ContextTokens"]))
            except (ValueError, TypeError) as err:
                raise TraceError(f"{path}:{lineno}: {err}") from err
    return np.asarray(times, dtype=np.float64), np.asarray(lengths, dtype=np.int64)


def _read_jsonl(path: Path) -> tuple[np.ndarray, np.ndarray]:
    times: list[float] = []
    lengths: list[int] = []
    with path.open() as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                times.append(float(rec["timestamp"]))
                lengths.append(int(rec["input_length"]))
            except (ValueError, KeyError, TypeError) as err:
                raise TraceError(f"{path}:{lineno}: need an object with timestamp and input_length ({err})") from err
    return np.asarray(times, dtype=np.float64), np.asarray(lengths, dtype=np.int64)


def fit_lengths(
    lengths: np.ndarray, max_length: int, mode: LengthMode = "scale", reference_max: int | None = None
) -> np.ndarray:
    """Lengths mapped into [1, max_length]. `scale` divides by `reference_max` (default: the largest length)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    if mode == "scale":
        top = float(reference_max if reference_max is not None else lengths.max(initial=1.0))
        fitted = np.ceil(lengths * (max_length / max(top, 1.0)))
    elif mode == "clip":
        fitted = lengths
    else:
        raise TraceError(f"length mode {mode!r}: use 'scale' or 'clip'")
    return np.clip(fitted, 1, max_length).astype(np.int64)


def load_trace(
    path: str | Path,
    *,
    max_length: int,
    length_mode: LengthMode = "scale",
    reference_max: int | None = None,
    speed: float = 1.0,
    start: float = 0.0,
    duration: float | None = None,
    limit: int | None = None,
) -> Trace:
    """Read a trace, sort it by arrival, re-base time to 0, fit lengths, and cut a window.

    `speed` > 1 compresses time (a faster arrival rate with the same shape); `start`/`duration`
    (seconds, after speed-up) cut a window; `limit` keeps the first N requests of it.
    """
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    if speed <= 0:
        raise TraceError(f"speed must be > 0, got {speed}")
    times, lengths = _read_jsonl(path) if path.suffix in {".jsonl", ".json"} else _read_azure_csv(path)
    if len(times) == 0:
        raise TraceError(f"{path}: the trace holds no requests")
    order = np.argsort(times, kind="stable")
    times = (times[order] - times[order][0]) / speed
    lengths = fit_lengths(lengths[order], max_length, length_mode, reference_max)
    keep = times >= start
    if duration is not None:
        keep &= times < start + duration
    times, lengths = times[keep] - start, lengths[keep]
    if limit is not None:
        times, lengths = times[:limit], lengths[:limit]
    if len(times) == 0:
        raise TraceError(f"{path}: the window start={start}s duration={duration}s holds no requests")
    return Trace(times, lengths, str(path))


def looped_trace(
    timestamps: npt.NDArray[np.float64], lengths: npt.NDArray[np.int64], rate: float, duration_s: float
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """The trace's arrival pattern scaled to a mean of `rate` per second and repeated back to back until
    `duration_s` seconds are covered, with each arrival's own length: (arrival times, lengths).

    One pass of the trace lasts its span / speed plus one mean gap (so that its last arrival and the next
    pass's first do not coincide), speed = rate / the trace's own mean rate."""
    ts = np.asarray(timestamps, dtype=np.float64)
    if len(ts) == 0 or rate <= 0 or duration_s <= 0:
        return np.zeros(0), np.zeros(0, dtype=np.int64)
    ts = ts - ts[0]
    period_own = float(ts[-1]) + (float(ts[-1]) / max(len(ts) - 1, 1) if len(ts) > 1 else 1.0)
    own_rate = len(ts) / period_own
    scaled = ts * (own_rate / rate)
    period = period_own * (own_rate / rate)
    passes = int(np.ceil(duration_s / period))
    times = (scaled[None, :] + period * np.arange(passes)[:, None]).ravel()
    lens = np.tile(np.asarray(lengths, dtype=np.int64), passes)
    keep = times < duration_s
    return times[keep], lens[keep]


def default_trace_path() -> Path:
    """The shared Azure trace (DESIGN.md "Data at hand"), looked up beside the repository."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent / "shared" / "data" / "traces" / "azure-llm-inference-conv-2023.csv"
        if candidate.is_file():
            return candidate
        candidate = parent.parent / "shared" / "data" / "traces" / "azure-llm-inference-conv-2023.csv"
        if candidate.is_file():
            return candidate
    raise TraceError("the shared Azure trace was not found in ../shared/data/traces; pass --trace PATH")
