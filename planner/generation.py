"""E3-style planning for early-exit generation (EE-LLM): the split cost model, the search, the threshold
under the accuracy budget, and the Plan a generation service runs. Pure: data in, results out.

In the pipeline-based mode every token eventually runs every block (exited tokens fill their cache
entries), so each stage's work per token is fixed; what exits change is when the token is decided,
and the next token can start only then. With contiguous stages, per token:

- decision time: the blocks and heads up to the deciding head, plus one hop per stage boundary crossed;
- stage work: the stage's blocks, plus its heads weighted by the share of tokens still undecided there;

and in steady state a token every max(E[decision time], max stage work + hop). `plan_splits` tries every
contiguous split into `stages` parts and returns the one with the least predicted time per token,
with every candidate for inspection.

One stage is KV recomputation in one worker: a token leaves at its head and its missing cache entries
ride in the next token's forward. A recomputed position costs `recompute_ratio` of a fresh one in the
same block call (measured: about 0 when decoding is latency-bound, as on small models on CPU; towards 1
when compute-bound), so the predicted time per token is the decision time plus that ratio times the
blocks an exited token skipped.

The inputs are data: a `GenerationProfile` (block and head times, the share of tokens each head
decides, the hop time), measured on a machine (exitplan.worker_image.generate.measure) or written by hand
from a GPU profile, and `ThresholdPoint`s (per candidate threshold, how often the deciding head
disagrees with the final head, teacher-forced on held-out text).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from math import comb
from pathlib import Path
from typing import Any

from exitplan.api.bundle import BundleManifest
from exitplan.api.plan import Cell, Plan, Prediction, SplitPlan, even_ranges
from exitplan.api.resources import EarlyExitServiceSpec, GPUPoolSpec
from exitplan.planner.errors import PlanInfeasible, PlanInvalid, PlannerError

MAX_CANDIDATES = 200_000
NEVER_EXIT = 1.0
"""A threshold of 1.0 disables early exits (every token runs the full model): the exact reference."""


class GenerationPlanError(PlannerError):
    """A generation profile, threshold table or split request the planner cannot use."""


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
    recompute_ratio: float = 0.0
    """Extra time of one more position in a block call, relative to the call's time for one position."""

    def check(self) -> GenerationProfile:
        n = len(self.block_ms)
        if n < 1 or any(t < 0 for t in self.block_ms):
            raise GenerationPlanError("block_ms needs one non-negative time per block", field="profile.block_ms")
        if any(not 0 <= b < n for b in list(self.head_ms) + list(self.decide_share)):
            raise GenerationPlanError(f"heads and shares must name blocks 0..{n - 1}", field="profile.head_ms")
        if n - 1 not in self.head_ms:
            raise GenerationPlanError(
                "the final head (after the last block) needs a time in head_ms", field="profile.head_ms"
            )
        total = sum(self.decide_share.values())
        if any(p < 0 for p in self.decide_share.values()) or not abs(total - 1.0) < 1e-6:
            raise GenerationPlanError(
                f"decide_share must be non-negative and sum to 1 (sums to {total:.6f})", field="profile.decide_share"
            )
        if self.hop_ms < 0:
            raise GenerationPlanError(f"hop_ms must be >= 0, got {self.hop_ms}", field="profile.hop_ms")
        if not 0.0 <= self.recompute_ratio <= 10.0:
            raise GenerationPlanError(
                f"recompute_ratio must be in [0, 10], got {self.recompute_ratio}", field="profile.recompute_ratio"
            )
        return self

    def with_shares(self, decide_share: dict[int, float]) -> GenerationProfile:
        return GenerationProfile(
            list(self.block_ms), dict(self.head_ms), dict(decide_share), self.hop_ms, self.recompute_ratio
        )

    def dump(self) -> dict[str, object]:
        return {
            "block_ms": list(self.block_ms),
            "head_ms": {str(k): v for k, v in self.head_ms.items()},
            "decide_share": {str(k): v for k, v in self.decide_share.items()},
            "hop_ms": self.hop_ms,
            "recompute_ratio": self.recompute_ratio,
        }

    @classmethod
    def load(cls, data: dict[str, Any]) -> GenerationProfile:
        try:
            return cls(
                [float(t) for t in data["block_ms"]],
                {int(k): float(v) for k, v in data["head_ms"].items()},
                {int(k): float(v) for k, v in data["decide_share"].items()},
                float(data.get("hop_ms", 0.0)),
                float(data.get("recompute_ratio", 0.0)),
            ).check()
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise GenerationPlanError(
                f"not a generation profile ({err}); expected block_ms, head_ms, decide_share, hop_ms", field="profile"
            ) from err


@dataclass(frozen=True)
class SplitCandidate:
    splits: tuple[tuple[int, int], ...]
    decision_ms: float
    bottleneck_ms: float
    recompute_ms: float = 0.0
    """One split (KV recomputation): the expected cost of recomputing the blocks an exited token skipped."""

    @property
    def time_per_token_ms(self) -> float:
        if len(self.splits) == 1:  # KV recomputation: exited tokens' later blocks ride in the next forward
            return self.decision_ms + self.recompute_ms
        return max(self.decision_ms, self.bottleneck_ms)

    @property
    def mode(self) -> str:
        return "recompute" if len(self.splits) == 1 else "pipeline"


@dataclass
class SplitSearch:
    """The best split and every candidate, best first."""

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
    skipped = sum(share * sum(profile.block_ms[b + 1 :]) for b, share in profile.decide_share.items())
    return SplitCandidate(tuple(splits), decision, max(work) + hop, profile.recompute_ratio * skipped)


def plan_splits(profile: GenerationProfile, stages: int) -> SplitSearch:
    """Every contiguous split of the blocks into `stages` parts, best (least time per token) first."""
    profile = profile.check()
    n = len(profile.block_ms)
    if not 1 <= stages <= n:
        raise GenerationPlanError(f"stages must be within 1..{n} (the model's blocks), got {stages}", field="stages")
    count = comb(n - 1, stages - 1)
    if count > MAX_CANDIDATES:
        raise GenerationPlanError(
            f"{count} candidate splits of {n} blocks into {stages} stages; use fewer stages", field="stages"
        )
    candidates = []
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        candidates.append(evaluate(profile, [(bounds[i], bounds[i + 1] - 1) for i in range(stages)]))
    candidates.sort(key=lambda c: (c.time_per_token_ms, c.bottleneck_ms, c.splits))
    return SplitSearch(best=candidates[0], candidates=candidates)


def even_splits(n_blocks: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous block ranges of near-equal size (the first stages take the extra blocks)."""
    if not 1 <= stages <= n_blocks:
        raise GenerationPlanError(
            f"stages must be within 1..{n_blocks} (the model's blocks), got {stages}", field="stages"
        )
    return even_ranges(n_blocks, stages)


# ------------------------------------------------------------------------------------ threshold


@dataclass(frozen=True)
class ThresholdPoint:
    """What one candidate threshold does on held-out text (teacher forced)."""

    threshold: float
    disagreement: float
    """Share of positions whose deciding head's token differs from the final head's."""
    decide_share: dict[int, float]
    """Share of positions each head (by the block it follows) decides."""

    def dump(self) -> dict[str, object]:
        return {
            "threshold": self.threshold,
            "disagreement": self.disagreement,
            "decide_share": {str(k): v for k, v in self.decide_share.items()},
        }

    @classmethod
    def load(cls, data: dict[str, Any]) -> ThresholdPoint:
        try:
            return cls(
                float(data["threshold"]),
                float(data["disagreement"]),
                {int(k): float(v) for k, v in data["decide_share"].items()},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise GenerationPlanError(
                f"not a threshold point ({err}); expected threshold, disagreement, decide_share", field="thresholds"
            ) from err


def choose_threshold(points: Sequence[ThresholdPoint], budget: float) -> ThresholdPoint:
    """The lowest threshold (most exits) whose disagreement with the full model stays within `budget`.

    Disagreement need not fall monotonically with the threshold on a finite sample, so the choice is
    the lowest threshold at and above which every measured point meets the budget; 1.0 (never exit,
    disagreement 0) is always admissible."""
    if not 0.0 <= budget < 1.0:
        raise GenerationPlanError(f"the accuracy budget must be in [0, 1), got {budget}", field="accuracy.maxDrop")
    ordered = sorted(points, key=lambda p: p.threshold)
    if any(not 0.0 <= p.threshold <= NEVER_EXIT or not 0.0 <= p.disagreement <= 1.0 for p in ordered):
        raise GenerationPlanError("thresholds and disagreements must lie in [0, 1]", field="thresholds")
    chosen = None
    for point in reversed(ordered):
        if point.disagreement > budget:
            break
        chosen = point
    if chosen is None:  # 1.0 was not measured: it is the exact reference, admissible by definition
        return ThresholdPoint(NEVER_EXIT, 0.0, {})
    return chosen


# ------------------------------------------------------------------------------------ the service plan


@dataclass
class GenerationPlanResult:
    plan: Plan
    mode: str
    """recompute (one split, KV recomputation) or pipeline (several splits)."""
    threshold: float
    predicted_ms_per_token: float | None
    """None when no profile was given (the split is then even and unranked)."""
    note: str = ""
    candidates: list[SplitCandidate] = field(default_factory=list)
    """Best split per stage count that was considered, best first."""

    def verify(self, n_blocks: int) -> None:
        splits = self.plan.splits
        if splits[0].first_block != 0 or splits[-1].last_block != n_blocks - 1:
            raise PlanInvalid(
                f"splits {[(s.first_block, s.last_block) for s in splits]} do not cover blocks 0..{n_blocks - 1}"
            )
        if sorted(c.split for c in self.plan.cells) != list(range(len(splits))) or any(
            c.replicas != 1 for c in self.plan.cells
        ):
            raise PlanInvalid("a generation plan runs exactly one replica of every stage")
        if self.mode != ("recompute" if len(splits) == 1 else "pipeline"):
            raise PlanInvalid(f"mode {self.mode} does not match {len(splits)} split(s)")


def max_stages(spec: EarlyExitServiceSpec, pools: dict[str, GPUPoolSpec], n_blocks: int) -> int:
    """The most stages the service may use: blocks, spec.planner.maxSplits, spec.planner.maxReplicas
    (one replica per stage), and the pools' capacity."""
    capacity = 0
    for ref in spec.pools:
        pool = pools.get(ref.name)
        if pool is not None:
            capacity += min(pool.capacity, ref.max_gpus) if ref.max_gpus is not None else pool.capacity
    return min(n_blocks, spec.planner.max_splits, spec.planner.max_replicas, capacity)


def plan_generation(
    service: str,
    spec: EarlyExitServiceSpec,
    pools: dict[str, GPUPoolSpec],
    *,
    n_blocks: int,
    exit_ramps: Sequence[str],
    max_context: int,
    profile: GenerationProfile | None = None,
    thresholds: Sequence[ThresholdPoint] = (),
    stages: int | None = None,
    reason: str = "initial",
) -> GenerationPlanResult:
    """The Plan of a generation service: one replica per stage (a sequence's cache lives in one process
    per stage), stages placed on the service's pools in order, the threshold chosen under the accuracy
    budget, the stage count (unless given) and the split chosen by predicted time per token.

    Without a profile the plan is one stage (KV recomputation) or `stages` even splits, and without
    threshold points the threshold is 1.0 (never exit: exactly the full model's tokens)."""
    missing = [ref.name for ref in spec.pools if ref.name not in pools]
    if missing:
        raise GenerationPlanError(f"the service names pools {missing} that are not given", field="spec.pools")
    limit = max_stages(spec, pools, n_blocks)
    if limit < 1:
        raise PlanInfeasible("the service's pools have no capacity for a single stage", field="spec.pools")
    if stages is not None and not 1 <= stages <= limit:
        raise PlanInfeasible(
            f"{stages} stages asked, but at most {limit} fit (blocks {n_blocks}, maxSplits "
            f"{spec.planner.max_splits}, pool capacity)",
            field="stages",
        )
    chosen = choose_threshold(thresholds, spec.accuracy.max_drop) if thresholds else None
    threshold = chosen.threshold if chosen else NEVER_EXIT
    note, predicted, ranked = "", None, []
    if profile is not None:  # the shares of the chosen threshold (never exit: the final head decides all)
        shares = chosen.decide_share if chosen is not None and chosen.decide_share else {n_blocks - 1: 1.0}
        profile = profile.with_shares(shares).check()
        if len(profile.block_ms) != n_blocks:
            raise GenerationPlanError(
                f"the profile has {len(profile.block_ms)} blocks, the bundle {n_blocks}", field="profile"
            )
        counts = [stages] if stages is not None else range(1, limit + 1)
        ranked = sorted(
            (plan_splits(profile, s).best for s in counts), key=lambda c: (c.time_per_token_ms, len(c.splits))
        )
        best = ranked[0]
        ranges, predicted = list(best.splits), best.time_per_token_ms
    else:
        ranges = even_splits(n_blocks, stages or 1)
        note = "no generation profile: splits are even, not ranked"
    if not thresholds:
        note = (note + "; " if note else "") + "no threshold table: threshold 1.0 (no early exit)"
    cells, placed = [], _placement(spec, pools, len(ranges))
    for index, pool in enumerate(placed):
        cells.append(Cell(split=index, bucket=max_context, pool=pool, replicas=1, batch_size=1))
    cost = sum(pools[c.pool].cost_per_hour for c in cells)
    plan = Plan(
        service=service,
        model=spec.model.name,
        splits=[SplitPlan(index=i, first_block=a, last_block=b) for i, (a, b) in enumerate(ranges)],
        buckets=[max_context],
        cells=cells,
        thresholds={name: threshold for name in exit_ramps},
        prediction=Prediction(cost_per_hour=cost),
        reason=reason,
    )
    result = GenerationPlanResult(
        plan, "recompute" if len(ranges) == 1 else "pipeline", threshold, predicted, note, ranked
    )
    result.verify(n_blocks)
    return result


def plan_bundle_generation(
    service: str,
    spec: EarlyExitServiceSpec,
    pools: dict[str, GPUPoolSpec],
    manifest: BundleManifest,
    *,
    profile: GenerationProfile | None = None,
    thresholds: Sequence[ThresholdPoint] = (),
    stages: int | None = None,
    reason: str = "initial",
) -> GenerationPlanResult:
    """`plan_generation` for a decoder bundle: its block count, exit ramps and context length read from
    its manifest (what `exitplan up` and the operator both plan from)."""
    if manifest.decoder is None:
        raise GenerationPlanError("the bundle has no decoder section: not a generation bundle", field="bundle")
    return plan_generation(
        service,
        spec,
        pools,
        n_blocks=len(manifest.blocks),
        exit_ramps=[r.name for r in manifest.exit_ramps()],
        max_context=manifest.decoder.max_context,
        profile=profile,
        thresholds=thresholds,
        stages=stages,
        reason=reason,
    )


def _placement(spec: EarlyExitServiceSpec, pools: dict[str, GPUPoolSpec], stages: int) -> list[str]:
    """The pool of each stage: the service's pools in order, each up to its (capped) capacity."""
    out: list[str] = []
    for ref in spec.pools:
        pool = pools[ref.name]
        room = min(pool.capacity, ref.max_gpus) if ref.max_gpus is not None else pool.capacity
        out += [ref.name] * min(room, stages - len(out))
    if len(out) < stages:
        raise PlanInfeasible(
            f"{stages} stages need {stages} accelerators; the pools hold {len(out)}", field="spec.pools"
        )
    return out


def generation_threshold(plan: Plan) -> float:
    """The one exit threshold a generation plan runs (every exit head shares it; 1.0 when none is set)."""
    values = [min(v, NEVER_EXIT) for v in plan.thresholds.values()]
    return min(values) if values else NEVER_EXIT


def measurements_file(bundle: str | Path, pool: str) -> Path:
    """Where measured generation data of a bundle on a pool is kept: `<bundle>/profiles/generation-<pool>.json`."""
    return Path(bundle) / "profiles" / f"generation-{pool}.json"


def read_measurements(path: str | Path) -> tuple[GenerationProfile, list[ThresholdPoint]]:
    """The profile and threshold table of a measurements file (`{"profile": ..., "thresholds": [...]}`)."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise GenerationPlanError(
            f"{path}: not a generation measurements file ({err}); measure with `exitplan up`", field="profile"
        ) from err
    return parse_measurements(text, str(path))


def parse_measurements(text: str, where: str) -> tuple[GenerationProfile, list[ThresholdPoint]]:
    """`read_measurements` on the file's text (`where` names it in errors)."""
    try:
        data = json.loads(text)
        return GenerationProfile.load(data["profile"]), [ThresholdPoint.load(p) for p in data["thresholds"]]
    except (ValueError, KeyError, TypeError) as err:
        if isinstance(err, GenerationPlanError):
            raise
        raise GenerationPlanError(
            f"{where}: not a generation measurements file ({err}); measure with `exitplan up`", field="profile"
        ) from err
