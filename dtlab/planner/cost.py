"""What a layout costs: memory per GPU, and a training step's time split into what takes it.

A layout ``DP x TP x PP x CP`` (``Layout``) puts ``dp * tp * pp * cp`` GPUs to work on one model;
``zero`` is the ZeRO stage over the DP dimension (3 is FSDP), and ``shard`` splits DP into shard groups and
their replicas (HSDP). Ranks are numbered with TP fastest, then CP, PP and DP (as Megatron-LM does; HSDP's shard
group is DP's fastest part), so a dimension's groups stay inside a node when it and the dimensions inside it fit
in one node's GPUs.

**One step** trains on ``global_batch`` sequences: each DP replica runs ``M = global_batch / (dp * b)``
micro-batches of ``b`` sequences, and the strategies communicate where they really do
(``traffic``)::

    DDP        all-reduce of the gradients, once per step (no_sync on the other micro-batches);
               hidden behind the last micro-batch's backward pass
    ZeRO-1     reduce-scatter of the gradients once per step, all-gather of the updated parameters
    ZeRO-2     reduce-scatter every micro-batch (the gradients are kept sharded), all-gather once
    ZeRO-3     all-gather of each layer's parameters in the forward pass and again in the backward,
    / FSDP     reduce-scatter of its gradients: every micro-batch. Deferred gradient sync (FSDP's
               set_requires_gradient_sync(False)) reduces once per step, holding whole gradients
    HSDP       ZeRO-3 inside groups of ``shard`` DP ranks (a node's GPUs), replicated across the
               ``dp / shard`` groups: the gathers and reduce-scatters stay in the shard group, and
               each rank then all-reduces its 1/shard of the gradients with its replicas (the
               ``replicate`` dimension), as often as it reduce-scatters (PyTorch's fully_shard on a
               2-D mesh ("replicate", "shard"); FSDP1's HYBRID_SHARD; MiCS). With gradient
               accumulation the all-reduce alone can wait for the step's last micro-batch
               (defer_all_reduce: fully_shard's set_requires_all_reduce(False)), the gradients
               staying sharded; deferred gradient sync defers both, holding whole gradients
    TP         4 all-reduces per layer and micro-batch (2 forward, 2 backward; 2 more when the
               forward is recomputed), on the critical path
    PP         one activation forward and one gradient backward per micro-batch and stage
               boundary; a bubble of (P-1)/(v*M + P - 1) of the pipeline's time
    CP         keys and values passed around the ring, forward and backward, each hop hidden behind
               the attention of the chunk computed meanwhile as far as it lasts; CP ranks hold the
               same weights, so gradients are reduced, and ZeRO shards, over DP x CP

Communication hides behind the compute that can hide it and no more: a prefetched all-gather
behind the forward pass (except the first layer's), gradients behind the backward pass (except
the last layer's reduce), DDP's once-per-step all-reduce behind the *last* micro-batch's backward
only, ring attention's K/V hops behind the attention chunks. TP and PP transfers are not hidden.

**Links are shared** by the groups that use them at once. Inside a node a GPU sends at
``intra_node_gbs`` (NVLink, or what a collective gets over PCIe). Across nodes a group's ring is
hierarchical: its members on one node split the tensor between them, and each node's network link
(``inter_node_gbs``, all the node's NICs together) carries ``ring_factor(nodes) x tensor`` for every
group with members on that node — so 4 TP x 4 DP GPUs per node push four DP rings through one NIC,
while one DP ring over all GPUs uses the whole NIC (as NCCL's rings and trees do, which is why
nccl-tests reports a multi-node bus bandwidth close to the node's total network bandwidth).

**Compute** is the step's hardware FLOPs (``formulas.training_flops``: recomputation included) at
``efficiency`` x the GPU's peak; MFU and HFU are then what the whole step achieves. It is a planning
model: it leaves out latencies, kernels that are not matrix products beyond the ``efficiency``
factor, the optimizer step, and the embedding's uneven place on the first and last pipeline stages.
``dtlab.planner.published`` holds it to published training runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dtlab.planner import formulas, hardware, kernels
from dtlab.planner import memory as peak
from dtlab.planner.formulas import ModelShape, ring_factor

#: The one-rate model (what the planner used before it priced each kernel at its measured rate, and what a given
#: ``Setup.efficiency`` selects): the fraction of the GPU's peak FLOP/s every kernel reaches, by GPU, the median over
#: the published runs on it of the value at which it reproduces each (``published.median_efficiencies``;
#: tests/test_published_runs.py recomputes them). Notebook 14 prices a layer by hand with it.
EFFICIENCY = {"A100": 0.58, "H100": 0.59}
#: For a GPU without published runs here (the course's A10G, T4, V100): the median over every run.
DEFAULT_EFFICIENCY = 0.58


def kernels_for(name: str, gpu: hardware.GPU):
    """The measured kernel rates the planner prices ``gpu`` (called ``name``) with (``dtlab.planner.kernels``)."""
    return kernels.rates_for(name, gpu.bf16_tflops or gpu.fp16_tflops)


def efficiency_for(gpu: hardware.GPU) -> tuple[float, str]:
    """The planner's compute efficiency for ``gpu`` and where it comes from (``EFFICIENCY``)."""
    for family, value in EFFICIENCY.items():
        if gpu.name.upper().startswith(family):
            return value, f"the median of the published {family} runs"
    return DEFAULT_EFFICIENCY, f"the median of all published runs; none on the {gpu.name}"
#: Host-to-GPU GB/s per GPU, one direction (PCIe Gen4 x16 is 32 GB/s nominal; GPUs share the host's lanes).
PCIE_GBS = 12.0
#: Bytes per gradient bucket of DDP and of ZeRO-1/2's once-per-step collectives (PyTorch DDP's bucket_cap_mb=25).
BUCKET_BYTES = 25e6
#: Parameters per second DeepSpeed's CPU Adam updates with one GPU's share of the host cores (an assumption).
CPU_ADAM_PARAMS_PER_S = 1e9
PRECISIONS = ("bf16", "fp16", "fp32")
#: Pipeline schedules ``Setup.schedule`` knows, and ways of sharing layers out among stages (``stage_layers``).
SCHEDULES = ("1f1b", "gpipe")
PIPELINE_SPLITS = ("even", "lighter_ends")


def stage_layers(n_layer: int, stages: int, split: str = "even") -> list[int]:
    """Layers on each pipeline stage: "even" gives the first ``n_layer % stages`` stages one more; "lighter_ends"
    gives the first and last stages one fewer than the stages between them (what is left over goes to the first
    middle stages). Raises ``LayoutError`` where a stage would get none."""
    if split not in PIPELINE_SPLITS:
        raise ValueError(f"split={split!r}: use one of {', '.join(PIPELINE_SPLITS)}")
    if split == "even" or stages < 3:
        base, extra = divmod(n_layer, stages)
        out = [base + (1 if s < extra else 0) for s in range(stages)]
    else:
        middle, extra = divmod(n_layer + 2, stages)             # the two ends give one layer each back
        out = [middle - 1] + [middle + (1 if s < extra else 0) for s in range(stages - 2)] + [middle - 1]
    if min(out) < 1:
        raise LayoutError(f"{n_layer} layers over {stages} pipeline stages leave a stage without a layer. Fix: at "
                          f"most {n_layer} stages")
    return out


def busiest_layers(shape: ModelShape, layout: Layout, setup: Setup) -> int:
    """The most layers any pipeline stage of ``layout`` holds: it sets the pipeline's pace."""
    return max(stage_layers(shape.n_layer, layout.pp, setup.pipeline_split)) if layout.pp > 1 else shape.n_layer


def megatron_bucket_bytes(dp: int, grad_bytes: int = 4) -> float:
    """Megatron-LM's gradient bucket: ``max(40,000,000, 1,000,000 x DP)`` parameters (its DDP config's
    ``bucket_size`` default), in bytes of ``grad_bytes`` per gradient value: a larger DP gets fewer, larger
    buckets, so the ring's per-step latency is paid fewer times."""
    return max(40e6, 1e6 * dp) * grad_bytes


class LayoutError(ValueError):
    """A layout that cannot run this model, batch or cluster; the message names the fix."""


@dataclass(frozen=True)
class Layout:
    """Degrees of each kind of parallelism, and how the data-parallel dimension shards and syncs.

    ``zero``: the ZeRO stage over DP (0 = DDP, 3 = ZeRO-3 / FSDP). ``defer_grad_sync``: with stage 3,
    reduce gradients once per step instead of every micro-batch (holding whole gradients until then).
    ``virtual``: pipeline chunks per GPU (interleaved 1F1B). ``offload_optimizer`` / ``offload_params``:
    ZeRO-Offload to host memory. ``gathers_per_layer``: ZeRO-3 collectives per layer and pass: 1 where each
    transformer block is one unit (FSDP wrapped per block, as torchtitan and MosaicML do); DeepSpeed's ZeRO-3
    of 2021 gathered each sub-module's parameters as it ran (``PartitionedParameterCoordinator.fetch_sub_module``:
    a GPT layer's 4 linear layers and 2 norms, 12 tensors). ``shard``: HSDP, with ``zero=3``: model states
    sharded over groups of ``shard`` consecutive DP ranks (inside a node when ``shard x tp x cp x pp`` fits one)
    and replicated over ``dp / shard`` groups; 0 shards over all of DP (``shard=dp`` is the same thing).
    ``defer_all_reduce``: with HSDP, reduce-scatter every micro-batch but all-reduce across replicas once per
    step (gradients stay sharded): the second of HSDP's three ways to accumulate, beside reducing every
    micro-batch and ``defer_grad_sync`` (PyTorch PR 126166, ``FSDPModule.set_requires_all_reduce``).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero: int = 1
    defer_grad_sync: bool = False
    virtual: int = 1
    offload_optimizer: bool = False
    offload_params: bool = False
    gathers_per_layer: int = 1
    shard: int = 0
    defer_all_reduce: bool = False

    def __post_init__(self):
        if min(self.dp, self.tp, self.pp, self.cp, self.virtual) < 1 or self.zero not in (0, 1, 2, 3):
            raise LayoutError(f"dp={self.dp}, tp={self.tp}, pp={self.pp}, cp={self.cp}, virtual={self.virtual}, "
                              f"zero={self.zero}: degrees must be >= 1 and zero one of 0-3. Fix: e.g. "
                              "Layout(dp=4, tp=4)")
        if self.defer_grad_sync and self.zero != 3:
            raise LayoutError("defer_grad_sync applies to ZeRO-3 / FSDP (stages 0-1 already reduce once per step; "
                              "DeepSpeed's stage 2 cannot defer). Fix: zero=3, or drop defer_grad_sync")
        if self.shard:
            if self.zero != 3:
                raise LayoutError(f"shard={self.shard} (HSDP) shards ZeRO-3 / FSDP's model states inside a group and "
                                  f"replicates them across groups; zero={self.zero} is not stage 3. Fix: zero=3, or "
                                  "drop shard")
            if self.shard < 1 or self.dp % self.shard:
                raise LayoutError(f"shard={self.shard} does not divide dp={self.dp} into replicas. Fix: a shard "
                                  f"degree that divides {self.dp} (e.g. the GPUs of one node)")
        if self.defer_all_reduce and (not self.shard or self.defer_grad_sync):
            raise LayoutError("defer_all_reduce defers HSDP's all-reduce across replicas; " + (
                "defer_grad_sync already defers it. Fix: drop one of them" if self.shard else
                "there is no HSDP here. Fix: zero=3 with shard=<GPUs per node>, or drop defer_all_reduce"))
        if self.virtual > 1 and self.pp == 1:
            raise LayoutError(f"virtual={self.virtual} needs a pipeline. Fix: pp >= 2, or virtual=1")
        if self.offload_optimizer and self.zero == 0:
            raise LayoutError("optimizer offload needs ZeRO stage 1, 2 or 3. Fix: zero=2 or 3")
        if self.offload_params and (self.zero != 3 or not self.offload_optimizer):
            raise LayoutError("parameter offload needs ZeRO-3 with the optimizer offloaded too. Fix: zero=3, "
                              "offload_optimizer=True")

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def hsdp(self) -> bool:
        """Whether model states are replicated across shard groups (``0 < shard < dp``)."""
        return 0 < self.shard < self.dp

    @property
    def shard_degree(self) -> int:
        """DP ranks that share one copy of the model states: ``shard`` under HSDP, else all of DP."""
        return self.shard if self.hsdp else self.dp

    @property
    def replicas(self) -> int:
        """Copies of the model states across DP (``dp / shard`` under HSDP, else 1)."""
        return self.dp // self.shard_degree

    @property
    def state_shards(self) -> int:
        """Ranks that share one copy of the model states and reduce their gradients together: the DP shard group
        times CP. Context-parallel ranks hold the same weights and see different tokens, so their gradients are
        reduced (and ZeRO shards its states) over DP x CP, as Megatron-LM's data-parallel group with context
        parallelism and torchtitan's ``dp_shard_cp`` mesh do."""
        return self.shard_degree * self.cp

    def degree(self, dim: str) -> int:
        """Ranks in one group of ``dim`` as ``traffic`` keys it: ``"dp"`` is the group that reduces gradients (the
        shard group under HSDP, times CP: ``state_shards``), ``"replicate"`` its replicas; else a degree."""
        return {"dp": self.state_shards, "replicate": self.replicas}.get(dim) or getattr(self, dim)

    @property
    def name(self) -> str:
        """``"TP4 x PP2 x DP2 (ZeRO-1)"``; data parallelism alone is named by its strategy (``"ZeRO-3"``)."""
        if (self.tp, self.pp, self.cp) == (1, 1, 1):
            base = "DDP" if self.zero == 0 else f"ZeRO-{self.zero}"
            if self.hsdp:
                base = f"HSDP (shard {self.shard}, {self.replicas} replicas)"
            if self.defer_grad_sync:
                base += ", sync deferred" if self.hsdp else ", gradient sync deferred"
            if self.defer_all_reduce and self.hsdp:
                base += ", all-reduce deferred"
            if self.offload_optimizer:
                base += " + optimizer" + (" and parameter" if self.offload_params else "") + " offload"
            return base
        parts = [f"{n.upper()}{getattr(self, n)}" for n in ("tp", "cp", "pp", "dp") if getattr(self, n) > 1]
        text = " x ".join(parts)
        if self.virtual > 1:
            text += f" (v{self.virtual})"
        if self.dp == 1 and self.cp > 1 and self.zero:          # ZeRO over the context-parallel ranks alone
            text += f" (ZeRO-{self.zero} over CP)"
        if self.dp > 1:
            kind = f"HSDP shard {self.shard}" if self.hsdp else f"ZeRO-{self.zero}"
            deferred = ", sync deferred" if self.defer_grad_sync else ""
            if self.defer_all_reduce and self.hsdp:
                deferred = ", all-reduce deferred"
            text += f" ({kind}{deferred})"
        return text

    def __str__(self) -> str:
        return self.name


def spread(layout: Layout, gpus_per_node: int) -> dict[str, tuple[int, int]]:
    """For each dimension: ``(members of one group on a node, nodes a group spans)``.

    Ranks are numbered TP fastest, then CP, PP, DP; a group's members are ``stride`` ranks apart,
    where ``stride`` is the product of the degrees inside it. Under HSDP, ``"shard"`` is DP's fastest
    part (its shard groups) and ``"replicate"`` the rest (one member of each shard group per replica).
    """
    def place(degree: int, stride: int) -> tuple[int, int]:
        members = max(1, min(degree, gpus_per_node // stride)) if stride < gpus_per_node else 1
        return members, math.ceil(degree / members)

    out, stride = {}, 1
    for name in ("tp", "cp", "pp", "dp"):
        out[name] = place(getattr(layout, name), stride)
        if name == "dp" and layout.hsdp:
            out["shard"] = place(layout.shard, stride)
            out["replicate"] = place(layout.replicas, stride * layout.shard)
        stride *= getattr(layout, name)
    if layout.cp > 1:   # the gradient group is DP (or HSDP's shard group) x CP: its members on a node multiply
        for name, degree in (("dp", layout.dp), ("shard", layout.shard)):
            if name in out:
                members = out[name][0] * out["cp"][0]
                out[name] = (members, math.ceil(degree * layout.cp / members))
    return out


def inside_node(layout: Layout, gpus_per_node: int) -> dict[str, bool]:
    """For each dimension, whether its groups stay inside one node."""
    return {name: nodes == 1 for name, (_, nodes) in spread(layout, gpus_per_node).items()}


#: Latency of one collective, in microseconds, from NCCL's own cost model (src/graph/tuning.cc, the "Simple"
#: protocol NCCL uses for large messages): a base per call, plus per ring step over NVLink, PCIe or the network.
NCCL_LATENCY_US = {"base": 8.4, "nvlink": 3.4, "pcie": 5.7, "network": 9.6}


def collective_latency(collective: str, members: int, nodes: int, cluster: hardware.Cluster) -> float:
    """Seconds one ring ``collective`` waits on latency (NCCL's model): ``base + steps inside nodes x their link's
    latency + steps across nodes x the network's``, with ``ranks - 1`` steps for all-gather and reduce-scatter
    and twice that for all-reduce (of which ``nodes - 1`` or twice that cross the network)."""
    ranks = members * nodes
    if ranks == 1:
        return 0.0
    twice = 2 if collective == "all_reduce" else 1
    inside = "nvlink" if "NVLink" in cluster.node.interconnect or "NVSwitch" in cluster.node.interconnect or \
        cluster.node.intra_node_gbs >= 100 else "pcie"
    steps, across = twice * (ranks - 1), twice * (nodes - 1)
    us = NCCL_LATENCY_US
    return (us["base"] + (steps - across) * us[inside] + across * us["network"]) * 1e-6


def collective_seconds(nbytes: float, collective: str, members: int, nodes: int, cluster: hardware.Cluster,
                       calls: float = 1) -> float:
    """Seconds of ``calls`` ``collective`` calls on ``nbytes`` per rank in all for a group with ``members`` GPUs on
    each of ``nodes`` nodes, every group of its kind running at the same time (see the module docstring: links
    are shared), plus each call's latency (``collective_latency``)."""
    if members * nodes == 1 or nbytes == 0:
        return 0.0
    node = cluster.node
    seconds = calls * collective_latency(collective, members, nodes, cluster)
    if members > 1:
        seconds += ring_factor(members, collective) * nbytes / (node.intra_node_gbs * 1e9)
    if nodes > 1:
        groups_per_node = node.gpus / members
        seconds += groups_per_node * ring_factor(nodes, collective) * nbytes / (cluster.inter_node_gbs * 1e9)
    return seconds


def p2p_seconds(nbytes: float, members: int, nodes: int, cluster: hardware.Cluster) -> float:
    """Seconds for a pipeline stage to send ``nbytes`` to the next, over the slowest boundary: the network when
    the pipeline spans nodes (every pipeline on the node sending through its link at once), else inside the node."""
    if members * nodes == 1 or nbytes == 0:
        return 0.0
    if nodes > 1:
        return (cluster.node.gpus / members) * nbytes / (cluster.inter_node_gbs * 1e9)
    return nbytes / (cluster.node.intra_node_gbs * 1e9)


def can_time(cluster: hardware.Cluster, precision: str = "bf16") -> bool:
    """Whether a step time can be computed: the GPU's peak for ``precision`` and the links the GPUs use are known."""
    node = cluster.node
    links = (node.gpus == 1 or node.intra_node_gbs > 0) and (cluster.nodes == 1 or cluster.inter_node_gbs > 0)
    return cluster.gpu.peak_flops(precision) > 0 and links


@dataclass(frozen=True)
class Setup:
    """What is trained and how: sequences per step and per micro-batch, their length, precision, recomputation.

    ``efficiency``: the fraction of peak FLOP/s while computing; None takes ``efficiency_for`` the cluster's GPU.
    ``flash_attention``: a fused attention kernel (FlashAttention; PyTorch's SDPA on a GPU) that keeps no
    sequence x sequence scores for backward (``formulas.layer_activation_bytes``); False for eager attention.
    ``grad_reduce``: the number format the data-parallel gradient collectives (DDP's all-reduce, ZeRO's and FSDP's
    reduce-scatter, HSDP's all-reduce across replicas) send. "fp32", the default, is what the frameworks do with
    16-bit compute: PyTorch DDP under autocast (its gradients are the fp32 parameters'; notebook 07 measures the
    bytes), Megatron-LM with ``--bf16`` (gradients accumulated and all-reduced in fp32) and torchtitan (FSDP2's
    ``reduce_dtype`` float32). "bf16" / "fp16" is DeepSpeed's default ``communication_data_type`` under bf16 / fp16,
    FSDP2's ``MixedPrecisionPolicy`` without a ``reduce_dtype``, or a DDP compression hook: half the bytes.
    Parameter all-gathers travel in the compute format either way; memory keeps the ZeRO paper's accounting.

    What a framework decides, with the defaults:

    * ``sequence_parallel``: with tensor parallelism, the norms, dropouts and the layers' inputs are split over the
      TP ranks too (Korthikanti et al. 2022; torchtitan's TP plan, Megatron-LM's ``--sequence-parallel``), so every
      activation divides by TP. False keeps those replicated, ``10*s*b*h`` bytes a GPT layer in 16-bit (notebook 14
      teaches TP without it first): a TP4 layer then keeps about 1.6x more. The traffic is the same either way.
    * ``schedule``: the pipeline's, "1f1b" (Megatron-LM's and torchtitan's; interleaved when the layout's
      ``virtual`` > 1): the first stage holds ``min(M, P)`` micro-batches; "gpipe" holds all ``M`` (every forward
      before the first backward). The bubble is the same.
    * ``bucket_bytes``: the gradient bucket of DDP and ZeRO-1/2's once-per-step collectives, PyTorch DDP's 25 MB
      (``bucket_cap_mb``); None for Megatron-LM's ``max(40M, 1M x DP)`` parameters (``megatron_bucket_bytes``).
      Each bucket pays a collective's latency once.
    * ``framework``: whose code trains (``dtlab.planner.memory.FRAMEWORKS``): "pytorch" (DDP, FSDP, torchtitan,
      Hugging Face, this course), "megatron", "deepspeed" or "megatron-deepspeed". It sets how model states are kept
      (fp32 parameters and gradients in PyTorch; Megatron-LM's fp32 gradient buffer beside 16-bit parameters;
      DeepSpeed's 16-bit parameters and fp32 gradient partition), the loss's working set and the buffers.
    * ``eager_norms``: the model's RMSNorm is eager PyTorch that upcasts to fp32 (Hugging Face's Llama, Mistral,
      Qwen): each norm keeps an fp32 copy of its input for backward. False for fused norms (Megatron-LM, Apex,
      torch.compile) and for LayerNorm, which PyTorch computes in one kernel.
    * ``fused_loss``: a fused cross-entropy (flash-attn's ``CrossEntropyLoss``, Liger's, Apple's cut cross-entropy;
      llm-foundry's ``fused_crossentropy``) that works on the 16-bit logits in place: the loss holds
      ``memory.FUSED_LOSS_BYTES`` per logit instead of the framework's own. Megatron-LM's is fused already.
    * ``attention_kernel``: which fused attention kernel runs, for its speed (``kernels.ATTENTION_KERNELS``):
      "flash2" (FlashAttention-2, PyTorch's SDPA on recent GPUs; the default), "flash1" or "triton" (the Triton
      FlashAttention llm-foundry's MPT benchmarks ran, with ALiBi). Ignored without ``flash_attention``.
    * ``deepspeed_bucket``: DeepSpeed's ``reduce_bucket_size`` (elements; 5e8 by default, Hugging Face's "auto" sets
      h x h). With ``contiguous_gradients`` (the default) it allocates the whole bucket, in the gradients' format,
      whatever the model's size: 1.9 GiB in fp32 at the default.
    * ``pipeline_split``: how the layers are shared out among pipeline stages (``stage_layers``): "even" (as equal
      as they go, the first stages taking one more) or "lighter_ends" (the first and last stages one layer fewer,
      as Llama 3's schedule does, to make room for what those stages hold besides their layers).
    """

    global_batch: int = 512
    micro_batch: int = 1
    seq_len: int = 2048
    recompute: str = "selective"
    precision: str = "bf16"
    efficiency: float | None = None
    flash_attention: bool = True
    grad_reduce: str = "fp32"
    sequence_parallel: bool = True
    schedule: str = "1f1b"
    bucket_bytes: float | None = BUCKET_BYTES
    pipeline_split: str = "even"
    framework: str = "pytorch"
    eager_norms: bool = False
    overhead: float | None = None
    fused_loss: bool = False
    attention_kernel: str = "flash2"
    deepspeed_bucket: float = 5e8

    @property
    def value_bytes(self) -> int:
        """Bytes of one activation, gradient or 16-bit parameter value."""
        return 4 if self.precision == "fp32" else 2

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            why = (" Float8 training (torchao's float8 linears, Transformer Engine's FP8) keeps float8 copies for "
                   "backward and scaling state, and gathers float8 weights: the planner does not price it" if
                   "8" in str(self.precision) else "")
            raise ValueError(f"precision={self.precision!r}: use one of {', '.join(PRECISIONS)}.{why} Fix: price the "
                             "run as bf16 and measure its memory (torch.cuda.max_memory_allocated), knowing the "
                             "prediction is not for float8")
        if self.framework not in peak.FRAMEWORKS:
            raise ValueError(f"framework={self.framework!r}: use one of {', '.join(peak.FRAMEWORKS)} (pytorch: DDP, "
                             "FSDP, torchtitan, Hugging Face; megatron: Megatron-LM; deepspeed; megatron-deepspeed)")
        if self.attention_kernel not in kernels.ATTENTION_KERNELS:
            raise ValueError(f"attention_kernel={self.attention_kernel!r}: use one of "
                             f"{', '.join(kernels.ATTENTION_KERNELS)}")
        if self.grad_reduce not in PRECISIONS:
            raise ValueError(f"grad_reduce={self.grad_reduce!r}: use one of {', '.join(PRECISIONS)} (fp32: what DDP "
                             "under autocast, Megatron-LM and torchtitan send; bf16: DeepSpeed's default)")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r}: use one of {', '.join(SCHEDULES)} (1f1b: Megatron-LM's and "
                             "torchtitan's; interleaving is the layout's virtual > 1)")
        if self.pipeline_split not in PIPELINE_SPLITS:
            raise ValueError(f"pipeline_split={self.pipeline_split!r}: use one of {', '.join(PIPELINE_SPLITS)}")
        if self.bucket_bytes is not None and self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={self.bucket_bytes}: give a positive size (25e6 is DDP's), or None for "
                             "Megatron-LM's rule")

    @property
    def grad_reduce_bytes(self) -> int:
        """Bytes of one gradient value in the data-parallel reductions (``grad_reduce``)."""
        return 4 if self.grad_reduce == "fp32" else 2


def check(num_params: float, shape: ModelShape, layout: Layout, cluster: hardware.Cluster, setup: Setup) -> int:
    """Why ``layout`` cannot run (``LayoutError`` naming the fix), or its micro-batches per step."""
    if layout.gpus > cluster.gpus:
        raise LayoutError(f"{layout} needs {layout.gpus} GPUs; {cluster.name} has {cluster.gpus}. Fix: smaller degrees")
    if layout.gpus < cluster.gpus:
        raise LayoutError(f"{layout} uses {layout.gpus} of {cluster.name}'s {cluster.gpus} GPUs. Fix: degrees whose "
                          f"product is {cluster.gpus}")
    if setup.micro_batch > setup.global_batch:
        raise LayoutError(f"micro_batch={setup.micro_batch} is larger than global_batch={setup.global_batch}. Fix: a "
                          "micro-batch of at most the global batch")
    per_replica = layout.dp * setup.micro_batch
    if setup.global_batch % per_replica:
        raise LayoutError(f"global batch {setup.global_batch} does not divide into DP {layout.dp} x micro-batch "
                          f"{setup.micro_batch}. Fix: a global batch that is a multiple of {per_replica}, or "
                          "another DP degree")
    gpn = cluster.node.gpus
    if layout.tp > 1 and (gpn % layout.tp if layout.tp <= gpn else layout.tp % gpn):
        raise LayoutError(f"{layout}: tensor-parallel groups of {layout.tp} would straddle nodes of {gpn} GPUs. Fix: a "
                          f"TP degree that divides {gpn} (or a multiple of it)")
    if shape.n_head % layout.tp:
        raise LayoutError(f"{shape.n_head} heads do not divide by TP {layout.tp}. Fix: a TP degree that divides "
                          f"the heads")
    kv = shape.n_kv_head or shape.n_head
    if kv % layout.tp and layout.tp % kv:
        raise LayoutError(f"{kv} KV heads and TP {layout.tp}: neither divides the other. Fix: a TP degree that "
                          "divides the KV heads, or a multiple of them")
    if layout.pp * layout.virtual > shape.n_layer:
        raise LayoutError(f"{layout.pp * layout.virtual} pipeline chunks for {shape.n_layer} layers. Fix: at most "
                          f"{shape.n_layer} chunks")
    if setup.seq_len % layout.cp:
        raise LayoutError(f"sequence {setup.seq_len} does not divide by CP {layout.cp}. Fix: a CP degree that "
                          "divides it")
    micro_batches = setup.global_batch // per_replica
    if layout.pp > 1 and micro_batches < 2:
        raise LayoutError(f"{layout} gets {micro_batches} micro-batch per step: a pipeline needs at least 2. Fix: "
                          "a larger global batch or a smaller micro-batch")
    return micro_batches


def memory(num_params: float, shape: ModelShape, layout: Layout, setup: Setup,
           micro_batches: int | None = None) -> dict[str, float]:
    """Bytes per GPU at the step's peak on the busiest GPU, by what holds them (``dtlab.planner.memory``):
    ``params``, ``grads``, ``optimizer`` (model states as ``Setup.framework`` keeps them), ``activations``, ``loss``
    (the logits and the cross-entropy, last stage), ``buffers`` (gathered units, buckets, 16-bit copies; at the
    optimizer step its temporaries), ``allocated`` (their sum: what ``torch.cuda.max_memory_allocated`` shows),
    ``runtime`` (CUDA context, NCCL, the allocator's slack), ``total`` (``allocated + runtime``: what nvidia-smi
    shows, and what must fit), ``peak_at`` ("backward" or "optimizer step"), ``stage`` (the pipeline stage priced)
    and ``cpu`` (offloaded to host memory, per GPU).

    Every pipeline stage is priced and the one that holds the most is returned: stage s has its layers
    (``stage_layers``), the first also the embedding and the last the output layer (and the loss); under 1F1B it
    holds ``min(M, P - s)`` micro-batches' activations at its peak (interleaving adds ``(P-1)/(P*v)`` of that;
    GPipe holds all M). Without a pipeline the one GPU holds both ends.
    """
    m = micro_batches if micro_batches is not None else max(1, setup.global_batch // (layout.dp * setup.micro_batch))
    splits = stage_layers(shape.n_layer, layout.pp, setup.pipeline_split) if layout.pp > 1 else [shape.n_layer]
    interleaved = 1 + ((layout.pp - 1) / (layout.pp * layout.virtual) if layout.virtual > 1 else 0)
    layer_total = shape.n_layer * shape.layer_params
    embedding = max(0.0, num_params - layer_total)       # what is not in the layers: embedding, output layer, norm
    # under a pipeline each end holds its own: a tied embedding twice (Megatron-LM copies it to the last stage), an
    # untied model's input embedding on the first stage and its output layer on the last
    end_share = 1.0 if shape.tied else 0.5
    busiest = None
    for s, layers in enumerate(splits):                 # every stage, and the one that holds the most
        first, last = s == 0, s == len(splits) - 1
        psi_layers = num_params * layers / shape.n_layer if embedding == 0 else layers * shape.layer_params
        ends = embedding if layout.pp == 1 else embedding * end_share * (int(first) + int(last))
        psi = (psi_layers + ends) / layout.tp
        in_flight = 1.0 if layout.pp == 1 else float(m if setup.schedule == "gpipe" else min(m, layout.pp - s))
        mem = peak.stage_peak(shape=shape, layout=layout, setup=setup, psi=psi, psi_layers=psi_layers / layout.tp,
                              layers=layers, in_flight=in_flight, first=first, last=last, interleaved=interleaved)
        mem["stage"] = s
        if busiest is None or mem["total"] > busiest["total"]:
            busiest = mem
    return busiest


#: What the kernel model leaves out of a step's compute (launch gaps, the optimizer, kernels it does not list), as a
#: factor on its time: the median over the published runs' sources of the factor at which it reproduces each run
#: (``published.fitted_overhead``; tests/test_published_runs.py recomputes it and holds every run out by source and by
#: framework family).
KERNEL_OVERHEAD = 1.10


def kernel_seconds(shape: ModelShape, layout: Layout, setup: Setup, gpu_name: str, peak: float) -> dict[str, float]:
    """One micro-batch's compute on the slowest pipeline stage, from the kernels' measured rates
    (``dtlab.planner.kernels``): each matrix product at the efficiency of its shape, attention at FlashAttention's
    (or eager attention's) rate for the sequence, the memory-bound kernels at the memory's bandwidth, all times
    ``Setup.overhead`` (``KERNEL_OVERHEAD`` when None). Returns ``forward``, ``backward`` (with what it recomputes),
    ``recompute``, ``attention_forward`` (one layer's attention forward, what ring attention hides a hop behind),
    and ``layers`` (the slowest stage's)."""
    rates = kernels.rates_for(gpu_name, peak / 1e12)
    t, seq = layout.tp, setup.seq_len
    tokens = setup.micro_batch * seq / layout.cp
    h = shape.n_embd
    kv = (shape.n_kv_head or shape.n_head) * shape.head_dim
    f = shape.ffn or 4 * h

    def gemm(flops: float, d: float) -> float:
        return flops / (kernels.gemm_efficiency(rates, d, tokens) * peak)
    layer_fwd = (gemm(2 * tokens * h * (h + 2 * kv) / t, min(h, (h + 2 * kv) / t)) + gemm(2 * tokens * h * h / t, h / t)
                 + gemm(2 * tokens * h * f * (2 if shape.gated else 1) / t, min(h, f / t))
                 + gemm(2 * tokens * f * h / t, min(f / t, h)))
    # attention as FlashAttention counts it: the causal half of 4 s d per head and token forward, 2.5x that backward
    attn_flops = 0.5 * 4.0 * tokens * seq * h / t
    attn = 3.5 * attn_flops / kernels.attention_flops_per_second(
        rates, seq, setup.attention_kernel if setup.flash_attention else "eager", shape.head_dim)
    split = 1 / t if (setup.sequence_parallel or t == 1) else 0.5 + 0.5 / t
    mem = kernels.KERNEL_BYTES[setup.framework] * tokens * h * split / (rates.hbm_gbs * 1e9)
    layer_f = layer_fwd + attn / 3.5 + mem / 3                       # one layer's forward
    layer_b = 2 * layer_fwd + attn * 2.5 / 3.5 + mem * 2 / 3         # ... and its backward
    extra = {"none": 0.0, "op": layer_fwd / 2, "full": layer_f,
             "selective": 0.0 if setup.flash_attention else attn / 3.5}[setup.recompute]
    v = shape.vocab or 0
    head_f = gemm(2 * tokens * v * h / t, min(h, v / t)) if v else 0.0
    loss = 20.0 * tokens * v / t / (rates.hbm_gbs * 1e9)               # the cross-entropy's passes over the logits
    splits = stage_layers(shape.n_layer, layout.pp, setup.pipeline_split) if layout.pp > 1 else [shape.n_layer]
    times = [n * (layer_f + layer_b + extra) + (3 * head_f + loss if s == len(splits) - 1 else 0.0)
             for s, n in enumerate(splits)]
    slowest = max(range(len(splits)), key=lambda s: times[s])
    n, last = splits[slowest], slowest == len(splits) - 1
    factor = setup.overhead if setup.overhead is not None else KERNEL_OVERHEAD
    forward = (n * layer_f + (head_f + loss / 3 if last else 0.0)) * factor
    recompute = n * extra * factor
    backward = (n * layer_b + (2 * head_f + 2 * loss / 3 if last else 0.0)) * factor + recompute
    return {"forward": forward, "backward": backward, "recompute": recompute,
            "attention_forward": attn / 3.5 * factor, "layers": n}


def traffic(num_params: float, shape: ModelShape, layout: Layout, setup: Setup,
            micro_batches: int) -> dict[str, dict[str, float]]:
    """Bytes per GPU per step of each collective, by dimension: ``{"dp": {"all_reduce": ..., ...}, ...}``.

    Sizes are per rank as nccl-tests counts them (the all-reduce's tensor, the all-gather's output, the
    reduce-scatter's input); ``bytes_sent`` multiplies by ``ring_factor``. ``"dp"`` is the gradient group, DP x CP
    (``Layout.state_shards``); under HSDP it holds what runs in the shard group (x CP), and ``"replicate"`` the
    all-reduce of this rank's share of the gradients across replicas.
    """
    m, vb, b = micro_batches, setup.value_bytes, setup.micro_batch
    share = busiest_layers(shape, layout, setup) / shape.n_layer
    tensor = vb * num_params * share / layout.tp          # this GPU's parameters in the compute format
    grads = setup.grad_reduce_bytes * num_params * share / layout.tp     # its gradients, as they are reduced
    out: dict[str, dict[str, float]] = {"dp": {}, "tp": {}, "cp": {}, "pp": {}}
    if layout.dp * layout.cp > 1:
        if layout.zero == 0:
            out["dp"]["all_reduce"] = grads
        elif layout.zero in (1, 2):
            out["dp"]["reduce_scatter"] = grads * (m if layout.zero == 2 else 1)
            out["dp"]["all_gather"] = tensor
        else:
            out["dp"]["all_gather"] = 2 * m * tensor
            out["dp"]["reduce_scatter"] = grads * (1 if layout.defer_grad_sync else m)
            if layout.hsdp:
                syncs = 1 if layout.defer_grad_sync or layout.defer_all_reduce else m
                out["replicate"] = {"all_reduce": syncs * grads / (layout.shard * layout.cp)}
    layers = busiest_layers(shape, layout, setup)
    tokens = b * setup.seq_len // layout.cp
    if layout.tp > 1:
        per_layer = 4 + (2 if setup.recompute == "full" else 0)
        out["tp"]["all_reduce"] = m * layers * per_layer * tokens * shape.n_embd * vb
    if layout.cp > 1:
        kv = 2 * tokens * (shape.n_kv_head or shape.n_head) * shape.head_dim * vb / layout.tp
        passes = 3 + (1 if setup.recompute == "full" else 0)      # forward, backward's K/V and their gradients
        out["cp"]["send"] = m * layers * passes * (layout.cp - 1) * kv
    if layout.pp > 1:
        out["pp"]["send"] = 2 * m * layout.virtual * tokens * shape.n_embd * vb / layout.tp
    return out


def bytes_sent(traffic_: dict[str, dict[str, float]], layout: Layout) -> dict[str, float]:
    """Bytes each GPU sends per step, by dimension (ring factors applied)."""
    return {dim: sum((ring_factor(layout.degree(dim), op) if op != "send" else 1.0) * n for op, n in ops.items())
            for dim, ops in traffic_.items()}


#: What ``fit`` says of a layout's memory: within ``1 - headroom`` of the GPU; above that but within the GPU's whole
#: memory (the headroom is the planner's margin for the CUDA context, communication buffers and fragmentation, which a
#: run that trained may well have needed less of: it may run); above the GPU's memory.
FIT_STATES = ("fits", "tight", "does not fit")


def fit_state(total: float, gpu_bytes: float, headroom: float, cpu: float = 0.0,
              host_bytes: float = 0.0) -> str | None:
    """``FIT_STATES``' word for ``total`` bytes per GPU (and ``cpu`` bytes offloaded per GPU, against ``host_bytes``
    of host memory per GPU), or None where an offload meets a host whose memory was not given."""
    if cpu > 0 and host_bytes <= 0:
        return None if total <= gpu_bytes * (1 - headroom) else "does not fit"
    worst = max(total / gpu_bytes, cpu / host_bytes if cpu > 0 else 0.0)
    return "fits" if worst <= 1 - headroom else ("tight" if worst <= 1 else "does not fit")


def cost(num_params: float, layout: Layout, cluster: str | hardware.Cluster, setup: Setup | None = None,
         shape: ModelShape | None = None, headroom: float = formulas.HEADROOM) -> dict:
    """Memory per GPU and step time of ``layout`` training a ``num_params`` model on ``cluster``.

    Returns a dict: ``layout`` (its name), ``micro_batches``, ``memory`` (``memory()``), ``fits`` (within
    ``1 - headroom`` of the GPU and of the host memory per GPU), ``fit`` (``fit_state``: "fits", "tight" inside
    the headroom, "does not fit", or None), ``headroom``, ``inside_node``, ``bytes_sent``
    (per GPU, by dimension), ``seconds`` (``compute``, ``recompute`` (part of compute), ``comm_exposed``,
    ``comm_hidden``, ``bubble``, ``offload``, ``total``, and ``by_dimension``: exposed seconds per
    dimension, ``dp`` with HSDP's all-reduce across replicas), ``tokens_per_second``, ``mfu`` and ``hfu``.
    Where the cluster's speeds are not known (``can_time``), the clock's entries are None and only memory is
    computed.

    Raises:
        LayoutError: when the layout cannot run (GPUs, batch, heads, layers or sequence do not divide);
            the message names the fix.
    """
    c = hardware.cluster(cluster)
    setup = setup or Setup()
    shape = shape or formulas.model_shape(num_params)
    m = check(num_params, shape, layout, c, setup)
    mem = memory(num_params, shape, layout, setup, m)
    fit = fit_state(mem["total"], c.gpu.memory_bytes, headroom, mem["cpu"], c.node.cpu_memory_bytes_per_gpu)
    fits = None if fit is None else fit == "fits"                 # None: a host whose memory was not given
    base = {"layout": layout.name, "micro_batches": m, "memory": mem, "fits": fits, "fit": fit, "headroom": headroom,
            "inside_node": inside_node(layout, c.node.gpus)}
    if not can_time(c, setup.precision):
        return {**base, "bytes_sent": None, "seconds": None, "tokens_per_second": None, "mfu": None, "hfu": None}

    # compute of one micro-batch on this GPU (the busiest pipeline stage)
    peak = c.gpu.peak_flops(setup.precision)
    layers = busiest_layers(shape, layout, setup)          # the busiest stage's: it sets the pipeline's pace
    if setup.efficiency is not None:                       # one given fraction of peak for every kernel
        rate = setup.efficiency * peak
        tokens = setup.micro_batch * setup.seq_len
        f = formulas.training_flops(tokens, shape, setup.seq_len, setup.recompute, num_params, setup.flash_attention)
        share = layers / shape.n_layer / (layout.tp * layout.cp)
        fwd = f.forward * share / rate
        recompute = f.recomputed * share / rate
        bwd = 2 * fwd + recompute                          # backward, with what it recomputes
        attention_s = 4.0 * (setup.micro_batch * setup.seq_len / layout.cp) * setup.seq_len * shape.n_embd \
            / layout.tp / rate
    else:                                                  # each kernel at its measured rate (dtlab.planner.kernels)
        k = kernel_seconds(shape, layout, setup, c.gpu.name, peak)
        fwd, bwd, recompute, attention_s = k["forward"], k["backward"], k["recompute"], k["attention_forward"]
        layers = k["layers"]
    per_mb = fwd + bwd

    spread_ = spread(layout, c.node.gpus)
    flows = traffic(num_params, shape, layout, setup, m)

    def coll(dim: str, op: str, nbytes: float, calls: float = 1) -> float:
        members, nodes = spread_[dim]
        return collective_seconds(nbytes, op, members, nodes, c, calls)

    bucket = (setup.bucket_bytes if setup.bucket_bytes is not None
              else megatron_bucket_bytes(layout.state_shards, setup.grad_reduce_bytes))
    buckets = max(1, math.ceil(flows["dp"].get("all_reduce", flows["dp"].get("all_gather", 0.0)) / bucket))

    # data parallelism: per collective call, what can hide it
    dp_exposed = dp_total = 0.0
    if layout.dp * layout.cp > 1:
        one = flows["dp"]
        if layout.zero == 0:
            t = coll("dp", "all_reduce", one["all_reduce"], buckets)
            dp_total, dp_exposed = t, max(0.0, t - bwd)
        elif layout.zero in (1, 2):
            rs_calls = m if layout.zero == 2 else 1
            rs = coll("dp", "reduce_scatter", one["reduce_scatter"] / rs_calls, buckets)
            ag = coll("dp", "all_gather", one["all_gather"], buckets)
            dp_total = rs_calls * rs + ag
            dp_exposed = rs_calls * max(0.0, rs - bwd) + max(0.0, ag - fwd)
        else:
            units = layers * layout.gathers_per_layer                        # collectives per pass over the layers
            group = "shard" if layout.hsdp else "dp"
            ag = coll(group, "all_gather", one["all_gather"] / (2 * m), units)
            rs = coll(group, "reduce_scatter", one["reduce_scatter"] / (1 if layout.defer_grad_sync else m), units)
            ar = 0.0
            if layout.hsdp:     # each unit's gradient shard all-reduced across replicas after its reduce-scatter
                syncs = 1 if layout.defer_grad_sync or layout.defer_all_reduce else m
                ar = coll("replicate", "all_reduce", flows["replicate"]["all_reduce"] / syncs, units)
            # what each micro-batch's backward reduces: the last one everything; the others what is not deferred
            early = 0.0 if layout.defer_grad_sync else rs + (0.0 if layout.defer_all_reduce else ar)
            last = rs + ar

            def backward_exp(reduce: float) -> float:   # the reduce of the last unit has no backward left to hide it
                return max(0.0, ag + reduce - bwd) + reduce / layers
            forward_exp = max(0.0, ag - fwd) + ag / layers
            dp_exposed = m * forward_exp + (m - 1) * backward_exp(early) + backward_exp(last)
            dp_total = 2 * m * ag + (m - 1) * early + last
    tp_calls = m * layers * (4 + (2 if setup.recompute == "full" else 0))
    tp_s = coll("tp", "all_reduce", flows["tp"].get("all_reduce", 0.0), tp_calls)
    cp_s = cp_total = 0.0
    if layout.cp > 1:   # the ring: cp - 1 steps, each a send to the next rank (a p2p per step)
        members, nodes = spread_["cp"]
        cp_total = p2p_seconds(flows["cp"]["send"], members, nodes, c)
        # Ring attention sends the next K/V block while it computes with the current one (notebook 16 measures
        # the overlap): cp - 1 of each layer's cp attention chunks, forward and backward, can hide the transfers.
        passes = 3 + (1 if setup.recompute == "full" or (setup.recompute == "selective" and not setup.flash_attention)
                      else 0)
        hideable = m * layers * passes * attention_s * (layout.cp - 1) / layout.cp
        cp_s = max(0.0, cp_total - hideable)
    pp_s = 0.0
    if layout.pp > 1:
        members, nodes = spread_["pp"]
        pp_s = p2p_seconds(flows["pp"]["send"], members, nodes, c)

    offload = 0.0
    if layout.offload_optimizer:
        # DeepSpeed's ZeRO-Offload copies this GPU's gradient shard to the host after every micro-batch's backward
        # (accumulating there, in fp32), then the host's Adam steps and the updated 16-bit parameters come up once
        shard = num_params / (layout.tp * layout.pp * layout.state_shards)
        offload = ((m + 1) * setup.value_bytes * shard) / (PCIE_GBS * 1e9) + shard / CPU_ADAM_PARAMS_PER_S
        if layout.offload_params:  # this GPU's parameter shard comes up for every forward and backward
            offload += m * 2 * setup.value_bytes * shard / (PCIE_GBS * 1e9)

    hidden = dp_total - dp_exposed + cp_total - cp_s
    compute = m * per_mb
    pipelined = compute + tp_s + cp_s + pp_s
    bubble_share = (layout.pp - 1) / (layout.virtual * m + layout.pp - 1) if layout.pp > 1 else 0.0
    bubble = pipelined * bubble_share / (1 - bubble_share)
    total = pipelined + bubble + dp_exposed + offload
    exposed = tp_s + cp_s + pp_s + dp_exposed
    step_tokens = setup.global_batch * setup.seq_len
    whole = formulas.training_flops(step_tokens, shape, setup.seq_len, setup.recompute, num_params,
                                    setup.flash_attention)
    return {**base, "bytes_sent": bytes_sent(flows, layout),
            "seconds": {"compute": compute, "recompute": m * recompute, "comm_exposed": exposed,
                        "comm_hidden": hidden, "bubble": bubble, "offload": offload,
                        "total": total,
                        "by_dimension": {"dp": dp_exposed, "tp": tp_s, "cp": cp_s, "pp": pp_s}},
            "tokens_per_second": step_tokens / total,
            "mfu": whole.model / (total * layout.gpus * peak), "hfu": whole.hardware / (total * layout.gpus * peak)}
