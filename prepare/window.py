"""The calibration window a bundle ships (`data/window.npz`), in the format `exitplan tune` reads.

For N held-out inputs and R exit ramps (the final head not counted), in block order:
  conf [N, R]     max softmax probability of each exit ramp
  pred [N, R]     each exit ramp's argmax
  final [N]       the final head's argmax (the full model's answer)
  saving_ms [R]   latency saved by exiting at the ramp: the blocks after the ramp's block plus the head
  cost_ms [R]     the ramp's own latency, paid by every input that reaches it
plus `ramps` [R] (names), `labels` [N] (ground truth), and the `bucket` and `batch_sizes` the
latencies were measured at: per-batch latency, median of repeats, averaged over batch sizes 1..8,
at the bucket holding the median held-out input.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from exitplan.api.bundle import BundleManifest
from exitplan.prepare.measure import Heldout, batch_state, time_chain
from exitplan.worker_image.bundle_runtime import BundleRuntime, bucket_for, softmax

WINDOW_BATCH_SIZES = (1, 2, 4, 8)


@dataclass
class CalibrationWindow:
    ramps: list[str]
    conf: np.ndarray
    pred: np.ndarray
    final: np.ndarray
    saving_ms: np.ndarray
    cost_ms: np.ndarray
    labels: np.ndarray
    bucket: int
    batch_sizes: tuple[int, ...]

    def save(self, path: Path) -> None:
        np.savez(
            path,
            conf=self.conf.astype(np.float32),
            pred=self.pred.astype(np.int64),
            final=self.final.astype(np.int64),
            saving_ms=self.saving_ms.astype(np.float64),
            cost_ms=self.cost_ms.astype(np.float64),
            ramps=np.asarray(self.ramps),
            labels=self.labels.astype(np.int64),
            bucket=np.int64(self.bucket),
            batch_sizes=np.asarray(self.batch_sizes, dtype=np.int64),
        )

    def agreement(self) -> list[float]:
        """Per exit ramp: fraction of inputs whose ramp answer equals the final head's."""
        return [float(v) for v in (self.pred == self.final[:, None]).mean(axis=0)]


def ramp_window(manifest: BundleManifest, logits: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """conf [N, R], pred [N, R], final [N] from every ramp's logits."""
    exits = manifest.exit_ramps()
    probs = [softmax(logits[r.name]) for r in exits]
    conf = (
        np.stack([p.max(axis=1) for p in probs], axis=1)
        if exits
        else np.zeros((len(logits[manifest.final_ramp().name]), 0))
    )
    pred = np.stack([p.argmax(axis=1) for p in probs], axis=1) if exits else np.zeros_like(conf, dtype=np.int64)
    final = logits[manifest.final_ramp().name].argmax(axis=1)
    return conf.astype(np.float32), pred.astype(np.int64), final.astype(np.int64)


def window_bucket(runtime: BundleRuntime, heldout: Heldout) -> int:
    if heldout.ids is not None:
        median = int(np.median([len(s) for s in heldout.ids]))
    elif heldout.lengths is not None:
        median = int(np.median(heldout.lengths))
    else:
        return runtime.buckets[0]
    return bucket_for(min(median, max(runtime.buckets)), runtime.buckets)


def measure_savings(
    runtime: BundleRuntime,
    heldout: Heldout,
    bucket: int,
    batch_sizes: Sequence[int] = WINDOW_BATCH_SIZES,
    repeats: int = 5,
) -> tuple[np.ndarray, np.ndarray]:
    """saving_ms [R] and cost_ms [R] for the exit ramps (runtime must cover the whole model)."""
    m = runtime.manifest
    blocks = np.zeros(len(m.blocks))
    ramps: dict[str, float] = {r.name: 0.0 for r in m.ramps}
    for batch in batch_sizes:
        timing = time_chain(runtime, batch_state(runtime, heldout, batch, bucket), bucket, repeats)
        blocks += np.asarray(timing.block_ms) / len(batch_sizes)
        for name, value in timing.ramp_ms.items():
            ramps[name] += value / len(batch_sizes)
    head = ramps[m.final_ramp().name]
    exits = m.exit_ramps()
    saving = np.array([blocks[r.after + 1 :].sum() + head for r in exits])
    cost = np.array([ramps[r.name] for r in exits])
    return saving, cost


def build_window(
    runtime: BundleRuntime, heldout: Heldout, logits: dict[str, np.ndarray], repeats: int = 5
) -> CalibrationWindow:
    conf, pred, final = ramp_window(runtime.manifest, logits)
    bucket = window_bucket(runtime, heldout)
    saving, cost = measure_savings(runtime, heldout, bucket, WINDOW_BATCH_SIZES, repeats)
    return CalibrationWindow(
        ramps=[r.name for r in runtime.manifest.exit_ramps()],
        conf=conf,
        pred=pred,
        final=final,
        saving_ms=saving,
        cost_ms=cost,
        labels=heldout.label,
        bucket=bucket,
        batch_sizes=WINDOW_BATCH_SIZES,
    )
