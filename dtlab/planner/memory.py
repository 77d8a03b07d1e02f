"""Memory per GPU at a training step's peak: what a framework keeps, and which of it a tool shows.

``cost.memory`` prices every pipeline stage with ``stage_peak`` and returns the busiest. A step has two peaks,
and the larger is the GPU's:

* **backward** (its start, the loss just computed): model states, every layer's saved activations (those of
  the micro-batches in flight under a pipeline), the loss's working set, and the framework's buffers;
* **optimizer step**: model states, the buffers that persist (DDP's buckets), and the step's temporaries.

The parts, bytes per GPU (``Ψ`` = this GPU's parameters: its TP slice of its stage's layers, plus the embedding
on the first stage and the output layer on the last):

``params``, ``grads``, ``optimizer``
    Model states as the framework (``FRAMEWORKS``) keeps them, sharded by ZeRO over ``Layout.state_shards``
    (``states_per_param``). They differ from the ZeRO paper's 2 + 2 + 12 bytes (``formulas.model_states``):
    PyTorch's autocast, DDP and FSDP keep fp32 parameters (they are the master weights) and fp32 gradients;
    Megatron-LM keeps 16-bit parameters and an fp32 gradient buffer, 18 bytes, ``6 + 12/d`` with its
    distributed optimizer (its README's table); DeepSpeed keeps 16-bit parameters and gradients, and an fp32
    gradient partition from stage 2 on, as its own estimators count (``estimate_zero2_model_states_mem_needs``:
    ``2 + 18/N``; ``estimate_zero3_...``: ``18/N``); its BF16 optimizer keeps fp32 gradients at stage 1.
``activations``
    ``formulas.layer_activation_bytes`` for the layers in flight, plus the recomputed layer's working set.
    With ``Setup.eager_norms``, an RMSNorm written in eager PyTorch (Hugging Face's Llama) keeps an fp32 copy of
    its input: 4 more bytes per value and norm than a fused norm keeps.
``loss``
    The logits and the cross-entropy on the last stage: ``LOSS_BYTES`` per logit (``b x s x V / TP``).
``buffers``
    FSDP / ZeRO-3's gathered units (the one computing and the one prefetched, the largest unit: often the output
    layer) and the unsharded gradient being reduced; with a pipeline, FSDP keeps its stage unsharded (parameters
    and gradients: ``reshard_after_forward=False``, the reduction deferred to the step's end, as torchtitan does);
    DDP's gradient buckets (a second copy of the gradients unless ``gradient_as_bucket_view``); autocast's 16-bit
    copies of the weights, saved for backward; DeepSpeed's reduce bucket (``cost.Setup.deepspeed_bucket``) and
    all-gather bucket (``DEEPSPEED_BUCKET``), and ZeRO-3's gathered parameters (up to ``DEEPSPEED_MAX_LIVE``).
    At the optimizer step: Adam's foreach temporary (4 bytes per parameter it steps), DeepSpeed's fp32 gradients.
``runtime``
    What a process needs besides its tensors: the CUDA context (``CUDA_CONTEXT_BYTES``) and NCCL's buffers for each
    communicator (``NCCL_BYTES``) — together ``process`` — and the caching allocator's slack on a full card
    (``FULL_CARD_SLACK``). On a card with room the allocator caches more (``ALLOCATOR_SLACK``), which a reserved or
    nvidia-smi figure shows, but it gives that back before it runs out of memory.

**The figure a tool shows** (``figure``): ``torch.cuda.max_memory_allocated`` is the first four parts at the peak
(``allocated``); ``max_memory_reserved`` adds the allocator's slack, up to what the card leaves; ``nvidia-smi`` adds
the CUDA context and NCCL's buffers too. What must fit in the GPU is ``total``, ``allocated + runtime``. Published
figures come in all three kinds (torchtitan's tables are peak reserved, Megatron-LM's logs peak allocated,
DeepSpeed's tutorials nvidia-smi), so a prediction is compared with the figure of the same kind.
``dtlab/planner/measured_memory.json`` holds the published figures and
``dtlab.planner.memory_record`` sets the planner beside them.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.planner import formulas
from dtlab.planner.formulas import GiB, ModelShape

#: How a framework keeps model states, computes the loss and buffers its collectives.
#: "pytorch": PyTorch's DDP, FSDP (1 and 2) and ZeroRedundancyOptimizer under autocast or a MixedPrecisionPolicy,
#: as torchtitan, Hugging Face's Trainer and Accelerate, MosaicML's Composer and this course use them.
#: "megatron": Megatron-LM / Megatron-Core (its distributed optimizer is ZeRO-1).
#: "deepspeed": DeepSpeed's engine and ZeRO optimizers, with PyTorch's layers and loss.
#: "megatron-deepspeed": Megatron's layers and fused loss, DeepSpeed's ZeRO and BF16 optimizers (BigScience's BLOOM,
#: DeepSpeed's Megatron GPT-2 tutorials).
FRAMEWORKS = ("pytorch", "megatron", "deepspeed", "megatron-deepspeed")

#: Bytes per logit the loss holds at its peak. PyTorch's cross-entropy (Hugging Face, torchtitan): the fp32 copy of
#: the 16-bit logits, the saved fp32 log-probabilities and, in backward, their gradient and the logits' (12; the
#: 16-bit logits themselves are freed or are a view). Megatron-LM's vocab-parallel cross-entropy works in place on
#: one fp32 copy beside the 16-bit logits (``_VocabParallelCrossEntropy``: softmax into the same buffer, the
#: gradient into it again): 6. At long sequences and large vocabularies this is the largest single item.
LOSS_BYTES = {"pytorch": 12, "deepspeed": 12, "megatron": 6, "megatron-deepspeed": 6}
#: ... and a fused cross-entropy's (``cost.Setup.fused_loss``): the 16-bit logits and their gradient, written into
#: the same buffer (flash-attn's ``CrossEntropyLoss(inplace_backward=True)``), with fp32 row statistics: 4.
FUSED_LOSS_BYTES = 4

#: The CUDA context and the kernels loaded into it, per process. BigScience measured 1271 MiB on a V100 ("cuda
#: kernels (1271MiB)", tr8-104B chronicles); the OOM messages in measured_memory.json leave 0.9-1.3 GiB of the
#: card outside PyTorch's reservation. CUDA 11.7+'s lazy loading makes it smaller on newer stacks.
CUDA_CONTEXT_BYTES = 1.1 * GiB
#: NCCL's buffers for one communicator (a TP, CP, PP or DP group with more than one rank): NCCL_BUFFSIZE (4 MiB)
#: per channel and peer for each protocol; about a quarter of a GiB with the channels of an NVLink node.
NCCL_BYTES = 0.25 * GiB
#: What PyTorch's caching allocator reserves beyond what is allocated, as a share of the allocated peak (blocks
#: split and cached for reuse, rounded up to its 2 MiB and 20 MiB sizes). The one constant fitted to measurements: the
#: median over the published runs whose figure includes it (peak reserved, nvidia-smi) of the share that figure
#: holds beyond the planner's allocated peak and process memory (``memory_record.fitted_slack``; the test suite
#: recomputes it, and ``memory_record.held_out`` prices each source with the median of the *other* sources' runs).
#: An OOM message shows much less (1.02-1.07 x allocated in measured_memory.json's): the allocator frees its cache
#: and retries before it gives up.
ALLOCATOR_SLACK = 0.19
#: The slack the allocator keeps when the card is full: it frees its cache and retries before it reports out of memory,
#: so what must fit is the allocated peak and this much (the median of reserved / allocated in the OOM messages of
#: measured_memory.json: 1.047, 1.022, 1.069, three sources), not ``ALLOCATOR_SLACK``.
FULL_CARD_SLACK = 0.05
#: DeepSpeed's default allgather_bucket_size (elements; its reduce bucket is ``cost.Setup.deepspeed_bucket``), and
#: its stage3_max_live_parameters: ZeRO-3 keeps up to that many gathered parameters live from forward to backward.
DEEPSPEED_BUCKET = 5e8
DEEPSPEED_MAX_LIVE = 1e9
#: The figures a tool shows: what each adds to the allocated peak.
FIGURES = ("max_memory_allocated", "max_memory_reserved", "nvidia-smi")


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model state, and the ZeRO stage from which each is sharded (4: never)."""

    params: float
    grads: float
    optimizer: float
    params_from: int = 3
    grads_from: int = 2
    optimizer_from: int = 1

    def per_gpu(self, psi: float, stage: int, shards: int) -> dict[str, float]:
        """Bytes per GPU of ``psi`` parameters at ZeRO ``stage`` over ``shards`` ranks."""
        def part(nbytes: float, start: int) -> float:
            return nbytes * psi / (shards if stage >= start else 1)
        return {"params": part(self.params, self.params_from), "grads": part(self.grads, self.grads_from),
                "optimizer": part(self.optimizer, self.optimizer_from)}


def states_per_param(framework: str, precision: str, stage: int) -> StateBytes:
    """How ``framework`` keeps model states for Adam, in bytes per parameter (see the module docstring).

    ``precision`` is the Setup's ("bf16", "fp16", "fp32"). In fp32 every framework keeps 4 + 4 + 8 (DeepSpeed's ZeRO
    optimizers add an fp32 master partition from stage 1 on, even in fp32)."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework={framework!r}: use one of {', '.join(FRAMEWORKS)}")
    deepspeed = framework in ("deepspeed", "megatron-deepspeed")
    if precision == "fp32":
        return StateBytes(4, 4, 12 if deepspeed and stage >= 1 else 8)
    if framework == "pytorch":             # fp32 parameters and gradients; the 16-bit copies are buffers. ZeRO-2 is
        return StateBytes(4, 4, 8, params_from=2)  # FSDP's SHARD_GRAD_OP: the fp32 parameters sharded too
    if framework == "megatron":            # 16-bit parameters, fp32 gradient buffer (whole, dist-opt or not)
        return StateBytes(2, 4, 12, params_from=4, grads_from=4)
    if stage == 2:                         # DeepSpeed's estimators: a 16-bit and an fp32 gradient partition, 2 + 18/N
        return StateBytes(2, 6, 12)
    if stage == 3:                         # ... and at stage 3 the fp32 one alone: 18/N
        return StateBytes(2, 4, 12)
    if precision == "bf16" and stage == 1:  # DeepSpeed's BF16_Optimizer: fp32 gradients for every parameter
        return StateBytes(2, 4, 12, grads_from=4)
    return StateBytes(2, 2, 12)            # fp16 (and bf16 without ZeRO): 16-bit gradients


def logits_peak_bytes(framework: str, batch: int, seq_len: int, vocab: int | None, tp: int = 1,
                      fused: bool = False) -> float:
    """Bytes the loss holds at its peak (``LOSS_BYTES`` per logit, ``FUSED_LOSS_BYTES`` for a fused cross-entropy),
    its vocabulary split over ``tp``."""
    per_logit = min(FUSED_LOSS_BYTES, LOSS_BYTES[framework]) if fused else LOSS_BYTES[framework]
    return per_logit * batch * seq_len * (vocab or 0) / tp


def process_bytes(communicators: int) -> float:
    """What a process holds outside PyTorch's allocator: the CUDA context and NCCL's buffers."""
    return CUDA_CONTEXT_BYTES + communicators * NCCL_BYTES


def figure(mem: dict[str, float], kind: str, slack: float | None = None, card: float | None = None) -> float:
    """The number a tool would show for ``mem`` (``cost.memory``'s dict): ``FIGURES``' ``kind``, with the allocator's
    ``slack`` (default ``ALLOCATOR_SLACK``). On a ``card`` of that many bytes the allocator caches no more than the
    card holds: a reserved or nvidia-smi figure stops there."""
    slack = ALLOCATOR_SLACK if slack is None else slack
    if kind not in FIGURES:
        raise ValueError(f"kind={kind!r}: use one of {', '.join(FIGURES)}")
    if kind == "max_memory_allocated":
        return mem["allocated"]
    outside = mem["process"] if kind == "nvidia-smi" else 0.0
    value = mem["allocated"] * (1 + slack) + outside
    if card is not None:
        value = max(min(value, card - (0.0 if kind == "nvidia-smi" else mem["process"])),
                    mem["allocated"] * (1 + FULL_CARD_SLACK) + outside)
    return value


def stage_peak(*, shape: ModelShape, layout, setup, psi: float, psi_layers: float, layers: int, in_flight: float,
               first: bool, last: bool, interleaved: float) -> dict[str, float]:
    """The peak of one pipeline stage (see the module docstring). ``psi``: this GPU's parameters (its stage's
    layers over TP, with the embedding or output layer where the stage holds it); ``psi_layers``: those of its
    layers alone; ``layers``: its layers; ``in_flight``: micro-batches whose activations it holds at its peak."""
    fw, precision = setup.framework, setup.precision
    vb = setup.value_bytes
    mixed = precision != "fp32"
    shards = layout.state_shards
    states = states_per_param(fw, precision, layout.zero).per_gpu(psi, layout.zero, shards)
    if layout.offload_optimizer:
        cpu = states["optimizer"] + (states["grads"] if layout.zero >= 2 else 0.0)
        states["optimizer"] = 0.0
        if layout.zero >= 2:
            states["grads"] = 0.0
        if layout.offload_params:
            cpu += states["params"]
            states["params"] = 0.0
    else:
        cpu = 0.0
    if layout.defer_grad_sync:               # whole gradients held until the step's one reduction
        states["grads"] = max(states["grads"], setup.grad_reduce_bytes * psi)

    b, seq = setup.micro_batch, setup.seq_len // layout.cp

    def layer(mode: str) -> dict[str, float]:
        return formulas.layer_activation_bytes(shape, b, seq, mode, setup.flash_attention, vb)

    kept = layer(setup.recompute)
    per_layer = kept["total"]
    if setup.eager_norms and mixed and setup.recompute in ("none", "selective"):
        per_layer += 2 * 4 * b * seq * shape.n_embd   # eager RMSNorm: an fp32 copy of each of its 2 norms' inputs
    replicated = 0.0
    if not setup.sequence_parallel and layout.tp > 1:   # what TP leaves whole without sequence parallelism
        tokens_h = b * seq * shape.n_embd
        replicated = kept["norms"] if setup.recompute in ("full", "op") else \
            kept["norms"] + 2 * vb * tokens_h + (2 * tokens_h if shape.dropout else 0.0)
    peak_extra = {"none": 0.0, "selective": layer("none")["scores"],
                  "op": layer("none")["total"] - layer("op")["total"], "full": layer("none")["total"]}[setup.recompute]
    n_held = layers * in_flight * interleaved
    activations = replicated * n_held + (per_layer * n_held - replicated * n_held + peak_extra) / layout.tp
    loss = logits_peak_bytes(fw, b, seq, shape.vocab, layout.tp, setup.fused_loss) if last else 0.0

    # buffers at the backward peak, and the optimizer step's
    buffers = 0.0
    persistent = 0.0
    unit = max(shape.layer_params, (shape.vocab or 0) * shape.n_embd) / layout.tp
    if layout.zero == 3:
        if layout.pp > 1 and fw == "pytorch":
            # FSDP under a pipeline keeps its stage's layers unsharded and defers the reduction (torchtitan)
            buffers += vb * psi + setup.grad_reduce_bytes * psi
        elif fw == "pytorch":
            # the unit computing and the one prefetched, in the compute format; the unit's gradient, in the compute
            # format and as the reduce-scatter's input (grad_reduce)
            buffers += 2 * vb * unit + (vb + setup.grad_reduce_bytes) * unit
        else:      # DeepSpeed keeps what it gathered live up to stage3_max_live_parameters; its reduce bucket
            buffers += vb * max(min(DEEPSPEED_MAX_LIVE, psi), 2 * unit)
            persistent += vb * setup.deepspeed_bucket    # allocated when the engine starts
    elif fw == "pytorch" and layout.zero == 2:
        # FSDP's SHARD_GRAD_OP: the 16-bit parameters stay gathered from forward to backward; a unit's gradient is
        # reduced as it is made
        buffers += vb * psi + (vb + setup.grad_reduce_bytes) * unit
    elif fw == "pytorch":
        if mixed:                        # autocast's 16-bit weight copies, saved for backward
            buffers += vb * psi_layers
        if layout.dp * layout.cp > 1:    # DDP's buckets (ZeroRedundancyOptimizer runs under DDP): a gradient copy
            persistent += states_per_param(fw, precision, 0).grads * psi
    elif fw in ("deepspeed", "megatron-deepspeed") and layout.dp * layout.cp > 1:
        buffers += vb * setup.deepspeed_bucket        # the reduce bucket, allocated whole (contiguous_gradients)
    step = 0.0
    opt_params = psi / (shards if layout.zero >= 1 else 1)
    if not layout.offload_optimizer:
        if fw == "pytorch":
            step += 4 * opt_params                                           # Adam's foreach temporary (sqrt(v))
        elif fw in ("deepspeed", "megatron-deepspeed"):
            if mixed and states_per_param(fw, precision, layout.zero).grads == 2:
                step += 4 * opt_params                                       # fp32 gradients of the partition
            if layout.zero in (1, 2) and layout.dp * layout.cp > 1:
                step += vb * min(DEEPSPEED_BUCKET, psi)                      # the all-gather bucket

    model_states = states["params"] + states["grads"] + states["optimizer"]
    backward = activations + loss + buffers + persistent
    at_step = step + persistent
    if backward >= at_step:
        mem = {**states, "activations": activations, "loss": loss, "buffers": buffers + persistent,
               "peak_at": "backward"}
    else:
        mem = {**states, "activations": 0.0, "loss": 0.0, "buffers": at_step, "peak_at": "optimizer step"}
    mem["allocated"] = model_states + max(backward, at_step)
    communicators = sum(1 for d in (layout.dp * layout.cp, layout.tp, layout.pp, layout.cp) if d > 1)
    mem["process"] = process_bytes(communicators)
    mem["runtime"] = mem["process"] + FULL_CARD_SLACK * mem["allocated"]
    mem["total"] = mem["allocated"] + mem["runtime"]
    mem["cpu"] = cpu
    return mem
