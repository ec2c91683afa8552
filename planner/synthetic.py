"""Profiles built from a stated latency model, for benchmarks, tests and what-if planning.

`bert_base_profile(gpu)` is a BERT-base 12-block early-exit encoder on a data-centre GPU, built
from published latency figures (not measured here):

- V100, the anchor: NVIDIA DeepLearningExamples, TensorFlow/LanguageModeling/BERT/README.md,
  "Fine-tuning inference performance for SQuAD v1.1 on 16GB" (DGX-1, 1x V100 16GB, TensorFlow
  20.06 NGC container), BERT-base, sequence length 128, FP16 (the serving precision on V100's
  tensor cores): 206.82 / 376.75 / 635.00 / 962.83 sentences/s at batch 1 / 2 / 4 / 8, i.e.
  4.84 / 5.31 / 6.30 / 8.31 ms per batch. A GPU batch is nearly flat in its size: 8 inputs cost
  1.7x one. We split a batch's time into a fixed part (the affine intercept, 4.35 ms: kernel
  launches and framework work that do not grow with the batch) and the per-input part (the rest,
  0.50 ms per input at batch 8), and spread both evenly over the 12 layers (embeddings and head
  folded in). The table stops at batch 8, so the profile does too (`VALIDATED_BATCHES`): the
  planner never plans a batch the figures do not cover. Other lengths: the fixed part stays, the
  per-input part scales as (length / 128) ** 1.19, fitted to the same table's length-384 row
  (5.99 / 7.93 / 11.70 / 18.99 ms at batch 1 / 2 / 4 / 8).
- P100 and K80 (no published table of the same kind): the per-input part scaled by the ratio of
  peak arithmetic rates from NVIDIA's datasheets, anchored on V100's measured FP32/FP16 ratio in
  the same README (FP32 batch 4 -> 8: 1.87 ms per extra input, 3.7x FP16's 0.50 ms). V100 FP32
  peak 15.7 TFLOPS; P100 (PCIe) 9.3 TFLOPS FP32 and 2x that in FP16; K80 (one GK210 die) 4.37
  TFLOPS FP32 and no faster FP16. So per input: P100 = 1.87 x 15.7 / 18.6 = 1.58 ms, K80 =
  1.87 x 15.7 / 4.37 = 6.72 ms (per batch, over the 12 layers). The fixed part is kept at V100's
  on P100 and taken 1.3x on K80 (older, lower-clocked GPU on a slower PCIe generation): a stated
  assumption.
- Exit ramps (DeeBERT-style pooler + classifier) after every layer cost 2 % of a layer.
- Memory and transfers in FP16, the precision of the figures: 7.1 M parameters (14 MB) per layer;
  activations d * L * 2 bytes per sample (197 kB at length 128).
- Cost per GPU-hour: one provider's public on-demand list prices, Google Cloud's per-GPU prices
  (us-central1, GPU only): V100 2.48, P100 1.46, K80 0.45 units/h. (Previously AWS p3.2xlarge
  3.06 for V100 and p2.xlarge 0.90 for K80 were mixed with GCP's P100 price.)

`tensorrt_bert_base_profile(gpu)` is the near-linear counterpart: BERT-base FP16 under TensorRT on
A100 (40GB) and T4 from NVIDIA's published tables (NVIDIA/TensorRT, demo/BERT/README.md, commit
007c347, "Inference performance", FP16 average latency, batch 1-128 at lengths 128 and 384). A
batch of 128 costs 24x one on A100 (the V100 TensorFlow table above: 1.7x from 1 to 8), so exits
save nearly their whole share. Lengths other than 128 and 384 follow, per batch size, the power law
through those two rows. Prices: Google Cloud's per-GPU list prices (us-central1): A100 40GB 2.93,
T4 0.35 units/h.

`tensorrt_bert_large_profile(gpu)` scales those tables to BERT-large (24 layers, hidden 1024), the size E3
plans at fleet scale: a layer costs a BERT-base layer x (1024 / 768)^2 (its matrix products grow with the
square of the hidden size; attention's length term, linear in it, is the smaller part at these lengths), and
V100, which the TensorRT tables do not list, runs A100's table x 2.5 (the ratio of their FP16 tensor-core
peaks, 312 / 125 TFLOPS): stated assumptions, a near-linear curve of the right size, not measurements.
Weights 12.6 M parameters (25 MB FP16) per layer, activations 1024 x L x 2 bytes per sample.

`flops_bert_base_profile` keeps the earlier FLOP-derived model (peak x 60 % with a flat region
below 512 tokens in flight) for comparison. `synthetic_profile` builds a profile from any latency
function; `easy_hard_survival` maps an easy:hard mix onto exit depths (stated in its docstring).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from exitplan.api.resources import BlockProfile, GPUPoolSpec, ModelProfileSpec, RampProfile

SATURATION_TOKENS = 512
"""Tokens in flight per layer below which a GPU's layer latency stays flat (under-filled GPU)."""


@dataclass(frozen=True)
class GPU:
    name: str
    peak_tflops: float
    launch_ms: float
    cost_per_hour: float
    memory_gib: int
    efficiency: float = 0.6


GPUS = {
    "v100": GPU("v100", 15.7, 0.25, 2.48, 16),
    "p100": GPU("p100", 9.3, 0.25, 1.46, 16),
    "k80": GPU("k80", 4.4, 0.40, 0.45, 12),
    # the GPUs of the TensorRT tables (tensorrt_bert_base_profile); FP32 peaks for the FLOP model
    "a100": GPU("a100", 19.5, 0.25, 2.93, 40),
    "t4": GPU("t4", 8.1, 0.25, 0.35, 16),
}

PUBLISHED_V100_FP16_MS = {1: 1e3 / 206.82, 2: 2e3 / 376.75, 4: 4e3 / 635.00, 8: 8e3 / 962.83}
"""Whole-model batch time of BERT-base, length 128, FP16 on one V100 16GB (NVIDIA
DeepLearningExamples TensorFlow BERT README, SQuAD v1.1 fine-tuning inference, TF 20.06)."""
PUBLISHED_V100_FP16_384_MS = {1: 1e3 / 167.01, 2: 2e3 / 252.12, 4: 4e3 / 341.95, 8: 8e3 / 421.26}
"""The same table at sequence length 384 (for how the per-input part grows with length)."""
VALIDATED_BATCHES = (1, 2, 4, 8)
PUBLISHED_V100_FP32_PER_INPUT_MS = (8e3 / 422.88 - 4e3 / 349.34) / 4
"""The same README's FP32 figures, batch 4 -> 8: milliseconds per extra input (1.87)."""
FIXED_MS = {"v100": 1.0, "p100": 1.0, "k80": 1.3}
"""The fixed (batch-independent) part of a batch on each GPU, relative to V100's."""
PER_INPUT_PEAK_TFLOPS = {"v100": None, "p100": 2 * 9.3, "k80": 4.37}
"""The arithmetic rate the per-input part scales with (None: V100's own FP16 figures)."""


TENSORRT_BATCHES = (1, 2, 4, 8, 12, 16, 24, 32, 64, 128)
TENSORRT_FP16_MS = {
    "a100": {
        128: (0.67, 0.83, 1.02, 1.38, 1.87, 2.18, 3.34, 4.10, 8.05, 16.14),
        384: (1.31, 1.64, 2.31, 3.62, 5.03, 6.72, 9.79, 13.51, 26.11, 51.26),
    },
    "t4": {
        128: (1.95, 2.71, 4.53, 9.09, 12.53, 17.90, 26.86, 36.63, 72.04, 144.20),
        384: (4.04, 6.61, 13.02, 27.81, 41.82, 55.31, 84.11, 114.90, 227.73, 458.76),
    },
}
"""Whole-model BERT-base batch time (ms), FP16, TensorRT, average latency at batch TENSORRT_BATCHES,
lengths 128 and 384 (NVIDIA/TensorRT demo/BERT/README.md, commit 007c347)."""


def tensorrt_model_ms(gpu_name: str, batch_index: int, length: float) -> float:
    """The published whole-model time at TENSORRT_BATCHES[batch_index] and `length`: exact at 128 and
    384, elsewhere the power law in length through those two figures."""
    rows = TENSORRT_FP16_MS[gpu_name]
    t128, t384 = rows[128][batch_index], rows[384][batch_index]
    exponent = float(np.log(t384 / t128) / np.log(3.0))
    return float(t128 * (length / 128.0) ** exponent)


def _v100_fixed_and_slope() -> tuple[float, float]:
    """Least-squares affine fit of the published V100 FP16 batch times: (fixed ms, ms per input)."""
    b = np.asarray(list(PUBLISHED_V100_FP16_MS), dtype=np.float64)
    t = np.asarray(list(PUBLISHED_V100_FP16_MS.values()))
    slope, fixed = np.polyfit(b, t, 1)
    return float(fixed), float(slope)


def published_model_ms(gpu_name: str, batch: float) -> float:
    """Whole-model (12 layers) batch time on `gpu_name` at length 128, from the published figures."""
    fixed, _ = _v100_fixed_and_slope()
    if gpu_name == "v100":
        sizes = np.asarray(list(PUBLISHED_V100_FP16_MS), dtype=np.float64)
        times = np.asarray(list(PUBLISHED_V100_FP16_MS.values()))
        if batch <= sizes[-1]:
            return float(np.interp(batch, np.r_[0.0, sizes], np.r_[fixed, times]))
        return float(times[-1] + (times[-1] - times[-2]) / (sizes[-1] - sizes[-2]) * (batch - sizes[-1]))
    peak = PER_INPUT_PEAK_TFLOPS[gpu_name]
    assert peak is not None, "only V100 scales with its own figures (handled above)"
    per_input = PUBLISHED_V100_FP32_PER_INPUT_MS * GPUS["v100"].peak_tflops / peak
    return fixed * FIXED_MS[gpu_name] + per_input * batch


def length_exponent() -> float:
    """How the per-input part grows with length, from the published 128 and 384 figures at batch 8:
    (t384 - fixed) / (t128 - fixed) = 3 ** exponent (1.19: attention's quadratic share on top of
    the linear layers)."""
    fixed, _ = _v100_fixed_and_slope()
    return float(np.log((PUBLISHED_V100_FP16_384_MS[8] - fixed) / (PUBLISHED_V100_FP16_MS[8] - fixed)) / np.log(3.0))


def published_layer_ms(gpu_name: str, batch: float, length: float) -> float:
    """One of the 12 layers at `length`: the whole-model time / 12, its fixed part as at 128 and its
    per-input part scaled by (length / 128) ** length_exponent() (fitted to the 128 and 384
    figures; lengths below 128 extrapolate the same curve down)."""
    fixed, _ = _v100_fixed_and_slope()
    fixed *= FIXED_MS.get(gpu_name, 1.0)
    at128 = published_model_ms(gpu_name, batch)
    growth: float = (length / 128.0) ** length_exponent()  # real: length > 0 (typeshed types float ** float as Any)
    return (fixed + (at128 - fixed) * growth) / 12


HIDDEN = 768


def layer_ms(gpu: GPU, batch: float, length: float) -> float:
    """One BERT-base encoder layer: launch overhead + max(saturation floor, batch work)."""
    flops_per_token = 2 * 12 * HIDDEN**2 + 4 * length * HIDDEN
    tokens = max(batch * length, SATURATION_TOKENS)
    return gpu.launch_ms + tokens * flops_per_token / (gpu.peak_tflops * 1e12 * gpu.efficiency) * 1e3


def synthetic_profile(
    model: str,
    pool: str,
    n_blocks: int,
    seq_lens: Sequence[int],
    batch_sizes: Sequence[int],
    block_ms: Callable[[int, float, float], float],
    *,
    ramp_after: Sequence[int] = (),
    ramp_ms: Callable[[float, float], float] | None = None,
    survival: Sequence[float] = (),
    output_bytes: Callable[[float], int] = lambda length: 0,
    weight_bytes: int = 0,
    measured_on: str = "synthetic",
) -> ModelProfileSpec:
    """A ModelProfile whose tables are `block_ms(block, batch, length)` on the given grid."""
    blocks = [
        BlockProfile(
            name=f"block{k}",
            latency_ms=[[float(block_ms(k, b, L)) for b in batch_sizes] for L in seq_lens],
            weight_bytes=weight_bytes,
            output_bytes=[int(output_bytes(L)) for L in seq_lens],
        )
        for k in range(n_blocks)
    ]
    ramps = [
        RampProfile(
            name=f"ramp{k}",
            after_block=k,
            latency_ms=[[float(ramp_ms(b, L)) if ramp_ms else 0.0 for b in batch_sizes] for L in seq_lens],
        )
        for k in ramp_after
    ]
    return ModelProfileSpec(
        model=model,
        pool=pool,
        batch_sizes=list(batch_sizes),
        seq_lens=list(seq_lens),
        blocks=blocks,
        ramps=ramps,
        survival=list(survival),
        input_bytes=[int(output_bytes(L)) for L in seq_lens],
        measured_on=measured_on,
    )


def easy_hard_survival(
    n_blocks: int, easy: float, easy_exit: tuple[int, int] = (2, 5), hard_exit: tuple[int, int] = (10, 12)
) -> list[float]:
    """Survival after the ramp following each block 0..n_blocks-2 for an easy:hard mix.

    Hardness -> exit depth: an easy input exits after running d blocks, d uniform in `easy_exit`
    (inclusive: 2..5 of 12 by default, DeeBERT-like early exits); a hard input after d uniform in
    `hard_exit` (10..12; 12 = the full model). Survival after the ramp of block k (0-based, k + 1
    blocks run) is the share of inputs with d > k + 1.
    """
    depths_e = np.arange(easy_exit[0], easy_exit[1] + 1)
    depths_h = np.arange(hard_exit[0], hard_exit[1] + 1)
    out = []
    for k in range(n_blocks - 1):
        run = k + 1
        out.append(float(easy * np.mean(depths_e > run) + (1 - easy) * np.mean(depths_h > run)))
    return out


def layered_profile(
    model: str,
    gpu_name: str,
    n: int,
    seq_lens: Sequence[int],
    batch_sizes: Sequence[int],
    layer: Callable[[float, float], float],
    survival: list[float],
    *,
    hidden: int,
    value_bytes: int,
    weight_params: float,
    measured_on: str,
) -> ModelProfileSpec:
    """`n` identical layers of `layer(batch, length)` ms, a ramp of 2 % of a layer after each but the last,
    activations of `hidden` values per token and `weight_params` weights per layer of `value_bytes` each:
    the shape every BERT-like profile of this module shares."""
    return synthetic_profile(
        model,
        gpu_name,
        n,
        seq_lens,
        batch_sizes,
        lambda k, b, L: layer(b, L),
        ramp_after=list(range(n - 1)),
        ramp_ms=lambda b, L: 0.02 * layer(b, L),
        survival=survival,
        output_bytes=lambda L: int(hidden * L * value_bytes),
        weight_bytes=int(weight_params * value_bytes),
        measured_on=measured_on,
    )


def bert_base_profile(
    gpu_name: str,
    survival: Sequence[float] | None = None,
    *,
    seq_lens: Sequence[int] = (128,),
    batch_sizes: Sequence[int] = VALIDATED_BATCHES,
    model: str = "bert-base-ee",
) -> ModelProfileSpec:
    """The BERT-base 12-block early-exit profile on `gpu_name` (v100, p100, k80) from published
    figures; see the module docstring."""
    n = 12
    return layered_profile(
        model,
        gpu_name,
        n,
        seq_lens,
        batch_sizes,
        lambda b, L: published_layer_ms(gpu_name, b, L),
        list(survival) if survival is not None else easy_hard_survival(n, 0.8),
        hidden=HIDDEN,
        value_bytes=2,  # FP16 activations and weights
        weight_params=7.1e6,
        measured_on=f"derived: published BERT-base FP16 V100 figures (NVIDIA DeepLearningExamples), {gpu_name} scaled as stated in planner/synthetic.py",
    )


def tensorrt_bert_base_profile(
    gpu_name: str,
    survival: Sequence[float] | None = None,
    *,
    seq_lens: Sequence[int] = (128,),
    batch_sizes: Sequence[int] = TENSORRT_BATCHES,
    model: str = "bert-base-ee",
) -> ModelProfileSpec:
    """The BERT-base 12-block early-exit profile on `gpu_name` (a100, t4) from NVIDIA's TensorRT FP16
    tables (see the module docstring): each of the 12 layers a twelfth of the whole model, ramps 2 %
    of a layer, FP16 activations and weights. `batch_sizes` must be among TENSORRT_BATCHES."""
    n = 12
    index = {b: i for i, b in enumerate(TENSORRT_BATCHES)}

    def layer(b: float, L: float) -> float:
        return tensorrt_model_ms(gpu_name, index[int(b)], L) / n

    return layered_profile(
        model,
        gpu_name,
        n,
        seq_lens,
        batch_sizes,
        layer,
        list(survival) if survival is not None else easy_hard_survival(n, 0.8),
        hidden=HIDDEN,
        value_bytes=2,
        weight_params=7.1e6,
        measured_on=f"derived: published TensorRT BERT-base FP16 latency on {gpu_name} (NVIDIA/TensorRT demo/BERT), planner/synthetic.py",
    )


LARGE_HIDDEN = 1024
LARGE_BATCHES = (1, 2, 4, 8, 12, 16, 24, 32, 64)
"""TENSORRT_BATCHES up to 64: the batch sizes of `tensorrt_bert_large_profile`."""
V100_FROM_A100 = 312.0 / 125.0
"""V100's TensorRT time over A100's (FP16 tensor-core peaks: 312 and 125 TFLOPS), for the V100 pool of
`tensorrt_bert_large_profile`, which the published tables do not cover."""


def tensorrt_bert_large_profile(
    gpu_name: str,
    survival: Sequence[float] | None = None,
    *,
    seq_lens: Sequence[int] = (128, 384),
    batch_sizes: Sequence[int] = LARGE_BATCHES,
    model: str = "bert-large-ee",
) -> ModelProfileSpec:
    """BERT-large (24 blocks, a ramp after every layer but the last) on `gpu_name` (a100, v100, t4) from
    the TensorRT BERT-base tables, scaled as the module docstring states; survival: 80:20 easy:hard, easy
    inputs exit after 4-10 blocks, hard ones after 20-24."""
    n = 24
    source, factor = ("a100", V100_FROM_A100) if gpu_name == "v100" else (gpu_name, 1.0)
    index = {b: i for i, b in enumerate(TENSORRT_BATCHES)}
    scale = factor * (LARGE_HIDDEN / HIDDEN) ** 2 / 12  # one BERT-large layer from the 12-layer whole model

    def layer(b: float, L: float) -> float:
        return tensorrt_model_ms(source, index[int(b)], L) * scale

    return layered_profile(
        model,
        gpu_name,
        n,
        seq_lens,
        batch_sizes,
        layer,
        list(survival) if survival is not None else easy_hard_survival(n, 0.8, (4, 10), (20, 24)),
        hidden=LARGE_HIDDEN,
        value_bytes=2,
        weight_params=12.6e6,
        measured_on=f"derived: published TensorRT BERT-base FP16 latency scaled to BERT-large on {gpu_name} (planner/synthetic.py)",
    )


def flops_bert_base_profile(
    gpu_name: str,
    survival: Sequence[float] | None = None,
    *,
    seq_lens: Sequence[int] = (128,),
    batch_sizes: Sequence[int] = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64),
    model: str = "bert-base-ee",
) -> ModelProfileSpec:
    """The earlier FLOP-derived BERT-base-like profile (datasheet FP32 peak at 60 %, flat below
    SATURATION_TOKENS tokens in flight, a per-layer launch overhead)."""
    gpu = GPUS[gpu_name]
    n = 12
    return layered_profile(
        model,
        gpu_name,
        n,
        seq_lens,
        batch_sizes,
        lambda b, L: layer_ms(gpu, b, L),
        list(survival) if survival is not None else easy_hard_survival(n, 0.8),
        hidden=HIDDEN,
        value_bytes=4,
        weight_params=7.1e6,
        measured_on=f"derived: BERT-base FLOPs on {gpu_name} at {gpu.efficiency:.0%} of {gpu.peak_tflops} TFLOPS (planner/synthetic.py)",
    )


def gpu_pool(gpu_name: str, capacity: int, link_gbps: float = 100.0) -> GPUPoolSpec:
    gpu = GPUS[gpu_name]
    return GPUPoolSpec(
        capacity=capacity,
        cost_per_hour=gpu.cost_per_hour,
        memory_bytes=gpu.memory_gib * 2**30,
        link_bandwidth_gbps=link_gbps,
    )
