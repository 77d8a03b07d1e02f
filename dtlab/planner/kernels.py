"""What a GPU's kernels achieve, from published measurements: matrix products by shape, attention by sequence
length, and the memory-bound rest. ``cost`` builds a step's compute time from these, not from one efficiency.

A transformer layer's forward and backward are three kinds of work, each at its own speed:

* **Matrix products** (the QKV, output, MLP and vocabulary projections) run at ``gemm_efficiency(d, tokens)`` of
  the GPU's peak: the best measured rate (Stas Bekman's "maximum achievable matmul FLOPS", ``mamf``: A100 SXM 271.2
  of 312 TFLOP/s, H100 SXM 794.5 of 989) for large products, less when the smaller of a product's two weight
  dimensions ``d`` is small (a small model, or a large one cut by tensor parallelism) or few tokens pass:
  ``min(mamf, e_inf * d / (d + 300) * T / (T + 128))``. At h = 4096 and 8k tokens this gives 249 TFLOP/s on an
  A100, where EleutherAI's sizing benchmark measured 235-255 for the same layer's products.
* **Attention** runs at the FlashAttention-2 paper's measured forward + backward rate for a causal mask and head
  dimension 128 (Dao 2023, figures 5-6: 155-189 TFLOP/s on an A100 from 2k to 16k tokens, 265-328 on an H100),
  counted as the paper counts (the causal half of ``4 s^2 d`` per head forward, 2.5 times that backward); eager
  attention (no fused kernel) at the same figures' PyTorch rate (32-34 TFLOP/s on an A100).
* **Memory-bound kernels** (norms, activations, dropout, residual adds, rotary embeddings, the loss) move
  ``kernel_bytes`` bytes per token and hidden unit over a layer's forward and backward, at the GPU's memory
  bandwidth: about 200 with fused kernels (Megatron-LM's; EleutherAI's sizing run gives ~85 forward), about 500 in
  eager PyTorch (Ivanov et al. 2021: normalisation and element-wise kernels took 39% of BERT-large's time in
  PyTorch, 0.2% of its FLOPs). Their share falls as 1/h, and is twice as large on an H100 (twice the FLOP/s per
  byte of an A100): why small models train further from peak.

GPUs without published rates here take the A100's fractions of their own peak and their datasheet bandwidth.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class KernelRates:
    """One GPU family's measured kernel rates (see the module docstring)."""

    family: str
    mamf: float                 # best measured matrix-product rate, as a fraction of the dense peak
    e_inf: float                # the GEMM curve's asymptote before the cap
    hbm_gbs: float              # memory bandwidth, GB/s
    #: FlashAttention-2, causal, head dim 128, forward + backward TFLOP/s by sequence length
    flash_tflops: dict[int, float] = field(default_factory=dict)
    #: the same figures' PyTorch (eager) attention
    eager_tflops: dict[int, float] = field(default_factory=dict)
    peak_tflops: float = 0.0    # the dense 16-bit peak the rates above were measured against
    source: str = ""


#: The two curve constants of ``gemm_efficiency``: the weight dimension and the token count at which a product
#: reaches half its asymptote.
GEMM_D0, GEMM_T0 = 300.0, 128.0

RATES: dict[str, KernelRates] = {
    "A100": KernelRates(
        "A100", mamf=271.2 / 312, e_inf=0.87, hbm_gbs=2039.0,
        flash_tflops={512: 99, 1024: 133, 2048: 155, 4096: 173, 8192: 182, 16384: 189},
        eager_tflops={512: 23, 1024: 28, 2048: 32, 4096: 32, 8192: 34}, peak_tflops=312.0,
        source="MAMF: Bekman, ml-engineering compute/accelerator/README.md (A100 SXM 271.2 TFLOP/s at "
               "1024x10240x5120); attention: Dao 2023 (FlashAttention-2), fig. 5(d), A100 80GB SXM4; bandwidth: "
               "the A100 80GB SXM datasheet (2,039 GB/s)"),
    "H100": KernelRates(
        "H100", mamf=794.5 / 989, e_inf=0.846, hbm_gbs=3350.0,
        flash_tflops={512: 163, 1024: 221, 2048: 265, 4096: 294, 8192: 308, 16384: 328},
        eager_tflops={512: 40, 1024: 50, 2048: 57, 4096: 61, 8192: 63}, peak_tflops=989.0,
        source="MAMF: Bekman (H100 SXM 794.5 TFLOP/s at 2048x2048x13312); attention: Dao 2023, fig. 6(d), H100 80GB "
               "SXM5; bandwidth: the H100 SXM datasheet (3.35 TB/s)"),
}
#: Datasheet memory bandwidths (GB/s) of GPUs without measured rates here, and of other memory sizes.
BANDWIDTH_GBS = {"H200": 4800.0, "H100 96GB": 3350.0, "A100 40GB": 1555.0, "A10G": 600.0, "V100": 900.0, "T4": 320.0,
                 "L4": 300.0, "L40S": 864.0}
#: Bytes per token and hidden unit that a layer's memory-bound kernels move, forward and backward, by framework
#: (``cost.Setup.framework``): fused kernels (Megatron-LM) or eager PyTorch.
KERNEL_BYTES = {"megatron": 200.0, "megatron-deepspeed": 200.0, "pytorch": 500.0, "deepspeed": 500.0}


def rates_for(gpu_name: str, peak_tflops: float) -> KernelRates:
    """The measured rates of ``gpu_name``'s family, or the A100's fractions scaled to this GPU (its bandwidth from
    ``BANDWIDTH_GBS`` where known, else the A100's ratio of bandwidth to peak)."""
    name = gpu_name.upper()
    bandwidth = next((v for k, v in sorted(BANDWIDTH_GBS.items(), key=lambda kv: -len(kv[0]))
                      if name.startswith(k.upper())), None)
    for family, rates in RATES.items():
        if name.startswith(family) and not name.startswith("H200"):
            if bandwidth is not None and bandwidth != rates.hbm_gbs:
                return KernelRates(**{**rates.__dict__, "hbm_gbs": bandwidth})
            return rates
    a100 = RATES["A100"]
    scale = peak_tflops / a100.peak_tflops if peak_tflops else 1.0
    if name.startswith("H200"):     # an H100's compute with more, faster memory
        h100 = RATES["H100"]
        return KernelRates(**{**h100.__dict__, "family": "H200", "hbm_gbs": BANDWIDTH_GBS["H200"]})
    return KernelRates(gpu_name, a100.mamf, a100.e_inf, bandwidth or a100.hbm_gbs * scale,
                       {s: v * scale for s, v in a100.flash_tflops.items()},
                       {s: v * scale for s, v in a100.eager_tflops.items()}, peak_tflops,
                       "the A100's measured fractions of peak, scaled to this GPU's")


def gemm_efficiency(rates: KernelRates, d: float, tokens: float) -> float:
    """Fraction of peak a matrix product reaches when its smaller weight dimension is ``d`` and ``tokens`` pass."""
    return min(rates.mamf, rates.e_inf * d / (d + GEMM_D0) * tokens / (tokens + GEMM_T0))


def _by_length(table: dict[int, float], seq_len: int) -> float:
    """``table`` at ``seq_len``: interpolated in log length, the end values beyond its ends."""
    lengths = sorted(table)
    if seq_len <= lengths[0]:
        return table[lengths[0]]
    if seq_len >= lengths[-1]:
        return table[lengths[-1]]
    i = bisect.bisect_left(lengths, seq_len)
    lo, hi = lengths[i - 1], lengths[i]
    w = (math.log(seq_len) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return table[lo] + w * (table[hi] - table[lo])


def attention_flops_per_second(rates: KernelRates, seq_len: int, fused: bool) -> float:
    """Forward + backward FLOP/s of causal attention over ``seq_len`` tokens (FlashAttention's count)."""
    return _by_length(rates.flash_tflops if fused else rates.eager_tflops, seq_len) * 1e12
