"""The cost model: what a block range costs on a pool, read from a ModelProfile (data, no solver).

- Latency of block k at any batch size and sequence length: piecewise-linear interpolation of the
  profile's `latencyMs[seqLen][batch]` table. Batch sizes below the smallest measured one scale
  linearly to 0 (an expected batch of 0.5 inputs costs half a 1-input batch on average); lengths
  outside the measured range and batches above it are clamped to the range, and every clamp is
  recorded in `notes` so the plan can say so.
- A split [a, b] runs block a at the full batch B; block k > a runs the survivors, B * s(k) / s(a)
  rounded up, where s(k) is the fraction of all inputs that reach block k (the survival curve). The exit ramps
  that are enabled run after their block on the batch that block ran.
- A rebatching split (SplitPlan.rebatch: one fusion queue per block) runs every block on a full
  batch B of the rows that reached it: per B entering rows it spends, on average,
  sum_k s(k)/s(a) x (block k + its ramp) at batch B (block k runs once per B / (s(k)/s(a))
  entering rows); one round, every block once at B, bounds the cycle.
- Transfer time of the activations leaving a split: survivors x output bytes per sample at that
  boundary / the pool's link bandwidth.
- The worker's own work per batch (the profile's `serving.hopMs`: the hop in, the answer or forward
  out, measured by running the real processes) is added once to every split's time per batch.
- On a CPU pool every block and ramp time at a length is multiplied by the profile's
  `serving.computeScale` there: the tables hold the fastest of repeats on fixed shapes, the workers
  spend their mean CPU time on the sessions they run (a free length where they trim): 3-12 % more for
  MiniLM on the 2-core dev machine.
- Memory per replica: the split's weights plus input and output activations of one batch (with
  rebatching also up to one batch of rows waiting at every inner block boundary).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
from scipy.stats import binom

from exitplan.api.resources import GPUPoolSpec, ModelProfileSpec
from exitplan.planner.errors import ProfileError
from exitplan.planner.rebatch_fill import fill_tables

FloatArray = npt.NDArray[np.float64]

MONOTONE_SLACK = 0.5
"""Measured latencies may dip by this fraction (timer noise on shared machines: profiles measured on
the 2-core dev machine dip by up to ~30 % at large batches) before the profile counts as
non-monotone; smaller dips are smoothed to a running maximum and noted."""
MONOTONE_FLOOR_MS = 0.05
"""Dips smaller than this many milliseconds are always noise."""


def _check_table(
    table: list[list[float]], name_: str, n_seq: int, n_batch: int, notes: list[str], prefix: str = ""
) -> np.ndarray:
    where = f"{prefix}.{name_}" if prefix else name_
    if len(table) != n_seq or any(len(row) != n_batch for row in table):
        shape = f"{len(table)} rows of " + ",".join(str(len(r)) for r in table) if table else "no rows"
        raise ProfileError(
            f"latency table has {shape}; expected {n_seq} rows (seqLens) of {n_batch} entries (batchSizes). "
            "Re-run `exitplan profile` or fill the missing cells",
            field=f"{where}.latencyMs",
        )
    arr = np.asarray(table, dtype=np.float64)
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ProfileError("latencies must be finite and >= 0 ms", field=f"{where}.latencyMs")
    for axis, name in ((1, "batch size"), (0, "sequence length")):
        running = np.maximum.accumulate(arr, axis=axis)
        dip = running - arr
        bad = (dip > MONOTONE_SLACK * running) & (dip > MONOTONE_FLOOR_MS)
        if np.any(bad):
            i, j = (int(x) for x in np.argwhere(bad)[0])
            raise ProfileError(
                f"latency falls as the {name} grows (row {i}, column {j}: {arr[i, j]:.3f} ms after "
                f"{running[i, j]:.3f} ms); re-measure the profile",
                field=f"{where}.latencyMs[{i}][{j}]",
            )
        if np.any(dip > 0) and name_ not in notes:
            notes.append(name_)
        arr = running
    return arr


GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "ROCMExecutionProvider")


def check_device(profile: ModelProfileSpec, pool_name: str, pool: GPUPoolSpec) -> None:
    """A profile measured on one kind of device is refused for a pool of the other kind: the planner would
    size the pool from another machine's figures. Profiles that do not say (hand-written, derived) pass."""
    if not profile.providers:
        return
    on_gpu = profile.providers[0] in GPU_PROVIDERS
    where = f"profiles[{pool_name}].providers"
    if pool.gpu_resource and not on_gpu:
        raise ProfileError(
            f"the ModelProfile for pool {pool_name} was measured on {profile.providers[0]} but the pool's workers "
            f"run on {pool.gpu_resource}: measure it on the pool's GPU (`exitplan profile --device gpu`, what the "
            'profiling Job runs there), or, for a pool of CPU cores, write gpuResource: ""',
            field=where,
        )
    if not pool.gpu_resource and on_gpu:
        raise ProfileError(
            f"the ModelProfile for pool {pool_name} was measured on {profile.providers[0]} but the pool's workers run "
            "on CPU cores (gpuResource is empty): measure it there (`exitplan profile --device cpu`)",
            field=where,
        )


def validate_profile(profile: ModelProfileSpec, where: str = "profile") -> list[str]:
    """Check a profile's shape and values; return notes about repairs; raise ProfileError otherwise."""
    notes: list[str] = []
    _validated_arrays(profile, where, notes)
    return notes


def _validated_arrays(profile: ModelProfileSpec, where: str, notes: list[str]) -> dict[str, FloatArray]:
    bs, sl = list(profile.batch_sizes), list(profile.seq_lens)
    if not bs or any(b >= c for b, c in zip(bs, bs[1:])) or bs[0] < 1:
        raise ProfileError(f"batch sizes must be >= 1 and increase strictly, got {bs}", field=f"{where}.batchSizes")
    if not sl or any(b >= c for b, c in zip(sl, sl[1:])) or sl[0] < 1:
        raise ProfileError(f"sequence lengths must be >= 1 and increase strictly, got {sl}", field=f"{where}.seqLens")
    if not profile.blocks:
        raise ProfileError("the profile lists no blocks", field=f"{where}.blocks")
    n = len(profile.blocks)
    smoothed: list[str] = []
    blocks = np.stack(
        [
            _check_table(b.latency_ms, f"blocks[{i}]", len(sl), len(bs), smoothed, where)
            for i, b in enumerate(profile.blocks)
        ]
    )
    ramps = []
    for i, r in enumerate(profile.ramps):
        if r.after_block >= n:
            raise ProfileError(
                f"ramp {r.name!r} follows block {r.after_block} but the profile has {n} blocks",
                field=f"{where}.ramps[{i}].afterBlock",
            )
        ramps.append(_check_table(r.latency_ms, f"ramps[{i}]", len(sl), len(bs), smoothed, where))
    if smoothed:
        notes.append(
            f"{where}: latency dips below {MONOTONE_SLACK:.0%} (timer noise) smoothed to a running maximum in {', '.join(smoothed)}"
        )
    if any(a.after_block > b.after_block for a, b in zip(profile.ramps, profile.ramps[1:])):
        raise ProfileError("ramps must be listed in block order", field=f"{where}.ramps")
    surv = list(profile.survival)
    if surv and len(surv) != len(profile.ramps):
        raise ProfileError(
            f"survival has {len(surv)} entries for {len(profile.ramps)} ramps (one per ramp)", field=f"{where}.survival"
        )
    if any(not 0.0 <= s <= 1.0 for s in surv):
        raise ProfileError(f"survival fractions must lie in [0, 1], got {surv}", field=f"{where}.survival")
    if any(b > a + 1e-9 for a, b in zip(surv, surv[1:])):
        raise ProfileError(f"survival must not increase along the ramps, got {surv}", field=f"{where}.survival")
    out = np.zeros((n, len(sl)))
    for i, b in enumerate(profile.blocks):
        if b.output_bytes:
            if len(b.output_bytes) != len(sl):
                raise ProfileError(
                    f"outputBytes has {len(b.output_bytes)} entries for {len(sl)} seqLens",
                    field=f"{where}.blocks[{i}].outputBytes",
                )
            out[i] = b.output_bytes
        elif i < n - 1:
            notes.append(f"{where}.blocks[{i}]: no outputBytes; transfers after it are taken as free")
    inp = np.zeros(len(sl))
    if profile.input_bytes:
        if len(profile.input_bytes) != len(sl):
            raise ProfileError(
                f"inputBytes has {len(profile.input_bytes)} entries for {len(sl)} seqLens", field=f"{where}.inputBytes"
            )
        inp = np.asarray(profile.input_bytes, dtype=np.float64)
    scale = profile.serving.compute_scale if profile.serving is not None else []
    if scale and len(scale) != len(sl):
        raise ProfileError(
            f"computeScale has {len(scale)} entries for {len(sl)} seqLens (one per length); re-run `exitplan profile`",
            field=f"{where}.serving.computeScale",
        )
    weights = np.asarray([b.weight_bytes for b in profile.blocks], dtype=np.float64)
    ramp_tables = np.stack(ramps) if ramps else np.zeros((0, len(sl), len(bs)))
    return {"blocks": blocks, "ramps": ramp_tables, "out": out, "inp": inp, "weights": weights}


def survival_before_blocks(
    n_blocks: int, ramp_after: Sequence[int], survival: Sequence[float], enabled: Sequence[bool]
) -> np.ndarray:
    """s[k] = fraction of inputs that reach block k (k = 0..n_blocks; s[n_blocks] = reach the end)."""
    s = np.ones(n_blocks + 1)
    for after, surv, on in zip(ramp_after, survival, enabled):
        if on:
            s[after + 1 :] = np.minimum(s[after + 1 :], surv)
    return s


def survivor_pmf(batch: int, ratio: np.ndarray) -> np.ndarray:
    """P(x of `batch` rows are still running) for x = 0..batch, each row independently with
    probability `ratio` (any shape): shape ratio.shape + (batch + 1,). Read-only: the same batch and
    ratios (every pool and length of one survival curve) share one table."""
    clipped = np.ascontiguousarray(np.clip(ratio, 0.0, 1.0), dtype=np.float64)
    return _survivor_pmf(int(batch), clipped.tobytes(), clipped.shape)


@functools.lru_cache(maxsize=64)
def _survivor_pmf(batch: int, ratio: bytes, shape: tuple[int, ...]) -> np.ndarray:
    p = np.frombuffer(ratio, dtype=np.float64).reshape(shape)
    pmf: FloatArray = binom.pmf(np.arange(batch + 1), batch, p[..., None])
    pmf.setflags(write=False)
    return pmf


@dataclass
class CostModel:
    """Latency, transfer and memory of block ranges on one pool, from that pool's ModelProfile."""

    profile: ModelProfileSpec
    pool_name: str
    pool: GPUPoolSpec
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_device(self.profile, self.pool_name, self.pool)
        arrays = _validated_arrays(self.profile, f"profiles[{self.pool_name}]", self.notes)
        self.block_ms_table: np.ndarray = arrays["blocks"]  # (n_blocks, n_seq, n_batch)
        self.ramp_ms_table: np.ndarray = arrays["ramps"]  # (n_ramps, n_seq, n_batch)
        self.output_bytes: np.ndarray = arrays["out"]  # (n_blocks, n_seq)
        self.input_bytes: np.ndarray = arrays["inp"]  # (n_seq,)
        self.weight_bytes: np.ndarray = arrays["weights"]  # (n_blocks,)
        self.batch_sizes = np.asarray(self.profile.batch_sizes, dtype=np.float64)
        self.seq_lens = np.asarray(self.profile.seq_lens, dtype=np.float64)
        self.ramp_after = [r.after_block for r in self.profile.ramps]
        self._clamped: set[str] = set()
        self._bs0 = np.concatenate([[0.0], self.batch_sizes])
        serving = self.profile.serving
        self.hop_ms = float(serving.hop_ms) if serving is not None else 0.0
        """The worker's own work per batch beyond the model (the hop in, the answer or forward out), added
        once to every split's time per batch."""
        self.compute_scale = self._compute_scale()
        """Per seqLen, what the CPU workers' compute costs over the tables (1 on an accelerator)."""
        self.block_ms_table = self.block_ms_table * self.compute_scale[None, :, None]
        self.ramp_ms_table = self.ramp_ms_table * self.compute_scale[None, :, None]

    def _compute_scale(self) -> np.ndarray:
        """The profile's `serving.computeScale` on a CPU pool (its workers compute on the CPU it was measured
        on), else ones."""
        serving = self.profile.serving
        if serving is None or not serving.compute_scale or self.pool.gpu_resource != "":
            return np.ones(len(self.profile.seq_lens))
        return np.asarray(serving.compute_scale, dtype=np.float64)

    @property
    def n_blocks(self) -> int:
        return len(self.profile.blocks)

    # ------------------------------------------------------------ interpolation

    def _seq_weights(self, seq: float) -> tuple[int, int, float]:
        sl = self.seq_lens
        if seq < sl[0] or seq > sl[-1]:
            key = f"seq{seq}"
            if key not in self._clamped:
                self._clamped.add(key)
                self.notes.append(
                    f"pool {self.pool_name}: length {seq:g} is outside the profiled lengths "
                    f"{int(sl[0])}..{int(sl[-1])}; latency clamped to the nearest measured length"
                )
            seq = float(np.clip(seq, sl[0], sl[-1]))
        hi = int(np.searchsorted(sl, seq, side="left"))
        if hi == 0 or sl[hi] == seq:
            return hi, hi, 0.0
        lo = hi - 1
        return lo, hi, (seq - sl[lo]) / (sl[hi] - sl[lo])

    def _at_seq(self, table: np.ndarray, seq: float) -> np.ndarray:
        """table[..., n_seq, n_batch] -> [..., n_batch] at length `seq`."""
        lo, hi, w = self._seq_weights(seq)
        return table[..., lo, :] * (1 - w) + table[..., hi, :] * w

    def _interp_batch(self, rows: np.ndarray, batch: np.ndarray) -> np.ndarray:
        """rows[i, n_batch] evaluated at batch[i, ...] (any trailing shape), linear, 0 at batch 0,
        past the last measured batch along the last measured step."""
        bs = self._bs0
        batch = np.asarray(batch, dtype=np.float64)
        if "batch" not in self._clamped and np.any(batch > bs[-1] + 1e-9):
            self._clamped.add("batch")
            self.notes.append(
                f"pool {self.pool_name}: batches above {int(bs[-1])} extrapolated from the last measured step"
            )
        flat = batch.reshape(batch.shape[0], -1)
        ys = np.concatenate([np.zeros((rows.shape[0], 1)), rows], axis=1)
        slope = np.diff(ys, axis=1) / np.diff(bs)[None, :]
        i = np.clip(np.searchsorted(bs, flat, side="right") - 1, 0, len(bs) - 2)
        r = np.arange(rows.shape[0])[:, None]
        out: np.ndarray = ys[r, i] + slope[r, i] * (flat - bs[i])
        return out.reshape(batch.shape)

    def block_ms(self, block: int, batch: float, seq: float) -> float:
        rows = self._at_seq(self.block_ms_table[block : block + 1], seq)
        return float(self._interp_batch(rows, np.asarray([[batch]]))[0, 0])

    def ramp_ms(self, ramp: int, batch: float, seq: float) -> float:
        rows = self._at_seq(self.ramp_ms_table[ramp : ramp + 1], seq)
        return float(self._interp_batch(rows, np.asarray([[batch]]))[0, 0])

    def bytes_per_sample(self, boundary_block: int, seq: float) -> float:
        """Activation bytes per sample leaving `boundary_block` (-1: the model's input)."""
        table = (
            self.input_bytes[None, :] if boundary_block < 0 else self.output_bytes[boundary_block : boundary_block + 1]
        )
        lo, hi, w = self._seq_weights(seq)
        return float(table[0, lo] * (1 - w) + table[0, hi] * w)

    def transfer_ms(self, boundary_block: int, samples: float, seq: float) -> float:
        """Time to send `samples` activations leaving `boundary_block` over the pool's link."""
        bits = 8.0 * samples * self.bytes_per_sample(boundary_block, seq)
        return bits / (self.pool.link_bandwidth_gbps * 1e9) * 1e3

    # ------------------------------------------------------------ whole stages

    def stage_tables(
        self,
        batches: Sequence[float] | FloatArray,
        seq: float,
        survival_before: np.ndarray,
        ramps_on: Sequence[bool],
        expected: bool = False,
        transfer: bool = True,
        rebatch: bool = False,
        fill_ms: float | None = None,
    ) -> np.ndarray:
        """ms[bi, a, b]: time of split [a, b] (exec + enabled ramps + transfer out) at batch batches[bi].

        Entries with b < a are +inf. The batch shrinks inside the split as inputs exit. By default
        the survivors of each block are rounded up (a batch that still holds anyone runs at the
        latency of a whole input): a bound for the cycle. With `expected`, the mean batch time, for
        throughput: each block's latency averaged over how many of the batch's rows are still in
        it (every row survives independently, so that number is binomial; a block no row reaches
        is not run -- the linear interpolation at the mean number of rows overcounts it). With
        transfer=False the transfer out is left off: the time the batch holds its replica (the
        worker forwards the survivors beside its next batch), for throughput.

        With `rebatch` the split regroups rows at every block (a fusion queue per block): with
        `expected`, the mean time per B entering rows is sum_k s(k)/s(a) x (block k + its enabled
        ramp at a full batch B); the bound is one round, every block that any row reaches at B.
        The transfer out is that of the survivors of B entering rows, as without rebatching.
        With `fill_ms` as well (expected only), a block's queue may not fill within that wait: a
        replica busy at its rate B / T (T the mean time per B entering rows) brings block k
        B s(k)/s(a) x fill_ms / T rows per wait, so block k runs at x_k = min(B, that) rows,
        x_k / (B s(k)/s(a)) times per B entering rows, and T = sum_k s(k)/s(a) x B / x_k x
        (block k + ramp at x_k), solved by fixed-point iteration from the full-batch T (inf where T
        passes fill_ms: slower than any split without rebatching that fits the cycle, whose mean
        time per batch is at most its bound, so never the better choice). Also
        inf where a row's expected time through the split -- at each block half the time its queue
        takes to gather its rows (at most fill_ms; none for a block fed whole batches by the one
        before) plus the run -- exceeds two cycles (2 fill_ms), a split's share of the latency
        without rebatching (wait one cycle, run one).
        """
        n = self.n_blocks
        s = np.maximum(survival_before, 1e-12)
        batch_arr = np.asarray(batches, dtype=np.float64)
        ratio = np.minimum(s[None, :n] / s[:n, None], 1.0)  # ratio[a, k] = s(k)/s(a) for k >= a
        comb = self.block_ramp_ms(seq, ramps_on)
        tri = np.arange(n)[None, :] >= np.arange(n)[:, None]
        if rebatch and expected and fill_ms is not None:  # queues that may not fill: per split, not a running sum
            cum = fill_tables(comb, self._bs0, ratio, batch_arr, [float(fill_ms)])[0][0]
        else:
            cost = np.where(tri[None], self._block_costs(comb, ratio, batch_arr, expected, rebatch), 0.0)
            cum = np.cumsum(cost, axis=2)  # cum[bi, a, b] = exec of [a, b]
        xfer = self._transfer_out(s, batch_arr, seq, expected) if transfer else 0.0
        out: np.ndarray = np.where(tri[None], cum + xfer + self.hop_ms, np.inf)
        return out

    def block_ramp_ms(self, seq: float, ramps_on: Sequence[bool]) -> np.ndarray:
        """[block, batch size]: each block's time at `seq` plus its enabled ramp's (a ramp runs on the
        rows its block ran)."""
        comb: np.ndarray = self._at_seq(self.block_ms_table, seq).copy()  # (n, n_batch)
        if len(self.ramp_ms_table):
            ramp_rows = self._at_seq(self.ramp_ms_table, seq)
            for r, (after, on) in enumerate(zip(self.ramp_after, ramps_on)):
                if on:
                    comb[after] += ramp_rows[r]
        return comb

    def _block_costs(
        self, comb: np.ndarray, ratio: np.ndarray, batches: np.ndarray, expected: bool, rebatch: bool
    ) -> np.ndarray:
        """cost[bi, a, k]: time of block k (and its enabled ramp; `comb` from block_ramp_ms) in a split
        starting at block a, at batch batches[bi] entering the split (see stage_tables: the bound,
        `expected` or `rebatch`); k < a unused."""
        n, nb = self.n_blocks, len(batches)
        if rebatch:
            # block k at a full batch B, weighted by the share of entering rows that reach it
            # (expected), or once per round if any row reaches it (the bound)
            at_b = self._interp_batch(comb, np.broadcast_to(batches[None, :], (n, nb))).T  # (bi, k)
            bsz = batches[:, None, None]
            weight = np.broadcast_to(ratio, (nb, n, n)) if expected else (bsz * ratio[None] > 1e-9).astype(np.float64)
            cost: np.ndarray = weight * at_b[:, None, :]
        elif expected:
            # the mean time of block k over the number of the batch's rows still in it (each row
            # survives independently: binomial), a block with no row left not run
            top = int(round(float(batches.max()))) if nb else 0
            rows_x = np.arange(top + 1, dtype=np.float64)
            at_x = self._interp_batch(comb, np.broadcast_to(rows_x, (n, len(rows_x))))  # (k, x)
            cost = np.empty((nb, n, n))
            for bi, bsz_ in enumerate(batches):
                b = int(round(float(bsz_)))
                cost[bi] = np.einsum("akx,kx->ak", survivor_pmf(b, ratio), at_x[:, : b + 1])
        else:
            # inputs running block k in a split starting at a, rounded up: a batch that still holds
            # anyone runs at the latency of a whole input (conservative for the cycle)
            load = np.ceil(batches[:, None, None] * ratio[None] - 1e-9)  # (bi, a, k)
            at = self._interp_batch(comb, load.transpose(2, 0, 1).reshape(n, -1))  # (k, bi * a)
            cost = at.reshape(n, nb, n).transpose(1, 2, 0)
        return cost

    def _transfer_out(self, s: np.ndarray, batches: float | np.ndarray, seq: float, expected: bool) -> np.ndarray:
        """xfer[..., a, b]: ms to send over the pool's link the survivors leaving block b of `batches`
        rows (a number, or one per leading entry) that entered at block a (whole rows unless
        `expected`; 0 after the last block). `s`: the survival before each block, kept off 0
        (stage_tables')."""
        n = self.n_blocks
        bytes_out = np.asarray([self.bytes_per_sample(b, seq) for b in range(n)])
        bsz = np.asarray(batches, dtype=np.float64)[..., None, None]
        leaving = bsz * np.minimum(s[None, 1 : n + 1] / s[:n, None], 1.0)  # samples leaving block b
        if not expected:
            leaving = np.ceil(leaving - 1e-9)
        xfer: np.ndarray = 8.0 * leaving * bytes_out / (self.pool.link_bandwidth_gbps * 1e9) * 1e3
        xfer[..., n - 1] = 0.0  # the last split answers the router; that hop is in the slack
        return xfer

    def rebatch_tables(
        self,
        batches: Sequence[float] | FloatArray,
        seq: float,
        survival_before: np.ndarray,
        ramps_on: Sequence[bool],
        fill_ms: float,
        needed: npt.NDArray[np.bool_] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(mean[bi, a, b], longest[bi, a, b]) of rebatching split [a, b] at batch batches[bi] when
        every queue launches at the latest every `fill_ms`: the mean time per batch of entering rows
        that holds the replica (`stage_tables(..., expected=True, transfer=False, rebatch=True,
        fill_ms=...)`), and the longest a row takes through the split (a queue's whole gather time
        at each block, the run, and the transfer of the survivors of one batch out); inf where the
        split cannot rebatch at that wait, and where `needed[bi, a, b]` (if given) is False."""
        mean, longest = self.rebatch_tables_at(
            batches, seq, survival_before, ramps_on, [fill_ms], None if needed is None else needed[None]
        )
        return mean[0], longest[0]

    def rebatch_tables_at(
        self,
        batches: Sequence[float] | FloatArray,
        seq: float,
        survival_before: np.ndarray,
        ramps_on: Sequence[bool],
        fills: Sequence[float],
        needed: npt.NDArray[np.bool_] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """`rebatch_tables` at every wait of `fills` in one solve: (mean, longest), each [f, bi, a, b];
        `needed[f, bi, a, b]` as there."""
        n = self.n_blocks
        s = np.maximum(survival_before, 1e-12)
        ratio = np.minimum(s[None, :n] / s[:n, None], 1.0)
        batch_arr = np.asarray(batches, dtype=np.float64)
        comb = self.block_ramp_ms(seq, ramps_on)
        mean, worst = fill_tables(comb, self._bs0, ratio, batch_arr, fills, needed)
        longest: np.ndarray = worst + self._transfer_out(s, batch_arr, seq, False) + self.hop_ms
        return mean + self.hop_ms, longest

    def replica_bytes(self, first: int, last: int, batch: float, seq: float, rebatch: bool = False) -> float:
        """Memory one replica of split [first, last] needs: weights + one batch of in/out activations
        (with `rebatch`, also up to one batch of rows waiting at every inner block boundary)."""
        weights = float(self.weight_bytes[first : last + 1].sum())
        acts = batch * (self.bytes_per_sample(first - 1, seq) + self.bytes_per_sample(last, seq))
        if rebatch:
            acts += batch * sum(self.bytes_per_sample(k, seq) for k in range(first, last))
        return weights + acts

    def replica_bytes_table(
        self, batches: Sequence[float] | FloatArray, seq: float, rebatch: bool = False
    ) -> np.ndarray:
        """mem[bi, a, b]: `replica_bytes(a, b, batches[bi], seq, rebatch)` for every split (inf for b < a)."""
        n = self.n_blocks
        out_b = np.asarray([self.bytes_per_sample(k, seq) for k in range(-1, n)])  # out_b[k + 1]: leaving block k
        cw = np.concatenate([[0.0], np.cumsum(self.weight_bytes)])
        a, b = np.arange(n)[:, None], np.arange(n)[None, :]
        weights = cw[b + 1] - cw[a]
        per_row = out_b[a] + out_b[b + 1]  # entering block a, leaving block b
        if rebatch:  # rows waiting at every inner boundary a..b-1
            co = np.concatenate([[0.0], np.cumsum(out_b[1:])])
            per_row = per_row + np.maximum(co[b] - co[a], 0.0)
        bs = np.asarray(batches, dtype=np.float64)[:, None, None]
        table: np.ndarray = np.where(b >= a, weights + bs * per_row, np.inf)
        return table

    def full_model_ms(self, seq: float, batch: float = 1.0) -> float:
        """One input (or batch) through every block and enabled ramp, no exits."""
        s = np.ones(self.n_blocks + 1)
        return float(self.stage_tables([batch], seq, s, [True] * len(self.ramp_after))[0, 0, self.n_blocks - 1])
