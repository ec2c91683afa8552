"""The solver's problem for a service: every option's rate, batch and stage time, and why none fits.

`build_problem` turns a service's resolved inputs and one bucket set into E3's problem
(planner/e3.py): per (splits, pool, first block, last block, bucket) option the best throughput
of one replica under the cycle (the SLO budget over `cycles(splits)`) and the pool's memory, from
the cost model's stage tables, with or without rebatching (a fusion queue per block) per split
and pool. `diagnose` names the binding constraint (the SLO, memory, or the caps and cost cap)
when no bucket set has a plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from exitplan.api.resources import EarlyExitServiceSpec
from exitplan.planner import buckets as bk
from exitplan.planner.e3_model import E3Problem
from exitplan.planner.errors import PlanInfeasible
from exitplan.planner.inputs import Inputs
from exitplan.planner.trimming import length_support, trimmed_length, trims


def cycles(splits: int) -> int:
    """End-to-end latency bound of a pipeline of `splits` stages, in cycles: at every stage a row
    may wait up to one cycle for its fusion queue to launch (a full batch, or the deadline rule)
    and then runs one. (The synchronous-pipeline count, splits + 1, proved optimistic in the
    simulator once several stages each wait for their own batches.)"""
    return 2 * splits


def rebatching(spec: EarlyExitServiceSpec, inp: Inputs) -> bool:
    """Whether the plan's splits rebatch: the spec asks for it and some exit is enabled (without
    exits every row runs every block of its split and rebatching changes nothing)."""
    return bool(spec.planner.rebatch and any(inp.enabled))


@dataclass
class PlanProblem(E3Problem):
    """E3's problem plus, per (splits, pool, first, last), whether that split rebatches and how long a row may
    take through it (the DP ignores both)."""

    rebatch: np.ndarray | None = None
    """bool (max_splits, P, N, N); None: no split rebatches."""
    longest_ms: np.ndarray | None = None
    """(max_splits, P, N, N, K): the longest a row takes through the option's split (a rebatching split: each
    queue's whole gather time and the run, the transfer out; a plain one: wait one cycle, run one)."""
    colocated_rate: np.ndarray | None = None
    """(max_splits, P, N, N, K): the option's rate as split 0 in the routers (co-located: no worker's hop per
    batch), at its own best batch; None: as `rate`."""
    colocated_batch: np.ndarray | None = None
    """The batch behind `colocated_rate` (without the hop to amortize, often smaller than `batch`)."""

    def rebatches(self, splits: int, pool: int, first: int, last: int) -> bool:
        return bool(self.rebatch is not None and self.rebatch[splits - 1, pool, first, last])


_LengthOptions = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""Of one pool at one length, per (splits, first, last): rate, batch, stage time, the longest a row takes, and
the rate and batch as split 0 in the routers (no hop)."""
_OptionKey = tuple[str, int, int, bool, int, str]


def _first_splits(options: _LengthOptions, S: int) -> _LengthOptions:
    """The options of split counts 1..S of a table computed for more."""
    a, b, c, d, e, f = (x[:S] for x in options)
    return a, b, c, d, e, f


class OptionCache:
    """Every pool's options per bucket, by what they are computed from (Inputs.option_digest, the length,
    the bucket below it where workers trim, rebatching, the split counts, the length mix where workers trim):
    bucket sets of one plan share their buckets, and a re-plan of the same service (a caller that keeps the
    cache: the operator keeps one per service) reuses every pool and length whose inputs did not change.
    `retain_used` keeps what the last plan used and drops the rest, so a cache holds one plan's tables."""

    def __init__(self) -> None:
        self._tables: dict[_OptionKey, tuple[_LengthOptions, list[str]]] = {}
        """Each entry's options and the notes the cost model made computing them (clamps), told again on a hit."""
        self._used: set[_OptionKey] = set()
        self.hits = self.misses = 0

    def get(self, inp: Inputs, p: int, length: int, lo: int, rebatch: bool, S: int) -> _LengthOptions:
        """Pool p's options for the bucket (lo, length], computed once per content."""
        model = inp.models[p]
        trimmed = trims(model.pool.gpu_resource, model.profile.seq_lens, rebatch)
        # the bucket below and the length mix matter only where workers trim to their batch's longest row
        key = (inp.option_digest(p), length, lo if trimmed else 0, rebatch, S, inp.length_digest() if trimmed else "")
        # a table for more split counts holds these: split count s's options do not depend on the most
        key = next((k for k in self._tables if k[:4] == key[:4] and k[5] == key[5] and k[4] >= S), key)
        self._used.add(key)
        if key in self._tables:
            self.hits += 1
            options, notes = self._tables[key]
            model.notes.extend(n for n in notes if n not in model.notes)
            return options if key[4] == S else _first_splits(options, S)
        self.misses += 1
        before = len(model.notes)
        options = _length_options(inp, p, length, S, rebatch, lo if trimmed else 0)
        self._tables[key] = (options, model.notes[before:])
        return options

    def retain_used(self) -> None:
        """Keep only the tables used since the last call (the plan just made)."""
        self._tables = {k: v for k, v in self._tables.items() if k in self._used}
        self._used = set()

    def __len__(self) -> int:
        return len(self._tables)


REBATCH_MIN_GAIN = 0.01
"""A split rebatches only where that needs this share fewer replicas for the bucket mix than without (and is
no slower for any bucket): the rebatching rate comes from a model of queues that fill within a cycle, the
plain one from whole batches, and rebatching holds rows longer, so a tie or a sliver goes to the plain split."""


def _length_options(inp: Inputs, p: int, length: int, S: int, rebatch: bool, lo: int = 0) -> _LengthOptions:
    """Pool p's options at `length` (the bucket (lo, length]): rate, batch, stage time (the bound, for the
    cycle) and the longest a row takes through the split (rebatching: each queue's whole gather time and the
    run; plain: wait one cycle, run one), and the rate and batch without the worker's hop per batch (split 0
    co-located in the routers: the best batch there may be smaller, with nothing to amortize), each (S, N, N)."""
    model, n = inp.models[p], inp.n_blocks
    sigma, ramps_on = inp.sigma(), inp.ramps_on()
    sizes = np.asarray(model.profile.batch_sizes, dtype=np.float64)
    tables = model.stage_tables(sizes, length, sigma, ramps_on, rebatch=rebatch)  # (nB, n, n): the bound
    # the mean time a batch holds its replica (survivors forwarded beside the next batch), for throughput
    # (with rebatching it depends on the cycle: an inner block's queue launches at the latest every cycle)
    plain_mean = None if rebatch else model.stage_tables(sizes, length, sigma, ramps_on, expected=True, transfer=False)
    if plain_mean is not None and trims(model.pool.gpu_resource, model.profile.seq_lens, rebatch):
        # a split that ends the model runs each batch at its longest row (trimming.py)
        values, probs = length_support(inp.grid, inp.mass, inp.lengths, lo, length)
        for bi, b in enumerate(sizes):
            at = trimmed_length(values, probs, length, b)
            if at < length:
                cut = model.stage_tables([b], at, sigma, ramps_on, expected=True, transfer=False)[0]
                plain_mean[bi, :, n - 1] = cut[:, n - 1]
    fits = model.replica_bytes_table(sizes, length, rebatch=rebatch) <= model.pool.process_memory_bytes
    cycle_of = [inp.budget_ms / cycles(s) for s in range(1, S + 1)]
    if plain_mean is None:  # every split count's cycle in one solve, only where the split fits the pool and cycle
        needed = np.stack([fits & (tables <= c) & np.isfinite(tables) for c in cycle_of])
        rb_mean, rb_worst = model.rebatch_tables_at(sizes, length, sigma, ramps_on, cycle_of, needed)
    rate, stage, longest = np.zeros((S, n, n)), np.full((S, n, n), np.inf), np.full((S, n, n), np.inf)
    batch = np.zeros((S, n, n), dtype=np.int64)
    rate_co, batch_co = np.zeros((S, n, n)), np.zeros((S, n, n), dtype=np.int64)
    for s in range(1, S + 1):
        cycle = cycle_of[s - 1]
        if plain_mean is None:
            mean, worst = rb_mean[s - 1], rb_worst[s - 1]
        else:
            mean, worst = plain_mean, 2.0 * tables
        ok = fits & (tables <= cycle) & np.isfinite(tables) & np.isfinite(mean)
        with np.errstate(divide="ignore", invalid="ignore"):
            thr = np.where(ok, sizes[:, None, None] / np.where(mean > 0, mean, 1e-9) * 1e3, 0.0)
        best = np.argmax(thr, axis=0)[None]
        rate[s - 1] = np.take_along_axis(thr, best, 0)[0]
        batch[s - 1] = sizes[best[0]].astype(np.int64)
        stage[s - 1] = np.take_along_axis(tables, best, 0)[0]
        longest[s - 1] = np.take_along_axis(worst, best, 0)[0]
        rate_co[s - 1], batch_co[s - 1] = rate[s - 1], batch[s - 1]
        if not rebatch and model.hop_ms > 0:
            shed = np.maximum(mean - model.hop_ms, 1e-9)
            with np.errstate(divide="ignore", invalid="ignore"):
                thr_co = np.where(ok, sizes[:, None, None] / shed * 1e3, 0.0)
            best_co = np.argmax(thr_co, axis=0)[None]
            rate_co[s - 1] = np.take_along_axis(thr_co, best_co, 0)[0]
            batch_co[s - 1] = sizes[best_co[0]].astype(np.int64)
    return rate, batch, stage, longest, rate_co, batch_co


def _options(
    inp: Inputs, bucket_set: Sequence[int], S: int, rebatch: bool, cache: OptionCache | None = None
) -> _LengthOptions:
    """rate, batch, stage time and longest time of every (splits, pool, first, last, bucket) option, splits
    rebatching or not."""
    cache = OptionCache() if cache is None else cache
    per: list[list[_LengthOptions]] = []
    for p in range(len(inp.pool_names)):
        row = []
        for k, length in enumerate(bucket_set):
            lo = int(bucket_set[k - 1]) if k else 0
            row.append(cache.get(inp, p, int(length), lo, rebatch, S))
        per.append(row)
    # (S, P, n, n, K) from [P][K] of (S, n, n)
    stacked = [np.stack([np.stack([opt[i] for opt in row], axis=-1) for row in per], axis=1) for i in range(6)]
    return stacked[0], stacked[1], stacked[2], stacked[3], stacked[4], stacked[5]


def build_problem(
    inp: Inputs,
    bucket_set: Sequence[int],
    max_splits: int,
    layout: tuple[list[tuple[int, int]], list[int]] | None = None,
    rebatch: bool = False,
    cache: OptionCache | None = None,
) -> PlanProblem:
    """Rates of every (splits, pool, first, last, bucket) option under the cycle and memory limits.

    `layout` = (segments, pool per segment) restricts the problem to one layout (the previous plan's).
    `rebatch`: a split may regroup rows at each block (the cost model's rebatching tables and
    memory); on a pool it does where that is no slower for any bucket and needs REBATCH_MIN_GAIN fewer
    replicas for the bucket mix, so no option is slower than E3's own and the DP's optimum is at least E3's.
    `cache`: options already computed (for other bucket sets, or by an earlier plan of the same service) and
    filled here.
    """
    n = inp.n_blocks
    S = max_splits if layout is None else len(layout[0])
    rate, batch, stage, longest, rate_co, batch_co = _options(inp, bucket_set, S, False, cache)
    shares = bk.shares(inp.grid, inp.mass, bucket_set)
    chosen = None
    if rebatch:
        rb_rate, rb_batch, rb_stage, rb_longest, _, _ = _options(inp, bucket_set, S, True, cache)
        # no bucket slower, and the replicas the split needs for the bucket mix (share / rate) fewer by the gain
        with np.errstate(divide="ignore", invalid="ignore"):
            work = (shares / np.where(rate > 0, rate, np.inf)).sum(axis=4)
            rb_work = (shares / np.where(rb_rate > 0, rb_rate, np.inf)).sum(axis=4)
        no_slower = np.all(rb_rate >= rate, axis=4) & np.any(rb_rate > 0, axis=4)
        chosen = no_slower & ((rb_work < work * (1 - REBATCH_MIN_GAIN)) | (work == 0))  # (S, P, n, n)
        pick = chosen[..., None]
        rate, batch, stage, longest = (
            np.where(pick, rb_rate, rate),
            np.where(pick, rb_batch, batch),
            np.where(pick, rb_stage, stage),
            np.where(pick, rb_longest, longest),
        )
        rate_co, batch_co = np.where(pick, rb_rate, rate_co), np.where(pick, rb_batch, batch_co)
    if layout is not None:
        keep = np.zeros_like(rate, dtype=bool)
        for (a, b), p in zip(*layout):
            keep[S - 1, p, a, b, :] = True
        # Fewer splits than the layout's are not this layout.
        rate = np.where(keep, rate, 0.0)
    return PlanProblem(
        n,
        list(inp.pool_names),
        inp.caps.copy(),
        inp.costs.copy(),
        shares,
        inp.sigma()[:n].copy(),
        rate,
        batch,
        stage,
        inp.cost_cap,
        max_replicas=inp.max_replicas,
        rebatch=chosen,
        longest_ms=longest,
        colocated_rate=rate_co,
        colocated_batch=batch_co,
    )


def diagnose(inp: Inputs, bucket_set: Sequence[int], max_splits: int) -> PlanInfeasible:
    """Name the binding constraint when no plan exists."""
    top = max(bucket_set)
    full = {m.pool_name: m.full_model_ms(top, 1.0) for m in inp.models}
    fastest_pool = min(full, key=lambda name: full[name])
    # The best pipeline for single inputs: the smallest cycles(S) x slowest stage at batch 1.
    best_bound = math.inf
    sigma = inp.sigma()
    for m in inp.models:
        t = m.stage_tables([1.0], top, sigma, inp.ramps_on())[0]
        n = m.n_blocks
        for s in range(1, max_splits + 1):
            # bottleneck path: minimise the slowest stage over layouts with s splits
            worst = np.full(n + 1, np.inf)
            worst[0] = 0.0
            for _ in range(s):
                nxt = np.full(n + 1, np.inf)
                nxt[1:] = np.maximum(worst[:n, None], t).min(axis=0)
                worst = nxt
            best_bound = min(best_bound, cycles(s) * worst[n])
    if best_bound > inp.budget_ms:
        return PlanInfeasible(
            f"SLO budget {inp.budget_ms:g} ms (latencyMs minus slackMs) is below the {best_bound:.3g} ms that the fastest "
            f"batching pipeline needs for inputs of length {top} (each split may wait one cycle for its batch and run one); the fastest "
            f"single-input latency through every block is {full[fastest_pool]:.3g} ms on pool {fastest_pool}. Relax spec.slo.latencyMs, "
            "use a faster pool, or cap workload.lengthBuckets lower",
            field="spec.slo.latencyMs",
        )
    mem_ok = any(
        m.replica_bytes(a, a, 1, top) <= m.pool.process_memory_bytes for m in inp.models for a in range(m.n_blocks)
    )
    if not mem_ok:
        return PlanInfeasible(
            "no single block fits the memory of any pool (GPUPool memoryBytes, split between the worker processes "
            "of a device with sharedDevices); use pools with more memory or fewer processes per device",
            field="pools.memoryBytes",
        )
    return PlanInfeasible(
        f"no plan fits {len(bucket_set)} bucket(s) x at least one split within the pools' caps {dict(zip(inp.pool_names, inp.caps.tolist()))}"
        + (f" and the cost cap {inp.cost_cap:g}/h" if inp.cost_cap is not None else "")
        + (f" and maxReplicas {inp.max_replicas}" if inp.max_replicas is not None else "")
        + "; raise capacity/maxGpus, the cost cap or spec.planner.maxReplicas",
        field="spec.pools",
    )
