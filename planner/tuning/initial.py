"""Initial exit thresholds for a service, from its bundle's calibration window (held-out data).

The accuracy budget must hold for the traffic the service gets, whose length mix is not the
calibration window's and moves (the drift loop re-plans for exactly that). How often an early
exit disagrees with the full model depends on the input's length (on the MiniLM test bundle,
thresholds tuned on the whole window to 1.8 % disagree 2.0 % on inputs of <= 16 tokens and
3.2 % on 17..32, but 0.7 % on 33..64), so thresholds tuned on the window as a whole keep the
budget only for traffic mixed like the window. Here the budget holds in every length stratum (the
service's length buckets): each stratum is tuned to the budget less its own sampling error
(`autotune.sample_budget` on the stratum's inputs), raising thresholds only, until every stratum
is within; any mix of lengths over the buckets then stays within the budget.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from exitplan.api.bundle import BundleError, BundleManifest, read_manifest
from exitplan.planner.tuning.autotune import sample_budget
from exitplan.planner.tuning.feedback import DISABLED, FeedbackWindow, evaluate
from exitplan.planner.tuning.thresholds import tune

MAX_ROUNDS = 20

Strata = list[tuple[int, float]]
"""Per length stratum: (inputs, disagreement with the full model at the thresholds)."""


class MissingCalibrationWindow(ValueError):
    """The bundle has exit ramps but no calibration window (``data/window.npz``) to tune them on."""


def length_strata(lengths: npt.NDArray[np.int64], bounds: Sequence[int]) -> list[npt.NDArray[np.bool_]]:
    """Boolean masks, one per bucket (lengths up to its bound, above the previous one; the last
    takes everything longer too), empty ones left out."""
    masks: list[npt.NDArray[np.bool_]] = []
    low = 0
    ordered = sorted(int(b) for b in bounds)
    for i, high in enumerate(ordered):
        mask: npt.NDArray[np.bool_] = (lengths > low) & ((lengths <= high) if i < len(ordered) - 1 else True)
        if mask.any():
            masks.append(mask)
        low = high
    return masks


def initial_thresholds(bundle: Path, budget: float, bounds: Sequence[int]) -> tuple[dict[str, float], Strata]:
    """A service's first thresholds: (thresholds per exit ramp, per stratum (inputs, disagreement))
    on the bundle's calibration window, within `budget` in every length stratum (`bounds`: the
    service's length buckets; fewer than two, or no input lengths in the held-out set: the whole
    window is the one stratum), the inputs' lengths read from the held-out set (`stratify`).
    The one way initial thresholds are computed: the operator's first plan and `exitplan up` /
    `exitplan demo` both call it. ({}, []) for a bundle without exit ramps; raises
    :class:`MissingCalibrationWindow` when the bundle has ramps but no calibration window."""
    manifest = read_manifest(bundle)
    ramps = [r.name for r in manifest.exit_ramps()]
    if not ramps:
        return {}, []
    path = bundle / "data" / "window.npz"
    if not path.is_file():
        raise MissingCalibrationWindow(
            f"{path}: the bundle has exit ramps but no calibration window to tune their thresholds on; "
            f"rebuild it with `exitplan prepare --force`"
        )
    window = FeedbackWindow.load(path)
    lengths = None
    heldout = bundle / manifest.data.heldout
    if heldout.is_file():
        with np.load(heldout) as data:
            if "length" in data.files and data["length"].shape == (window.n_inputs,):
                lengths = data["length"].astype(np.int64)
    thresholds, report = stratify(window, lengths, budget, bounds)
    return {name: float(t) for name, t in zip(ramps, thresholds)}, report


def stratify(
    window: FeedbackWindow, lengths: npt.NDArray[np.int64] | None, budget: float, bounds: Sequence[int]
) -> tuple[npt.NDArray[np.float64], Strata]:
    """Thresholds within `budget` in every length stratum of `window` (pure).

    Starts from the whole window tuned to its sample budget, then for each stratum that breaks
    its own sample budget re-tunes on that stratum from the current thresholds and keeps only the
    raises, until no stratum breaks (or every ramp is disabled, which disagrees nowhere). Without
    lengths (or with one bucket) the window is the one stratum."""
    thresholds: npt.NDArray[np.float64] = np.asarray(
        tune(window, sample_budget(budget, window.n_inputs)).thresholds, dtype=np.float64
    )
    if lengths is None or len(bounds) < 2:
        return thresholds, [(window.n_inputs, 1.0 - evaluate(window, thresholds)[0])]

    def part(mask: npt.NDArray[np.bool_]) -> FeedbackWindow:
        return FeedbackWindow(
            conf=window.conf[mask],
            pred=window.pred[mask],
            final=window.final[mask],
            saving_ms=window.saving_ms,
            cost_ms=window.cost_ms,
        )

    strata = [part(m) for m in length_strata(np.asarray(lengths, dtype=np.int64), bounds)]
    for _ in range(MAX_ROUNDS):
        broken = False
        for stratum in strata:
            allowed = sample_budget(budget, stratum.n_inputs)
            if 1.0 - evaluate(stratum, thresholds)[0] > allowed + 1e-12:
                broken = True
                tuned = np.asarray(tune(stratum, allowed, start=thresholds).thresholds, dtype=np.float64)
                thresholds = np.maximum(thresholds, tuned)
        if not broken:
            break
    else:
        thresholds = np.full(window.n_ramps, DISABLED, dtype=np.float64)
    return thresholds, [(s.n_inputs, 1.0 - evaluate(s, thresholds)[0]) for s in strata]


def survival_curve(conf: np.ndarray, thresholds: Sequence[float]) -> list[float]:
    """Fraction of inputs still running after each exit ramp (earliest-exit semantics)."""
    exited = np.zeros(conf.shape[0], dtype=bool)
    out = []
    for r, t in enumerate(thresholds):
        if t <= 1.0:
            exited |= conf[:, r] >= t
        out.append(float(1.0 - exited.mean()) if conf.shape[0] else 1.0)
    return out


def survival_at(directory: Path, manifest: BundleManifest, thresholds: Mapping[str, float]) -> dict[str, float]:
    """Ramp name -> share of the calibration window's inputs that pass it under `thresholds` (the profiler's
    rule, and the one `exitplan up` and the demo plan with); BundleError without a window."""
    window_path = directory / "data" / "window.npz"
    if not window_path.is_file():
        raise BundleError(
            f"{window_path}: the bundle has no calibration window; rebuild it with `exitplan prepare --force`"
        )
    with np.load(window_path) as window:
        conf = window["conf"]
    exits = manifest.exit_ramps()
    surv = survival_curve(conf, [thresholds[r.name] for r in exits])
    survival = {r.name: s for r, s in zip(exits, surv)}
    # The head is not an exit: its entry repeats the survival after the last exit ramp.
    survival[manifest.final_ramp().name] = surv[-1] if surv else 1.0
    return survival
