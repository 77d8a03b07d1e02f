"""How much memory does training take per GPU, for DDP and each ZeRO stage, and what fits?

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

**Activations** (Korthikanti et al., 2022, "Reducing Activation Recomputation in Large Transformer
Models"). A GPT-style layer keeps ``s*b*h*(34 + 5*a*s/h)`` bytes in 16-bit for its backward pass
(sequence s, micro-batch b, hidden size h, a heads); selective recomputation (recompute the
attention scores) keeps ``34*s*b*h``; full recomputation keeps only each layer's input, ``2*s*b*h``.
ZeRO does not shard activations: every GPU holds those of its own micro-batch, whatever the stage.

**What fits** (``plan_table``, ``recommend``, ``format_table``): model states plus activations
within ``1 - headroom`` of a GPU's memory, and offloaded states within ``1 - headroom`` of the CPU
memory per GPU. GPU and CPU memory come from ``dtlab.hardware`` (default: the course's
g5.12xlarge, 4 x A10G); activations from the model's shape (default: micro-batch 1, 2,048 tokens,
no recomputation, the shape of a known model of that size).

``model_states`` computes the paper's figures; ``deepspeed_estimate`` reproduces DeepSpeed's own
estimators (``estimate_zero2/3_model_states_mem_needs``), which add the buffers its implementation
keeps (an fp32 gradient shard; in stage 3 also the largest layer gathered in fp32).

**Units.** The functions return bytes. Tables print **GB = 10**9 bytes**, the unit of the ZeRO
paper and of GPU datasheets. (DeepSpeed's estimators print "GB" for GiB = 2**30 bytes: compare
bytes, or divide by ``GiB``.)
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import asdict, dataclass

from dtlab import hardware

#: Units: GB = 10**9 bytes (what the tables print); GiB = 2**30 bytes (what DeepSpeed prints as "GB").
GB, GiB = hardware.GB, hardware.GiB

#: Share of each GPU's (and CPU's) memory a plan leaves free: the CUDA context and what the driver
#: reserves (CUDA sees ~1.5% less than nvidia-smi on an A10G), communication buckets (DeepSpeed's
#: default reduce and all-gather buckets hold 5e8 elements each, ~1 GB each in 16-bit), temporary
#: buffers, and fragmentation in PyTorch's caching allocator.
HEADROOM = 0.15
#: What activations are computed for when not told otherwise: one sequence of 2,048 tokens.
MICRO_BATCH, SEQ_LEN = 1, 2048
#: Activation recomputation (checkpointing) modes: keep everything, recompute attention, keep layer inputs only.
RECOMPUTE = ("none", "selective", "full")

#: The reference material's rule of thumb (the seed tutorials): model size -> set-up and strategy.
#: It is not arithmetic: 7B parameters in DDP hold 16 x 7e9 = 112 GB of model states per GPU.
SIZE_GUIDE = [
    (1e9, "up to ~1B parameters", "1-4 GPUs on one node, DDP"),
    (7e9, "1B-7B", "1-2 nodes (4-8 GPUs), DDP + mixed precision"),
    (70e9, "7B-70B", "4-8 nodes (16-64 GPUs), ZeRO-3"),
    (float("inf"), "70B and more", "8+ nodes (64+ GPUs), ZeRO-3 + offloading"),
]

#: Plan rows in order of preference (least communication first): name, stage, offload optimizer, offload params.
STRATEGIES = [("DDP (stage 0)", 0, False, False), ("ZeRO-1", 1, False, False), ("ZeRO-2", 2, False, False),
              ("ZeRO-3", 3, False, False), ("ZeRO-2 + optimizer offload", 2, True, False),
              ("ZeRO-3 + optimizer offload", 3, True, False),
              ("ZeRO-3 + optimizer and parameter offload", 3, True, True)]


@dataclass(frozen=True)
class ModelStates:
    """Bytes per GPU for parameters, gradients and optimizer state, and bytes moved to CPU per GPU."""

    params: float
    grads: float
    optimizer: float
    cpu: float = 0.0

    @property
    def gpu(self) -> float:
        """Bytes on the GPU: parameters + gradients + optimizer state."""
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict[str, float]:
        """The fields and ``gpu`` as a dict (bytes)."""
        return {**asdict(self), "gpu": self.gpu}


def model_states(num_params: float, gpus: int, stage: int, precision: str = "mixed",
                 offload_optimizer: bool = False, offload_params: bool = False) -> ModelStates:
    """Model-state bytes per GPU for ``num_params`` parameters on ``gpus`` GPUs (Adam), as in the ZeRO paper.

    Args:
        num_params: parameters of the model (Ψ).
        gpus: data-parallel GPUs (N) that share the states.
        stage: 0 (plain DDP) to 3.
        precision: ``"mixed"`` (16-bit params/grads, K=12: the paper's setting) or ``"fp32"``
            (4-byte params/grads; K=8 for Adam's moments, plus a 4-byte fp32 master shard from
            stage 1 on, which DeepSpeed's ZeRO optimizer keeps even in fp32 training).
        offload_optimizer: optimizer state (and, from stage 2, the gradient shard) in CPU memory.
        offload_params: parameters in CPU memory (stage 3 only).

    Returns:
        ``ModelStates`` in bytes: ``.params``, ``.grads``, ``.optimizer``, ``.gpu`` (their sum) and
        ``.cpu`` (what was offloaded).

    Raises:
        ValueError: for a stage outside 0-3, an unknown precision, offload the stage cannot do, or
            non-positive sizes.
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
    """Bytes as DeepSpeed 0.19's estimators compute them.

    These are ``estimate_zero2_model_states_mem_needs`` and ``estimate_zero3_...`` (with
    ``zero_init=True``), written out. Against ``model_states(..., "mixed")`` they add what the
    implementation keeps besides the paper's 16 bytes per parameter: an fp32 gradient shard
    (18Ψ/N instead of 14Ψ/N or 16Ψ/N) and, in stage 3, the largest layer gathered in fp32
    (4 bytes x ``largest_layer_params``). (Releases before 0.10 estimated stage 2 without offload
    as 4Ψ + 16Ψ/N, which is what older published tables show.) DeepSpeed prints these bytes
    divided by 2**30 and labelled "GB": they are GiB.

    Args:
        num_params: parameters of the model.
        gpus_per_node, nodes: the cluster (N = gpus_per_node x nodes).
        stage: 2 or 3 (DeepSpeed publishes estimators for these only).
        offload_optimizer, offload_params: as in ``model_states``.
        largest_layer_params: parameters of the largest layer (stage 3).
        buffer_factor: DeepSpeed's padding of the CPU side.

    Returns:
        ``(gpu_bytes_per_gpu, cpu_bytes_per_node)``.

    Raises:
        ValueError: for another stage, or an offload combination the estimators do not cover.
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
                     bytes_per_value: int = 2, recompute: str = "none", peak: bool = True) -> float:
    """Activations a GPT-style transformer keeps for backward, per GPU (Korthikanti et al., 2022).

    Per layer, in 16-bit, for sequence length s, batch b, hidden size h and a heads (the paper's
    equation for one layer without parallelism): ``s*b*h*(34 + 5*a*s/h)`` bytes without
    recomputation, ``34*s*b*h`` with selective recomputation (the attention scores, ``5*a*s*s*b``,
    are recomputed), ``2*s*b*h`` with full recomputation (only the layer's input is kept). The
    formula assumes a GPT layer (4h MLP, full multi-head attention, dropout); LLaMA-style layers
    differ by a few percent. Embeddings and the output logits are not included. Values of another
    size scale the result by ``bytes_per_value / 2``.

    Args:
        batch: sequences per GPU per step (the micro-batch).
        seq_len: tokens per sequence.
        n_layer, n_embd, n_head: the model's layers, hidden size and attention heads.
        bytes_per_value: 2 for bf16/fp16 activations.
        recompute: ``"none"``, ``"selective"`` or ``"full"``.
        peak: with recomputation, add what one layer recomputes during its backward (its
            attention scores for "selective", its full activations for "full"): the peak, not only
            what is stored between forward and backward (``peak=False`` gives the paper's figures).

    Returns:
        Bytes per GPU.

    Raises:
        ValueError: for a size below 1, ``n_embd`` not divisible by ``n_head``, or an unknown recompute mode.
    """
    _check_shape(n_layer, n_embd, n_head)
    if batch < 1 or seq_len < 1:
        raise ValueError(f"batch={batch}, seq_len={seq_len}: both must be >= 1. Fix: e.g. batch=1, seq_len=2048")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}: use one of {', '.join(map(repr, RECOMPUTE))}")
    s, b, h, a = seq_len, batch, n_embd, n_head
    layer = s * b * h * (34 + 5 * a * s / h)
    if recompute == "none":
        total = n_layer * layer
    elif recompute == "selective":
        total = n_layer * 34 * s * b * h + (5 * a * s * s * b if peak else 0)
    else:
        total = n_layer * 2 * s * b * h + (layer if peak else 0)
    return total * bytes_per_value / 2


@dataclass(frozen=True)
class ModelShape:
    """A transformer's layers, hidden size and attention heads: what its activations depend on."""

    name: str
    n_layer: int
    n_embd: int
    n_head: int
    source: str = ""

    def describe(self) -> str:
        """One line for a table: name, layers, hidden size, heads."""
        return f"{self.name} shape ({self.n_layer} layers, hidden {self.n_embd:,}, {self.n_head} heads)"


#: Shapes of published models, by nominal size (parameters).
KNOWN_SHAPES: dict[float, ModelShape] = {
    1.3e9: ModelShape("OPT 1.3B", 24, 2048, 32, "Zhang et al. 2022, 'OPT: Open Pre-trained Transformer Language "
                                                "Models', Table 1"),
    7e9: ModelShape("LLaMA 7B", 32, 4096, 32, "Touvron et al. 2023, 'LLaMA: Open and Efficient Foundation "
                                              "Language Models', Table 2"),
    13e9: ModelShape("LLaMA 13B", 40, 5120, 40, "Touvron et al. 2023, LLaMA, Table 2"),
    70e9: ModelShape("Llama 2 70B", 80, 8192, 64, "Touvron et al. 2023, 'Llama 2', released config (the same "
                                                  "layers, width and heads as LLaMA 65B, Table 2 of LLaMA)"),
}


def model_shape(num_params: float) -> ModelShape:
    """The shape assumed for a model of ``num_params`` parameters.

    A known shape (``KNOWN_SHAPES``: 1.3B, 7B, 13B, 70B) when ``num_params`` is within a factor 1.25
    of its nominal size; otherwise one derived from ``parameters ~ 12 * n_layer * n_embd**2`` (the
    weights of a GPT layer) with 128-wide heads and ``n_embd = 128 * n_layer``, the proportions of
    LLaMA 7B and 13B.

    Args:
        num_params: parameters of the model.

    Returns:
        A ``ModelShape`` (its ``source`` says where it comes from).

    Raises:
        ValueError: for ``num_params <= 0``.
    """
    if num_params <= 0:
        raise ValueError(f"num_params={num_params:g}: a model needs parameters. Fix: e.g. 7e9")
    nominal = min(KNOWN_SHAPES, key=lambda size: abs(math.log(num_params / size)))
    if 1 / 1.25 <= num_params / nominal <= 1.25:
        return KNOWN_SHAPES[nominal]
    n_layer = max(1, round((num_params / (12 * 128**2)) ** (1 / 3)))
    return ModelShape(f"derived {num_params / 1e9:g}B", n_layer, 128 * n_layer, n_layer,
                      "12 * n_layer * n_embd**2 ~ parameters, n_embd = 128 * n_layer, 128-wide heads")


def _check_shape(n_layer: int, n_embd: int, n_head: int) -> None:
    if min(n_layer, n_embd, n_head) < 1:
        raise ValueError(f"n_layer={n_layer}, n_embd={n_embd}, n_head={n_head}: all must be >= 1. "
                         "Fix: e.g. 32 layers, hidden 4096, 32 heads")
    if n_embd % n_head:
        raise ValueError(f"hidden size {n_embd} is not divisible by {n_head} heads. Fix: a hidden size that is a "
                         f"multiple of the heads, e.g. {n_head * max(1, round(n_embd / n_head))}")


def size_guide(num_params: float) -> tuple[str, str]:
    """The reference material's rule of thumb for a model of ``num_params`` parameters (``SIZE_GUIDE``).

    Args:
        num_params: parameters of the model.

    Returns:
        ``(size label, advice)``, e.g. ``("1B-7B", "1-2 nodes (4-8 GPUs), DDP + mixed precision")``.
        A rule of thumb, not a computation: ``format_table`` says where the computation disagrees.
    """
    for limit, label, advice in SIZE_GUIDE:
        if num_params <= limit:
            return label, advice
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class _Setup:
    """What a plan is computed for, resolved from the arguments, with the words the tables print."""

    gpus: int
    gpu_name: str
    gpu_bytes: float
    gpu_note: str
    cpu_bytes: float      # per GPU
    cpu_note: str
    headroom: float
    activations: float    # bytes per GPU
    act_note: str
    shape: ModelShape | None  # set when the activations were computed from a shape
    micro_batch: int
    seq_len: int
    recompute: str

    @property
    def budget(self) -> float:
        return (1 - self.headroom) * self.gpu_bytes

    @property
    def cpu_budget(self) -> float:
        return (1 - self.headroom) * self.cpu_bytes


def _setup(num_params, gpus, gpu_memory_gb, cluster, gpu, cpu_gb_per_gpu, headroom, activations, shape,
           micro_batch, seq_len, recompute) -> _Setup:
    """Resolve and check the arguments of ``plan_table`` (see its docstring)."""
    if not (num_params > 0 and math.isfinite(num_params)):
        raise ValueError(f"num_params={num_params}: a model needs parameters. Fix: a positive count, e.g. 7e9")
    where = hardware.cluster(cluster if cluster is not None else hardware.DEFAULT_CLUSTER)
    gpus = where.gpus if gpus is None else gpus
    if int(gpus) != gpus or gpus < 1:
        raise ValueError(f"gpus={gpus}: need a whole number of GPUs >= 1. Fix: e.g. gpus=16")
    kind = hardware.gpu(gpu) if gpu is not None else where.gpu
    if gpu_memory_gb is not None:
        if not gpu_memory_gb > 0:
            raise ValueError(f"gpu_memory_gb={gpu_memory_gb}: GPU memory must be positive. Fix: e.g. 24")
        gpu_name, gpu_bytes, gpu_note = f"{gpu_memory_gb:g}-GB GPU", gpu_memory_gb * GB, ""
    else:
        gpu_name, gpu_bytes = kind.name, kind.memory_bytes
        gpu_note = f" (nvidia-smi's {kind.memory_bytes / 2**20:,.0f} MiB; the datasheet says {kind.datasheet_gb} GB)"
    if cpu_gb_per_gpu is not None:
        if cpu_gb_per_gpu < 0:
            raise ValueError(f"cpu_gb_per_gpu={cpu_gb_per_gpu}: CPU memory cannot be negative. Fix: e.g. 48")
        cpu_bytes, cpu_note = cpu_gb_per_gpu * GB, ""
    else:
        node = where.node
        cpu_bytes = node.cpu_memory_bytes_per_gpu
        cpu_note = f" ({node.name}: {node.memory_gib:g} GiB for {node.gpus} GPUs)"
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom={headroom}: the share of memory left free must be in [0, 1). Fix: e.g. 0.15")
    if activations is not None:
        if activations < 0:
            raise ValueError(f"activations={activations}: bytes cannot be negative. Fix: 0 for model states only")
        note = "not included (model states only)" if activations == 0 else "as given"
        return _Setup(int(gpus), gpu_name, gpu_bytes, gpu_note, cpu_bytes, cpu_note, headroom, float(activations),
                      note, None, micro_batch, seq_len, recompute)
    if isinstance(shape, str):
        found = [s for s in KNOWN_SHAPES.values() if shape.lower() in (s.name.lower(), s.name.split()[-1].lower())]
        if not found:
            names = ", ".join(s.name for s in KNOWN_SHAPES.values())
            raise ValueError(f"shape={shape!r}: unknown. Fix: one of {names}, or (n_layer, n_embd, n_head)")
        shape = found[0]
    elif shape is None:
        shape = model_shape(num_params)
    elif not isinstance(shape, ModelShape):
        n_layer, n_embd, n_head = shape
        shape = ModelShape("given", n_layer, n_embd, n_head)
    size = activation_bytes(micro_batch, seq_len, shape.n_layer, shape.n_embd, shape.n_head, recompute=recompute)
    how = {"none": "no recomputation", "selective": "selective recomputation",
           "full": "full recomputation"}[recompute]
    note = f"micro-batch {micro_batch} x {seq_len:,} tokens, {shape.describe()}, {how}"
    return _Setup(int(gpus), gpu_name, gpu_bytes, gpu_note, cpu_bytes, cpu_note, headroom, size, note, shape,
                  micro_batch, seq_len, recompute)


def _rows(num_params: float, setup: _Setup) -> list[dict]:
    rows = []
    for name, stage, off_opt, off_par in STRATEGIES:
        states = model_states(num_params, setup.gpus, stage, offload_optimizer=off_opt, offload_params=off_par)
        total = states.gpu + setup.activations
        rows.append({"strategy": name, "stage": stage,
                     "offload": "optimizer and parameters" if off_par else ("optimizer" if off_opt else "none"),
                     "states_gb": states.gpu / GB, "activations_gb": setup.activations / GB, "gpu_gb": total / GB,
                     "cpu_gb_per_gpu": states.cpu / GB,
                     "fits": total <= setup.budget and states.cpu <= setup.cpu_budget})
    return rows


def plan_table(num_params: float, gpus: int | None = None, gpu_memory_gb: float | None = None, *,
               cluster: str | hardware.Cluster | None = None, gpu: str | None = None,
               cpu_gb_per_gpu: float | None = None, headroom: float = HEADROOM, activations: float | None = None,
               shape: ModelShape | tuple[int, int, int] | str | None = None, micro_batch: int = MICRO_BATCH,
               seq_len: int = SEQ_LEN, recompute: str = "none") -> list[dict]:
    """Memory per GPU of every strategy (DDP, ZeRO 1-3, with offload), and whether it fits.

    A strategy fits when its model states plus the activations are within ``1 - headroom`` of a
    GPU's memory and what it offloads is within ``1 - headroom`` of the CPU memory per GPU.

    Args:
        num_params: parameters of the model (mixed-precision Adam: 16 bytes each, ZeRO-sharded).
        gpus: data-parallel GPUs (default: the cluster's GPUs).
        gpu_memory_gb: memory per GPU in GB (10**9 bytes), overriding the GPU's own figure.
        cluster: a ``dtlab.hardware`` cluster or its name, e.g. ``"g5.12xlarge x4"``: GPU type, GPU
            count and CPU memory per GPU (default: ``hardware.DEFAULT_CLUSTER``, one g5.12xlarge).
        gpu: a ``dtlab.hardware`` GPU name (``"A10G"``, ``"A100"``, ...) overriding the cluster's GPU.
        cpu_gb_per_gpu: CPU memory per GPU in GB for offloading (default: the cluster node's memory / its GPUs).
        headroom: share of memory left free for the CUDA context, buffers and fragmentation (``HEADROOM``).
        activations: activation bytes per GPU, overriding the shape-based figure; ``0`` gives the
            model-states-only table of the ZeRO paper.
        shape: the model's shape: a ``ModelShape``, ``(n_layer, n_embd, n_head)``, or a known name
            (``"7B"``); default ``model_shape(num_params)``.
        micro_batch: sequences per GPU per step (default 1).
        seq_len: tokens per sequence (default 2,048).
        recompute: ``"none"`` (default), ``"selective"`` or ``"full"`` activation recomputation.

    Returns:
        One dict per strategy of ``STRATEGIES``, in order of preference (least communication first):
        ``strategy``, ``stage``, ``offload``, ``states_gb``, ``activations_gb``, ``gpu_gb`` (their sum:
        what must fit), ``cpu_gb_per_gpu``, ``fits``. GB = 10**9 bytes.

    Raises:
        ValueError: for non-positive sizes, a hidden size not divisible by the heads, an unknown
            recompute mode or shape name, or a headroom outside [0, 1).
        dtlab.hardware.UnknownHardware: for an unknown cluster or GPU name (also a ValueError).
    """
    setup = _setup(num_params, gpus, gpu_memory_gb, cluster, gpu, cpu_gb_per_gpu, headroom, activations, shape,
                   micro_batch, seq_len, recompute)
    return _rows(num_params, setup)


def first_fit(num_params: float, gpus: int | None = None, gpu_memory_gb: float | None = None,
              **options) -> dict | None:
    """The first row of ``plan_table`` that fits (the strategy with the least communication), or None.

    Args:
        num_params, gpus, gpu_memory_gb, **options: as for ``plan_table``.

    Returns:
        The row (a dict, see ``plan_table``), or None when nothing fits.

    Raises:
        ValueError: as ``plan_table``.
    """
    return next((row for row in plan_table(num_params, gpus, gpu_memory_gb, **options) if row["fits"]), None)


def _options(setup: _Setup, **changes) -> dict:
    """The keyword arguments that rebuild ``setup`` (with ``changes``), for trying alternatives."""
    base = dict(gpu_memory_gb=setup.gpu_bytes / GB, cpu_gb_per_gpu=setup.cpu_bytes / GB, headroom=setup.headroom,
                shape=setup.shape, micro_batch=setup.micro_batch, seq_len=setup.seq_len, recompute=setup.recompute)
    return {**base, **changes}


def _explain(num_params: float, setup: _Setup, rows: list[dict]) -> str:
    """Why the first fitting strategy was chosen, or why nothing fits and what would."""
    budget, gpus, name = setup.budget / GB, setup.gpus, setup.gpu_name
    fit = next((i for i, row in enumerate(rows) if row["fits"]), None)
    if fit is not None:
        row = rows[fit]
        parts = (f"{row['states_gb']:.1f} GB model states + {row['activations_gb']:.1f} GB activations"
                 if setup.activations else "model states only")
        text = f"{row['strategy']}: {row['gpu_gb']:.1f} GB per GPU ({parts}) fits the {budget:.1f} GB usable on "
        text += f"each {name}"
        if row["cpu_gb_per_gpu"]:
            text += f", with {row['cpu_gb_per_gpu']:.1f} GB per GPU in CPU memory ({setup.cpu_budget / GB:.1f} usable)"
        if fit:  # why not a strategy with less communication: the one that comes closest
            before = min(rows[:fit], key=lambda r: r["gpu_gb"])
            short = ("GPU" if before["gpu_gb"] > budget else "CPU")
            need = before["gpu_gb"] if short == "GPU" else before["cpu_gb_per_gpu"]
            text += f"; {before['strategy']} would need {need:.1f} GB of {short} memory per GPU"
        return text
    act = setup.activations / GB
    if setup.activations > setup.budget:
        why = (f"the activations alone are {act:.1f} GB per GPU, more than the {budget:.1f} GB usable on each "
               f"{name}, and no ZeRO stage shards activations")
    else:
        least = min(rows, key=lambda r: r["gpu_gb"])
        if least["gpu_gb"] > budget:
            why = (f"even {least['strategy']} needs {least['gpu_gb']:.1f} GB per GPU "
                   f"({least['states_gb']:.1f} GB states + {act:.1f} GB activations), more than {budget:.1f} GB usable")
        else:
            why = (f"{least['strategy']} fits the GPU ({least['gpu_gb']:.1f} GB) but offloads "
                   f"{least['cpu_gb_per_gpu']:.1f} GB per GPU to CPU memory, more than {setup.cpu_budget / GB:.1f} "
                   "GB usable")
    options = []
    if setup.shape is not None:
        for mode in RECOMPUTE[RECOMPUTE.index(setup.recompute) + 1:]:
            row = first_fit(num_params, gpus, **_options(setup, recompute=mode))
            options.append(f"with recompute={mode!r} " + (f"{row['strategy']} fits ({row['gpu_gb']:.1f} GB per GPU)"
                                                          if row else "still nothing fits"))
    room = setup.budget - setup.activations
    if room > 0:
        options.append(f"ZeRO-3 fits on about {math.ceil(16 * num_params / room)} GPUs like these")
    options.append("tensor or pipeline parallelism (not modelled here) divide activations and states across GPUs")
    return f"nothing fits on {gpus} x {name}: {why}. Options: " + "; ".join(options)


def recommend(num_params: float, gpus: int | None = None, gpu_memory_gb: float | None = None, **options) -> str:
    """The strategy to use, and why: the first of ``plan_table`` that fits, or why nothing does.

    Args:
        num_params, gpus, gpu_memory_gb, **options: as for ``plan_table`` (by default the
            activations of one 2,048-token sequence of a model of this size, no recomputation).

    Returns:
        A sentence. It starts with the strategy's name and a colon when one fits (``"ZeRO-3: ..."``),
        with ``"nothing fits on ..."`` otherwise, followed by the reason and, when nothing fits, what
        would (recomputation, more GPUs, tensor or pipeline parallelism). ``first_fit`` returns the
        row itself.

    Raises:
        ValueError: as ``plan_table``.
    """
    setup = _setup(num_params, gpus, gpu_memory_gb, **_defaults(options))
    return _explain(num_params, setup, _rows(num_params, setup))


def _defaults(options: dict) -> dict:
    """``options`` completed with ``plan_table``'s defaults (unknown names raise TypeError)."""
    defaults = dict(cluster=None, gpu=None, cpu_gb_per_gpu=None, headroom=HEADROOM, activations=None, shape=None,
                    micro_batch=MICRO_BATCH, seq_len=SEQ_LEN, recompute="none")
    unknown = set(options) - set(defaults)
    if unknown:
        raise TypeError(f"unexpected argument(s) {', '.join(sorted(unknown))}; plan_table takes {', '.join(defaults)}")
    return {**defaults, **options}


_GUIDE_ROWS = {"DDP": ["DDP (stage 0)"], "ZeRO-3": ["ZeRO-3"],
               "ZeRO-3 + offloading": ["ZeRO-3 + optimizer offload", "ZeRO-3 + optimizer and parameter offload"]}


def _guide_verdict(num_params: float, setup: _Setup, rows: list[dict]) -> str:
    """The reference's rule of thumb, and whether the computation above agrees with it."""
    label, advice = size_guide(num_params)
    strategy = advice.split(", ", 1)[1].replace(" + mixed precision", "")
    names = _GUIDE_ROWS[strategy]
    guide = [r for r in rows if r["strategy"] in names]
    first = next((i for i, r in enumerate(rows) if r["fits"]), None)
    text = f"the reference's rule of thumb for {label}: {advice}"
    if not any(r["fits"] for r in guide):
        r = guide[-1]
        need = (f"{r['gpu_gb']:.1f} GB per GPU ({setup.budget / GB:.1f} usable)" if r["gpu_gb"] * GB > setup.budget
                else f"{r['cpu_gb_per_gpu']:.1f} GB of CPU memory per GPU ({setup.cpu_budget / GB:.1f} usable)")
        return f"{text}. The computation disagrees: {r['strategy']} needs {need} here"
    if first is not None and rows[first]["strategy"] not in names:
        return f"{text}. It fits here, but {rows[first]['strategy']} does too, with less communication"
    return f"{text}. The computation agrees here"


def format_table(num_params: float, gpus: int | None = None, gpu_memory_gb: float | None = None, **options) -> str:
    """The table ``dtlab memory`` prints: every strategy's memory per GPU, what fits, and why.

    Its header states every assumption (GPU and CPU memory and their source, headroom, the
    activations' micro-batch, sequence length, shape and recomputation); its last lines give
    ``recommend``'s sentence and the reference's rule of thumb, marked where the computation
    disagrees with it.

    Args:
        num_params, gpus, gpu_memory_gb, **options: as for ``plan_table``.

    Returns:
        The table as text, in GB = 10**9 bytes.

    Raises:
        ValueError: as ``plan_table``.
    """
    setup = _setup(num_params, gpus, gpu_memory_gb, **_defaults(options))
    rows = _rows(num_params, setup)
    only = " -- model states only" if not setup.activations else ""
    if not setup.activations:
        activations = f"activations: {setup.act_note}"
    elif setup.shape is None:
        activations = f"activations: {setup.activations / GB:.1f} GB per GPU, {setup.act_note}"
    else:
        activations = (f"activations: {setup.activations / GB:.1f} GB per GPU, the same for every strategy "
                       f"(Korthikanti et al. 2022):\n  {setup.act_note}")
    lines = [f"{num_params / 1e9:g}B parameters on {setup.gpus} x {setup.gpu_name}: {setup.gpu_bytes / GB:.2f} GB each"
             f"{setup.gpu_note}{only}",
             f"usable: {1 - setup.headroom:.0%} = {setup.budget / GB:.1f} GB per GPU ({setup.headroom:.0%} headroom "
             "for the CUDA context, buffers, fragmentation)",
             f"CPU memory for offloading: {setup.cpu_bytes / GB:.1f} GB per GPU{setup.cpu_note}, "
             f"{1 - setup.headroom:.0%} usable",
             "model states: mixed-precision Adam, 16 bytes per parameter, sharded by ZeRO (Rajbhandari et al. 2019)",
             activations,
             "GB = 10^9 bytes",
             f"{'strategy':<42} {'states':>7} {'activations':>11} {'GPU total':>9} {'CPU/GPU':>8}  fits"]
    for r in rows:
        lines.append(f"{r['strategy']:<42} {r['states_gb']:>7.2f} {r['activations_gb']:>11.2f} {r['gpu_gb']:>9.2f} "
                     f"{r['cpu_gb_per_gpu']:>8.2f}  {'yes' if r['fits'] else 'no'}")
    lines.append(textwrap.fill(f"recommended: {_explain(num_params, setup, rows)}", 110, subsequent_indent="  "))
    lines.append(textwrap.fill(_guide_verdict(num_params, setup, rows), 110, subsequent_indent="  "))
    return "\n".join(lines)
