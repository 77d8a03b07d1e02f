"""Fully sharded data parallelism (FSDP, ZeRO-3) built from scratch, to see what ``fully_shard`` does.

Data parallelism keeps the whole model on every rank. FSDP keeps only a slice: every 2-D weight
(the weights of linear and embedding layers, which hold nearly all of a model's parameters) is
flattened, padded to a multiple of the world size N and cut into N equal pieces; rank r keeps
piece r, ⌈numel/N⌉ elements, as an fp32 "master shard". Small 1-D parameters (norm weights,
biases) stay whole on every rank, as in data parallelism. A layer gets its full weight back only
while it needs it:

    forward of layer i:   all-gather W_i  ->  compute  ->  free W_i   (and start gathering W_i+1)
    backward of layer i:  all-gather W_i  ->  compute  ->  free W_i  ->  reduce-scatter grad W_i

so a rank holds its slices plus about one layer's full weight at a time, and sends about 3x the
model per step (two all-gathers and a reduce-scatter) where DDP sends 2x (one all-reduce).

``ScratchFSDP`` does this with forward hooks and one small autograd function (``_Unshard``):

    model = ScratchFSDP(MLP())                       # after dist.init_process_group(...)
    optimizer = torch.optim.AdamW(model.parameters()) # after wrapping: it steps the shards
    loss = loss_fn(model(x), y)
    loss.backward()                                   # reduce-scatters start during this call
    model.finish_gradient_synchronization()           # wait for them; shards get their .grad
    optimizer.step()
    full = model.gather_full_params()                 # the whole model, on every rank

``compute_dtype=torch.bfloat16`` (or float16) gathers and computes in that type while the
shards, their gradients and the optimizer stay in fp32 — mixed precision, as FSDP2's
``MixedPrecisionPolicy(param_dtype=...)``. Gradients are reduced in fp32 here.

What it leaves out, to stay readable: one flat buffer per layer (FSDP groups a block's tensors
into one collective), gradient accumulation without synchronising (``no_sync``), and CPU offload.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# the two collectives FSDP is made of, under torch 2.13's names where they exist
from dtlab.distributed import all_gather_single as _all_gather
from dtlab.distributed import reduce_scatter_single as _reduce_scatter


@dataclass(eq=False)
class _Shard:
    """What a rank knows about one sharded weight: its slice, and the full tensor's shape."""

    param: nn.Parameter  # this rank's slice, 1-D fp32, registered in the module in the weight's place
    name: str            # the weight's name in the unwrapped model
    shape: torch.Size    # the full weight's shape
    uses: int = 0        # forward uses whose gradient has not arrived yet (a tied weight has two)
    grad_sum: torch.Tensor | None = None  # full gradient summed over those uses (fp32)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(eq=False)
class _Call:
    """One forward call of one layer: the full weights it gathered, to free and to re-gather."""

    module: nn.Module
    names: list[str]
    shards: list[_Shard]
    previous: _Call | None = None  # the layer call before this one in the same forward
    fulls: list[torch.Tensor] = field(default_factory=list)
    pending: list[tuple[torch.Tensor, Any]] | None = None  # a started re-gather: (buffer, handle)
    regathered: bool = False
    gradients_left: int = 0  # full weights of this call whose gradient has not arrived yet
    compute_start: float = 0.0  # for the timeline: when its forward (then its backward) began


class _Unshard(torch.autograd.Function):
    """Forward: the full weight (already gathered). Backward: hand its gradient to the wrapper.

    The gradient does not flow to the shard through autograd: the wrapper sums it over the
    weight's uses, reduce-scatters it asynchronously and writes the slice into ``shard.grad`` in
    ``finish_gradient_synchronization``. This lets the reduce-scatter overlap the rest of backward.
    """

    @staticmethod
    def forward(ctx, shard_param: torch.Tensor, full: torch.Tensor, fsdp: ScratchFSDP, shard: _Shard, call: _Call):
        ctx.fsdp, ctx.shard, ctx.call = fsdp, shard, call
        return full

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        ctx.fsdp._gradient_arrived(ctx.shard, ctx.call, grad_full)
        return None, None, None, None, None


class ScratchFSDP(nn.Module):
    """Fully sharded data parallelism (ZeRO-3) in one class.

    Args:
        module: the model, on the device it will train on (one GPU per rank, or CPU). Its 2-D
            parameters are replaced by this rank's slices; everything else stays as it is.
        compute_dtype: gather weights and run the layers in this floating type (e.g.
            ``torch.bfloat16``); ``None`` computes in fp32. Shards and gradients stay fp32.
        process_group: the ranks to shard over (default: the whole world).
        record_timeline: append to ``timeline`` one event per all-gather, forward, backward and
            reduce-scatter of each layer (``{"what", "layer", "start", "end"}``, seconds since wrapping;
            a collective runs from when it was started to when it was waited for). Notebook 12 plots it.

    Rank 0's weights are broadcast first, so every rank shards the same model. Build the optimizer
    over ``model.parameters()`` after wrapping: it then holds state for the slices only.

    Counters for the lessons: ``collectives`` (calls per kind), ``elements_moved`` (elements of
    the full tensors each kind of collective produced or consumed), ``gathered_bytes`` (bytes of
    full weights materialised right now, the all-gather buffers in flight included: 0 between steps)
    and ``peak_gathered_bytes`` (its maximum).

    Raises:
        RuntimeError: ``dist.init_process_group`` has not been called.
        TypeError: ``compute_dtype`` is not a floating-point type.
        ValueError: the module has no 2-D parameter to shard, or a weight has fewer rows than
            there are ranks.
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None, process_group: Any = None,
                 record_timeline: bool = False):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("wrap the model after dist.init_process_group(...): ScratchFSDP needs the "
                               "process group to know how many slices to cut.")
        floating = isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point
        if compute_dtype is not None and not floating:
            raise TypeError(f"compute_dtype={compute_dtype!r} is not a floating-point type. Fix: pass "
                            "torch.bfloat16, torch.float16 or torch.float32 (or None for fp32).")
        self.module = module
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.compute_dtype = compute_dtype
        self.collectives = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
        self.elements_moved = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
        self.gathered_bytes = self.peak_gathered_bytes = 0
        self.record_timeline, self.timeline, self._t0 = record_timeline, [], time.perf_counter()
        self._names = {m: name or "model" for name, m in module.named_modules()}

        weights = {id(p): (n, p) for n, p in module.named_parameters() if p.dim() == 2}
        if not weights:
            raise ValueError(f"{type(module).__name__} has no 2-D parameter (a Linear or Embedding weight) to "
                             "shard. Fix: wrap a model with linear or embedding layers, or train this one "
                             "with DDP (dtlab.parallel.data_parallel).")
        narrow = [(n, p.shape[0]) for n, p in weights.values() if p.shape[0] < self.world_size]
        if narrow:
            name, rows = min(narrow, key=lambda item: item[1])
            raise ValueError(f"{name} has {rows} rows, fewer than the {self.world_size} ranks, so a rank would "
                             f"hold only padding of it. Fix: run at most {rows} processes, or make the layer "
                             "wider (or keep it out of the model you shard).")
        with torch.no_grad():  # every rank starts from rank 0's model
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t, src=self._global(0), group=process_group)

        self._shards: dict[int, _Shard] = {}  # id(shard param) -> _Shard
        for name, p in weights.values():
            shard = _Shard(nn.Parameter(self._slice(p), requires_grad=p.requires_grad), name, p.shape)
            self._shards[id(shard.param)] = shard
            for m in module.modules():  # replace the weight everywhere it is used (a tied weight twice)
                for key, value in list(m._parameters.items()):
                    if value is p:
                        m._parameters[key] = shard.param
        self._replicated = [p for p in module.parameters() if id(p) not in self._shards]
        self._layers = [m for m in module.modules() if self._needs_hooks(m)]
        for m in self._layers:
            m.register_forward_pre_hook(self._before_layer, with_kwargs=True)
            m.register_forward_hook(self._after_layer)
        for p in self._replicated:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._all_reduce_replicated)

        self._order: list[nn.Module] = []  # layers in the order the first forward ran them
        self._calls: list[_Call] = []      # this forward's layer calls
        self._prefetched: dict[nn.Module, list[tuple[torch.Tensor, Any]]] = {}
        self._pending_grads: list[tuple[torch.Tensor, Any, torch.Tensor | None, nn.Parameter, float]] = []

    # ---- the public API -------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._pending_grads or any(s.grad_sum is not None for s in self._shards.values()):
            raise RuntimeError("gradients from the last backward() were never synchronised. Fix: call "
                               "model.finish_gradient_synchronization() after loss.backward() and before "
                               "optimizer.step().")
        self._calls = []  # the layer calls of this forward (earlier ones live on in autograd's hooks)
        try:
            return self.module(*args, **kwargs)
        finally:
            self._drop_prefetched()
            if not self._order:
                self._order = [c.module for c in self._calls]

    def finish_gradient_synchronization(self) -> None:
        """Wait for every gradient collective of the last backward; give each parameter its ``.grad``.

        Sharded weights get the averaged slice of their gradient (the shape of the slice), replicated
        parameters the averaged full gradient. Call after ``loss.backward()``, before ``optimizer.step()``.
        """
        for shard in self._shards.values():  # a use whose output never reached the loss
            if shard.grad_sum is not None:
                self._start_reduce_scatter(shard)
        replicated_ids = {id(p) for p in self._replicated}
        for buffer, handle, previous, param, issued in self._pending_grads:
            handle.wait()
            buffer.div_(self.world_size)
            if id(param) in replicated_ids:
                self._log("all-reduce", param, issued)
                continue  # reduced in place in .grad
            self._log("reduce-scatter", param, issued)
            param.grad = buffer if previous is None else previous.add_(buffer)
        self._pending_grads = []
        for shard in self._shards.values():
            shard.uses = 0
        for call in self._calls:
            for full in call.fulls:
                self._free(full)
        self._calls = []

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters (fp32, full shapes) on every rank, by the unwrapped names.

        A collective: every rank must call it. Tied weights appear once, under their first name.
        """
        out = {}
        for name, p in self.module.named_parameters():
            shard = self._shards.get(id(p))
            if shard is None:
                out[name] = p.detach().clone()
                continue
            flat = torch.empty(shard.param.numel() * self.world_size, dtype=p.dtype, device=p.device)
            _all_gather(flat, p.detach(), group=self.group)
            out[name] = flat[:shard.numel].view(shard.shape).clone()
        return out

    def held_elements(self) -> dict[str, int]:
        """Elements this rank keeps between steps: ``params`` (slices + replicated) and ``grads``."""
        params = list(self.module.parameters())
        return {"params": sum(p.numel() for p in params),
                "sharded_params": sum(s.param.numel() for s in self._shards.values()),
                "replicated_params": sum(p.numel() for p in self._replicated),
                "grads": sum(p.grad.numel() for p in params if p.grad is not None)}

    # ---- sharding -------------------------------------------------------------------------

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    def _slice(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's ⌈numel/N⌉ elements of ``weight``, flattened and zero-padded, in fp32."""
        chunk = math.ceil(weight.numel() / self.world_size)
        flat = torch.zeros(chunk * self.world_size, dtype=torch.float32, device=weight.device)
        flat[:weight.numel()] = weight.detach().reshape(-1)
        return flat[self.rank * chunk:(self.rank + 1) * chunk].clone()

    def _needs_hooks(self, m: nn.Module) -> bool:
        own = [p for p in m._parameters.values() if p is not None]
        return any(id(p) in self._shards for p in own) or (self.compute_dtype is not None and bool(own))

    def _start_gather(self, shards: list[_Shard]) -> list[tuple[torch.Tensor, Any, float]]:
        dtype = self.compute_dtype or torch.float32
        started, issued = [], time.perf_counter()
        for shard in shards:
            local = shard.param.detach().to(dtype)
            buffer = torch.empty(local.numel() * self.world_size, dtype=dtype, device=local.device)
            self._count_gathered(buffer.untyped_storage().nbytes())      # in flight: it counts from now
            started.append((buffer, _all_gather(buffer, local, group=self.group, async_op=True), issued))
            self.collectives["all_gather"] += 1
            self.elements_moved["all_gather"] += buffer.numel()
        return started

    def _layer_shards(self, m: nn.Module) -> tuple[list[str], list[_Shard]]:
        names, shards = [], []
        for key, p in m._parameters.items():
            if p is not None and id(p) in self._shards:
                names.append(key)
                shards.append(self._shards[id(p)])
        return names, shards

    # ---- forward: gather, compute, free ---------------------------------------------------

    def _before_layer(self, m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        names, shards = self._layer_shards(m)
        started = self._prefetched.pop(m, None) or self._start_gather(shards)
        position = len(self._calls)
        if position + 1 < len(self._order):  # start the next layer's gather before computing this one
            upcoming = self._order[position + 1]
            if upcoming is not m and upcoming not in self._prefetched:
                self._prefetched[upcoming] = self._start_gather(self._layer_shards(upcoming)[1])
        call = _Call(m, names, shards, previous=self._calls[-1] if self._calls else None)
        grad_on = torch.is_grad_enabled()
        for name, shard, (buffer, handle, _issued) in zip(names, shards, started):
            handle.wait()
            full = buffer[:shard.numel].view(shard.shape).clone()  # its own allocation, freed after use
            self._count_gathered(full.untyped_storage().nbytes())
            self.gathered_bytes -= buffer.untyped_storage().nbytes()  # the buffer goes when this loop moves on
            if grad_on and shard.param.requires_grad:
                full = _Unshard.apply(shard.param, full, self, shard, call)
                shard.uses += 1
                call.gradients_left += 1
            vars(m)[name] = full  # found before m._parameters: the layer computes with the full weight
            call.fulls.append(full)
        if self.compute_dtype is not None:
            for name, p in m._parameters.items():
                if p is not None and id(p) not in self._shards:
                    vars(m)[name] = p.to(self.compute_dtype)  # differentiable: the fp32 grad flows back
            args, kwargs = _cast_floats((args, kwargs), self.compute_dtype)
        if started:
            self._log("all-gather", m, started[0][2])
        call.compute_start = time.perf_counter()
        self._calls.append(call)
        return args, kwargs

    def _after_layer(self, m: nn.Module, args: tuple, output: Any) -> None:
        call = next((c for c in reversed(self._calls) if c.module is m), None)  # (a layer may hold layers)
        for name in list(m._parameters):
            vars(m).pop(name, None)  # the shard (or the fp32 parameter) is visible again
        if call is None:
            return
        self._log("forward", m, call.compute_start)
        for full in call.fulls:
            self._free(full)
        outputs = [t for t in _tensors(output) if t.requires_grad]
        if outputs and call.fulls:
            for t in outputs:
                t.register_hook(lambda grad, call=call: self._before_layer_backward(call))

    def _drop_prefetched(self) -> None:
        for started in self._prefetched.values():  # gathered for a layer that did not run
            for buffer, handle, _issued in started:
                handle.wait()
                self.gathered_bytes -= buffer.untyped_storage().nbytes()
        self._prefetched = {}

    # ---- backward: re-gather, compute, free, reduce-scatter -------------------------------

    def _before_layer_backward(self, call: _Call) -> None:
        """The gradient reached this layer's output: put its full weights back, prefetch the layer before."""
        if not call.regathered:
            self._regather(call)
        before = call.previous
        if before is not None and before.fulls and not before.regathered and before.pending is None:
            before.pending = self._start_gather(before.shards)

    def _regather(self, call: _Call) -> None:
        started = call.pending or self._start_gather(call.shards)
        for full, (buffer, handle, _issued) in zip(call.fulls, started):
            handle.wait()
            full.untyped_storage().resize_(full.numel() * full.element_size())
            self._count_gathered(full.untyped_storage().nbytes())
            full.data.copy_(buffer[:full.numel()].view(full.shape))  # .data: autograd's saved copy sees it
            self.gathered_bytes -= buffer.untyped_storage().nbytes()
        call.pending, call.regathered = None, True
        if started:
            self._log("all-gather", call.module, started[0][2])
        call.compute_start = time.perf_counter()

    def _gradient_arrived(self, shard: _Shard, call: _Call, grad_full: torch.Tensor) -> None:
        """One use of a weight has its gradient. When all uses have, reduce-scatter their sum; when a
        layer call has all its weights' gradients, its backward is done with them: free them."""
        grad = grad_full.detach().float()
        shard.grad_sum = grad.clone() if shard.grad_sum is None else shard.grad_sum.add_(grad)
        shard.uses -= 1
        if shard.uses == 0:
            self._start_reduce_scatter(shard)
        call.gradients_left -= 1
        if call.gradients_left == 0:
            self._log("backward", call.module, call.compute_start)
            for full in call.fulls:
                self._free(full)

    def _start_reduce_scatter(self, shard: _Shard) -> None:
        chunk = shard.param.numel()
        flat = torch.zeros(chunk * self.world_size, dtype=torch.float32, device=shard.param.device)
        flat[:shard.numel] = shard.grad_sum.reshape(-1)
        out = torch.empty(chunk, dtype=torch.float32, device=shard.param.device)
        handle = _reduce_scatter(out, flat, group=self.group, async_op=True)
        self.collectives["reduce_scatter"] += 1
        self.elements_moved["reduce_scatter"] += flat.numel()
        self._pending_grads.append((out, handle, shard.param.grad, shard.param, time.perf_counter()))
        shard.param.grad = None  # set again, to the reduced slice, when the collective finishes
        shard.grad_sum = None

    def _log(self, what: str, where: nn.Module | nn.Parameter, start: float) -> None:
        """Record one timeline event of a layer (or of the layer owning a parameter), ending now."""
        if not self.record_timeline:
            return
        if isinstance(where, nn.Module):
            layer = self._names[where]
        else:
            layer = next(n for n, q in self.module.named_parameters() if q is where).rsplit(".", 1)[0]
        self.timeline.append({"what": what, "layer": layer, "start": start - self._t0,
                              "end": time.perf_counter() - self._t0})

    def _count_gathered(self, nbytes: int) -> None:
        self.gathered_bytes += nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def _free(self, full: torch.Tensor) -> None:
        """Release a gathered weight's memory; the tensor object stays, so backward can refill it."""
        self.gathered_bytes -= full.untyped_storage().nbytes()
        full.untyped_storage().resize_(0)

    def _all_reduce_replicated(self, p: nn.Parameter) -> None:
        handle = dist.all_reduce(p.grad, group=self.group, async_op=True)
        self.collectives["all_reduce"] += 1
        self.elements_moved["all_reduce"] += p.grad.numel()
        self._pending_grads.append((p.grad, handle, None, p, time.perf_counter()))


def held_elements(model: ScratchFSDP, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Elements this rank of a ``ScratchFSDP`` model keeps between steps: ``params`` (its slices and the replicated
    parameters), ``grads`` and the ``optimizer`` state (read after the first ``step()``), with ``sharded_params``
    and ``replicated_params`` apart: the interface every strategy shares (``dtlab.parallel.held_elements``)."""
    held = model.held_elements()
    state = optimizer.state.values() if optimizer is not None else []
    held["optimizer"] = sum(t.numel() for s in state for t in s.values() if torch.is_tensor(t) and t.dim())
    return held


def _tensors(value: Any) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    if torch.is_tensor(value):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(_cast_floats(v, dtype) for v in value)
    if isinstance(value, list):
        return [_cast_floats(v, dtype) for v in value]
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value
