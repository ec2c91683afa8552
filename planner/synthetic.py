"""Profiles built from a stated latency model, for benchmarks, tests and what-if planning.

`bert_base_profile(gpu)` is a BERT-base-like 12-block early-exit encoder on a data-centre GPU,
derived (not measured here) from public figures:

- Work: BERT-base has hidden size d = 768 and FFN 3072, so one token through one encoder layer
  costs about 2 * 12 d^2 + 4 L d FLOPs (the QKV/output projections and FFN, plus attention over a
  length-L input): 14.2 MFLOP + 3 kFLOP * L.
- Speed: the FP32 peak of each GPU from NVIDIA's datasheets -- V100 (SXM2) 15.7 TFLOPS, P100 (PCIe)
  9.3 TFLOPS, K80 (one GK210 die) 4.4 TFLOPS -- at 60 % efficiency once the GPU is full.
- Assumption (stated, not measured): a layer is under-filled below `SATURATION_TOKENS` = 512
  tokens in flight (4 inputs of length 128), so its latency is flat below that, plus a fixed
  per-layer launch overhead (0.25 ms V100/P100, 0.4 ms K80). Consequences on a V100: 12.5 ms for
  one to four length-128 inputs through the 12 layers (the range of published FP32 batch-1
  BERT-base latencies), 41 ms for 16, 2.4 ms of GPU time per input once full.
- Exit ramps (DeeBERT-style pooler + classifier) after every layer cost 2 % of a layer.
- Memory: 7.1 M parameters (28 MB FP32) per layer; activations d * L * 4 bytes per sample.
- Cost per GPU-hour: typical public on-demand prices -- V100 3.06, P100 1.46, K80 0.90 (units/h).

`synthetic_profile` builds a profile from any latency function; `easy_hard_survival` maps an
easy:hard mix onto exit depths (stated in its docstring).
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
    "v100": GPU("v100", 15.7, 0.25, 3.06, 16),
    "p100": GPU("p100", 9.3, 0.25, 1.46, 16),
    "k80": GPU("k80", 4.4, 0.40, 0.90, 12),
}

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
        RampProfile(name=f"ramp{k}", after_block=k, latency_ms=[[float(ramp_ms(b, L)) if ramp_ms else 0.0 for b in batch_sizes] for L in seq_lens])
        for k in ramp_after
    ]
    return ModelProfileSpec(
        model=model, pool=pool, batch_sizes=list(batch_sizes), seq_lens=list(seq_lens), blocks=blocks, ramps=ramps,
        survival=list(survival), input_bytes=[int(output_bytes(L)) for L in seq_lens], measured_on=measured_on,
    )


def easy_hard_survival(n_blocks: int, easy: float, easy_exit: tuple[int, int] = (2, 5), hard_exit: tuple[int, int] = (10, 12)) -> list[float]:
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


def bert_base_profile(gpu_name: str, survival: Sequence[float] | None = None, *, seq_lens: Sequence[int] = (128,),
                      batch_sizes: Sequence[int] = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64), model: str = "bert-base-ee") -> ModelProfileSpec:
    """The BERT-base-like 12-block early-exit profile on `gpu_name` (v100, p100, k80); see the module docstring."""
    gpu = GPUS[gpu_name]
    n = 12
    return synthetic_profile(
        model, gpu_name, n, seq_lens, batch_sizes,
        lambda k, b, L: layer_ms(gpu, b, L),
        ramp_after=list(range(n - 1)),
        ramp_ms=lambda b, L: 0.02 * layer_ms(gpu, b, L),
        survival=list(survival) if survival is not None else easy_hard_survival(n, 0.8),
        output_bytes=lambda L: int(HIDDEN * L * 4),
        weight_bytes=int(7.1e6 * 4),
        measured_on=f"derived: BERT-base FLOPs on {gpu_name} at {gpu.efficiency:.0%} of {gpu.peak_tflops} TFLOPS (planner/synthetic.py)",
    )


def gpu_pool(gpu_name: str, capacity: int, link_gbps: float = 100.0) -> GPUPoolSpec:
    gpu = GPUS[gpu_name]
    return GPUPoolSpec(capacity=capacity, cost_per_hour=gpu.cost_per_hour, memory_bytes=gpu.memory_gib * 2**30, link_bandwidth_gbps=link_gbps)
