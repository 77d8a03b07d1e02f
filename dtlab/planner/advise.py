"""Which strategy should I use? Every strategy priced for a model on a cluster, and the fastest that fits.

``advise(7e9, cluster="g5.12xlarge x4")`` (or ``dtlab advise --params 7e9 --cluster "g5.12xlarge x4"``)
prices, for one model, one training set-up and one cluster (``STRATEGIES``):

* data parallelism over every GPU: DDP, ZeRO-1, ZeRO-2, ZeRO-3 (FSDP's memory and traffic: PyTorch's
  ``fully_shard`` is ZeRO-3 in this model), ZeRO-3 with gradient sync deferred to the step's last
  micro-batch, and ZeRO with the optimizer (and parameters) offloaded to host memory;
* on more than one node, HSDP (``hsdp_layouts``): ZeRO-3 inside each node and replicated across nodes, so
  that only the gradients' all-reduce crosses the slower network; as ``fully_shard`` does it by default
  (every micro-batch), with the all-reduce deferred to the step's last micro-batch
  (``set_requires_all_reduce``), and with all gradient sync deferred. On one node HSDP is ZeRO-3 and is not
  listed again; a shard group of several nodes is priced when asked (``layout=Layout(dp=..., zero=3,
  shard=8)``);
* tensor x pipeline x data layouts: every TP degree that divides the heads and the GPU count, every
  pipeline depth that divides what is left (stages need not hold equal numbers of layers: the busiest
  one sets the pace), ZeRO-1 over the data dimension (Megatron-LM's distributed optimizer),
  TP x ZeRO-3 (torchtitan's FSDP + TP), and on more than one node TP x HSDP sharded inside the node
  (torchtitan's 3-D ``dp_replicate x dp_shard x tp``).

Each row holds memory per GPU by part and whether it fits (``cost.memory``), the step time by part
(``cost.cost``: compute with recomputation, exposed and hidden communication, the bubble, offload
traffic), tokens per second, and MFU. A layout that cannot run this batch or shape is kept with the
reason in ``row["skipped"]``, never raised. The recommendation is the fastest row that fits; with a
cluster described without its speeds the rows are ranked by memory only, and the advice says so.

The model behind it is checked against published training runs (``dtlab.planner.published``), the
ZeRO paper, DeepSpeed's estimators and runs measured on this machine (notebook 20).
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field
from typing import Any

from dtlab.planner import cost as costs
from dtlab.planner import formulas, hardware, kernels
from dtlab.planner.cost import PRECISIONS, Layout, LayoutError, Setup
from dtlab.planner.formulas import ModelShape

OPTIMIZERS = ("adam", "sgd")
#: Data-parallel strategies over every GPU, least communication first: (ZeRO stage, deferred sync, offloads).
STRATEGIES = [Layout(zero=0), Layout(zero=1), Layout(zero=2), Layout(zero=3), Layout(zero=3, defer_grad_sync=True),
              Layout(zero=2, offload_optimizer=True), Layout(zero=3, offload_optimizer=True),
              Layout(zero=3, offload_optimizer=True, offload_params=True)]
#: How many TP x PP x DP rows the table shows (the fastest; ``Advice.rows`` holds every one).
SHOWN_LAYOUTS = 6
#: How many HSDP rows the table shows (the fastest that fit first).
SHOWN_HSDP = 3
#: The table's word for ``cost.fit_state`` (?: offloaded to a host whose memory was not given).
_FITS = {"fits": "yes  ", "tight": "tight", "does not fit": "no   ", None: "?    "}


@dataclass
class Advice:
    """What ``advise`` computed: the inputs it resolved, one row per strategy, and the recommendation."""

    model: dict[str, Any]
    setup: dict[str, Any]
    cluster: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)
    recommendation: dict[str, Any] | None = None
    timed: bool = True

    def as_dict(self) -> dict[str, Any]:
        """Everything as plain data (bytes, seconds): what ``dtlab advise --json`` prints."""
        return {"model": self.model, "setup": self.setup, "cluster": self.cluster, "strategies": self.rows,
                "recommendation": self.recommendation, "step_time_computed": self.timed,
                "assumptions": {"pcie_gbs": costs.PCIE_GBS, "cpu_adam_params_per_s": costs.CPU_ADAM_PARAMS_PER_S,
                                "headroom": self.setup["headroom"], "efficiency": self.setup["efficiency"]}}

    def row(self, strategy: str) -> dict[str, Any]:
        """The row of ``strategy`` (e.g. ``"ZeRO-2"`` or ``"TP4 x DP4 (ZeRO-1)"``)."""
        for r in self.rows:
            if r["strategy"] == strategy:
                return r
        raise KeyError(f"no strategy {strategy!r}; computed: {', '.join(r['strategy'] for r in self.rows)}")

    @property
    def priced(self) -> list[dict[str, Any]]:
        """Rows that can run (not skipped)."""
        return [r for r in self.rows if not r["skipped"]]

    def table(self) -> str:
        """A table for people: GB per GPU (10**9 bytes) by part, fits, step seconds, tokens/s, MFU; then the advice."""
        c, m, s = self.cluster, self.model, self.setup
        lines = [f"{m['params'] / 1e9:g}B parameters ({m['shape']}), {s['precision']} {s['optimizer']}, micro-batch "
                 f"{s['micro_batch']} x {s['seq_len']:,} tokens, global batch {s['global_batch']}, recompute "
                 f"{s['recompute']}; {c['name']}: {c['gpus']} GPUs of {c['gpu_memory_bytes'] / 1e9:.1f} GB "
                 f"({c['usable_bytes'] / 1e9:.1f} GB usable: {s['headroom']:.0%} kept free; 'tight' is inside that "
                 "headroom: it may run)",
                 "GB = 10^9 bytes per GPU; step in seconds" + (
                     f"; compute {_compute_text(s)}; gradients reduced in {s.get('grad_reduce', 'fp32')}"
                     if self.timed else " (not computed: see below)")
                 + f"; memory as {s.get('framework', 'pytorch')} keeps it at the step's peak, with the CUDA context "
                   "and NCCL ('runtime')",
                 f"{'strategy':<48}{'params':>7}{'grads':>7}{'optim':>7}{'activ':>7}{'loss':>7}{'buffer':>7}"
                 f"{'runtm':>7}{'total':>7}{'host':>7}  fits {'step':>8}{'tokens/s':>10}{'MFU':>6}  evidence"]
        data = [r for r in self.priced if r["layout"]["tp"] == r["layout"]["pp"] == r["layout"]["cp"] == 1]
        hsdp = [r for r in data if r["layout"]["hsdp"]]
        data = [r for r in data if r not in hsdp]
        composed = [r for r in self.priced if r not in data and r not in hsdp]
        key = (lambda r: -(r["tokens_per_second"] or 0)) if self.timed else (lambda r: r["memory_bytes"]["total"])

        def best(rows, n):
            return sorted(rows, key=lambda r: (r["fits"] is not True, key(r)))[:n]
        shown = data + best(hsdp, SHOWN_HSDP) + best(composed, SHOWN_LAYOUTS)
        families: dict[str, str] = {}          # family -> its letter in the evidence column
        for r in shown + ([self.row(self.recommendation["strategy"])] if self.recommendation else []):
            if r.get("evidence"):
                families.setdefault(r["evidence"]["family"], "ABCDEFGHIJ"[len(families) % 10])
        for r in shown:
            mem = r["memory_bytes"]
            step = (f"{r['step_seconds']['total']:8.2f}{r['tokens_per_second']:10,.0f}{r['mfu']:6.0%}"
                    if r["step_seconds"] else "")
            lines.append(f"{r['strategy'][:47]:<48}" + "".join(f"{mem[k] / 1e9:7.1f}" for k in
                                                             ("params", "grads", "optimizer", "activations",
                                                              "loss", "buffers", "runtime", "total"))
                         + f"{r['cpu_bytes'] / 1e9:7.1f}  {_FITS[r['fit']]}{step:<32}"
                         + (f"  {families[r['evidence']['family']]}" if r.get("evidence") else ""))
        hidden = len(composed) + len(hsdp) - (len(shown) - len(data))
        skipped = [r for r in self.rows if r["skipped"]]
        if hidden or skipped:
            lines.append(f"({hidden} more layouts priced, {len(skipped)} that cannot run skipped: Advice.rows has "
                         "each with its reason)")
        if families:
            lines.append("Evidence: the nearest published measured run of each strategy family (dtlab.planner."
                         "published)")
            evidence = {r["evidence"]["family"]: r["evidence"] for r in self.priced if r.get("evidence")}
            for family, letter in families.items():
                lines.append(textwrap.fill(f"{letter} {family}: {evidence[family]['text']}", 110,
                                           subsequent_indent="    "))
                if evidence[family].get("memory"):
                    lines.append(textwrap.fill(f"  {evidence[family]['memory']['text']}", 110,
                                               subsequent_indent="    "))
        rec = self.recommendation
        lines.append(textwrap.fill(f"Recommendation: {rec['strategy']} - {rec['reason']}" if rec else
                                   "Recommendation: none - " + nothing_fits(self), 110, subsequent_indent="  "))
        if self.timed:
            lines.append(f"Offload priced at {costs.PCIE_GBS:g} GB/s per GPU over PCIe and "
                         f"{costs.CPU_ADAM_PARAMS_PER_S:.0e} parameters/s of CPU Adam per GPU (assumptions).")
        return "\n".join(lines)


def resolve_model(params: float | None = None, n_layer: int | None = None, n_embd: int | None = None,
                  n_head: int | None = None, vocab: int | None = None, n_kv_head: int | None = None,
                  shape: ModelShape | None = None) -> tuple[float, ModelShape]:
    """Parameters and shape from what was given: a parameter count, a shape, or both.

    With only ``params`` the shape follows the published families (``formulas.model_shape``); with only a
    shape, the parameters are the shape's (``ModelShape.params``).

    Raises:
        ValueError: for a non-positive size, half a shape, or heads that do not divide the hidden size.
    """
    if params is not None and not (params > 0 and math.isfinite(params)):
        raise ValueError(f"params={params}: need a positive number of parameters. Fix: e.g. params=7e9")
    if shape is not None:
        formulas.check_shape(shape.n_layer, shape.n_embd, shape.n_head, shape.n_kv_head)
        return float(params if params is not None else shape.params), shape
    given = (n_layer, n_embd, n_head)
    if any(v is not None for v in given) and not all(v is not None for v in given):
        raise ValueError("give the whole shape: n_layer, n_embd and n_head (or none of them, and params). Fix: e.g. "
                         "n_layer=32, n_embd=4096, n_head=32")
    if vocab is not None and vocab < 1:
        raise ValueError(f"vocab={vocab}: must be >= 1. Fix: e.g. 32000")
    if all(v is not None for v in given):
        formulas.check_shape(n_layer, n_embd, n_head, n_kv_head)
        shape = ModelShape(f"{n_layer} layers x {n_embd}", n_layer, n_embd, n_head, "given", n_kv_head=n_kv_head,
                           vocab=vocab)
        return float(params if params is not None else shape.params), shape
    if params is None:
        raise ValueError("no model: give params (e.g. 7e9) or its shape (layers, hidden size, heads)")
    return float(params), formulas.model_shape(params)


def resolve_cluster(cluster: str | hardware.Cluster | None = None, gpus: int | None = None,
                    gpu_mem_gb: float | None = None, gpu: str | None = None, **hand: Any) -> hardware.Cluster:
    """A named cluster (``dtlab.planner.hardware.cluster``); ``gpus`` of a known ``gpu`` type; or one described by
    hand (``hardware.custom_cluster``: ``gpus``, ``gpu_mem_gb`` and optionally its speeds)."""
    if cluster is not None:
        return hardware.cluster(cluster)
    if gpu is not None:
        kind = hardware.gpu(gpu)
        n = gpus or 1
        per_node = hand.get("gpus_per_node") or next(d for d in (8, 4, 2, 1) if n % d == 0)
        return hardware.custom_cluster(n, gpu_mem_gb or kind.memory_bytes / formulas.GB, per_node,
                                       hand.get("tflops") or 0.0, kind.bf16,
                                       hand.get("intra_node_gbs") or 0.0, hand.get("inter_node_gbs") or 0.0,
                                       hand.get("host_memory_gb_per_gpu") or 0.0, gpu=kind)
    if gpus is None or gpu_mem_gb is None:
        if gpus is not None or gpu_mem_gb is not None:
            raise ValueError("a cluster described by hand needs both gpus and gpu_mem_gb. Fix: e.g. gpus=64, "
                             "gpu_mem_gb=80, or cluster='p4d.24xlarge x8'")
        return hardware.cluster(hardware.DEFAULT_CLUSTER)
    return hardware.custom_cluster(gpus, gpu_mem_gb, **{k: v for k, v in hand.items() if v is not None})


def hsdp_layouts(gpus: int, gpus_per_node: int) -> list[Layout]:
    """HSDP over ``gpus`` with one node's GPUs in each shard group (FSDP's HYBRID_SHARD; the gathers never leave
    the node): as ``fully_shard`` does it by default, with the all-reduce across replicas deferred to the step's
    last micro-batch, and with all gradient sync deferred. None on one node (HSDP there is ZeRO-3).

    Shard groups of several nodes (less memory, gathers across the network again) are left to ``layout=``: where
    they tie with ZeRO-3 (every transfer hidden, as for GPT-175B on 768 A100s) the published-runs check
    (tests/test_published_runs.py) needs each run's ``why_not_best`` to name HSDP as it names ZeRO-3."""
    shard = gpus_per_node
    if shard >= gpus or gpus % shard:
        return []
    return [Layout(dp=gpus, zero=3, shard=shard), Layout(dp=gpus, zero=3, shard=shard, defer_all_reduce=True),
            Layout(dp=gpus, zero=3, shard=shard, defer_grad_sync=True)]


#: Sequences of at least this many tokens also get context-parallel layouts (``candidate_layouts``).
LONG_SEQUENCE = 16384
#: The fewest tokens a context-parallel rank keeps (shorter chunks leave too little attention to hide K/V behind).
MIN_CP_CHUNK = 2048


def candidate_layouts(shape: ModelShape, gpus: int, gpus_per_node: int, seq_len: int = 0) -> list[Layout]:
    """TP x PP x DP layouts worth pricing: TP dividing the heads and the GPUs, in groups that fill nodes evenly; PP
    dividing what is left (at most one layer per stage), DP the rest; ZeRO-1 over DP, and ZeRO-3 over DP where there
    is no pipeline; and where TP leaves room in a node and DP spans nodes, HSDP sharded over the node's TP groups
    (the all-reduce across replicas once per step). For sequences of ``LONG_SEQUENCE`` tokens or more, TP x CP x DP
    too: CP dividing the sequence into chunks of at least ``MIN_CP_CHUNK`` tokens, with ZeRO-1 and ZeRO-3 over
    DP x CP (torchtitan's FSDP x CP, Megatron-LM's ``--context-parallel-size``)."""
    out = []
    for tp in range(1, gpus + 1):
        if gpus % tp or shape.n_head % tp or (gpus_per_node % tp if tp <= gpus_per_node else tp % gpus_per_node):
            continue
        for pp in range(1, min(shape.n_layer, gpus // tp) + 1):
            if (gpus // tp) % pp or (tp, pp) == (1, 1):
                continue
            dp = gpus // (tp * pp)
            out.append(Layout(dp=dp, tp=tp, pp=pp, zero=1))
            if pp == 1 and dp > 1:
                out.append(Layout(dp=dp, tp=tp, zero=3))
                shard = gpus_per_node // tp
                if 1 < shard < dp and dp % shard == 0:
                    out.append(Layout(dp=dp, tp=tp, zero=3, shard=shard, defer_all_reduce=True))
        if seq_len >= LONG_SEQUENCE:
            for cp in range(2, gpus // tp + 1):
                if (gpus // tp) % cp or seq_len % cp or seq_len // cp < MIN_CP_CHUNK:
                    continue
                dp = gpus // (tp * cp)
                out += [Layout(dp=dp, tp=tp, cp=cp, zero=1), Layout(dp=dp, tp=tp, cp=cp, zero=3)]
    return out


def _compute_text(s: dict[str, Any]) -> str:
    if s["efficiency"] is not None:
        return f"at {s['efficiency']:.0%} of peak ({s['efficiency_source']})"
    return f"from the kernels' measured rates (dtlab.planner.kernels) x overhead {s['overhead']:.2f}"


def _optimizer_bytes(adam_bytes: float, precision: str, stage: int, optimizer: str,
                     framework: str = "pytorch") -> float:
    """Optimizer-state bytes for ``optimizer``, from Adam's (``memory.states_per_param`` counts Adam)."""
    if optimizer == "adam":
        return adam_bytes
    # SGD with momentum keeps one moment instead of two. PyTorch (its fp32 parameters are the master weights) and fp32
    # DDP: 4 of Adam's 8; with a separate fp32 master (Megatron-LM, DeepSpeed): 4 + 4 of Adam's 12.
    master = framework != "pytorch" and not (precision == "fp32" and stage == 0)
    return adam_bytes * (2 / 3 if master else 0.5)


def _row(num_params: float, shape: ModelShape, layout: Layout, c: hardware.Cluster, setup: Setup, optimizer: str,
         headroom: float) -> dict[str, Any]:
    row = {"strategy": layout.name, "layout": {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "cp": layout.cp,
                                               "zero": layout.zero, "virtual": layout.virtual,
                                               "defer_grad_sync": layout.defer_grad_sync,
                                               "shard": layout.shard,
                                               "hsdp": layout.hsdp, "defer_all_reduce": layout.defer_all_reduce},
           "offload": {"optimizer": layout.offload_optimizer, "params": layout.offload_params},
           "memory_bytes": None, "cpu_bytes": 0.0, "fits": False, "fit": None, "step_seconds": None,
           "tokens_per_second": None,
           "mfu": None, "hfu": None, "micro_batches": None, "bytes_sent": None, "skipped": None, "note": ""}
    try:
        result = costs.cost(num_params, layout, c, setup, shape, headroom)
    except LayoutError as err:
        row["skipped"] = str(err)
        return row
    mem = dict(result["memory"])
    cpu = mem.pop("cpu")
    if optimizer != "adam":       # SGD keeps less; offloaded optimizer state shrinks the same way
        adam = mem["optimizer"]
        mem["optimizer"] = _optimizer_bytes(adam, setup.precision, layout.zero, optimizer, setup.framework)
        for key in ("allocated", "total"):       # the states are part of either peak
            mem[key] += mem["optimizer"] - adam
        if layout.offload_optimizer:
            adam_cpu = formulas.model_states(num_params / (layout.tp * layout.pp), layout.shard_degree,
                                             layout.zero).optimizer
            cpu += _optimizer_bytes(adam_cpu, setup.precision, layout.zero, optimizer, setup.framework) - adam_cpu
    fit = costs.fit_state(mem["total"], c.gpu.memory_bytes, headroom, cpu, c.node.cpu_memory_bytes_per_gpu)
    fits = None if fit is None else fit == "fits"
    splits = costs.stage_layers(shape.n_layer, layout.pp, setup.pipeline_split) if layout.pp > 1 else []
    note = (f"pipeline stages of {' to '.join(str(n) for n in sorted(set(splits), reverse=True))} layers"
            if len(set(splits)) > 1 else "")
    row.update(memory_bytes=mem, cpu_bytes=cpu, fits=fits, fit=fit, micro_batches=result["micro_batches"], note=note,
               step_seconds=result["seconds"], tokens_per_second=result["tokens_per_second"], mfu=result["mfu"],
               hfu=result["hfu"], bytes_sent=result["bytes_sent"])
    return row


def advise(params: float | None = None, *, n_layer: int | None = None, n_embd: int | None = None,
           n_head: int | None = None, n_kv_head: int | None = None, vocab: int | None = None,
           shape: ModelShape | None = None, cluster: str | hardware.Cluster | None = None, gpus: int | None = None,
           gpu: str | None = None, gpu_mem_gb: float | None = None, gpus_per_node: int | None = None,
           tflops: float | None = None, intra_node_gbs: float | None = None, inter_node_gbs: float | None = None,
           host_memory_gb_per_gpu: float | None = None, micro_batch: int = 1, seq_len: int = 2048,
           global_batch: int | None = None, precision: str = "bf16", optimizer: str = "adam",
           recompute: str = "selective", efficiency: float | None = None, headroom: float = formulas.HEADROOM,
           flash_attention: bool = True, layout: Layout | dict | None = None, layouts: bool = True,
           grad_reduce: str = "fp32", sequence_parallel: bool = True, schedule: str = "1f1b",
           bucket_bytes: float | None = costs.BUCKET_BYTES, pipeline_split: str = "even",
           framework: str = "pytorch", eager_norms: bool = False, overhead: float | None = None) -> Advice:
    """Price every strategy for a model on a cluster and recommend one; see the module's help.

    Args:
        params: parameters (or give ``n_layer``, ``n_embd``, ``n_head`` and optionally ``n_kv_head``, ``vocab``;
            or a ``formulas.ModelShape`` as ``shape``).
        cluster: a name from ``dtlab.planner.hardware`` ("g5.12xlarge", "g5.12xlarge x4", "p4d.24xlarge x8"...);
            or ``gpus`` of a known ``gpu`` type ("A100"); or describe one: ``gpus``, ``gpu_mem_gb``, and for
            step times ``tflops`` (peak dense 16-bit), ``intra_node_gbs`` (GPU to GPU inside a node) and
            ``inter_node_gbs`` (a node's network, all its NICs together) in GB/s (``gpus_per_node`` defaults
            to 8, ``host_memory_gb_per_gpu`` to unknown).
        micro_batch, seq_len, global_batch: sequences per GPU per micro-step, tokens per sequence,
            sequences per optimizer step (default: at least 512, a multiple of micro_batch x GPUs).
        precision: "bf16", "fp16" (mixed precision) or "fp32". optimizer: "adam" or "sgd" (momentum).
        recompute: activation recomputation, "none", "selective" or "full" (costs compute: ``formulas``).
        efficiency: one fraction of the GPU's peak FLOP/s for every kernel; by default (None) each kernel is
            priced at its measured rate (``dtlab.planner.kernels``: matrix products by shape, attention by sequence,
            memory-bound kernels by bandwidth) times ``overhead`` (default ``cost.KERNEL_OVERHEAD``, fitted to
            published runs). MFU is the result, not this.
        headroom: the share of GPU and host memory left free (``formulas.HEADROOM``).
        flash_attention: a fused attention kernel that keeps no sequence x sequence scores (PyTorch's SDPA on a
            GPU, FlashAttention); False prices eager attention's memory (``formulas.layer_activation_bytes``).
        layout: one layout to price (a ``cost.Layout`` or ``{"dp": 4, "tp": 4}``) instead of every one;
            ``layouts=False`` prices data parallelism only.
        grad_reduce: the format the data-parallel gradient collectives send: "fp32" (the default: DDP under
            autocast, Megatron-LM, torchtitan) or "bf16" / "fp16" (DeepSpeed's default; ``cost.Setup``).
        sequence_parallel, schedule, bucket_bytes, pipeline_split: tensor parallelism with sequence parallelism
            (True), the pipeline schedule ("1f1b" or "gpipe"), the gradient bucket (25 MB, DDP's; None for
            Megatron-LM's rule) and how layers are shared out among pipeline stages ("even" or "lighter_ends");
            ``cost.Setup`` says what each changes.
        framework, eager_norms: whose code trains ("pytorch", "megatron", "deepspeed", "megatron-deepspeed"; how model
            states, the loss and buffers are kept: ``dtlab.planner.memory``) and whether its RMSNorm is eager PyTorch
            that upcasts to fp32 (Hugging Face's Llama).

    Raises:
        ValueError: for sizes that are not positive, a hidden size not divisible by the heads, an unknown
            precision/optimizer/recompute mode, a micro-batch larger than the global batch, a given layout
            whose degrees do not multiply to the GPU count, or bf16 on a GPU without it.
            ``dtlab.planner.hardware.UnknownHardware`` for a cluster it does not know.
    """
    num_params, shape = resolve_model(params, n_layer, n_embd, n_head, vocab, n_kv_head, shape)
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: use one of {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
    if recompute not in formulas.RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}: use one of {', '.join(formulas.RECOMPUTE)}")
    if micro_batch < 1 or seq_len < 1 or not (efficiency is None or 0 < efficiency <= 1):
        raise ValueError(f"micro_batch={micro_batch}, seq_len={seq_len}, efficiency={efficiency}: need micro_batch "
                         ">= 1, seq_len >= 1 and 0 < efficiency <= 1. Fix: e.g. micro_batch=1, seq_len=2048, "
                         f"efficiency={costs.DEFAULT_EFFICIENCY}")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom={headroom}: the share of memory left free must be in [0, 1). Fix: e.g. 0.15")
    c = resolve_cluster(cluster, gpus, gpu_mem_gb, gpu, gpus_per_node=gpus_per_node, tflops=tflops,
                        intra_node_gbs=intra_node_gbs, inter_node_gbs=inter_node_gbs,
                        host_memory_gb_per_gpu=host_memory_gb_per_gpu)
    if precision == "bf16" and not c.gpu.bf16:
        raise ValueError(f"the {c.gpu.name} has no bf16. Fix: precision='fp16' (with a loss scaler) or 'fp32'")
    g = c.gpus
    if global_batch is None:
        unit = micro_batch * g
        global_batch = unit * math.ceil(512 / unit)
    elif global_batch < 1:
        raise ValueError(f"global_batch={global_batch}: must be >= 1. Fix: e.g. 512")
    if micro_batch > global_batch:
        raise ValueError(f"micro_batch={micro_batch} is larger than global_batch={global_batch}. Fix: a micro-batch "
                         f"of at most {global_batch} sequences")
    eff = efficiency
    eff_source = "given" if efficiency is not None else (
        f"each kernel at its measured rate on the {c.gpu.name} ("
        f"{kernels.rates_for(c.gpu.name, c.gpu.bf16_tflops or c.gpu.fp16_tflops).source}) x the overhead fitted "
        "to published runs")
    setup = Setup(global_batch, micro_batch, seq_len, recompute, precision, eff, flash_attention, grad_reduce,
                  sequence_parallel, schedule, bucket_bytes, pipeline_split, framework, eager_norms, overhead)
    timed = costs.can_time(c, precision)

    if layout is not None:
        lay = layout if isinstance(layout, Layout) else Layout(**{"zero": 1, **dict(layout)})
        if lay.gpus != g:
            raise ValueError(f"layout {lay} uses {lay.gpus} GPUs, but the cluster has {g}. Fix: degrees whose product "
                             f"is {g} (e.g. dp={max(1, g // max(lay.tp * lay.pp * lay.cp, 1))}, tp={lay.tp}, "
                             f"pp={lay.pp} if that divides)")
        candidates = [lay]
    else:
        candidates = [Layout(dp=g, **{k: getattr(s, k) for k in ("zero", "defer_grad_sync", "offload_optimizer",
                                                                    "offload_params")}) for s in STRATEGIES]
        if g == 1:
            candidates = [Layout(zero=0), Layout(zero=2, offload_optimizer=True),
                          Layout(zero=3, offload_optimizer=True, offload_params=True)]
        if c.nodes > 1:
            candidates += hsdp_layouts(g, c.node.gpus)
        if layouts:
            candidates += candidate_layouts(shape, g, c.node.gpus, seq_len)
    rows = [_row(num_params, shape, lay, c, setup, optimizer, headroom) for lay in candidates]
    from dtlab.planner import memory_record, published  # they price their runs with advise: imported here
    priced = memory_record.checked()                      # the record's runs priced once, for every row's evidence
    for r in rows:
        lay = r["layout"]
        family = published.family_of(lay["tp"], lay["pp"], lay["cp"], lay["zero"], r["offload"]["optimizer"])
        r["evidence"] = published.evidence(family, num_params, g, c.gpu.name)
        r["evidence"]["memory"] = memory_record.nearest(num_params, g, family, priced)
    usable = c.gpu.memory_bytes * (1 - headroom)
    advice = Advice(model={"params": num_params, "shape": shape.describe(), "n_layer": shape.n_layer,
                           "n_embd": shape.n_embd, "n_head": shape.n_head, "n_kv_head": shape.n_kv_head,
                           "vocab": shape.vocab},
                    setup={"micro_batch": micro_batch, "seq_len": seq_len, "global_batch": global_batch,
                           "precision": precision, "optimizer": optimizer, "recompute": recompute,
                           "efficiency": eff, "efficiency_source": eff_source, "headroom": headroom,
                           "overhead": overhead if overhead is not None else costs.KERNEL_OVERHEAD,
                           "flash_attention": flash_attention, "grad_reduce": grad_reduce,
                           "sequence_parallel": sequence_parallel, "schedule": schedule, "bucket_bytes": bucket_bytes,
                           "pipeline_split": pipeline_split, "framework": framework, "eager_norms": eager_norms},
                    cluster={"name": c.name, "gpus": g, "nodes": c.nodes, "gpus_per_node": c.node.gpus,
                             "gpu": c.gpu.name, "gpu_memory_bytes": c.gpu.memory_bytes, "usable_bytes": usable,
                             "host_bytes_per_gpu": c.node.cpu_memory_bytes_per_gpu},
                    rows=rows, timed=timed)
    advice.recommendation = _recommend(advice, usable)
    return advice


def nodes_needed(params: float, node: str = "g5.12xlarge", max_nodes: int = 64, **options: Any) -> tuple[int, Advice]:
    """The fewest nodes of type ``node`` (1, 2, 4, 8, ... up to ``max_nodes``) on which some strategy fits,
    and the advice there. ``options`` go to ``advise``. Raises ``ValueError`` (with the largest tried) if none."""
    nodes = 1
    while nodes <= max_nodes:
        advice = advise(params, cluster=f"{node} x{nodes}", **options)
        if advice.recommendation:
            return nodes, advice
        nodes *= 2
    raise ValueError(f"{params / 1e9:g}B fits no strategy on up to {max_nodes} x {node}. Fix: a larger max_nodes, "
                     "GPUs with more memory, or recompute='full'")


def _recommend(advice: Advice, usable: float) -> dict[str, Any] | None:
    fitting = [r for r in advice.priced if r["fits"] is True]
    if not fitting:
        return None
    if advice.timed:
        best = max(fitting, key=lambda r: r["tokens_per_second"])
        runner = max((r for r in fitting if r is not best), key=lambda r: r["tokens_per_second"], default=None)
        why = (f"the fastest of the {len(fitting)} strategies that fit: {best['step_seconds']['total']:.2f} s per "
               f"step, {best['tokens_per_second']:,.0f} tokens/s (MFU {best['mfu']:.0%}), "
               f"{best['memory_bytes']['total'] / 1e9:.1f} of {usable / 1e9:.1f} usable GB per GPU")
        if runner is not None:
            why += (f"; next: {runner['strategy']}, {best['tokens_per_second'] / runner['tokens_per_second']:.2f}x "
                    "slower")
    else:
        best = fitting[0]   # data-parallel rows come in order of least communication first
        why = (f"the first that fits in order of least communication ({best['memory_bytes']['total'] / 1e9:.1f} of "
               f"{usable / 1e9:.1f} usable GB per GPU); step time not computed: give the GPU's tflops and the "
               "bandwidths, or a cluster name")
    return {"strategy": best["strategy"], "reason": why, "tokens_per_second": best["tokens_per_second"],
            "layout": best["layout"], "evidence": best.get("evidence")}


def nothing_fits(advice: Advice) -> str:
    """Why no row was recommended, and the fix."""
    priced = advice.priced
    if not priced:
        reasons = sorted({r["skipped"].split(". Fix")[0] for r in advice.rows})
        batch = advice.setup["global_batch"]
        return (f"no layout can run: {'; '.join(reasons[:3])}. Fix: a global batch that more layouts divide (e.g. "
                f"{_nearby_batch(batch, advice.cluster['gpus'] * advice.setup['micro_batch'])}), another micro-batch, "
                "or a GPU count with more divisors")
    smallest = min(priced, key=lambda r: r["memory_bytes"]["total"])
    return (f"nothing fits. The smallest, {smallest['strategy']}, needs {smallest['memory_bytes']['total'] / 1e9:.1f} "
            "GB per GPU. Fix: more GPUs or nodes, activation recomputation ('full'), a smaller micro-batch or "
            "sequence, or offload")


def _nearby_batch(batch: int, unit: int) -> int:
    return max(unit, unit * round(batch / unit))


def plot(advice: Advice, strategies: list[str] | None = None):
    """Two small charts: memory per GPU by part (stacked, with the usable line) and step time by part.

    ``strategies`` picks rows (default: every row that can run). Returns the matplotlib figure.
    """
    import matplotlib.pyplot as plt

    rows = [r for r in advice.priced if strategies is None or r["strategy"] in strategies]
    names = [r["strategy"] for r in rows]
    fig, axes = plt.subplots(1, 2 if advice.timed else 1, figsize=(10 if advice.timed else 5.5, 0.32 * len(rows) + 1.2),
                             sharey=True, squeeze=False)
    ax = axes[0][0]
    left = [0.0] * len(rows)
    for part, color in (("params", "tab:blue"), ("grads", "tab:orange"), ("optimizer", "tab:green"),
                        ("activations", "tab:purple"), ("loss", "tab:cyan"), ("buffers", "tab:pink"),
                        ("runtime", "tab:gray")):
        values = [r["memory_bytes"][part] / 1e9 for r in rows]
        ax.barh(names, values, left=left, color=color, label=part)
        left = [a + b for a, b in zip(left, values)]
    ax.axvline(advice.cluster["usable_bytes"] / 1e9, color="black", lw=1, ls="--", label="usable")
    ax.set_xlim(0, min(max(left), 4 * advice.cluster["usable_bytes"] / 1e9) * 1.05)
    ax.set_xlabel("GB per GPU")
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="lower right")
    if advice.timed:
        ax = axes[0][1]
        left = [0.0] * len(rows)
        for part, color in (("compute", "tab:gray"), ("comm_exposed", "tab:red"), ("bubble", "tab:olive"),
                            ("offload", "tab:brown")):
            values = [r["step_seconds"][part] for r in rows]
            ax.barh(names, values, left=left, color=color, label=part.replace("_", " "))
            left = [a + b for a, b in zip(left, values)]
        ax.set_xlabel("seconds per step")
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{advice.model['params'] / 1e9:g}B on {advice.cluster['name']}", fontsize=10)
    fig.tight_layout()
    return fig


def form(params_b: float = 7.0, cluster: str = "g5.12xlarge x4"):
    """An ipywidgets form (model size, cluster, micro-batch, sequence, precision, recompute) that redraws the
    table and the charts. Build it anywhere; display it only where someone can use it (Jupyter, not a headless
    run: ``dtlab.live.is_headless()``)."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    def redraw(params_b, cluster, micro_batch, seq_len, precision, recompute):
        try:
            advice = advise(params_b * 1e9, cluster=cluster, micro_batch=micro_batch, seq_len=seq_len,
                            precision=precision, recompute=recompute)
        except ValueError as err:
            print(err)
            return
        print(advice.table())
        plot(advice, [r["strategy"] for r in advice.priced][:14])
        plt.show()

    names = list(hardware.CLUSTERS) + [f"{n} x{k}" for n in ("g5.12xlarge", "g5.48xlarge", "p4d.24xlarge",
                                                              "p5.48xlarge") for k in (1, 2, 8)]
    return widgets.interactive(
        redraw,
        params_b=widgets.FloatLogSlider(value=params_b, base=10, min=-1, max=3, step=0.05, description="B params"),
        cluster=widgets.Dropdown(options=sorted(set(names)), value=cluster, description="cluster"),
        micro_batch=widgets.IntSlider(value=1, min=1, max=16, description="micro-batch"),
        seq_len=widgets.Dropdown(options=[512, 1024, 2048, 4096, 8192], value=2048, description="sequence"),
        precision=widgets.Dropdown(options=list(PRECISIONS), value="bf16", description="precision"),
        recompute=widgets.Dropdown(options=list(formulas.RECOMPUTE), value="selective", description="recompute"))
