"""Which strategy should I use? Memory per GPU and step time of every strategy on a cluster, ranked.

``advise(7e9, cluster="g5.12xlarge x4")`` (or ``dtlab advise --params 7e9 --cluster "g5.12xlarge x4"``)
prices, for one model, one training set-up and one cluster:

* data parallelism over every GPU: DDP, ZeRO-1, ZeRO-2, ZeRO-3, FSDP (ZeRO-3's memory and traffic in
  PyTorch), and ZeRO with the optimizer (and parameters) offloaded to CPU memory;
* tensor x pipeline x data layouts (ZeRO-1 over the data dimension, as Megatron-LM's distributed
  optimizer), for every TP degree inside a node and PP degree that divides the layers.

For each: memory per GPU split into parameters / gradients / optimizer state / activations
(``dtlab.memory``: the ZeRO paper's model states, the Megatron activation formulas), whether it fits
(within ``1 - memory.HEADROOM`` of the GPU, and of the host memory per GPU for what is offloaded), and
the step time split into compute, exposed communication, communication hidden behind the backward
pass, pipeline bubble and offload traffic (``dtlab.composition.cost``), with tokens per second. The
recommendation is the fastest strategy that fits, with the reason in one line; when a step time
cannot be computed (a cluster described without its speed), strategies are ranked by memory only,
and the advice says so.

Offloading is priced with two planning figures, stated in every table: ``PCIE_GBS`` for each GPU's
host link, and ``CPU_ADAM_PARAMS_PER_S`` for DeepSpeed's CPU Adam on one GPU's share of the host's
cores. They are assumptions, not measurements: measure your own node.

Every figure is a model: it leaves out latencies, kernel efficiency other than the ``mfu`` fraction of
peak, and the embedding's and head's extra work. The tests hold it to the ZeRO paper, DeepSpeed's own
estimators and the Megatron formulas; the course's notebooks measure what it predicts on CPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dtlab import composition, hardware, memory

PRECISIONS = ("bf16", "fp16", "fp32")
OPTIMIZERS = ("adam", "sgd")
#: Host-to-GPU GB/s per GPU, one direction (PCIe Gen4 x16 is 32 GB/s nominal; GPUs share the host's lanes).
PCIE_GBS = 12.0
#: Parameters per second DeepSpeed's CPU Adam updates with one GPU's share of the host cores (an assumption).
CPU_ADAM_PARAMS_PER_S = 1e9
#: Data-parallel strategies: name, ZeRO stage, optimizer offloaded, parameters offloaded.
DATA_PARALLEL = [("DDP", 0, False, False), ("ZeRO-1", 1, False, False), ("ZeRO-2", 2, False, False),
                 ("ZeRO-3", 3, False, False), ("FSDP", 3, False, False),
                 ("ZeRO-2 + optimizer offload", 2, True, False), ("ZeRO-3 + optimizer offload", 3, True, False),
                 ("ZeRO-3 + optimizer and parameter offload", 3, True, True)]


_FITS = {True: "yes ", False: "no  ", None: "?   "}   # ?: offloaded to a host whose memory was not given


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
                "assumptions": {"pcie_gbs": PCIE_GBS, "cpu_adam_params_per_s": CPU_ADAM_PARAMS_PER_S,
                                "headroom": memory.HEADROOM}}

    def row(self, strategy: str) -> dict[str, Any]:
        """The row of ``strategy`` (e.g. ``"ZeRO-2"`` or ``"TP4 x PP2 x DP2"``)."""
        for r in self.rows:
            if r["strategy"] == strategy:
                return r
        raise KeyError(f"no strategy {strategy!r}; computed: {', '.join(r['strategy'] for r in self.rows)}")

    def table(self) -> str:
        """A table for people: GB per GPU (10**9 bytes) by part, fits, step seconds, tokens/s; then the advice."""
        c, m, s = self.cluster, self.model, self.setup
        lines = [f"{m['params'] / 1e9:g}B parameters ({m['shape']}), {s['precision']} {s['optimizer']}, micro-batch "
                 f"{s['micro_batch']} x {s['seq_len']} tokens, global batch {s['global_batch']}, recompute "
                 f"{s['recompute']}; {c['name']}: {c['gpus']} GPUs of {c['gpu_memory_bytes'] / 1e9:.1f} GB "
                 f"({c['usable_bytes'] / 1e9:.1f} GB usable)",
                 "GB = 10^9 bytes per GPU; step in seconds" + ("" if self.timed else " (not computed: see below)"),
                 f"{'strategy':<42}{'params':>8}{'grads':>8}{'optim':>8}{'activ':>8}{'total':>8}{'CPU':>8}  fits"
                 f"{'step':>9}{'tokens/s':>11}"]
        for r in self.rows:
            mem = r["memory_bytes"]
            step = f"{r['step_seconds']['total']:9.2f}{r['tokens_per_second']:11,.0f}" if r["step_seconds"] else ""
            lines.append(f"{r['strategy']:<42}" + "".join(f"{mem[k] / 1e9:8.1f}" for k in
                                                         ("params", "grads", "optimizer", "activations", "total"))
                         + f"{r['cpu_bytes'] / 1e9:8.1f}  {_FITS[r['fits']]}{step}")
        rec = self.recommendation
        lines.append(f"Recommendation: {rec['strategy']} - {rec['reason']}" if rec else
                     "Recommendation: none - nothing fits. " + _nothing_fits_fix(self))
        if self.timed:
            lines.append(f"Offload priced at {PCIE_GBS:g} GB/s per GPU over PCIe and {CPU_ADAM_PARAMS_PER_S:.0e} "
                         "parameters/s of CPU Adam per GPU (assumptions).")
        return "\n".join(lines)


def resolve_model(params: float | None = None, n_layer: int | None = None, n_embd: int | None = None,
                  n_head: int | None = None, vocab: int | None = None) -> tuple[float, memory.ModelShape]:
    """Parameters and shape from what was given: a parameter count, a shape, or both.

    With only ``params``, the shape is ``memory.model_shape(params)``. With a shape, the parameters are
    ``12 * n_layer * n_embd**2`` (attention and MLP weights) plus ``vocab * n_embd`` (the embedding, tied
    with the head) unless ``params`` is given too.
    """
    shape_given = [v is not None for v in (n_layer, n_embd, n_head)]
    if any(shape_given) and not all(shape_given):
        raise ValueError("give the whole shape (layers, hidden size and heads) or none of it. "
                         "Fix: e.g. n_layer=32, n_embd=4096, n_head=32")
    if params is not None and not params > 0:
        raise ValueError(f"params={params}: a model needs a positive number of parameters. Fix: e.g. 7e9")
    if vocab is not None and vocab < 1:
        raise ValueError(f"vocab={vocab}: must be >= 1. Fix: e.g. 32000")
    if all(shape_given):
        memory._check_shape(n_layer, n_embd, n_head)
        shape = memory.ModelShape(f"{n_layer} layers x {n_embd}", n_layer, n_embd, n_head, "given")
        derived = 12 * n_layer * n_embd**2 + (vocab or 0) * n_embd
        return float(params if params is not None else derived), shape
    if params is None:
        raise ValueError("no model: give params (e.g. 7e9) or its shape (layers, hidden size, heads)")
    return float(params), memory.model_shape(params)


def resolve_cluster(cluster: str | hardware.Cluster | None = None, gpus: int | None = None,
                    gpu_mem_gb: float | None = None, **hand: Any) -> hardware.Cluster:
    """A named cluster (``dtlab.hardware.cluster``), or one described by hand (``hardware.custom_cluster``)."""
    if cluster is not None:
        return hardware.cluster(cluster)
    if gpus is None or gpu_mem_gb is None:
        return hardware.cluster(hardware.DEFAULT_CLUSTER)
    return hardware.custom_cluster(gpus, gpu_mem_gb, **{k: v for k, v in hand.items() if v is not None})


def advise(params: float | None = None, *, n_layer: int | None = None, n_embd: int | None = None,
           n_head: int | None = None, vocab: int | None = None, cluster: str | hardware.Cluster | None = None,
           gpus: int | None = None, gpu_mem_gb: float | None = None, gpus_per_node: int | None = None,
           tflops: float | None = None, intra_node_gbs: float | None = None, inter_node_gbs: float | None = None,
           host_memory_gb_per_gpu: float | None = None, micro_batch: int = 1, seq_len: int = 2048,
           global_batch: int | None = None, precision: str = "bf16", optimizer: str = "adam",
           recompute: str = "selective", mfu: float = 0.4, layout: composition.Layout | dict | None = None,
           layouts: bool = True) -> Advice:
    """Price every strategy for a model on a cluster and recommend one; see the module's help.

    Args:
        params: parameters (or give ``n_layer``, ``n_embd``, ``n_head`` and optionally ``vocab``).
        cluster: a name from ``dtlab.hardware`` ("g5.12xlarge", "g5.12xlarge x4", "p4d.24xlarge x8"...),
            or describe one: ``gpus``, ``gpu_mem_gb``, and for step times ``tflops``, ``intra_node_gbs``,
            ``inter_node_gbs`` (``gpus_per_node`` defaults to 8, ``host_memory_gb_per_gpu`` to unknown).
        micro_batch, seq_len, global_batch: sequences per GPU per micro-step, tokens per sequence,
            sequences per optimizer step (default: at least 512, a multiple of micro_batch x GPUs).
        precision: "bf16", "fp16" (mixed precision) or "fp32". optimizer: "adam" or "sgd" (momentum).
        recompute: activation recomputation, "none", "selective" or "full".
        mfu: the fraction of the GPU's peak FLOP/s the model assumes training reaches.
        layout: one TP x PP x DP layout to price (a ``composition.Layout`` or ``{"dp": 4, "tp": 4}``)
            instead of every one; ``layouts=False`` prices data parallelism only.

    Raises:
        ValueError: for sizes that are not positive, a hidden size not divisible by the heads, an unknown
            precision/optimizer/recompute mode, a layout whose degrees do not multiply to the GPU count,
            or bf16 on a GPU without it. ``dtlab.hardware.UnknownHardware`` for a cluster it does not know.
    """
    num_params, shape = resolve_model(params, n_layer, n_embd, n_head, vocab)
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: use one of {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
    if recompute not in memory.RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}: use one of {', '.join(memory.RECOMPUTE)}")
    if micro_batch < 1 or seq_len < 1 or not 0 < mfu <= 1:
        raise ValueError(f"micro_batch={micro_batch}, seq_len={seq_len}, mfu={mfu}: need micro_batch >= 1, "
                         "seq_len >= 1 and 0 < mfu <= 1. Fix: e.g. micro_batch=1, seq_len=2048, mfu=0.4")
    c = resolve_cluster(cluster, gpus, gpu_mem_gb, gpus_per_node=gpus_per_node, tflops=tflops or 0.0,
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
    usable = c.gpu.memory_bytes * (1 - memory.HEADROOM)
    host = c.node.cpu_memory_bytes_per_gpu * (1 - memory.HEADROOM)
    links_known = g == 1 or (c.inter_node_gbs > 0 if c.nodes > 1 else c.node.intra_node_gbs > 0)
    timed = c.gpu.peak_flops(precision) > 0 and links_known
    kw = {"global_batch": global_batch, "micro_batch": micro_batch, "seq_len": seq_len, "recompute": recompute,
          "mfu": mfu, "shape": shape, "precision": precision}

    rows = []
    chosen = _as_layout(layout, g) if layout is not None else None
    if chosen is None:
        for name, stage, off_opt, off_par in DATA_PARALLEL:
            rows.append(_data_parallel_row(name, stage, off_opt, off_par, num_params, c, kw, optimizer, timed))
    candidates = [chosen] if chosen is not None else (_layouts(shape, c, global_batch, micro_batch) if layouts else [])
    for lay in candidates:
        r = _layout_row(lay, num_params, c, kw, optimizer, timed)
        if r is not None:
            rows.append(r)
    for r in rows:     # True, False, or None: offloaded states on a host whose memory was not given
        on_gpu = r["memory_bytes"]["total"] <= usable
        r["fits"] = on_gpu if r["cpu_bytes"] == 0 else (False if not on_gpu else
                                                         (r["cpu_bytes"] <= host if host > 0 else None))
    advice = Advice(model={"params": num_params, "shape": shape.describe(), "n_layer": shape.n_layer,
                           "n_embd": shape.n_embd, "n_head": shape.n_head},
                    setup={"micro_batch": micro_batch, "seq_len": seq_len, "global_batch": global_batch,
                           "precision": precision, "optimizer": optimizer, "recompute": recompute, "mfu": mfu},
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


def _optimizer_bytes(adam_bytes: float, precision: str, stage: int, optimizer: str) -> float:
    """Optimizer-state bytes for ``optimizer``, from Adam's (``model_states`` counts Adam)."""
    if optimizer == "adam":
        return adam_bytes
    # SGD with momentum keeps one moment instead of two: mixed precision 4 (master) + 4 (momentum) of Adam's 12;
    # fp32 DDP 4 of Adam's 8; fp32 ZeRO (a master copy) 8 of 12.
    return adam_bytes * (0.5 if precision == "fp32" and stage == 0 else 2 / 3)


def _states(num_params, gpus, stage, precision, optimizer, off_opt=False, off_par=False):
    s = memory.model_states(num_params, gpus, stage, "fp32" if precision == "fp32" else "mixed", off_opt, off_par)
    opt_gpu = _optimizer_bytes(s.optimizer, precision, stage, optimizer)
    cpu = s.cpu
    if off_opt:  # what moved to the CPU includes the optimizer state: scale that part
        adam = memory.model_states(num_params, gpus, stage, "fp32" if precision == "fp32" else "mixed").optimizer
        cpu += _optimizer_bytes(adam, precision, stage, optimizer) - adam
    return {"params": s.params, "grads": s.grads, "optimizer": opt_gpu}, cpu


def _timing(cost: dict, extra: float = 0.0) -> dict[str, float]:
    comm = cost["comm_seconds"]
    exposed = comm["tp"] + comm["cp"] + comm["pp"] + cost["exposed_dp_seconds"]
    hidden = comm["dp"] - cost["exposed_dp_seconds"]
    total = cost["step_seconds"] + extra
    busy = cost["compute_seconds"] + exposed
    return {"compute": cost["compute_seconds"], "comm_exposed": exposed, "comm_overlapped": hidden,
            "bubble": cost["step_seconds"] - busy, "offload": extra, "total": total}


def _data_parallel_row(name, stage, off_opt, off_par, num_params, c, kw, optimizer, timed) -> dict:
    g = c.gpus
    mem, cpu = _states(num_params, g, stage, kw["precision"], optimizer, off_opt, off_par)
    shape = kw["shape"]
    mem["activations"] = memory.activation_bytes(kw["micro_batch"], kw["seq_len"], shape.n_layer, shape.n_embd,
                                                 shape.n_head, 4 if kw["precision"] == "fp32" else 2,
                                                 recompute=kw["recompute"])
    mem["total"] = sum(mem.values())
    row = {"strategy": name, "layout": {"dp": g, "tp": 1, "pp": 1, "zero": stage}, "memory_bytes": mem,
           "cpu_bytes": cpu, "offload": {"optimizer": off_opt, "params": off_par}, "step_seconds": None,
           "tokens_per_second": None}
    if timed:
        cost = composition.cost(num_params, composition.Layout(dp=g, zero=stage), c, **kw)
        extra = 0.0
        if off_opt:       # gradients down, updated 16-bit parameters up, and the update on the CPU
            value = 4 if kw["precision"] == "fp32" else 2
            extra = 2 * value * num_params / g / (PCIE_GBS * 1e9) + num_params / g / CPU_ADAM_PARAMS_PER_S
        if off_par:       # the parameters come up from the host for the forward and again for the backward
            extra += 2 * 2 * num_params / g / (PCIE_GBS * 1e9)
        row["step_seconds"] = _timing(cost, extra)
        row["tokens_per_second"] = kw["global_batch"] * kw["seq_len"] / row["step_seconds"]["total"]
    return row


def _layouts(shape: memory.ModelShape, c: hardware.Cluster, global_batch: int, micro_batch: int) -> list:
    """TP x PP x DP layouts worth pricing: TP a power of 2 inside a node dividing the heads, PP dividing the layers."""
    out = []
    tp = 1
    while tp <= c.node.gpus:
        if shape.n_head % tp == 0:
            for pp in range(1, shape.n_layer + 1):
                if shape.n_layer % pp or c.gpus % (tp * pp) or (tp, pp) == (1, 1):
                    continue
                dp = c.gpus // (tp * pp)
                if global_batch % (dp * micro_batch) == 0:
                    out.append(composition.Layout(dp=dp, tp=tp, pp=pp, zero=1))
        tp *= 2
    return out


def _as_layout(layout, gpus: int) -> composition.Layout:
    lay = layout if isinstance(layout, composition.Layout) else composition.Layout(**{"zero": 1, **dict(layout)})
    if lay.gpus != gpus:
        raise ValueError(f"layout {lay} uses {lay.gpus} GPUs, but the cluster has {gpus}. Fix: degrees whose product "
                         f"is {gpus} (e.g. dp={gpus // max(lay.tp * lay.pp * lay.cp, 1) or 1}, tp={lay.tp}, "
                         f"pp={lay.pp} if that divides)")
    return lay


def _layout_row(lay, num_params, c, kw, optimizer, timed) -> dict | None:
    try:
        cost = composition.cost(num_params, lay, c, **kw) if timed else None
        if cost is None:   # memory only: the same arithmetic, without the clock
            mem = composition.memory_per_gpu(num_params, lay, kw["shape"], kw["micro_batch"], kw["seq_len"],
                                             kw["recompute"], kw["precision"])
        else:
            mem = {k: v for k, v in cost["memory"].items() if k != "total"}
    except ValueError:
        return None
    mem["optimizer"] = _optimizer_bytes(mem["optimizer"], kw["precision"], lay.zero, optimizer)
    mem["total"] = sum(mem.values())
    name = " x ".join(f"{n.upper()}{getattr(lay, n)}" for n in ("tp", "pp", "dp") if getattr(lay, n) > 1)
    row = {"strategy": name, "layout": {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "zero": lay.zero},
           "memory_bytes": mem, "cpu_bytes": 0.0, "offload": {"optimizer": False, "params": False},
           "step_seconds": None, "tokens_per_second": None}
    if cost is not None:
        row["step_seconds"] = _timing(cost)
        row["tokens_per_second"] = kw["global_batch"] * kw["seq_len"] / row["step_seconds"]["total"]
    return row


def _recommend(advice: Advice, usable: float) -> dict[str, Any] | None:
    fitting = [r for r in advice.rows if r["fits"] is True]
    if not fitting:
        return None
    if advice.timed:
        best = max(fitting, key=lambda r: r["tokens_per_second"])
        why = (f"the fastest of the {len(fitting)} strategies that fit: {best['step_seconds']['total']:.2f} s per "
               f"step, {best['tokens_per_second']:,.0f} tokens/s, {best['memory_bytes']['total'] / 1e9:.1f} of "
               f"{usable / 1e9:.1f} usable GB per GPU")
    else:
        best = fitting[0]   # rows come in order of least communication first
        why = (f"the first that fits in order of least communication ({best['memory_bytes']['total'] / 1e9:.1f} of "
               f"{usable / 1e9:.1f} usable GB per GPU); step time not computed: give the GPU's tflops and the "
               "bandwidths, or a cluster name")
    return {"strategy": best["strategy"], "reason": why, "tokens_per_second": best["tokens_per_second"]}


def _nothing_fits_fix(advice: Advice) -> str:
    smallest = min(advice.rows, key=lambda r: r["memory_bytes"]["total"])
    return (f"The smallest, {smallest['strategy']}, needs {smallest['memory_bytes']['total'] / 1e9:.1f} GB per GPU. "
            "Fix: more GPUs or nodes, activation recomputation ('full'), a smaller micro-batch or sequence, or offload")


def plot(advice: Advice, strategies: list[str] | None = None):
    """Two small charts: memory per GPU by part (stacked, with the usable line) and step time by part.

    ``strategies`` picks rows (default: every row). Returns the matplotlib figure.
    """
    import matplotlib.pyplot as plt

    rows = [r for r in advice.rows if strategies is None or r["strategy"] in strategies]
    names = [r["strategy"] for r in rows]
    fig, axes = plt.subplots(1, 2 if advice.timed else 1, figsize=(10 if advice.timed else 5.5, 0.32 * len(rows) + 1.2),
                             sharey=True, squeeze=False)
    ax = axes[0][0]
    left = [0.0] * len(rows)
    for part, color in (("params", "tab:blue"), ("grads", "tab:orange"), ("optimizer", "tab:green"),
                        ("activations", "tab:purple")):
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
        plot(advice)
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
        recompute=widgets.Dropdown(options=list(memory.RECOMPUTE), value="selective", description="recompute"))
