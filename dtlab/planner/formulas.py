"""The planner's formulas: bytes a GPU holds, FLOPs a step does, bytes a collective sends, a model's shape.

Everything here is arithmetic from published papers, with the paper named where the formula is
given. ``dtlab.planner.cost`` combines these into a step time, ``dtlab.planner.advise`` ranks
strategies with it; notebooks 06, 12 and 20 measure what the formulas predict.

**Model states** (Rajbhandari et al., "ZeRO", 2019). With Ψ parameters trained by Adam in mixed
precision, every GPU of plain data parallelism holds 2Ψ bytes of 16-bit parameters, 2Ψ of 16-bit
gradients and 12Ψ of optimizer state (an fp32 master copy and Adam's two fp32 moments, K = 12):
16Ψ in all. ZeRO divides by the N data-parallel GPUs the optimizer state (stage 1), also the
gradients (stage 2), also the parameters (stage 3)::

    stage 0 (DDP): 2Ψ + 2Ψ + 12Ψ          stage 2: 2Ψ + (2Ψ + 12Ψ)/N
    stage 1:       2Ψ + 2Ψ + 12Ψ/N        stage 3: (2Ψ + 2Ψ + 12Ψ)/N

``deepspeed_estimate`` reproduces DeepSpeed's own estimators, which add the buffers its
implementation keeps.

**Activations** (Korthikanti et al., 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4). A GPT layer keeps ``s*b*h*(34 + 5*a*s/h)`` bytes in 16-bit for its backward pass
(sequence s, micro-batch b, hidden h, a heads); selective recomputation (the attention scores are
recomputed) keeps ``34*s*b*h``; full recomputation keeps each layer's input, ``2*s*b*h``. Tensor
parallelism with sequence parallelism divides all of it by the TP degree.

**FLOPs** (Narayanan et al., 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", section 5.1, and Chowdhery et al., 2022, PaLM, appendix B). A forward pass over
one token does ``2*Ψ_layers + 4*L*s*h + 2*V*h`` FLOPs: every weight once (a multiply and an add), the
attention scores and their use (QKᵀ and AV, counted over the whole sequence), and the output layer;
backward does twice that. The **model FLOPs** of training are 3 x forward: ``6Ψ + 12*L*s*h`` per token
(PaLM's MFU numerator). Recomputation does more work than the model needs — the **hardware FLOPs**:
full recomputation runs every layer's forward again (4 passes over the layers; Megatron's
``96*B*s*l*h²*(1 + s/6h + V/16lh)``), selective recomputation runs the attention scores again
(``+4*L*s*h`` per token). MFU divides model FLOPs by time and peak; HFU divides hardware FLOPs.

**Collectives** (``ring_factor``): in a ring of N ranks, all-reduce sends ``2(N-1)/N`` of the tensor
per rank (a reduce-scatter then an all-gather); all-gather, reduce-scatter and all-to-all send
``(N-1)/N`` of the full tensor. These are the factors nccl-tests uses to turn algorithm bandwidth into
bus bandwidth.

**Units.** Functions return bytes, FLOPs and counts. Tables print GB = 10**9 bytes (the unit of the
ZeRO paper and of GPU datasheets; DeepSpeed prints GiB = 2**30 bytes and calls it "GB").
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from dtlab.planner import hardware

#: Units: GB = 10**9 bytes (what the tables print); GiB = 2**30 bytes (what DeepSpeed prints as "GB").
GB, GiB = hardware.GB, hardware.GiB

#: Share of each GPU's (and host's) memory a plan leaves free: the CUDA context and what the driver
#: reserves (CUDA sees ~1.5% less than nvidia-smi on an A10G), communication buckets (DeepSpeed's
#: default buckets hold 5e8 elements each, ~1 GB in 16-bit), temporary buffers, and fragmentation in
#: PyTorch's caching allocator.
HEADROOM = 0.15
#: Activation recomputation (checkpointing) modes: keep everything; recompute the attention core (Megatron-LM's
#: selective); keep every other matrix product's output and recompute the rest (torchtitan's per-operator selective
#: checkpointing, "op"); keep layer inputs only.
RECOMPUTE = ("none", "selective", "op", "full")
#: Collectives and the share of the tensor each rank sends in a ring of n ranks.
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


def ring_factor(n: int, collective: str = "all_reduce") -> float:
    """Bytes each of ``n`` ranks sends, as a multiple of the tensor's size, in a ring ``collective``.

    ``2(n-1)/n`` for all-reduce; ``(n-1)/n`` for all-gather (of the output), reduce-scatter (of the
    input) and all-to-all; 1 for broadcast. These are nccl-tests' bus-bandwidth factors: the one
    place the course writes them (``dtlab.bandwidth``, ``dtlab.planner.speedup`` and the cost model read
    them here).

    Raises:
        ValueError: for ``n < 1`` or an unknown collective.
    """
    if n < 1:
        raise ValueError(f"n={n}: a collective needs at least one rank")
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if collective == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}")


# ---------------------------------------------------------------------------------------------------------
# Model states
# ---------------------------------------------------------------------------------------------------------

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
        num_params: parameters of the model (Ψ), or of this GPU's slice of it under TP/PP.
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


# ---------------------------------------------------------------------------------------------------------
# A model's shape
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape: what its activations, FLOPs and parallel degrees depend on.

    ``n_kv_head`` (grouped-query attention) defaults to ``n_head``; ``ffn`` to ``4 * n_embd``;
    ``gated`` is True for SwiGLU MLPs (three matrices, as LLaMA); ``vocab`` may be None (unknown: no
    output layer is counted); ``tied`` says whether the input embedding is the output layer;
    ``dropout`` whether the layer applies dropout (GPT-2/3 and Megatron's GPT do; LLaMA does not).
    """

    name: str
    n_layer: int
    n_embd: int
    n_head: int
    source: str = ""
    n_kv_head: int | None = None
    ffn: int | None = None
    gated: bool = False
    vocab: int | None = None
    tied: bool = True
    dropout: bool = False

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def layer_params(self) -> int:
        """Weights of one layer: Q and the output projection (h² each), K and V (h x kv heads x head dim each),
        the MLP (2 or, gated, 3 matrices of h x ffn). Norms and biases are left out (under 0.1%)."""
        h, kv = self.n_embd, (self.n_kv_head or self.n_head) * self.head_dim
        ffn = self.ffn or 4 * h
        return 2 * h * h + 2 * h * kv + (3 if self.gated else 2) * h * ffn

    @property
    def params(self) -> int:
        """Parameters of the whole model: the layers, plus the embedding (and an untied output layer)."""
        embedding = (self.vocab or 0) * self.n_embd * (1 if self.tied else 2)
        return self.n_layer * self.layer_params + embedding

    def describe(self) -> str:
        """One line for a table: name, layers, hidden size, heads."""
        kv = f", {self.n_kv_head} KV heads" if self.n_kv_head and self.n_kv_head != self.n_head else ""
        return f"{self.name} shape ({self.n_layer} layers, hidden {self.n_embd:,}, {self.n_head} heads{kv})"


#: Shapes of published models, by nominal size (parameters).
KNOWN_SHAPES: dict[float, ModelShape] = {
    1.3e9: ModelShape("OPT 1.3B", 24, 2048, 32, "Zhang et al. 2022, 'OPT: Open Pre-trained Transformer Language "
                                                "Models', Table 1", vocab=50272),
    7e9: ModelShape("LLaMA 7B", 32, 4096, 32, "Touvron et al. 2023, 'LLaMA: Open and Efficient Foundation "
                                              "Language Models', Table 2", ffn=11008, gated=True, vocab=32000,
                    tied=False),
    13e9: ModelShape("LLaMA 13B", 40, 5120, 40, "Touvron et al. 2023, LLaMA, Table 2", ffn=13824, gated=True,
                     vocab=32000, tied=False),
    70e9: ModelShape("Llama 2 70B", 80, 8192, 64, "Touvron et al. 2023, 'Llama 2', released config (the same "
                                                  "layers, width and heads as LLaMA 65B, Table 2 of LLaMA; 8 KV "
                                                  "heads)", n_kv_head=8, ffn=28672, gated=True, vocab=32000,
                     tied=False),
}

#: Width of one attention head in the model families the course follows (GPT-3 from 6.7B, LLaMA, Llama 2 and 3).
HEAD_DIM = 128


def model_shape(num_params: float) -> ModelShape:
    """The shape assumed for a model of ``num_params`` parameters (give the shape when you know it).

    A known shape (``KNOWN_SHAPES``) when ``num_params`` is within a factor 1.25 of its nominal size.
    Otherwise one that follows the published families: heads of ``HEAD_DIM`` = 128 (GPT-3 from 6.7B
    on, Brown et al. 2020, Table 2.1; LLaMA), about as many layers as heads (GPT-3 175B: 96 and 96;
    LLaMA 65B: 80 and 64; Llama 3 405B: 126 and 128), a head count that is a multiple of 8 from 8
    heads on (so tensor-parallel degrees 2, 4 and 8 divide it, as in every one of those models), and
    ``12 * n_layer * n_embd**2`` weights (a GPT layer with a 4h MLP).

    Raises:
        ValueError: for ``num_params <= 0``.
    """
    if not num_params > 0:
        raise ValueError(f"num_params={num_params:g}: a model needs parameters. Fix: e.g. 7e9")
    nominal = min(KNOWN_SHAPES, key=lambda size: abs(math.log(num_params / size)))
    if 1 / 1.25 <= num_params / nominal <= 1.25:
        return KNOWN_SHAPES[nominal]
    ideal = (num_params / (12 * HEAD_DIM**2)) ** (1 / 3)              # heads = layers, h = 128 x heads
    heads = max(8, 8 * round(ideal / 8)) if ideal >= 6 else 2 ** max(0, round(math.log2(ideal)))
    n_embd = HEAD_DIM * heads
    n_layer = max(1, round(num_params / (12 * n_embd**2)))
    return ModelShape(f"derived {num_params / 1e9:g}B", n_layer, n_embd, heads,
                      f"{HEAD_DIM}-wide heads, heads a multiple of 8 and about as many as layers, "
                      "12 x layers x hidden^2 ~ parameters (the GPT-3 and LLaMA families)")


def check_shape(n_layer: int, n_embd: int, n_head: int, n_kv_head: int | None = None) -> None:
    """Raise ``ValueError`` naming the fix when a shape cannot be a transformer's."""
    if min(n_layer, n_embd, n_head) < 1:
        raise ValueError(f"n_layer={n_layer}, n_embd={n_embd}, n_head={n_head}: all must be >= 1. "
                         "Fix: e.g. 32 layers, hidden 4096, 32 heads")
    if n_embd % n_head:
        raise ValueError(f"hidden size {n_embd} is not divisible by {n_head} heads. Fix: a hidden size that is a "
                         f"multiple of the heads, e.g. {n_head * max(1, round(n_embd / n_head))}")
    if n_kv_head is not None and (n_kv_head < 1 or n_head % n_kv_head):
        raise ValueError(f"{n_head} heads do not divide into groups of {n_kv_head} KV heads. Fix: a KV head count "
                         f"that divides {n_head}, e.g. {math.gcd(n_head, 8)}")


def shaped(shape: ModelShape, **changes) -> ModelShape:
    """A copy of ``shape`` with ``changes`` (checked)."""
    new = replace(shape, **changes)
    check_shape(new.n_layer, new.n_embd, new.n_head, new.n_kv_head)
    return new


#: Config keys that give a mixture-of-experts model's experts per layer (Mixtral, Qwen-MoE / OLMoE, DeepSeek, DBRX).
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def shape_from_hf(config: Any) -> ModelShape:
    """The shape of a Hugging Face decoder-only model from its config (a ``transformers`` ``PretrainedConfig``,
    or its ``config.json`` as a dict): layers, hidden size, heads, key/value heads, MLP width, vocabulary, tied
    embeddings; a SwiGLU ("silu") MLP counts three matrices, as in LLaMA.

    Raises:
        ValueError: a config without a decoder's fields (named); a mixture-of-experts config (``MOE_KEYS``), whose
        expert parallelism the planner does not price (the message says what to do instead).
    """
    get = config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))
    experts = next((int(get(k)) for k in MOE_KEYS if get(k) and int(get(k)) > 1), 0)
    if experts:
        raise ValueError(f"a mixture-of-experts model ({experts} experts per MoE layer): the planner prices dense "
                         "models only; expert parallelism (an all-to-all per MoE layer each way, the experts' states "
                         "sharded over the expert-parallel ranks) is not priced. Fix: notebook 16 measures an MoE "
                         "layer's all-to-all on your machine; plan the attention and dense layers with a dense shape "
                         "(--layers, --hidden, --heads) and add the experts' memory by hand")
    names = {"num_hidden_layers": ("n_layer",), "hidden_size": ("n_embd",), "num_attention_heads": ("n_head",)}
    values = {}
    for key, aliases in names.items():
        value = get(key)
        for alias in aliases:
            value = get(alias) if value is None else value
        if value is None:
            raise ValueError(f"the config has no {key!r}: not a decoder-only transformer's config. Fix: pass the "
                             "config of a causal LM (LlamaConfig, MistralConfig, GPT2Config...)")
        values[key] = int(value)
    act = str(get("hidden_act") or get("activation_function") or "")
    shape = ModelShape(str(get("model_type") or "hf") + " (from its config)", values["num_hidden_layers"],
                       values["hidden_size"], values["num_attention_heads"], "the model's Hugging Face config",
                       n_kv_head=get("num_key_value_heads"), ffn=get("intermediate_size") or get("n_inner"),
                       gated=act in ("silu", "swiglu"), vocab=get("vocab_size"),
                       tied=bool(get("tie_word_embeddings", True)),
                       dropout=any(float(get(k) or 0) > 0 for k in ("attention_dropout", "hidden_dropout",
                                                                    "resid_pdrop")))
    check_shape(shape.n_layer, shape.n_embd, shape.n_head, shape.n_kv_head)
    return shape


# ---------------------------------------------------------------------------------------------------------
# Activations and FLOPs
# ---------------------------------------------------------------------------------------------------------

def activation_bytes(batch: int, seq_len: int, n_layer: int, n_embd: int, n_head: int,
                     bytes_per_value: int = 2, recompute: str = "none", peak: bool = True) -> float:
    """Activations a GPT-style transformer keeps for backward, per GPU (Korthikanti et al., 2022).

    Per layer, in 16-bit, for sequence length s, batch b, hidden size h and a heads (the paper's
    equation for one layer without parallelism): ``s*b*h*(34 + 5*a*s/h)`` bytes without
    recomputation, ``34*s*b*h`` with selective recomputation (the attention scores, ``5*a*s*s*b``,
    are recomputed), ``2*s*b*h`` with full recomputation (only the layer's input is kept). The
    formula assumes a GPT layer (4h MLP, full multi-head attention, dropout); LLaMA-style layers
    differ by a few percent. Embeddings and the output logits are not included. Values of another
    size scale the result by ``bytes_per_value / 2``. With tensor and sequence parallelism of
    degree t every term is divided by t.

    Args:
        batch: sequences per GPU per step (the micro-batch).
        seq_len: tokens per sequence.
        n_layer, n_embd, n_head: the model's layers, hidden size and attention heads.
        bytes_per_value: 2 for bf16/fp16 activations.
        recompute: ``"none"``, ``"selective"``, ``"op"`` (every other matrix product's output kept, with a fused
            attention kernel: ``13*s*b*h``) or ``"full"``.
        peak: with recomputation, add what one layer recomputes during its backward (its
            attention scores for "selective", its full activations for "full"): the peak, not only
            what is stored between forward and backward (``peak=False`` gives the paper's figures).

    Returns:
        Bytes per GPU.

    Raises:
        ValueError: for a size below 1, ``n_embd`` not divisible by ``n_head``, or an unknown recompute mode.
    """
    check_shape(n_layer, n_embd, n_head)
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
    elif recompute == "op":     # layer input, attention output, half of q, k, v, o, fc1, fc2's outputs (9h): 13sbh
        total = n_layer * 13 * s * b * h + (layer - 13 * s * b * h if peak else 0)
    else:
        total = n_layer * 2 * s * b * h + (layer if peak else 0)
    return total * bytes_per_value / 2


def layer_activation_bytes(shape: ModelShape, batch: int, seq_len: int, recompute: str = "none",
                           flash_attention: bool = True, bytes_per_value: int = 2) -> dict[str, float]:
    """Bytes one layer of ``shape`` keeps for its backward pass, by what keeps them (Korthikanti et al.'s
    accounting, section 4.1, extended to grouped-query attention, gated MLPs and fused attention).

    With ``v = bytes_per_value`` (2 in 16-bit), ``s*b`` tokens, hidden ``h``, KV width ``k`` (KV heads x head
    dim), MLP width ``f`` and ``a`` heads, each layer keeps:

    * ``norms``: the input of its two normalisations, ``2*v*s*b*h``;
    * ``attention``: the QKV projection's input, Q, K, V and the output projection's input,
      ``v*s*b*(3h + 2k)``; a dropout mask after the projection, ``s*b*h`` (one byte), if the model has dropout;
    * ``scores``: without a fused attention kernel, the softmax output ``v*a*s*s*b`` (with dropout also its
      mask, ``a*s*s*b``, and the dropped-out copy, ``v*a*s*s*b``); a fused kernel (FlashAttention, PyTorch's
      SDPA on a GPU) keeps none of it: its backward recomputes the scores from Q, K, V and a log-sum-exp;
    * ``mlp``: the first projection's input ``v*s*b*h``, then ``2*v*s*b*f`` (GELU's input and output) or
      ``4*v*s*b*f`` for a gated MLP (gate, up, the activation and their product); a dropout mask if any.

    For a GPT layer (k = h, f = 4h, dropout, no fused attention) this is the paper's ``s*b*h*(34 + 5*a*s/h)``.
    Selective recomputation drops ``scores``; full recomputation keeps only the layer's input,
    ``v*s*b*h``, in ``norms``; "op" (torchtitan's per-operator selective checkpointing) keeps the layer's input, the
    attention kernel's output and half of the matrix products' outputs.
    Tensor parallelism with sequence parallelism divides every part by its degree.

    Returns:
        ``{"norms", "attention", "scores", "mlp", "total"}`` in bytes.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}: use one of {', '.join(map(repr, RECOMPUTE))}")
    if batch < 1 or seq_len < 1:
        raise ValueError(f"batch={batch}, seq_len={seq_len}: both must be >= 1. Fix: e.g. batch=1, seq_len=2048")
    v, tokens, h = bytes_per_value, batch * seq_len, shape.n_embd
    k = (shape.n_kv_head or shape.n_head) * shape.head_dim
    f = shape.ffn or 4 * h
    mask = tokens * h if shape.dropout else 0.0
    if recompute == "full":
        parts = {"norms": v * tokens * h, "attention": 0.0, "scores": 0.0, "mlp": 0.0}
    elif recompute == "op":
        # torchtitan's per-operator policy: the layer's input and the attention kernel's output are kept, and the
        # output of every other matrix product (q, k, v, o, then the MLP's two or three); the rest is recomputed
        products = {"attention": 2 * h + 2 * k, "mlp": (2 if shape.gated else 1) * f + h}
        scores = 0.0 if flash_attention else v * shape.n_head * seq_len * tokens
        parts = {"norms": v * tokens * h, "attention": v * tokens * (h + products["attention"] / 2), "scores": scores,
                 "mlp": v * tokens * products["mlp"] / 2}
    else:
        scores = 0.0
        if not flash_attention and recompute == "none":
            per_score = shape.n_head * seq_len * tokens
            scores = v * per_score + ((1 + v) * per_score if shape.dropout else 0.0)
        parts = {"norms": 2 * v * tokens * h, "attention": v * tokens * (3 * h + 2 * k) + mask, "scores": scores,
                 "mlp": v * tokens * h + (4 if shape.gated else 2) * v * tokens * f + mask}
    parts["total"] = sum(parts.values())
    return parts


def logits_bytes(batch: int, seq_len: int, vocab: int | None) -> float:
    """The output layer's logits kept for the loss's backward: ``4*b*s*V`` bytes (fp32, as the cross-entropy
    computes them), 0 when the vocabulary is unknown. Tensor parallelism divides it by its degree."""
    return 4.0 * batch * seq_len * (vocab or 0)


@dataclass(frozen=True)
class Flops:
    """FLOPs of one training pass over some tokens: ``forward`` (one pass), ``model`` (3 x forward: what the
    model needs; MFU's numerator) and ``hardware`` (what the GPU does, recomputation included; HFU's)."""

    forward: float
    model: float
    hardware: float

    @property
    def recomputed(self) -> float:
        """FLOPs done again by recomputation."""
        return self.hardware - self.model


def training_flops(tokens: float, shape: ModelShape, seq_len: int, recompute: str = "none",
                   num_params: float | None = None, flash_attention: bool = False) -> Flops:
    """FLOPs to train on ``tokens`` tokens of ``seq_len``-token sequences (see the module docstring).

    Forward per token: ``2*Ψ_layers + 4*L*s*h`` for the layers and ``2*V*h`` for the output layer.
    ``num_params`` (default: the shape's) sets Ψ; the layers get what the shape says they hold, at
    most Ψ. Full recomputation repeats the layers' forward (not the output layer's), selective
    recomputation the attention's ``4*L*s*h`` — nothing with ``flash_attention``: a fused kernel keeps no scores, so
    there is nothing for it to recompute (the kernel's own backward recomputes them whatever the mode, inside the
    time its efficiency is measured with); "op" repeats half of the layers' matrix products, ``Ψ_layers``.

    Raises:
        ValueError: for an unknown recompute mode or a negative token count.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}: use one of {', '.join(map(repr, RECOMPUTE))}")
    if tokens < 0:
        raise ValueError(f"tokens={tokens}: cannot be negative")
    psi = float(num_params if num_params is not None else shape.params)
    layer_weights = min(psi, float(shape.n_layer * shape.layer_params))
    head = 2.0 * (shape.vocab or 0) * shape.n_embd if shape.vocab else 2.0 * (psi - layer_weights)
    attention = 4.0 * shape.n_layer * seq_len * shape.n_embd
    layers_fwd = 2.0 * layer_weights + attention
    forward = tokens * (layers_fwd + head)
    extra = {"none": 0.0, "selective": 0.0 if flash_attention else attention, "op": layer_weights,
             "full": layers_fwd}[recompute]
    return Flops(forward, 3 * forward, 3 * forward + tokens * extra)


# ---------------------------------------------------------------------------------------------------------
# A published rule of thumb by model size
# ---------------------------------------------------------------------------------------------------------

#: Where ``SIZE_GUIDE`` comes from: NVIDIA's Megatron Bridge documentation, "Parallelism Strategy Selection",
#: section "Decision by Model Size", table "Dense models".
SIZE_GUIDE_SOURCE = ("NVIDIA Megatron Bridge documentation, 'Parallelism Strategy Selection', section 'Decision by "
                     "Model Size', table 'Dense models' (docs.nvidia.com/nemo/megatron-bridge/latest/skills/"
                     "perf-techniques/parallelism-strategies/SKILL.html)")


@dataclass(frozen=True)
class SizeRule:
    """One row of a rule of thumb: models up to ``up_to`` parameters, on ``gpus`` (fewest, most), start from
    tensor-parallel degrees ``tp``, pipeline degrees ``pp`` and context-parallel degree ``cp``, the rest data
    parallel (``advice`` is the row as published)."""

    up_to: float
    label: str
    gpus: tuple[int, int]
    tp: tuple[int, ...]
    pp: tuple[int, ...]
    cp: int
    advice: str


#: ``SIZE_GUIDE_SOURCE``'s rows, as data. Its GPUs are H100-class (80 GB): notebooks 06 and 20 check the rows
#: on the course's A10Gs (24 GB), where the arithmetic answers differently.
SIZE_GUIDE = [
    SizeRule(1e9, "< 1B", (1, 8), (1,), (1,), 1, "DP only"),
    SizeRule(10e9, "1-10B", (8, 16), (2, 4), (1,), 1, "TP=2-4 + DP"),
    SizeRule(70e9, "10-70B", (16, 64), (4, 8), (2, 4), 1, "TP=4-8 + PP=2-4 + DP"),
    SizeRule(175e9, "70-175B", (64, 256), (8,), (4, 8), 1, "TP=8 + PP=4-8 + DP"),
    SizeRule(500e9, "175-500B", (256, 1024), (8,), (8, 16), 2, "TP=8 + PP=8-16 + CP=2 + DP"),
]


def size_guide(num_params: float) -> SizeRule:
    """The row of the published rule of thumb (``SIZE_GUIDE``, from ``SIZE_GUIDE_SOURCE``) for a model of
    ``num_params`` parameters, e.g. ``size_guide(7e9).advice == "TP=2-4 + DP"``.

    A rule of thumb, not a computation: notebooks 06 and 20 check it against the planner. Beyond its last
    row (500B) it raises ``ValueError``.
    """
    for rule in SIZE_GUIDE:
        if num_params <= rule.up_to:
            return rule
    raise ValueError(f"{num_params:.3g} parameters is beyond the table's last row ({SIZE_GUIDE[-1].label}); "
                     "Fix: ask the planner (dtlab advise) instead")
