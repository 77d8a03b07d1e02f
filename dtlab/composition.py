"""Composing data, tensor, pipeline and context parallelism on paper: what each GPU holds and sends.

A layout ``DP x TP x PP x CP`` puts ``dp * tp * pp * cp`` GPUs to work on one model. Ranks are
numbered with TP fastest, then CP, PP and DP (as Megatron-LM does), so a dimension's groups stay
inside a node when it and the dimensions inside it fit in one node's GPUs.

Per GPU and step, with Ψ parameters, ``L`` layers of width ``h``, micro-batch ``b``, sequence ``s``
and ``M = global_batch / (dp * b)`` micro-batches per step (16-bit values, Adam in mixed precision):

* model states: ``dtlab.memory.model_states(Ψ / (tp * pp), dp, zero)`` (ZeRO stage 0-3 over DP);
* activations: ``dtlab.memory.activation_bytes(b, s / cp, L, ...) / tp`` — 1F1B's first stage
  holds P micro-batches of L/P layers, L layers' worth whatever P (sequence parallelism assumed);
* TP: 4 all-reduces per layer and micro-batch of ``b·(s/cp)·h`` values, on the critical path;
* CP: keys and values (``2·b·(s/cp)·h``) passed ``cp - 1`` times per layer forward, twice that backward;
* PP: one activation forward and one gradient backward per micro-batch (``b·(s/cp)·h`` each);
* DP: the gradients of this GPU's Ψ/(tp·pp) parameters all-reduced (ZeRO-3: 1.5x that), overlapped
  with the backward pass.

Each transfer is priced at the bandwidth of the slowest link its group crosses (inside a node or
the network, from ``dtlab.hardware``), compute at a fraction ``mfu`` of the GPU's bf16 peak, and the
pipeline bubble adds (P-1)/(M+P-1). It is a planning model, not a measurement: it leaves out
latencies, overlap of TP and CP with compute, and the embedding's and head's extra work.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlab import hardware, memory


@dataclass(frozen=True)
class Layout:
    """Degrees of each kind of parallelism; ``zero`` is the ZeRO stage used over the DP dimension."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero: int = 1

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def __str__(self) -> str:
        parts = [f"{name.upper()}{getattr(self, name)}" for name in ("dp", "tp", "pp", "cp") if getattr(self, name) > 1]
        return " x ".join(parts or ["1 GPU"]) + (f" (ZeRO-{self.zero})" if self.dp > 1 else "")


def inside_node(layout: Layout, gpus_per_node: int) -> dict[str, bool]:
    """For each dimension, whether its groups stay inside one node (ranks numbered TP, CP, PP, DP fastest first)."""
    span, out = 1, {}
    for name in ("tp", "cp", "pp", "dp"):
        degree = getattr(layout, name)
        span *= degree
        out[name] = degree == 1 or span <= gpus_per_node
    return out


def memory_per_gpu(num_params: float, layout: Layout, shape: memory.ModelShape, micro_batch: int = 1,
                   seq_len: int = 2048, recompute: str = "selective", precision: str = "bf16") -> dict[str, float]:
    """Bytes per GPU of ``layout``: ``params``, ``grads``, ``optimizer`` (ZeRO over DP) and ``activations`` (/ TP)."""
    states = memory.model_states(num_params / (layout.tp * layout.pp), layout.dp, layout.zero,
                                 "fp32" if precision == "fp32" else "mixed")
    activations = memory.activation_bytes(micro_batch, seq_len // layout.cp, shape.n_layer, shape.n_embd,
                                          shape.n_head, 4 if precision == "fp32" else 2,
                                          recompute=recompute) / layout.tp
    return {"params": states.params, "grads": states.grads, "optimizer": states.optimizer, "activations": activations}


def cost(num_params: float, layout: Layout, cluster: str | hardware.Cluster, global_batch: int = 512,
         micro_batch: int = 1, seq_len: int = 2048, recompute: str = "selective", mfu: float = 0.4,
         shape: memory.ModelShape | None = None, precision: str = "bf16") -> dict:
    """Memory per GPU (bytes, by part) and step time (seconds, by part) of ``layout`` on ``cluster``.

    ``shape`` defaults to ``memory.model_shape(num_params)``; ``precision`` is the compute format
    ("bf16", "fp16": 16-bit values and mixed-precision Adam; "fp32": 4-byte values throughout).
    Raises ``ValueError`` when the layout needs more GPUs than the cluster has, or the batch, the
    layers, the heads or the sequence do not divide by the degrees (the message names the fix).
    """
    c = hardware.cluster(cluster)
    shape = shape or memory.model_shape(num_params)
    value_bytes = 4 if precision == "fp32" else 2                    # bytes per activation / gradient value
    if layout.gpus > c.gpus:
        raise ValueError(f"{layout} needs {layout.gpus} GPUs; {c.name} has {c.gpus}. Fix: smaller degrees")
    for what, value, by in (("global_batch", global_batch, layout.dp * micro_batch),
                            ("layers", shape.n_layer, layout.pp), ("heads", shape.n_head, layout.tp),
                            ("seq_len", seq_len, layout.cp)):
        if value % by:
            raise ValueError(f"{what}={value} does not divide by {by} for {layout}. Fix: degrees that divide it")
    mem = memory_per_gpu(num_params, layout, shape, micro_batch, seq_len, recompute, precision)
    mem["total"] = sum(mem.values())

    local = inside_node(layout, c.node.gpus)
    bandwidth = {name: (c.node.intra_node_gbs if inside and c.node.intra_node_gbs else c.inter_node_gbs) * 1e9
                 for name, inside in local.items()}
    m = global_batch // (layout.dp * micro_batch)
    layers = shape.n_layer // layout.pp
    tokens = micro_batch * seq_len // layout.cp                      # per micro-batch, per GPU
    ring = lambda n: 2 * (n - 1) / n                                  # noqa: E731
    sent = {"tp": m * layers * 4 * ring(layout.tp) * tokens * shape.n_embd * value_bytes,
            "cp": m * layers * 3 * (layout.cp - 1) * 2 * tokens * shape.n_embd * value_bytes,
            "pp": (2 * m * tokens * shape.n_embd * value_bytes) if layout.pp > 1 else 0.0,
            "dp": (1.5 if layout.zero == 3 else 1.0) * ring(layout.dp) * value_bytes * num_params
            / (layout.tp * layout.pp)}
    seconds = {name: sent[name] / bandwidth[name] if sent[name] else 0.0 for name in sent}
    compute = 6 * num_params * global_batch * seq_len / (layout.gpus * mfu * c.gpu.peak_flops(precision))
    exposed_dp = max(0.0, seconds["dp"] - 2 / 3 * compute)             # overlapped with the backward pass
    busy = compute + seconds["tp"] + seconds["cp"] + seconds["pp"] + exposed_dp
    bubble = (layout.pp - 1) / (m + layout.pp - 1)
    step = busy / (1 - bubble)
    return {"layout": str(layout), "memory": mem, "fits": mem["total"] <= c.gpu.memory_bytes * (1 - memory.HEADROOM),
            "inside_node": local, "bytes_sent": sent, "comm_seconds": seconds, "compute_seconds": compute,
            "exposed_dp_seconds": exposed_dp, "bubble": bubble, "step_seconds": step,
            "tokens_per_second": global_batch * seq_len / step}


def device_mesh(device_type: str, **dims: int):
    """``init_device_mesh`` with named dimensions, checked first: ``device_mesh("cpu", dp=2, tp=2)``.

    Raises ``ValueError`` (before any collective) when the degrees' product is not the world size,
    or a degree is below 1. Index the result by name (``mesh["tp"]``); ``submesh`` names the fix for
    an unknown name.
    """
    import math

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    wanted = math.prod(dims.values()) if dims else 0
    if not dims or any(d < 1 for d in dims.values()) or wanted != world:
        shown = " x ".join(f"{k}={v}" for k, v in dims.items()) or "no dimensions"
        names = list(dims) or ["dp"]
        inner = dims.get(names[-1], 1) if len(names) > 1 and world % max(1, dims.get(names[-1], 1)) == 0 else 1
        example = {names[0]: world // inner, **({names[-1]: inner} if len(names) > 1 else {})}
        raise ValueError(f"a mesh of {shown} has {wanted} ranks but the job has {world}. Fix: degrees whose "
                         f"product is {world} (e.g. {', '.join(f'{k}={v}' for k, v in example.items())}), or start "
                         f"{wanted} processes")
    return init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))


def submesh(mesh, name: str):
    """``mesh[name]``, with an error that lists the mesh's dimension names when ``name`` is not one."""
    names = tuple(mesh.mesh_dim_names or ())
    if name not in names:
        raise ValueError(f"the mesh has no dimension {name!r}; its dimensions are {names}. Fix: one of those names "
                         "(set them with device_mesh(..., dp=2, tp=2))")
    return mesh[name]
