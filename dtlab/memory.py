"""How much memory does training take per GPU, for DDP and each ZeRO stage?

**Model states** (Rajbhandari et al., "ZeRO", 2019). With Ψ parameters trained by Adam in mixed
precision, every GPU of plain data parallelism holds

* 2Ψ bytes of 16-bit parameters,   * 2Ψ bytes of 16-bit gradients,
* 12Ψ bytes of optimizer state: an fp32 master copy of the parameters plus Adam's two fp32
  moments (K = 12),

16Ψ in all. ZeRO divides by the number of GPUs N: stage 1 the optimizer state, stage 2 also the
gradients, stage 3 also the parameters::

    stage 0 (DDP): 2Ψ + 2Ψ + 12Ψ          stage 2: 2Ψ + (2Ψ + 12Ψ)/N
    stage 1:       2Ψ + 2Ψ + 12Ψ/N        stage 3: (2Ψ + 2Ψ + 12Ψ)/N

Offloading the optimizer (ZeRO-Offload) moves the optimizer state, and from stage 2 the gradient
shard, to CPU memory; offloading parameters (stage 3 only) moves those too.

``model_states`` computes that. ``deepspeed_estimate`` reproduces DeepSpeed's own estimators
(``estimate_zero2/3_model_states_mem_needs``), which add the buffers its implementation keeps
(an fp32 gradient shard; in stage 3 also the largest layer gathered in fp32).
``activation_bytes`` estimates a transformer's activations, which come on top.

Sizes are in bytes; ``GB = 2**30`` as DeepSpeed prints them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

GB = 2**30

#: The seed tutorials' rule of thumb: model size -> set-up and strategy.
SIZE_GUIDE = [
    (1e9, "up to ~1B parameters", "1-4 GPUs on one node, DDP"),
    (7e9, "1B-7B", "1-2 nodes (4-8 GPUs), DDP + mixed precision"),
    (70e9, "7B-70B", "4-8 nodes (16-64 GPUs), ZeRO-3"),
    (float("inf"), "70B and more", "8+ nodes (64+ GPUs), ZeRO-3 + offloading"),
]


@dataclass(frozen=True)
class ModelStates:
    """Bytes per GPU for parameters, gradients and optimizer state, and bytes moved to CPU per GPU."""

    params: float
    grads: float
    optimizer: float
    cpu: float = 0.0

    @property
    def gpu(self) -> float:
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "gpu": self.gpu}


def model_states(num_params: float, gpus: int, stage: int, precision: str = "mixed",
                 offload_optimizer: bool = False, offload_params: bool = False) -> ModelStates:
    """Model-state bytes per GPU for ``num_params`` parameters on ``gpus`` GPUs (Adam).

    Args:
        stage: 0 (plain DDP) to 3.
        precision: ``"mixed"`` (16-bit params/grads, K=12: the paper's setting) or ``"fp32"``
            (4-byte params/grads; K=8 for Adam's moments, plus a 4-byte fp32 master shard from
            stage 1 on, which DeepSpeed's ZeRO optimizer keeps even in fp32 training).
        offload_optimizer: optimizer state (and, from stage 2, the gradient shard) in CPU memory.
        offload_params: parameters in CPU memory (stage 3 only).

    Raises:
        ValueError: for a stage outside 0-3, an unknown precision, or offload the stage cannot do.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage}: ZeRO stages are 0 (DDP), 1, 2 and 3")
    if precision not in ("mixed", "fp32"):
        raise ValueError(f"precision={precision!r}: use 'mixed' or 'fp32'")
    if offload_optimizer and stage == 0:
        raise ValueError("optimizer offload needs ZeRO stage 1, 2 or 3")
    if offload_params and stage != 3:
        raise ValueError("parameter offload needs ZeRO stage 3")
    if gpus < 1 or num_params <= 0:
        raise ValueError("need gpus >= 1 and num_params > 0")
    n, psi = gpus, float(num_params)
    if precision == "mixed":
        p_bytes, g_bytes, k = 2, 2, 12
    else:
        p_bytes, g_bytes, k = 4, 4, 8 if stage == 0 else 12
    params = p_bytes * psi / (n if stage == 3 else 1)
    grads = g_bytes * psi / (n if stage >= 2 else 1)
    optimizer = k * psi / (n if stage >= 1 else 1)
    cpu = 0.0
    if offload_optimizer:
        cpu += optimizer
        optimizer = 0.0
        if stage >= 2:
            cpu += grads
            grads = 0.0
    if offload_params:
        cpu += params
        params = 0.0
    return ModelStates(params, grads, optimizer, cpu)


def deepspeed_estimate(num_params: float, gpus_per_node: int, nodes: int, stage: int,
                       offload_optimizer: bool = False, offload_params: bool = False,
                       largest_layer_params: float = 0, buffer_factor: float = 1.5) -> tuple[int, int]:
    """``(gpu_bytes_per_gpu, cpu_bytes_per_node)`` as DeepSpeed 0.19's estimators compute them.

    These are ``estimate_zero2_model_states_mem_needs`` and ``estimate_zero3_...`` (with
    ``zero_init=True``), written out. Against ``model_states(..., "mixed")`` they add what the
    implementation keeps besides the paper's 16 bytes per parameter: an fp32 gradient shard
    (18Ψ/N instead of 14Ψ/N or 16Ψ/N) and, in stage 3, the largest layer gathered in fp32
    (4 bytes x ``largest_layer_params``). ``buffer_factor`` pads the CPU side, as DeepSpeed's does.
    (Releases before 0.10 estimated stage 2 without offload as 4Ψ + 16Ψ/N, which is what older
    published tables show.)
    """
    n = gpus_per_node * nodes
    psi = float(num_params)
    if stage == 2:
        if offload_params:
            raise ValueError("parameter offload needs ZeRO stage 3")
        if offload_optimizer:
            gpu = 2 * psi
            cpu = psi * max(4 * n, 16) * buffer_factor
        else:
            gpu = 2 * psi + int(18 * psi / n)
            cpu = psi * 4 * gpus_per_node * buffer_factor
        return int(gpu), int(cpu)
    if stage == 3:
        largest = 4 * largest_layer_params
        per_node = 1 / nodes
        if offload_optimizer and offload_params:
            gpu, cpu = largest, psi * 18 * per_node * buffer_factor
        elif offload_optimizer:
            gpu = largest + int(2 * psi / n)
            cpu = psi * 16 * per_node * buffer_factor
        elif offload_params:
            raise ValueError("DeepSpeed's estimator has no parameter-only offload; offload the optimizer too")
        else:
            gpu = largest + int(18 * psi / n)
            cpu = largest_layer_params * 4 * gpus_per_node * buffer_factor
        return int(gpu), int(cpu)
    raise ValueError(f"DeepSpeed publishes estimators for stages 2 and 3, not {stage}")


def activation_bytes(batch: int, seq_len: int, n_layer: int, n_embd: int, n_head: int,
                     bytes_per_value: int = 2) -> float:
    """Activations a GPT-style transformer keeps for backward, without recomputation.

    Per layer ``s*b*h*(34 + 5*a*s/h)`` bytes in 16-bit (Korthikanti et al., 2022: "Reducing
    Activation Recomputation in Large Transformer Models"), for sequence length s, batch b,
    hidden size h and a heads; scaled for other value sizes.
    """
    s, b, h, a = seq_len, batch, n_embd, n_head
    return n_layer * s * b * h * (34 + 5 * a * s / h) * bytes_per_value / 2


def size_guide(num_params: float) -> tuple[str, str]:
    """The seed tutorials' recommendation for a model of ``num_params`` parameters."""
    for limit, label, advice in SIZE_GUIDE:
        if num_params <= limit:
            return label, advice
    raise AssertionError("unreachable")


#: CPU memory per GPU on a g5.12xlarge (192 GiB for 4 GPUs): where offloaded states go.
G5_CPU_GB_PER_GPU = 48.0


def plan_table(num_params: float, gpus: int, gpu_memory_gb: float, headroom: float = 0.8,
               cpu_gb_per_gpu: float = G5_CPU_GB_PER_GPU) -> list[dict]:
    """Per-GPU model-state memory for each strategy, and whether it fits.

    A strategy fits when its GPU share is within ``headroom`` x GPU memory (the rest is left for
    activations, buffers and fragmentation) and what it offloads is within ``headroom`` x the CPU
    memory per GPU. Rows in order of preference (least communication first).
    """
    budget = headroom * gpu_memory_gb * GB
    cpu_budget = headroom * cpu_gb_per_gpu * GB
    rows = []
    for name, stage, off_opt, off_par in [("DDP (stage 0)", 0, False, False), ("ZeRO-1", 1, False, False),
                                          ("ZeRO-2", 2, False, False), ("ZeRO-3", 3, False, False),
                                          ("ZeRO-2 + optimizer offload", 2, True, False),
                                          ("ZeRO-3 + optimizer offload", 3, True, False),
                                          ("ZeRO-3 + optimizer and parameter offload", 3, True, True)]:
        states = model_states(num_params, gpus, stage, offload_optimizer=off_opt, offload_params=off_par)
        rows.append({"strategy": name, "stage": stage, "gpu_gb": states.gpu / GB, "cpu_gb_per_gpu": states.cpu / GB,
                     "fits": states.gpu <= budget and states.cpu <= cpu_budget})
    return rows


def recommend(num_params: float, gpus: int, gpu_memory_gb: float, headroom: float = 0.8,
              cpu_gb_per_gpu: float = G5_CPU_GB_PER_GPU) -> str:
    """The first strategy of ``plan_table`` whose model states fit, or how many GPUs ZeRO-3 needs."""
    for row in plan_table(num_params, gpus, gpu_memory_gb, headroom, cpu_gb_per_gpu):
        if row["fits"]:
            return row["strategy"]
    needed = int(-(-16 * num_params // (headroom * gpu_memory_gb * GB)))
    return f"nothing fits on {gpus} GPUs: ZeRO-3 needs about {needed} GPUs of {gpu_memory_gb:g} GB"


def format_table(num_params: float, gpus: int, gpu_memory_gb: float, headroom: float = 0.8,
                 cpu_gb_per_gpu: float = G5_CPU_GB_PER_GPU) -> str:
    """The table ``dtlab memory`` prints."""
    label, advice = size_guide(num_params)
    lines = [f"{num_params / 1e9:g}B parameters on {gpus} GPUs of {gpu_memory_gb:g} GB "
             f"and {cpu_gb_per_gpu:g} GB CPU memory each (model states must fit {headroom:.0%}; "
             "mixed-precision Adam; activations not included)",
             f"{'strategy':<42} {'GB per GPU':>10} {'CPU GB/GPU':>10}  fits"]
    for r in plan_table(num_params, gpus, gpu_memory_gb, headroom, cpu_gb_per_gpu):
        lines.append(f"{r['strategy']:<42} {r['gpu_gb']:>10.2f} {r['cpu_gb_per_gpu']:>10.2f}  "
                     f"{'yes' if r['fits'] else 'no'}")
    lines.append(f"recommended: {recommend(num_params, gpus, gpu_memory_gb, headroom, cpu_gb_per_gpu)}")
    lines.append(f"rule of thumb for {label}: {advice}")
    return "\n".join(lines)
