"""ZeRO: shard what data parallelism replicates. Stage 1 from scratch, and a ruler for DeepSpeed's.

Plain data parallelism keeps a full copy of everything on every rank: parameters, gradients and
the optimizer state (for Adam: two moments per parameter, plus an fp32 master copy under mixed
precision — most of the memory). ZeRO (Rajbhandari et al., 2019) splits them N ways:

* stage 1: optimizer state,  * stage 2: + gradients,  * stage 3: + parameters.

``ShardedOptimizer`` is stage 1 in about a hundred lines, constructed like
``torch.distributed.optim.ZeroRedundancyOptimizer(params, optimizer_class, **defaults)``: every
parameter is owned by one rank; each rank keeps optimizer state for, and steps, only the
parameters it owns, then broadcasts them so every rank ends the step with the same weights.
Gradients must already be averaged (wrap the model in DDP first).

``held_elements(engine)`` reads how many elements a DeepSpeed engine's rank really holds in each
category, from the engine's own partitions; ``full_state_dict(module)`` gathers its whole weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer


class ShardedOptimizer(Optimizer):
    """ZeRO stage 1: optimizer state split across ranks; parameters stay replicated.

    Args:
        params: parameters or parameter-group dicts, as for any torch optimizer.
        optimizer_class: the real optimizer each rank runs on its shard (e.g. ``torch.optim.AdamW``).
        process_group: the group to shard over (default: the whole world).
        **defaults: hyperparameters for ``optimizer_class`` (``lr``, ``weight_decay``, ...).

    Parameters are assigned to ranks greedily, largest first, to the rank holding the fewest
    elements so far, so shards are close to equal. Changing ``param_groups[i]["lr"]`` (as an LR
    scheduler does) is honoured at the next ``step``.
    """

    def __init__(self, params: Any, optimizer_class: type[Optimizer], process_group: Any = None, **defaults: Any):
        if not dist.is_initialized():
            raise RuntimeError("create the ShardedOptimizer after dist.init_process_group(...)")
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.optimizer_class = optimizer_class
        self._load = [0] * self.world_size  # elements owned by each rank
        self.owner: dict[torch.Tensor, int] = {}
        self.local: Optimizer | None = None
        self._local_groups: list[int] = []  # global index of each local group
        # the real optimizer's full defaults (betas, eps, ...), so param_groups look like its own
        full = optimizer_class([torch.zeros(1, requires_grad=True)], **defaults).defaults
        super().__init__(params, full)  # calls add_param_group for each group

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (e.g. unfrozen layers): its parameters are spread over the ranks too."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        mine = []
        for p in sorted(group["params"], key=lambda t: t.numel(), reverse=True):
            owner = min(range(self.world_size), key=lambda r: self._load[r])
            self._load[owner] += p.numel()
            self.owner[p] = owner
            if owner == self.rank:
                mine.append(p)
        if not mine:
            return
        local_group = {**{k: v for k, v in group.items() if k != "params"}, "params": mine}
        if self.local is None:
            self.local = self.optimizer_class([local_group])
        else:
            self.local.add_param_group(local_group)
        self._local_groups.append(len(self.param_groups) - 1)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Step this rank's shard, then broadcast every parameter from its owner."""
        loss = None
        if self.local is not None:
            for local_group, i in zip(self.local.param_groups, self._local_groups):
                local_group.update({k: v for k, v in self.param_groups[i].items() if k != "params"})
            loss = self.local.step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                src = self.owner[p]
                dist.broadcast(p, src=dist.get_global_rank(self.group, src) if self.group else src,
                               group=self.group)
        return loss

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank (all tensors in its shard's state)."""
        if self.local is None:
            return 0
        return sum(t.numel() * t.element_size() for s in self.local.state.values()
                   for t in s.values() if torch.is_tensor(t))

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state, consolidated from every rank's shard, in torch's usual format.

        A collective: every rank must call it (the shards are gathered to all ranks). The result
        is what a plain ``optimizer_class`` over the same parameters would return, so it can be
        saved with ``dtlab.checkpoint.training_state`` and loaded by ``restore`` — into another
        ``ShardedOptimizer`` (which keeps only its shard) or into a plain optimizer.
        """
        index = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        mine: dict[int, Any] = {}
        if self.local is not None:
            for p, st in self.local.state.items():
                mine[index[p]] = {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in st.items()}
        shards: list[Any] = [None] * self.world_size
        dist.all_gather_object(shards, mine, group=self.group)
        state: dict[int, Any] = {}
        for shard in shards:
            state.update(shard)
        groups = []
        for group in self.param_groups:
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": [index[p] for p in group["params"]]})
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a consolidated state (from ``state_dict`` or a plain optimizer): keep this rank's shard.

        Raises:
            ValueError: when the parameter groups differ in number or size from this optimizer's.
        """
        saved = [len(g["params"]) for g in state_dict["param_groups"]]
        now = [len(g["params"]) for g in self.param_groups]
        if saved != now:
            raise ValueError(f"optimizer state has parameter groups of sizes {saved}, this optimizer {now}. "
                             "Fix: build the optimizer over the same parameters (and groups) as the saved run.")
        params = [p for g in self.param_groups for p in g["params"]]
        for group, saved_group in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        if self.local is None:
            return
        local_params = [p for g in self.local.param_groups for p in g["params"]]
        position = {id(p): i for i, p in enumerate(params)}
        local_state = {}
        for j, p in enumerate(local_params):
            entry = state_dict["state"].get(position[id(p)], state_dict["state"].get(str(position[id(p)])))
            if entry is not None:
                local_state[j] = {k: (v.to(p.device) if torch.is_tensor(v) and v.dim() > 0 else v)
                                  for k, v in entry.items()}
        local_groups = []
        start = 0
        for local_group, i in zip(self.local.param_groups, self._local_groups):
            n = len(local_group["params"])
            local_groups.append({**{k: v for k, v in self.param_groups[i].items() if k != "params"},
                                 "params": list(range(start, start + n))})
            start += n
        self.local.load_state_dict({"state": local_state, "param_groups": local_groups})


def optimizer_state_bytes(optimizer: Optimizer) -> int:
    """Bytes of tensor state an ordinary torch optimizer holds (e.g. Adam's two moments)."""
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
               if torch.is_tensor(t))


def held_elements(engine: Any, optimizer: Any = None) -> dict[str, int]:
    """Elements this rank of a DeepSpeed engine holds: parameters, gradients, optimizer state.

    Read gradients after the ``engine.backward(loss)`` that ends an accumulation cycle, before
    ``engine.step()``; read optimizer state after a step (Adam creates its moments at the first
    one). Returns ``{"params", "grads", "optimizer", "optimizer_moments", "master_weights"}`` (element
    counts; ``optimizer`` is the moments plus the fp32 master weights, what ``formulas.model_states`` calls
    optimizer state; DeepSpeed pads shards to an alignment, so a count can exceed the exact share by a few).
    ``optimizer`` is accepted for the interface every strategy shares (``dtlab.parallel.held_elements``); the
    engine holds its own.
    """
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    params = list(engine.module.parameters())
    held = {"params": sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params)}

    grads = sum(p.grad.numel() for p in params if p.grad is not None and p.grad.numel() > 0)
    shard = getattr(opt, "grad_partitions_flat_buffer", None)  # ZeRO-3: this rank's gradient shard
    if torch.is_tensor(shard):
        grads += shard.numel()
    else:  # ZeRO-1/2: the reduced gradient shard, per parameter group
        for tensors in (getattr(opt, "averaged_gradients", None) or {}).values():
            grads += sum(t.numel() for t in tensors or [] if t is not None)
    held["grads"] = grads

    held["optimizer_moments"] = sum(t.numel() for s in inner.state.values() for t in s.values()
                                    if torch.is_tensor(t) and t.dim() > 0)
    masters = (getattr(opt, "single_partition_of_fp32_groups", None)  # ZeRO-1/2
               or getattr(opt, "fp32_partitioned_groups_flat", None))  # ZeRO-3
    held["master_weights"] = sum(t.numel() for t in masters) if masters else 0
    held["optimizer"] = held["optimizer_moments"] + held["master_weights"]
    return held


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's whole state dict, copied to CPU memory; under DeepSpeed ZeRO-3 gathered from every rank.

    Under ZeRO-3 each rank holds only a slice of each parameter (``p.ds_tensor``; ``p`` itself is empty), so reading
    whole weights is a collective: call this on every rank. Each ZeRO-3 parameter is gathered on its own
    (``deepspeed.zero.GatheredParameters([p])``). Gathering several at once is what the DeepSpeed tutorials show,
    but DeepSpeed before 0.19 launches one asynchronous all-gather per parameter and waits only for the last; on
    CPU processes (gloo) those run on independent threads, so the others can be read before they have arrived:
    uninitialised memory (a weight of 7e31 in a CI run of notebook 06 with 0.14.4; deepspeedai/DeepSpeed#8539).
    One at a time is right on every version; on GPUs (nccl, one stream) both are.
    Modules without DeepSpeed (plain or DDP) are copied as they are.
    """
    out = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if hasattr(tensor, "ds_id"):          # a ZeRO-3 parameter: this rank holds a slice
            import deepspeed

            with deepspeed.zero.GatheredParameters([tensor]):
                out[name] = tensor.detach().cpu().clone()
        else:
            out[name] = tensor.detach().cpu().clone()
    return out


#: The first DeepSpeed measured to train ZeRO-3 right on CPU processes (``zero3_cpu_fault``).
ZERO3_CPU_FIXED = (0, 19)


def zero3_cpu_fault(device: str, deepspeed_version: str | None = None) -> str | None:
    """Why DeepSpeed ZeRO-3's weights cannot be held to one process's on ``device``, or None.

    DeepSpeed before 0.19 with its CPU accelerator (gloo) sometimes trains wrong ZeRO-3 weights, on any number of
    processes: measured with 0.16.5 (Databricks Runtime 17.3 LTS ML's) on torch 2.7, notebook 21's model ended far
    from one process's (several NaN) in 7 of 12 runs on 3 processes and 3 of 6 on 4, and on 2 in a CI run of the
    job simulation; 0.14.4 (15.4's, torch 2.3) in 3 of 8 on 3; 0.19.8 on the same torch in 0 of 10 on 3
    (``benchmarks/zero3_cpu.py``). The cause: to gather several parameters DeepSpeed launches one asynchronous
    all-gather per parameter and waits only for the last; gloo runs them on separate threads in no set order, so a
    layer can compute with a parameter whose slices have not arrived (deepspeedai/DeepSpeed#8539 waits for each;
    with every all-gather waited for, 0.16.5 trained right in 12 runs of 12). On GPUs (nccl runs them in order on
    one stream) it cannot happen. A lesson on such a stack still runs ZeRO-3 (the launch, the arguments, each
    rank's share held) but leaves out the comparison with one process, printing this reason.
    """
    if device != "cpu":
        return None
    if deepspeed_version is None:
        import deepspeed

        deepspeed_version = deepspeed.__version__
    major, minor = (int(x) for x in deepspeed_version.split("+")[0].split(".")[:2])
    if (major, minor) >= ZERO3_CPU_FIXED:
        return None
    return (f"DeepSpeed {deepspeed_version}'s ZeRO-3 on CPU processes sometimes trains wrong weights: it reads "
            "parameters before their gloo all-gathers end (measured with 0.16.5: 7 of 12 runs on 3 processes, 3 of 6 "
            "on 4, and on 2 too). Fix: DeepSpeed >= 0.19, or GPUs")
