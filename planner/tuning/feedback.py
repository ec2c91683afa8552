"""The feedback window and what a set of exit thresholds does on it (pure numpy).

The tuner itself lives in :mod:`exitplan.planner.tuning.thresholds` (which re-exports these names).

A *window* records, for N inputs and R exit ramps (block order, the final head excluded):
``conf`` [N, R] (exit confidence at each ramp, in [0, 1]), ``pred`` [N, R] (each ramp's answer),
``final`` [N] (the full model's answer), ``saving_ms`` [R] (latency saved by exiting at a ramp
instead of running to the end) and ``cost_ms`` [R] (a ramp's overhead, paid by every input that
reaches it while it is active).

Semantics of thresholds, agreement and savings, used everywhere in exitplan:

- A ramp is *active* when its threshold is <= 1; any threshold above 1 disables it (the tuner writes
  :data:`DISABLED`). An input exits at the earliest active ramp whose confidence is >= that ramp's
  threshold; an input that never exits runs to the end and agrees with the full model by definition.
- ``agreement`` = fraction of inputs whose answer (the exit ramp's ``pred``, or ``final``) equals
  ``final``.
- An input *reaches* a ramp when it has not exited before it: an input exiting at ramp k reached the
  active ramps 0..k (k included: it paid for the ramp that let it out); an input that never exits
  reached every active ramp. Disabled ramps cost nothing. Per input, its saving is the exit ramp's
  ``saving_ms`` (0 if it never exits) minus the ``cost_ms`` of the active ramps it reached;
  ``saving_ms`` of a window = the mean of that over inputs (negative when ramps cost more than
  exits save).
- The budget holds when ``agreement >= 1 - budget``, evaluated on integer counts: disagreements
  <= floor(budget * N + 1e-9), so float rounding never decides it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

DISABLED = 2.0
"""The threshold the tuner writes for a disabled ramp (any value above 1 disables)."""

_FIELDS = ("conf", "pred", "final", "saving_ms", "cost_ms")
_CONF_SLACK = 1e-5


class WindowError(ValueError):
    """Bad tuning input; ``field`` names what is wrong (``conf``, ``budget``, ``thresholds``...)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class InfeasibleBudget(WindowError):
    """The ramps the tuner may not move already break the budget on this window."""


def _int_array(name: str, value: object, ndim: int) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != ndim:
        raise WindowError(name, f"expected {ndim} dimension(s), got shape {arr.shape}")
    if arr.dtype.kind in "biu":
        return arr.astype(np.int64)
    if arr.dtype.kind == "f":
        if not np.isfinite(arr).all():
            raise WindowError(name, "holds NaN or infinite values; answers must be class indices")
        if (arr != np.round(arr)).any():
            raise WindowError(name, "holds non-integer values; answers must be class indices")
        return arr.astype(np.int64)
    raise WindowError(name, f"expected integer class indices, got dtype {arr.dtype}")


def _float_array(name: str, value: object, ndim: int) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype.kind not in "biuf":
        raise WindowError(name, f"expected numbers, got dtype {arr.dtype}")
    if arr.ndim != ndim:
        raise WindowError(name, f"expected {ndim} dimension(s), got shape {arr.shape}")
    arr = np.ascontiguousarray(arr, dtype=np.float64)
    if np.isnan(arr).any():
        bad = np.argwhere(np.isnan(arr))[0].tolist()
        raise WindowError(name, f"holds NaN (first at index {bad}); drop those inputs or fix the ramp")
    if not np.isfinite(arr).all():
        raise WindowError(name, "holds infinite values")
    return arr


@dataclass(frozen=True, eq=False)
class FeedbackWindow:
    """One feedback window (see the module docstring); validated on construction."""

    conf: np.ndarray
    pred: np.ndarray
    final: np.ndarray
    saving_ms: np.ndarray
    cost_ms: np.ndarray
    ramps: tuple[str, ...] = ()
    """Optional ramp names (R of them); empty means "ramp0".."rampR-1"."""
    agree: np.ndarray = field(init=False, repr=False)
    """[N, R] bool: ramp r's answer equals the full model's."""
    conf_t: np.ndarray = field(init=False, repr=False)
    """[R, N] ``conf`` ramp-major (contiguous per ramp)."""

    def __post_init__(self) -> None:
        conf = _float_array("conf", self.conf, 2)
        n, r = conf.shape
        if n == 0:
            raise WindowError("conf", "the window has no inputs (N = 0); record some traffic first")
        if r == 0:
            raise WindowError("conf", "the window has no ramps (R = 0)")
        if conf.min() < -_CONF_SLACK or conf.max() > 1.0 + _CONF_SLACK:
            raise WindowError("conf", f"confidences must lie in [0, 1], got [{conf.min():.6g}, {conf.max():.6g}]")
        conf = np.clip(conf, 0.0, 1.0)  # float32 softmax maxima may round a hair past 1
        pred = _int_array("pred", self.pred, 2)
        if pred.shape != (n, r):
            raise WindowError("pred", f"shape {pred.shape} does not match conf's {(n, r)}")
        final = _int_array("final", self.final, 1)
        if final.shape != (n,):
            raise WindowError("final", f"shape {final.shape} does not match conf's N = {n}")
        saving = _float_array("saving_ms", self.saving_ms, 1)
        if saving.shape != (r,):
            raise WindowError("saving_ms", f"shape {saving.shape} does not match conf's R = {r}")
        cost = _float_array("cost_ms", self.cost_ms, 1)
        if cost.shape != (r,):
            raise WindowError("cost_ms", f"shape {cost.shape} does not match conf's R = {r}")
        if (cost < 0).any():
            raise WindowError("cost_ms", "ramp overheads must be >= 0")
        ramps = tuple(str(x) for x in self.ramps)
        if ramps and len(ramps) != r:
            raise WindowError("ramps", f"{len(ramps)} names for R = {r} ramps")
        for name, value in (
            ("conf", conf),
            ("pred", pred),
            ("final", final),
            ("saving_ms", saving),
            ("cost_ms", cost),
            ("ramps", ramps or tuple(f"ramp{i}" for i in range(r))),
            ("agree", pred == final[:, None]),
            ("conf_t", np.ascontiguousarray(conf.T)),
        ):
            object.__setattr__(self, name, value)

    @property
    def n_inputs(self) -> int:
        return int(self.conf.shape[0])

    def tail(self, k: int) -> FeedbackWindow:
        """The newest `k` samples as a window: slices of this one, already validated (not checked again)."""
        if k >= self.n_inputs:
            return self
        if k <= 0:
            raise WindowError("conf", f"a tail of {k} samples holds no inputs; ask for at least one")
        out = object.__new__(FeedbackWindow)
        out.__dict__[_PARENT] = (self, self.n_inputs - k)  # its outcomes are read off this window's (`outcome`)
        for name, value in (
            ("conf", self.conf[-k:]),
            ("pred", self.pred[-k:]),
            ("final", self.final[-k:]),
            ("saving_ms", self.saving_ms),
            ("cost_ms", self.cost_ms),
            ("ramps", self.ramps),
            ("agree", self.agree[-k:]),
            ("conf_t", np.ascontiguousarray(self.conf_t[:, -k:])),
        ):
            object.__setattr__(out, name, value)
        return out

    @property
    def n_ramps(self) -> int:
        return int(self.conf.shape[1])

    @classmethod
    def load(cls, path: str | Path) -> FeedbackWindow:
        """Read the ``.npz`` format (arrays conf, pred, final, saving_ms, cost_ms; optional ramps)."""
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as data:
                missing = [k for k in _FIELDS if k not in data.files]
                if missing:
                    raise WindowError(missing[0], f"{path} has no array {missing[0]!r} (it holds {sorted(data.files)})")
                arrays = {k: data[k] for k in _FIELDS}
                ramps = tuple(str(x) for x in data["ramps"]) if "ramps" in data.files else ()
        except FileNotFoundError:
            raise WindowError("window", f"{path} does not exist") from None
        except (OSError, ValueError) as exc:
            if isinstance(exc, WindowError):
                raise
            raise WindowError("window", f"{path} is not a readable .npz window: {exc}") from None
        return cls(**arrays, ramps=ramps)

    def save(self, path: str | Path) -> None:
        np.savez(
            Path(path),
            conf=self.conf,
            pred=self.pred,
            final=self.final,
            saving_ms=self.saving_ms,
            cost_ms=self.cost_ms,
            ramps=np.asarray(self.ramps, dtype=str),
        )

    def subset(self, rows: np.ndarray | slice | None = None, ramps: list[int] | None = None) -> FeedbackWindow:
        """A window over some inputs (rows) and/or some ramps (columns, kept in block order)."""
        rows = slice(None) if rows is None else rows
        cols = list(range(self.n_ramps)) if ramps is None else sorted(ramps)
        return FeedbackWindow(
            self.conf[rows][:, cols],
            self.pred[rows][:, cols],
            self.final[rows],
            self.saving_ms[cols],
            self.cost_ms[cols],
            tuple(self.ramps[c] for c in cols),
        )


def check_budget(budget: float) -> float:
    try:
        value = float(budget)
    except (TypeError, ValueError):
        raise WindowError("budget", f"expected a fraction in [0, 1), got {budget!r}") from None
    if not (0.0 <= value < 1.0):
        raise WindowError("budget", f"expected a fraction in [0, 1) (0.01 = one point of agreement), got {budget!r}")
    return value


def allowed_disagreements(n_inputs: int, budget: float) -> int:
    """The most inputs that may disagree with the full model: floor(budget * N + 1e-9)."""
    return int(math.floor(check_budget(budget) * n_inputs + 1e-9))


def check_thresholds(thresholds: object, n_ramps: int, name: str = "thresholds") -> np.ndarray:
    t = np.asarray(thresholds, dtype=np.float64)
    if t.ndim != 1 or t.shape[0] != n_ramps:
        raise WindowError(name, f"expected {n_ramps} values (one per ramp of the window), got shape {t.shape}")
    if np.isnan(t).any():
        raise WindowError(name, f"holds NaN at ramp {int(np.argmax(np.isnan(t)))}")
    return t


def exit_index(conf: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """[N] int: the earliest ramp whose confidence >= its threshold; R where an input never exits."""
    conf = np.asarray(conf, dtype=np.float64)
    t = check_thresholds(thresholds, conf.shape[1])
    return _exit_index(conf.T, t)


def _exit_index(conf_t: np.ndarray, t: np.ndarray) -> np.ndarray:
    """exit_index over ramp-major confidences [R, N]: the active ramps from the last to the first,
    each overwriting the exit of the inputs it lets out (so the earliest one wins)."""
    r_all, n = conf_t.shape
    k = np.full(n, r_all, dtype=np.int64)
    for r in np.flatnonzero(t <= 1.0)[::-1].tolist():
        k[conf_t[r] >= t[r]] = r
    return k


@dataclass(frozen=True)
class Outcome:
    """What a set of thresholds does on a window, in detail (evaluate() returns the two headline figures)."""

    thresholds: np.ndarray
    exit_at: np.ndarray
    """[N] exit ramp per input (R = never exits)."""
    agreement: float
    saving_ms: float
    agree_count: int
    exits: np.ndarray
    """[R + 1] inputs exiting at each ramp, then those that never exit."""
    exit_agree: np.ndarray
    """[R] of the inputs exiting at each ramp, how many agree with the full model."""
    reached: np.ndarray
    """[R] inputs that reached each ramp while it was active (0 for disabled ramps)."""
    per_input_ms: np.ndarray = field(repr=False)
    """[N] each input's saving (exit saving minus the overheads of the ramps it reached)."""
    agrees: np.ndarray = field(repr=False)
    """[N] bool: the input's answer equals the full model's."""

    @property
    def active(self) -> np.ndarray:
        return self.thresholds <= 1.0


OUTCOMES_KEPT = 4
"""Outcomes a window keeps, by thresholds: the live tuner's tests (breach, exit shift, margin) each ask for
the thresholds in force on the same window."""


_PARENT = "_tail_of"
"""A tail's (FeedbackWindow.tail) key in its __dict__: (the window it is the tail of, where it starts there)."""


def outcome(w: FeedbackWindow, thresholds: object) -> Outcome:
    """What `thresholds` do on `w`. The newest OUTCOMES_KEPT are kept with the window (its arrays read-only); a
    tail's is read off the outcome its window keeps for the same thresholds, when it keeps one (each input's exit,
    agreement and saving do not depend on the other inputs: the live tuner judges the same thresholds on the
    window, its newest samples and its fresh ones)."""
    t = check_thresholds(thresholds, w.n_ramps)
    kept: dict[bytes, Outcome] = w.__dict__.setdefault("_outcomes", {})
    key = t.tobytes()
    if (hit := kept.get(key)) is not None:
        return hit
    parent: tuple[FeedbackWindow, int] | None = w.__dict__.get(_PARENT)
    whole = parent[0].__dict__.get("_outcomes", {}).get(key) if parent is not None else None
    if parent is None or whole is None:
        out = _outcome(w, t.copy())
    else:
        out = _tail_outcome(whole, parent[1], w.n_ramps)
    for arr in (out.thresholds, out.exit_at, out.exits, out.exit_agree, out.reached, out.per_input_ms, out.agrees):
        arr.flags.writeable = False
    if len(kept) >= OUTCOMES_KEPT:
        del kept[next(iter(kept))]
    kept[key] = out
    return out


def _outcome(w: FeedbackWindow, t: np.ndarray) -> Outcome:
    n, r = w.n_inputs, w.n_ramps
    k = _exit_index(w.conf_t, t)
    active = t <= 1.0
    cum_cost = np.cumsum(np.where(active, w.cost_ms, 0.0))
    exited = k < r
    kk = np.minimum(k, r - 1)
    rows = np.arange(n)
    agrees = np.where(exited, w.agree[rows, kk], True)
    per_input = np.where(exited, w.saving_ms[kk] - cum_cost[kk], -cum_cost[-1])
    return _counted(t, k, agrees, per_input, r)


def _tail_outcome(whole: Outcome, start: int, r: int) -> Outcome:
    """The outcome on the inputs from `start` on, read off `whole`, the outcome on every input."""
    return _counted(whole.thresholds.copy(), whole.exit_at[start:], whole.agrees[start:], whole.per_input_ms[start:], r)


def _counted(t: np.ndarray, k: np.ndarray, agrees: np.ndarray, per_input: np.ndarray, r: int) -> Outcome:
    """An Outcome from each input's exit ramp `k`, agreement and saving: the counts and figures over them."""
    n, active, exited = k.size, t <= 1.0, k < r
    exits = np.bincount(k, minlength=r + 1)
    exit_agree = np.bincount(k[exited], weights=agrees[exited], minlength=r).astype(np.int64)[:r]
    reached = np.where(active, n - np.concatenate(([0], np.cumsum(exits[:r])[:-1])), 0)
    agree_count = int(agrees.sum())
    return Outcome(
        t,
        k,
        agree_count / n,
        float(per_input.mean()),
        agree_count,
        exits,
        exit_agree,
        reached.astype(np.int64),
        per_input,
        agrees,
    )


def evaluate(w: FeedbackWindow, thresholds: object) -> tuple[float, float]:
    """(agreement, saving_ms) of ``thresholds`` on the window, exactly as the module docstring defines them."""
    out = outcome(w, thresholds)
    return out.agreement, out.saving_ms


def within_budget(w: FeedbackWindow, thresholds: object, budget: float) -> bool:
    return w.n_inputs - outcome(w, thresholds).agree_count <= allowed_disagreements(w.n_inputs, budget)
