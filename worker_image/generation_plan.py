"""E3-style planning of the pipeline splits for early-exit generation (pure functions + one measurement).

In the pipeline-based mode every token eventually runs every block (exited tokens fill their cache
entries), so each stage's work per token is fixed; what exits change is when the token is decided,
and the next token can start only then. With contiguous stages, per token:

- decision time: the blocks and heads up to the deciding head, plus one hop per stage boundary crossed;
- stage work: the stage's blocks, plus its heads weighted by the share of tokens still undecided there;

and in steady state a token every max(E[decision time], max stage work + hop). `plan_splits` tries every
contiguous split into `stages` parts and returns the one with the least predicted time per token,
with every candidate for inspection. The inputs are data (`GenerationProfile`): measured here by
`measure_profile`, or written by hand from a GPU profile.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .generation import DecoderModel, GenerationError

MAX_CANDIDATES = 200_000


@dataclass(frozen=True)
class GenerationProfile:
    block_ms: list[float]
    """Time of each block for one new token."""
    head_ms: dict[int, float]
    """Time of the head after block b (exit heads and the final head)."""
    decide_share: dict[int, float]
    """Share of tokens decided by the head after block b (sums to 1; the final head takes the rest)."""
    hop_ms: float = 0.0
    """Time to hand a token's state from one stage to the next."""

    def check(self) -> GenerationProfile:
        n = len(self.block_ms)
        if n < 1 or any(t < 0 for t in self.block_ms):
            raise GenerationError("block_ms needs one non-negative time per block")
        if any(not 0 <= b < n for b in list(self.head_ms) + list(self.decide_share)):
            raise GenerationError(f"heads and shares must name blocks 0..{n - 1}")
        if n - 1 not in self.head_ms:
            raise GenerationError("the final head (after the last block) needs a time in head_ms")
        total = sum(self.decide_share.values())
        if any(p < 0 for p in self.decide_share.values()) or not abs(total - 1.0) < 1e-6:
            raise GenerationError(f"decide_share must be non-negative and sum to 1 (sums to {total:.6f})")
        return self


@dataclass(frozen=True)
class SplitCandidate:
    splits: tuple[tuple[int, int], ...]
    decision_ms: float
    bottleneck_ms: float

    @property
    def time_per_token_ms(self) -> float:
        return max(self.decision_ms, self.bottleneck_ms)


@dataclass
class SplitPlan:
    best: SplitCandidate
    candidates: list[SplitCandidate] = field(default_factory=list)


def evaluate(profile: GenerationProfile, splits: Sequence[tuple[int, int]]) -> SplitCandidate:
    """Predicted decision time and bottleneck stage work of one contiguous split."""
    stage_of = {b: s for s, (first, last) in enumerate(splits) for b in range(first, last + 1)}
    undecided = 1.0
    elapsed = 0.0
    decision = 0.0
    work = [0.0] * len(splits)
    for block, block_ms in enumerate(profile.block_ms):
        if block > 0 and stage_of[block] != stage_of[block - 1]:
            elapsed += profile.hop_ms
        elapsed += block_ms
        work[stage_of[block]] += block_ms
        if block in profile.head_ms:
            elapsed += profile.head_ms[block]
            work[stage_of[block]] += undecided * profile.head_ms[block]
            share = profile.decide_share.get(block, 0.0)
            decision += share * elapsed
            undecided -= share
    hop = profile.hop_ms if len(splits) > 1 else 0.0
    return SplitCandidate(tuple(splits), decision, max(work) + hop)


def plan_splits(profile: GenerationProfile, stages: int) -> SplitPlan:
    """Every contiguous split of the blocks into `stages` parts, best (least time per token) first."""
    profile = profile.check()
    n = len(profile.block_ms)
    if not 1 <= stages <= n:
        raise GenerationError(f"stages must be within 1..{n} (the model's blocks), got {stages}")
    count = _binomial(n - 1, stages - 1)
    if count > MAX_CANDIDATES:
        raise GenerationError(f"{count} candidate splits of {n} blocks into {stages} stages; use fewer stages")
    candidates = []
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        candidates.append(evaluate(profile, [(bounds[i], bounds[i + 1] - 1) for i in range(stages)]))
    candidates.sort(key=lambda c: (c.time_per_token_ms, c.bottleneck_ms, c.splits))
    return SplitPlan(best=candidates[0], candidates=candidates)


def _binomial(n: int, k: int) -> int:
    from math import comb

    return comb(n, k)


def measure_profile(
    model: DecoderModel, texts: Sequence[str], threshold: float, *, hop_ms: float = 0.0, context: int = 64, repeats: int = 50
) -> GenerationProfile:
    """Block and head times for one token against a `context`-long cache, and the share of tokens each head
    decides at `threshold` (teacher forced on `texts`: the first head whose confidence reaches it)."""
    if not texts:
        raise GenerationError("give some texts to measure the exit shares on")
    n = model.n_blocks
    spec = model.spec
    past = np.random.default_rng(0).standard_normal((1, spec.num_heads, context, spec.head_dim)).astype(np.float32)
    hidden = np.random.default_rng(1).standard_normal((1, 1, spec.hidden_size)).astype(np.float32)
    block_ms, head_ms = [], {}
    for block in range(n):
        x = np.asarray([[1]], dtype=np.int64) if block == 0 else hidden
        block_ms.append(_time(lambda: model.run_block(block, x, context, past, past), repeats))
        if model.ramp_after(block) is not None:
            head_ms[block] = _time(lambda: model.head_logits(block, hidden), repeats)
    heads = [h.after for h in model.heads]
    counts = dict.fromkeys(heads, 0)
    total = 0
    for text in texts:
        ids = model.codec.encode(text)[: spec.max_context]
        logits = model.full_forward(ids).logits
        undecided = np.ones(len(ids), dtype=bool)
        for after in heads:
            z = logits[model.ramp_after(after).name].astype(np.float64)  # type: ignore[union-attr]
            p = np.exp(z - z.max(axis=1, keepdims=True))
            conf = p.max(axis=1) / p.sum(axis=1)
            final = after == n - 1
            take = undecided & (final | ((threshold < 1.0) & (conf >= threshold)))
            counts[after] += int(take.sum())
            undecided &= ~take
        total += len(ids)
    return GenerationProfile(block_ms, head_ms, {b: c / total for b, c in counts.items()}, hop_ms)


def _time(call, repeats: int) -> float:
    call()
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    return 1000 * (time.perf_counter() - started) / repeats
