"""DDP, ZeRO-3 (DeepSpeed), FSDP2 and the scratch FSDP trained side by side, at M micro-batches per step.

``worker`` (run it with ``dtlab.launch.run(worker, cfg, nprocs=N)``) trains the same small GPT on the same
batches with each strategy and measures, per optimizer step of M micro-batches:

* the fastest of its timed steps (noise on a shared machine only adds time), and the bytes that crossed the
  loopback interface during one (gloo talks TCP over it; NCCL's traffic between GPUs is invisible to it, so
  ``wire`` is None there), less what the measurement's own barriers send;
* the collectives one step calls, by kind (``calls``, counted by ``dtlab.bandwidth.collective_calls``);
* the elements a rank holds after a step (``held``: parameters, gradients, optimizer state; DeepSpeed's
  fp32 master slice apart, as ``master_weights``);
* the ingredients a prediction needs, measured in the same processes: one micro-batch's forward and
  backward without any communication (``compute_s``), and each collective weighed and timed at a small and
  a large size (bytes and seconds per call and per element: ``wire_cost``, ``time_cost``).

Each strategy accumulates gradients the way it does in practice: DDP under ``no_sync`` until the last
micro-batch; FSDP2 reduce-scatters every micro-batch (or, "sync deferred", only the last:
``set_requires_gradient_sync``); the scratch FSDP synchronises after every backward; DeepSpeed's ZeRO-3 with
``gradient_accumulation_steps = M``. Notebook 20 sets the result beside ``dtlab.planner.cost``'s prediction
for the same configuration.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

#: The strategies ``worker`` can train, in the order it trains them.
STRATEGIES = ("DDP", "ZeRO-3 (DeepSpeed)", "FSDP2", "FSDP2, sync deferred", "scratch FSDP")


def make_model(cfg: dict):
    """The small GPT every strategy trains (untied head, so each weight is one tensor)."""
    import torch

    from dtlab import models

    torch.manual_seed(0)
    return models.TinyGPT(vocab_size=cfg["vocab"], block_size=cfg["block"], n_layer=cfg["n_layer"],
                          n_head=cfg["n_head"], n_embd=cfg["n_embd"], tie_weights=False)


def accumulating(opt, m: int, micro) -> Any:
    """One optimizer step over ``m`` micro-batches: ``micro(i)`` runs micro-batch ``i``'s forward and backward
    (and whatever the strategy does with its gradients), then the optimizer steps."""
    def step():
        opt.zero_grad(set_to_none=False)
        for i in range(m):
            micro(i)
        opt.step()
    return step


def worker(cfg: dict) -> dict[str, Any]:
    """Train every strategy of ``cfg["strategies"]`` at each M of ``cfg["micro_batches"]``; see the module help.

    ``cfg``: ``backend``, ``device``, the model (``n_layer``, ``n_embd``, ``n_head``, ``vocab``, ``block``),
    ``batch`` (sequences per micro-batch, all ranks together), ``micro_batches``, ``time_steps``, ``strategies``.
    """
    import logging
    import warnings

    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.utils import logger
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dtlab import data, ds_config
    from dtlab.bandwidth import collective_calls, collective_costs, loopback_during
    from dtlab.distributed import local_device
    from dtlab.parallel import fsdp2
    from dtlab.parallel.fsdp import ScratchFSDP
    from dtlab.parallel.zero import held_elements

    logger.setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    warnings.filterwarnings("ignore", message=".* is deprecated. Please use .*_single")
    deepspeed.init_distributed(dist_backend=cfg["backend"])
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = local_device(cfg["device"])
    per_rank = cfg["batch"] // world
    most = max(cfg["micro_batches"])
    x, y = data.synthetic_tokens(most * cfg["batch"], cfg["block"], cfg["vocab"], seed=1).tensors
    x = x.reshape(most, cfg["batch"], -1)[:, rank * per_rank:(rank + 1) * per_rank].to(dev)
    y = y.reshape(most, cfg["batch"], -1)[:, rank * per_rank:(rank + 1) * per_rank].to(dev)

    def timed(work, repeats: int) -> float:    # the fastest try, each after a barrier: noise only adds time
        work()
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            work()
            times.append(time.perf_counter() - start)
        return min(times)

    costs = collective_costs(dev, cfg["backend"])
    out: dict[str, Any] = {"wire_cost": costs["wire"], "time_cost": costs["time"], "results": {}}
    barriers = loopback_during(lambda: None, cfg["backend"])     # what the measuring itself puts on the wire
    plain = make_model(cfg).to(dev)
    out["compute_s"] = timed(lambda: plain(x[0], y[0])[1].backward(), cfg["time_steps"])
    out["psi"] = sum(p.numel() for p in plain.parameters())

    def trainer(name: str, m: int):
        model = make_model(cfg).to(dev)
        if name == "DDP":
            ddp = DDP(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

            def micro(i):
                with ddp.no_sync() if i < m - 1 else contextlib.nullcontext():
                    ddp(x[i], y[i])[1].backward()
            return accumulating(opt, m, micro), lambda: fsdp2.held_elements(model, opt)
        if name.startswith("FSDP2"):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(cfg["device"], (world,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            deferred = name.endswith("deferred")

            def micro(i):
                if deferred:
                    model.set_requires_gradient_sync(i == m - 1)
                model(x[i], y[i])[1].backward()
            return accumulating(opt, m, micro), lambda: fsdp2.held_elements(model, opt)
        if name == "scratch FSDP":
            sharded = ScratchFSDP(model)
            opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3)

            def micro(i):
                sharded(x[i], y[i])[1].backward()
                sharded.finish_gradient_synchronization()
            return accumulating(opt, m, micro), lambda: fsdp2.held_elements(sharded, opt)
        config = ds_config.build(stage=3, micro_batch=per_rank, accumulation=m, world_size=world, lr=1e-3)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

        grads = {}

        def step():
            for i in range(m):
                engine.backward(engine(x[i], y[i])[1])
                if i == m - 1:                 # DeepSpeed's gradient shard lives until its step
                    grads["n"] = held_elements(engine)["grads"]
                engine.step()                  # updates only at the end of the M micro-batches

        def held():
            ds = held_elements(engine)
            return {"params": ds["params"], "grads": grads["n"], "optimizer": ds["optimizer_moments"],
                    "master_weights": ds["master_weights"]}
        return step, held

    for name in cfg["strategies"]:
        if name.startswith("FSDP2") and not fsdp2.AVAILABLE:
            continue
        for m in cfg["micro_batches"]:
            step, held = trainer(name, m)
            row = {"step_s": timed(step, cfg["time_steps"]), "wire": loopback_during(step, cfg["backend"]),
                   "calls": collective_calls(step), "held": held()}
            if row["wire"] is not None:
                row["wire"] -= barriers
            if "master_weights" in row["held"]:         # DeepSpeed's fp32 master slice, beside the Adam state
                row["master_weights"] = row["held"].pop("master_weights")
            out["results"].setdefault(name, {})[m] = row
    dist.destroy_process_group()
    return out


def layout_of(name: str, world: int, model):
    """The planner's layout for a strategy of ``worker``: DDP is ZeRO stage 0; the sharded ones are stage 3, with
    as many collectives per layer and pass as the implementation makes (FSDP2 one per block, the scratch FSDP and
    DeepSpeed one per parameter tensor)."""
    from dtlab.planner import cost

    if name == "DDP":
        return cost.Layout(dp=world, zero=0)
    per_block = 1 if name.startswith("FSDP2") else len(list(model.blocks[0].parameters()))
    return cost.Layout(dp=world, zero=3, defer_grad_sync=name.endswith("deferred"), gathers_per_layer=per_block)


def predict(measured: dict[str, Any], cfg: dict, name: str, m: int, world: int) -> dict[str, float]:
    """What ``dtlab.planner.cost`` predicts for strategy ``name`` at ``m`` micro-batches, priced with this machine's
    measured ingredients: ``wire`` (loopback bytes per step) and ``step_s`` (seconds per step).

    The bytes are the planner's ``traffic`` (per collective) times the bytes each collective was measured to put
    on the loopback interface per element (``wire_cost``), plus each call's fixed bytes for the calls the step was
    counted making (``calls``; where they could not be counted, payload only). gloo's reduce-scatter sends an
    all-reduce's bytes, so torch's FSDP pays for that; DeepSpeed reduce-scatters with collectives of its own that
    send a ring's payload (``ring_factor``), so its reduce-scatter is priced as the planner writes it. FSDP2 gathers
    its root's parameters once per micro-batch, not twice: the root keeps them from forward to backward
    (``reshard_after_forward`` is False for the root, as FSDP2 documents).

    The time adds ``m`` micro-batches of measured compute and each collective at its measured cost per call (the
    counted calls, else one per unit and pass) and per element, without overlap: on two CPU cores gloo runs on the
    cores the compute uses (the planner hides communication only on GPUs).
    """
    import math

    from dtlab.planner import cost, formulas

    model = make_model(cfg)
    layout = layout_of(name, world, model)
    shape = formulas.ModelShape("TinyGPT", cfg["n_layer"], cfg["n_embd"], cfg["n_head"], vocab=cfg["vocab"],
                                tied=False)
    setup = cost.Setup(global_batch=world * m, micro_batch=1, seq_len=cfg["block"], precision="fp32")
    flows = cost.traffic(measured["psi"], shape, layout, setup, m)["dp"]
    per_tensor = len(list(model.parameters())) - cfg["n_layer"] * len(list(model.blocks[0].parameters()))
    units = cfg["n_layer"] * layout.gathers_per_layer + (1 if name.startswith("FSDP2") else per_tensor)
    estimated = {"all_reduce": 1, "all_gather": 2 * m * units,
                 "reduce_scatter": (1 if layout.defer_grad_sync else m) * units}
    if name.startswith("FSDP2"):        # the root keeps its weights from forward to backward (FSDP2's default)
        root = measured["psi"] - sum(p.numel() for p in model.blocks.parameters())
        flows = {**flows, "all_gather": flows["all_gather"] - m * root * 4}
        estimated["all_gather"] -= m
    counted = measured["results"].get(name, {}).get(m, {}).get("calls")
    calls = {op: (counted or {}).get(op, 0) if counted is not None else estimated[op] for op in flows}
    wire = seconds = 0.0
    for op, nbytes in flows.items():
        elements = nbytes / 4
        per_byte = measured["wire_cost"].get(op, {}).get("per_element")
        if name.startswith("ZeRO-3") and op == "reduce_scatter":
            per_byte = 4 * formulas.ring_factor(world, op) * world
        wire += elements * (per_byte if per_byte is not None else math.nan)
        if counted is not None:                          # each call's headers, where the calls were counted
            wire += calls[op] * measured["wire_cost"].get(op, {}).get("per_call", math.nan)
        t = measured["time_cost"][op]
        seconds += calls[op] * t["per_call"] + elements * t["per_element"]
    return {"wire": wire, "step_s": m * measured["compute_s"] + seconds}
