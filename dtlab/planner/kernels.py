"""What a GPU's kernels achieve, from published measurements: matrix products by shape, attention by sequence
length, and the memory-bound rest. ``cost`` builds a step's compute time from these, not from one efficiency.

A transformer layer's forward and backward are three kinds of work, each at its own speed:

* **Matrix products** (the QKV, output, MLP and vocabulary projections) run at ``gemm_efficiency(d, tokens)`` of
  the GPU's peak: the best measured rate (Stas Bekman's "maximum achievable matmul FLOPS", ``mamf``: A100 SXM 271.2
  of 312 TFLOP/s, H100 SXM 794.5 of 989) for large products, less when the smaller of a product's two weight
  dimensions ``d`` is small (a small model, or a large one cut by tensor parallelism) or few tokens pass:
  ``min(mamf, e_inf * d / (d + 300) * T / (T + 128))``. At h = 4096 and 8k tokens this gives 249 TFLOP/s on an
  A100, where EleutherAI's sizing benchmark measured 235-255 for the same layer's products.
* **Attention** runs at the FlashAttention-2 paper's measured forward + backward rate for a causal mask, by head
  dimension (64 or 128) and sequence length (Dao 2023, the repo's assets/flash2_a100_fwd_bwd_benchmark.png and
  flash2_h100_fwd_bwd_benchmark.png, the paper's figures 4 and 7: FlashAttention-2 155-189 TFLOP/s on an A100 from
  2k to 16k tokens at head dimension 128, 265-328 on an H100), counted as the paper counts (the causal half of
  ``4 s^2 d`` per head forward, 2.5 times that backward). The same figures give FlashAttention (1), the Triton
  FlashAttention (on the H100, whose figure has no Triton bars, FlashAttention (1)'s stand in) and eager PyTorch
  (32-34 TFLOP/s on an A100): ``cost.Setup.attention_kernel`` picks one.
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
    #: causal attention, forward + backward TFLOP/s (FlashAttention's count) by kernel, head dimension and sequence
    #: length: {"flash2": {128: {2048: 155, ...}, 64: {...}}, "eager": {...}, ...}
    attention: dict[str, dict[int, dict[int, float]]] = field(default_factory=dict)
    peak_tflops: float = 0.0    # the dense 16-bit peak the rates above were measured against
    source: str = ""


#: The two curve constants of ``gemm_efficiency``: the weight dimension and the token count at which a product
#: reaches half its asymptote.
GEMM_D0, GEMM_T0 = 300.0, 128.0

#: FlashAttention (1) on an H100 (TFLOP/s by head dimension and sequence length): Dao 2023, fig. 6(d).
_H100_FLASH1 = {128: {512: 98, 1024: 109, 2048: 108, 4096: 126, 8192: 135, 16384: 137},
                64: {512: 104, 1024: 123, 2048: 136, 4096: 138, 8192: 149, 16384: 156}}

RATES: dict[str, KernelRates] = {
    "A100": KernelRates(
        "A100", mamf=271.2 / 312, e_inf=0.87, hbm_gbs=2039.0,
        attention={"flash2": {128: {512: 99, 1024: 133, 2048: 155, 4096: 173, 8192: 182, 16384: 189},
                              64: {512: 88, 1024: 119, 2048: 140, 4096: 156, 8192: 165, 16384: 171}},
                   "flash1": {128: {512: 55, 1024: 62, 2048: 69, 4096: 76, 8192: 80, 16384: 83},
                              64: {512: 58, 1024: 70, 2048: 77, 4096: 87, 8192: 92, 16384: 97}},
                   "triton": {128: {512: 50, 1024: 61, 2048: 68, 4096: 74, 8192: 78, 16384: 80},
                              64: {512: 59, 1024: 75, 2048: 79, 4096: 76, 8192: 79, 16384: 80}},
                   "eager": {128: {512: 23, 1024: 28, 2048: 32, 4096: 32, 8192: 34},
                             64: {512: 15, 1024: 16, 2048: 17, 4096: 18, 8192: 18}}},
        peak_tflops=312.0,
        source="MAMF: Bekman, ml-engineering compute/accelerator/README.md (A100 SXM 271.2 TFLOP/s at "
               "1024x10240x5120); attention: Dao 2023 (FlashAttention-2), fig. 5(d), A100 80GB SXM4; bandwidth: "
               "the A100 80GB SXM datasheet (2,039 GB/s)"),
    "H100": KernelRates(
        "H100", mamf=794.5 / 989, e_inf=0.846, hbm_gbs=3350.0,
        attention={"flash2": {128: {512: 163, 1024: 221, 2048: 265, 4096: 294, 8192: 308, 16384: 328},
                              64: {512: 141, 1024: 192, 2048: 232, 4096: 257, 8192: 273, 16384: 284}},
                   # the H100 figure has no Triton bars: its FlashAttention (1) bars stand in for them
                   "flash1": _H100_FLASH1, "triton": _H100_FLASH1,
                   "eager": {128: {512: 40, 1024: 50, 2048: 57, 4096: 61, 8192: 63},
                             64: {512: 26, 1024: 29, 2048: 31, 4096: 32, 8192: 32}}},
        peak_tflops=989.0,
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
    scaled = {kernel: {d: {n: v * scale for n, v in by_len.items()} for d, by_len in by_dim.items()}
              for kernel, by_dim in a100.attention.items()}
    return KernelRates(gpu_name, a100.mamf, a100.e_inf, bandwidth or a100.hbm_gbs * scale, scaled, peak_tflops,
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


#: Attention kernels with measured rates: FlashAttention-2, FlashAttention (1), the Triton FlashAttention, eager
#: PyTorch (no fused kernel).
ATTENTION_KERNELS = ("flash2", "flash1", "triton", "eager")


def attention_flops_per_second(rates: KernelRates, seq_len: int, kernel: str = "flash2", head_dim: int = 128) -> float:
    """Forward + backward FLOP/s of causal attention over ``seq_len`` tokens (FlashAttention's count) by ``kernel``
    (``ATTENTION_KERNELS``), at the measured head dimension nearest ``head_dim`` (64 or 128)."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"kernel={kernel!r}: one of {', '.join(ATTENTION_KERNELS)}")
    by_dim = rates.attention[kernel]
    dim = min(by_dim, key=lambda d: abs(math.log(d / max(head_dim, 1))))
    return _by_length(by_dim[dim], seq_len) * 1e12
