"""The search behind :func:`exitplan.planner.tuning.thresholds.tune` (pure numpy; internal).

State: :class:`Search` holds the thresholds and, per input, its exit ramp, whether its answer
agrees with the full model and its saving. Three ways to move:

- :func:`climb_steps`: Apparate's hill-climb as published -- one step per ramp per round, halved on
  overshoot, doubled when chosen.
- :func:`climb_profiles`: the same greedy rule (largest extra saving per unit of agreement lost,
  lowering one ramp per round) but each ramp proposes its best move over *every* distinct
  confidence below its threshold, i.e. every step size at once, read off one cumulative sum
  (:func:`lowering`). Proposals are re-computed lazily: the ramp with the best proposal is
  re-evaluated on the current state and moves only if it still beats every other ramp's last
  proposal.
- :func:`refine`: coordinate ascent that re-places one ramp at a time at its exact best threshold
  given the others (raising, lowering or disabling: :func:`profile`), until R ramps in a row bring
  nothing.
- :func:`repair`: raising thresholds until the window is back within budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from exitplan.planner.tuning.feedback import DISABLED, FeedbackWindow, outcome

EPS_MS = 1e-9


@dataclass(frozen=True)
class Move:
    """One accepted threshold change, for logs: which ramp, from/to, and the window after it."""

    phase: str
    """"repair" (raising to get back within budget), "climb" (the hill-climb), "restart" (taken from the
    budget programme, :mod:`exitplan.planner.tuning.dp`) or "refine"."""
    ramp: int
    old: float
    new: float
    agreement: float
    saving_ms: float


class Search:
    """Mutable search state over one window: thresholds, each input's exit, answer and saving.

    Arrays are kept ramp-major ([R, N]) so per-ramp reductions run over contiguous rows.
    """

    def __init__(self, w: FeedbackWindow, t: np.ndarray, allowed: int) -> None:
        self.w = w
        self.n, self.r = w.n_inputs, w.n_ramps
        self.allowed = allowed
        self.ramp_col = np.arange(self.r)[:, None]
        self.conf_t = w.conf_t
        self.agree_t = np.ascontiguousarray(w.agree.T)
        self.agree_tf = self.agree_t.astype(np.float64)
        self.agree_ti = self.agree_t.astype(np.int64)
        # Per ramp, computed once: inputs by confidence (highest first), and in that order their
        # confidences, agreement, and whether no equal confidence follows (only where ties exist).
        self.orders = np.argsort(-self.conf_t, axis=1)
        self.conf_sorted = np.take_along_axis(self.conf_t, self.orders, axis=1)
        self.agree_sorted = np.take_along_axis(self.agree_ti, self.orders, axis=1)
        differs = self.conf_sorted[:, 1:] != self.conf_sorted[:, :-1]
        self.ties = ~differs.all(axis=1)
        self.group_end: list[np.ndarray | None] = [
            np.append(differs[q], True) if self.ties[q] else None for q in range(self.r)
        ]
        self.cost_l = [float(x) for x in w.cost_ms]
        self.saving_l = [float(x) for x in w.saving_ms]
        self._before_key = b""
        self._before: list[float] = []
        self.set(t)

    def order(self, ramp: int) -> npt.NDArray[np.intp]:
        """Inputs by confidence at ``ramp``, highest first."""
        row: npt.NDArray[np.intp] = self.orders[ramp]
        return row

    def cost_before(self, ramp: int) -> float:
        """Overhead of the active ramps before ``ramp``."""
        key = (self.t <= 1.0).tobytes()
        if self._before_key != key:
            paid = np.cumsum(np.where(self.t <= 1.0, self.w.cost_ms, 0.0))
            self._before = [0.0, *paid[:-1].tolist()]
            self._before_key = key
        return self._before[ramp]

    def set(self, t: np.ndarray) -> None:
        out = outcome(self.w, t)
        self.t = out.thresholds.copy()
        self.k = out.exit_at.copy()  # changed in place by the search (an outcome's arrays are read-only)
        self.ok = out.agrees.astype(np.int64)
        self.val = out.per_input_ms.copy()
        self.n_agree = out.agree_count
        self.total = float(self.val.sum())

    @property
    def feasible(self) -> bool:
        return self.n - self.n_agree <= self.allowed

    @property
    def figures(self) -> tuple[float, float]:
        return self.n_agree / self.n, self.total / self.n


def climb_steps(
    s: Search,
    movable: np.ndarray,
    init_step: float,
    min_step: float,
    max_step: float,
    max_rounds: int,
    moves: list[Move],
) -> tuple[np.ndarray, float, int]:
    """The hill-climb; returns the best thresholds visited, their total saving, and the rounds."""
    n, r = s.n, s.r
    conf_t, agree_tf, cost, saving = s.conf_t, s.agree_tf, s.w.cost_ms, s.w.saving_ms
    steps = np.full(r, init_step)
    done = ~movable
    best_t, best_total = s.t.copy(), s.total
    rounds = 0
    while rounds < max_rounds and not done.all():
        rounds += 1
        t = s.t
        active = t <= 1.0
        passing = s.k > s.ramp_col  # [R, N]: reached the ramp and went on (or it is disabled)
        top = np.where(passing, conf_t, -1.0).max(axis=1)  # highest confidence still passing each ramp
        done |= top < 0.0
        cand = np.maximum(np.minimum(np.minimum(t, 1.0) - steps, top), 0.0)
        newly = passing & (conf_t >= cand[:, None])
        nf = newly.astype(np.float64)
        count = newly.sum(axis=1)
        d_agree = np.rint(np.einsum("ij,ij->i", nf, agree_tf) - nf @ s.ok).astype(np.int64)
        off_cost = np.where(active, 0.0, cost)  # the ramp's own cost if the move switches it on
        d_total = (
            (saving - np.cumsum(cost - off_cost) - off_cost) * count
            - nf @ s.val
            - off_cost * (passing.sum(axis=1) - count)
        )
        fits = n - (s.n_agree + d_agree) <= s.allowed
        # Overshoot: halve the step; a ramp whose smallest move overshoots is done.
        over = ~done & ~fits
        done |= over & ((steps <= min_step) | (cand >= top))
        steps = np.where(over, np.maximum(steps / 2.0, min_step), steps)
        ok = ~done & fits
        if not ok.any():
            continue
        loss = -d_agree
        gain = d_total > EPS_MS
        tier = np.where(gain & (loss <= 0), 2, np.where(gain, 1, 0))
        key = np.where(loss > 0, d_total / np.maximum(loss, 1), d_total)
        pick = int(np.argmax(np.where(ok & (tier == tier[ok].max()), key, -np.inf)))
        old = float(t[pick])
        _lower(
            s,
            pick,
            float(cand[pick]),
            newly[pick],
            int(d_agree[pick]),
            float(d_total[pick]),
            was_active=bool(active[pick]),
        )
        steps[pick] = min(steps[pick] * 2.0, max_step)
        moves.append(Move("climb", pick, old, float(cand[pick]), *s.figures))
        if s.total > best_total + EPS_MS:
            best_t, best_total = s.t.copy(), s.total
    return best_t, best_total, rounds


def _lower(
    s: Search, ramp: int, new_t: float, newly: np.ndarray, d_agree: int, d_total: float, was_active: bool
) -> None:
    """Apply a climb move: the ``newly`` inputs now exit at ``ramp``."""
    w = s.w
    if not was_active:
        s.val[s.k > ramp] -= w.cost_ms[ramp]  # inputs going past a newly active ramp pay for it
    s.t[ramp] = new_t
    cost_through = float(np.sum(w.cost_ms[: ramp + 1][s.t[: ramp + 1] <= 1.0]))
    s.k[newly] = ramp
    s.ok[newly] = s.agree_ti[ramp, newly]
    s.val[newly] = w.saving_ms[ramp] - cost_through
    s.n_agree += d_agree
    s.total += d_total


@dataclass(slots=True, eq=False)
class Profile:
    """Every placement of one ramp's threshold with the others fixed (see :func:`profile`)."""

    ramp: int
    reach: npt.NDArray[np.intp]
    """The inputs reaching the ramp, highest confidence first."""
    val_off: npt.NDArray[np.float64]
    """Per reaching input: its saving, agreement (0/1) and exit ramp if the ramp let it go on."""
    ok_off: npt.NDArray[np.int64]
    k_off: npt.NDArray[np.int64]
    conf: npt.NDArray[np.float64]
    """Their confidences at the ramp."""
    ends: npt.NDArray[np.intp]
    """Last index of each tie group of ``conf``: the distinct placements."""
    totals: npt.NDArray[np.float64]
    """Per placement: the window's total saving and agreement count."""
    agrees: npt.NDArray[np.int64]
    total_off: float
    """The same with the ramp disabled."""
    agree_off: int

    def threshold(self, pos: int) -> float:
        """The threshold letting out the first ``ends[pos] + 1`` reaching inputs (-1: disabled)."""
        if pos < 0:
            return DISABLED
        c, e = self.conf, int(self.ends[pos])
        if e + 1 < c.size and c[e + 1] < (c[e] + c[e + 1]) / 2.0 <= c[e]:
            return float((c[e] + c[e + 1]) / 2.0)  # midway to the next input that does not exit
        return float(c[e])

    def best(self, s: Search) -> tuple[int, float]:
        """(position, total) of the best placement within budget (-1 = disabled, preferred on ties)."""
        score = np.where(s.n - self.agrees <= s.allowed, self.totals, -np.inf)
        off = self.total_off if s.n - self.agree_off <= s.allowed else -np.inf
        i = int(np.argmax(score)) if score.size else -1
        if i < 0 or not score[i] > off + EPS_MS * max(1.0, abs(off) if np.isfinite(off) else 1.0):
            return -1, float(off)
        return i, float(score[i])


def profile(s: Search, ramp: int, order: np.ndarray) -> Profile | None:
    """Saving and agreement of every threshold of one ramp with the others fixed.

    Only the inputs reaching the ramp matter; for each, its fate if the ramp let it go on (``*_off``:
    its later exit, or the end) is fixed by the other thresholds, so one cumulative sum over the
    inputs in confidence order gives the saving and agreement of every distinct threshold.
    """
    w, t, k = s.w, s.t, s.k
    active = t <= 1.0
    cost_r = float(w.cost_ms[ramp])
    k_sorted = k[order]
    reaching = k_sorted >= ramp
    reach = order[reaching]  # inputs reaching the ramp, highest confidence first
    m = reach.size
    if m == 0:
        return None
    before = s.cost_before(ramp)
    k_off = k_sorted[reaching]
    val_off = s.val[reach] + (cost_r if active[ramp] else 0.0)
    ok_off = s.ok[reach]
    here = np.flatnonzero(k_off == ramp)
    if here.size:  # inputs exiting here now: where would they go instead?
        ok_off = ok_off.copy()
        rows = reach[here]
        if ramp == s.r - 1:
            val_off[here], ok_off[here], k_off[here] = -before, 1, s.r
        else:
            later = t[ramp + 1 :]
            hits = s.conf_t[ramp + 1 :, rows] >= later[:, None]
            anyhit = hits.any(axis=0)
            q = ramp + 1 + hits.argmax(axis=0)
            cum_after = np.cumsum(np.where(later <= 1.0, w.cost_ms[ramp + 1 :], 0.0))
            val_off[here] = np.where(anyhit, w.saving_ms[q] - before - cum_after[q - ramp - 1], -before - cum_after[-1])
            ok_off[here] = np.where(anyhit, s.agree_ti[q, rows], 1)
            k_off[here] = np.where(anyhit, q, s.r)
    total_off = s.total - float(s.val[reach].sum()) + float(val_off.sum())
    agree_off = s.n_agree - int(s.ok[reach].sum()) + int(ok_off.sum())
    c = s.conf_t[ramp, reach]
    ends = np.flatnonzero(np.append(c[1:] != c[:-1], True))  # last index of each tie group
    totals = total_off - cost_r * m + np.cumsum(w.saving_ms[ramp] - before - val_off)[ends]
    agrees = agree_off + np.cumsum(s.agree_ti[ramp, reach] - ok_off)[ends]
    return Profile(
        ramp=ramp,
        reach=reach,
        val_off=val_off,
        ok_off=ok_off,
        k_off=k_off,
        conf=c,
        ends=ends,
        totals=totals,
        agrees=agrees,
        total_off=total_off,
        agree_off=agree_off,
    )


def place(s: Search, p: Profile, pos: int) -> None:
    """Apply placement ``pos`` of a profile (-1 = disable the ramp)."""
    w, ramp = s.w, p.ramp
    s.t[ramp] = p.threshold(pos)
    if pos < 0:
        s.k[p.reach], s.val[p.reach], s.ok[p.reach] = p.k_off, p.val_off, p.ok_off
        s.total, s.n_agree = float(p.total_off), int(p.agree_off)
        return
    n_exit = int(p.ends[pos]) + 1
    cost_r = float(w.cost_ms[ramp])
    cost_through = float(np.sum(w.cost_ms[: ramp + 1][s.t[: ramp + 1] <= 1.0]))
    out, on = p.reach[:n_exit], p.reach[n_exit:]
    s.k[out], s.val[out], s.ok[out] = ramp, w.saving_ms[ramp] - cost_through, s.agree_ti[ramp, out]
    s.k[on], s.val[on], s.ok[on] = p.k_off[n_exit:], p.val_off[n_exit:] - cost_r, p.ok_off[n_exit:]
    s.total, s.n_agree = float(p.totals[pos]), int(p.agrees[pos])


class Lowering:
    """The lowerings of one ramp's threshold with the others fixed (see :func:`lowering`).

    Position p lets out the first p + 1 of the inputs going past the ramp (``going``: a mask over
    the ramp's confidence order); ``ends`` (None: every position) marks the positions that do not
    split inputs of equal confidence. ``totals`` / ``agrees``: the window's total saving and
    agreement count after each position's move, up to the last position within the budget (the
    later ones can never be proposed).
    """

    __slots__ = (
        "ramp",
        "idx",
        "going",
        "sorted_conf",
        "_conf",
        "ends",
        "totals",
        "agrees",
        "exit_ms",
        "activates",
        "first",
        "done",
    )

    def __init__(
        self,
        ramp: int,
        idx: np.ndarray,
        going: np.ndarray,
        sorted_conf: np.ndarray,
        ends: np.ndarray | None,
        totals: np.ndarray,
        agrees: np.ndarray,
        exit_ms: float,
        activates: bool,
    ) -> None:
        self.ramp, self.idx, self.going, self.sorted_conf = ramp, idx, going, sorted_conf
        self.ends, self.totals, self.agrees = ends, totals, agrees
        self.exit_ms, self.activates = exit_ms, activates
        self._conf: np.ndarray | None = None
        self.first = 0  # positions before this one are no longer lowerings (the ramp already moved there)
        self.done = 0  # inputs of idx already let out

    @property
    def conf(self) -> np.ndarray:
        """Confidences of the inputs going past the ramp, highest first (taken when first needed)."""
        if self._conf is None:
            self._conf = self.sorted_conf[self.going]
        return self._conf

    def threshold(self, pos: int) -> float:
        c = self.conf
        if pos + 1 < c.size and c[pos + 1] < (c[pos] + c[pos + 1]) / 2.0 <= c[pos]:
            return float((c[pos] + c[pos + 1]) / 2.0)  # midway to the next input that does not exit
        return float(c[pos])

    def proposal(self, s: Search) -> tuple[int, float, int] | None:
        """The greedy's proposal: (tier, key, position) of the best lowering that fits and saves more.

        Tier 2: moves that lose no agreement (key: the extra saving); tier 1: the others (key: extra
        saving per input that stops agreeing). None when no lowering fits the budget and saves more.
        """
        first = self.first
        totals, agrees = self.totals, self.agrees
        if first >= totals.size:
            return None
        if first:
            totals, agrees = totals[first:], agrees[first:]
        gain = totals - s.total
        floor = EPS_MS * max(1.0, abs(s.total))  # a move must save more than this
        # Tier 2: the feasible state has n_agree >= n - allowed, so a move that loses no agreement fits.
        free = agrees >= s.n_agree
        if self.ends is not None:
            free &= self.ends[first:]
        keyed = np.where(free, gain, -np.inf)
        j = int(keyed.argmax())
        if keyed[j] > floor:  # the first position of the largest gain (all such gains exceed the floor)
            return 2, float(gain[j]), first + j
        if s.n - s.n_agree >= s.allowed:
            return None  # no budget left for a move that loses agreement
        ok = gain > floor
        ok &= agrees >= s.n - s.allowed
        if self.ends is not None:
            ok &= self.ends[first:]
        ratio = np.where(ok, gain / np.maximum(s.n_agree - agrees, 1), -np.inf)
        j = int(ratio.argmax())
        if ratio[j] > -np.inf:
            return 1, float(ratio[j]), first + j
        return None


def lowering(s: Search, ramp: int) -> Lowering | None:
    """Saving and agreement of letting out, at ``ramp``, the first p of the inputs now going past it.

    Those inputs are taken by confidence, highest first; a disabled ramp is switched on by the move
    (every input going past it then pays its overhead). One running sum gives every p.
    """
    order = s.orders[ramp]
    going = s.k[order] > ramp
    idx = order[going]
    m = idx.size
    if m == 0:
        return None
    cost_r = s.cost_l[ramp]
    activates = s.t[ramp] > 1.0
    shift = cost_r if activates else 0.0
    exit_ms = s.saving_l[ramp] - s.cost_before(ramp) - cost_r
    agrees = s.agree_sorted[ramp][going]
    agrees -= s.ok[idx]
    np.add.accumulate(agrees, out=agrees)
    agrees += s.n_agree
    # Positions past the last one within budget can never be proposed (the budget does not move):
    # the savings are summed only up to it.
    within = (agrees >= s.n - s.allowed)[::-1]
    last = int(within.argmax())
    size = m - last if within[last] else 0
    agrees = agrees[:size]
    totals = np.subtract(exit_ms + shift, s.val[idx[:size]])
    np.add.accumulate(totals, out=totals)
    totals += s.total - shift * m
    # A cut must not split inputs of equal confidence (a tie with an input that does not go past
    # the ramp is harmless, so the whole-column tie marks are a safe, slightly strict filter).
    group_end = s.group_end[ramp]  # None: no tied confidences at this ramp
    ends = group_end[going][:size] if group_end is not None else None
    return Lowering(ramp, idx, going, s.conf_sorted[ramp], ends, totals, agrees, exit_ms, activates)


def place_lowering(s: Search, low: Lowering, pos: int) -> None:
    """Apply lowering ``pos``; the lowering stays valid for the ramp's next move (only later positions)."""
    ramp = low.ramp
    if low.activates:
        s.val[s.k > ramp] -= s.cost_l[ramp]  # everyone going past the ramp now pays for it
        low.activates = False
    newly = low.idx[low.done : pos + 1]
    s.k[newly] = ramp
    s.ok[newly] = s.agree_ti[ramp][newly]
    s.val[newly] = low.exit_ms
    s.t[ramp] = low.threshold(pos)
    s.total, s.n_agree = float(low.totals[pos]), int(low.agrees[pos])
    low.done, low.first = pos + 1, pos + 1


def climb_profiles(s: Search, movable: np.ndarray, max_rounds: int, moves: list[Move]) -> int:
    """The greedy over whole lowering profiles with lazy re-evaluation; returns the profiles computed.

    A ramp's lowerings depend only on the other ramps' thresholds, so they stay valid after the
    ramp's own move; every other move makes them stale. Each round takes the ramp with the best
    proposal, recomputes its lowerings if stale, and moves it if its fresh proposal still beats every
    other ramp's last one.
    """
    version = 0
    cache: dict[int, tuple[int, Lowering | None]] = {}
    proposals: dict[int, tuple[int, float]] = {}
    computed = 0

    def fresh(ramp: int) -> Lowering | None:
        nonlocal computed
        got = cache.get(ramp)
        if got is not None and got[0] == version:
            return got[1]
        computed += 1
        low = lowering(s, ramp)
        cache[ramp] = (version, low)
        return low

    for ramp in map(int, np.flatnonzero(movable)):
        low = fresh(ramp)
        move = low.proposal(s) if low is not None else None
        if move is not None:
            proposals[ramp] = move[:2]
    while proposals and computed < max_rounds:
        ramp = max(proposals, key=proposals.__getitem__)
        low = fresh(ramp)
        move = low.proposal(s) if low is not None else None
        if low is None or move is None:
            del proposals[ramp]
            continue
        proposals[ramp] = move[:2]
        if max(proposals.values()) > move[:2]:
            continue  # its proposal went stale; another ramp's may be better now
        old = float(s.t[ramp])
        place_lowering(s, low, move[2])
        version += 1
        cache[ramp] = (version, low)
        moves.append(Move("climb", ramp, old, float(s.t[ramp]), *s.figures))
        if s.n - s.n_agree >= s.allowed:
            # No budget left: a move that loses agreement cannot fit any more, so proposals of
            # that kind are dropped without re-evaluation (the refinement re-checks every ramp).
            proposals = {q: p for q, p in proposals.items() if p[0] == 2 or q == ramp}
    return computed


def refine(s: Search, movable: np.ndarray, moves: list[Move], max_sweeps: int, active_only: bool = True) -> None:
    """Coordinate ascent: re-place one ramp at a time at its exact best; stop after R ramps without gain.

    ``active_only``: only the active ramps are re-placed (raised, lowered or switched off); the climb
    and the budget programme have already weighed switching the others on.
    """
    since_gain, checks, ramp = 0, 0, 0
    while since_gain < s.r and checks < max_sweeps * s.r:
        checks += 1
        since_gain += 1
        if movable[ramp] and (not active_only or s.t[ramp] <= 1.0):
            prof = profile(s, ramp, s.order(ramp))
            if prof is not None:
                pos, score = prof.best(s)
                if score > s.total + EPS_MS * max(1.0, abs(s.total)):
                    old = float(s.t[ramp])
                    place(s, prof, pos)
                    moves.append(Move("refine", ramp, old, float(s.t[ramp]), *s.figures))
                    since_gain = 0
        ramp = (ramp + 1) % s.r


def repair(s: Search, movable: np.ndarray, init_step: float, moves: list[Move]) -> None:
    """Raise thresholds until the window is within budget (largest agreement gain per saving lost)."""
    steps = np.full(s.r, init_step)
    while not s.feasible:
        best, best_key = None, -np.inf
        for ramp in np.flatnonzero(movable & (s.t <= 1.0)).tolist():
            t = s.t.copy()
            t[ramp] = t[ramp] + steps[ramp] if t[ramp] + steps[ramp] <= 1.0 else DISABLED
            out = outcome(s.w, t)
            d_agree = out.agree_count - s.n_agree
            if d_agree <= 0:
                continue
            lost = s.total / s.n - out.saving_ms
            key = d_agree / max(lost, 1e-12)
            if key > best_key:
                best, best_key = (int(ramp), t), key
        if best is None:
            if (steps >= 1.0).all():
                # No single ramp helps even switched off (inputs would only fail at a later
                # ramp instead): switch off every movable ramp, which the caller checked is enough.
                old_t = s.t.copy()
                s.set(np.where(movable, DISABLED, s.t))
                for q in np.flatnonzero(old_t != s.t):
                    moves.append(Move("repair", int(q), float(old_t[q]), DISABLED, *s.figures))
                break
            steps *= 2.0
            continue
        ramp, t = best
        old = float(s.t[ramp])
        s.set(t)
        steps[ramp] *= 2.0
        moves.append(Move("repair", ramp, old, float(t[ramp]), *s.figures))
