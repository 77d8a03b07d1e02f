"""Data parallelism built from scratch, to see what ``DistributedDataParallel`` does for you.

Two wrappers, naive first, then the one that is used in practice (as in picotron):

* ``DataParallel`` — one asynchronous all-reduce per gradient, started by a hook the moment
  autograd has finished that gradient, so communication of late layers overlaps the backward
  computation of early layers. Simple, but one collective per parameter tensor: a model with
  hundreds of small tensors pays hundreds of latencies.
* ``BucketedDataParallel`` — gradients are packed into buckets of about ``bucket_cap_mb`` and
  each bucket is all-reduced once it is full: few large messages instead of many small ones.
  This is what torch DDP does (its ``bucket_cap_mb`` defaults to 25).

Both broadcast rank 0's parameters and buffers when they wrap the module (every replica starts
identical), average gradients (all-reduce sums, then divide by the world size), skip parameters
that do not require grad, count a parameter shared by two layers (tied weights) once, and have
``no_sync()`` for gradient accumulation. As with torch DDP, ``wrapper.module`` is your model and
calling the wrapper runs its forward. Unlike torch DDP, you call
``finish_gradient_synchronization()`` after ``backward()`` and before ``optimizer.step()``:

    model = DataParallel(MLP())
    loss = loss_fn(model(x), y)
    loss.backward()                              # all-reduces start during this call
    model.finish_gradient_synchronization()      # wait for them
    optimizer.step()

Set ``record_timeline=True`` to record when each all-reduce started and finished, relative to the
backward pass (``timeline`` and ``backward_window``): notebook 03 plots the overlap.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def _unique_trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters that need gradients, each tensor once (``named_parameters`` drops tied duplicates)."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


class _SyncBase(nn.Module):
    def __init__(self, module: nn.Module, process_group: Any = None, record_timeline: bool = False):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("wrap the model after dist.init_process_group(...): the wrapper needs the "
                               "process group to broadcast the initial weights.")
        self.module = module
        self.group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.require_backward_grad_sync = True
        self.allreduce_calls = 0  # collectives issued so far (the lesson counts them)
        self.record_timeline = record_timeline
        self.timeline: list[dict[str, Any]] = []
        self.backward_window: list[float] = []
        self._t0 = time.perf_counter()
        with torch.no_grad():  # every replica starts from rank 0's weights and buffers
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t, src=dist.get_global_rank(process_group, 0) if process_group else 0,
                               group=process_group)
        self._params = _unique_trainable(module)
        self._pending: list[Any] = []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.finish_gradient_synchronization()  # never let a new step race a previous step's all-reduce
        if self.record_timeline:
            self.backward_window = []
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Inside this block backward() only accumulates local gradients; the next synced backward
        all-reduces the sum. Use it for every micro-batch of an accumulation step but the last."""
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    def _allreduce(self, tensor: torch.Tensor, label: str) -> Any:
        tensor.div_(self.world_size)  # average: the sum of (g_i / N) over N ranks is the mean gradient
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        self.allreduce_calls += 1
        if self.record_timeline:
            entry = {"name": label, "bytes": tensor.numel() * tensor.element_size(), "start": self._now()}
            self.timeline.append(entry)
            work.get_future().then(lambda _fut, e=entry: e.__setitem__("end", self._now()))
        return work

    def finish_gradient_synchronization(self) -> None:
        """Wait for every outstanding all-reduce. Call it after ``backward()``, before ``optimizer.step()``."""
        for work in self._pending:
            work.wait()
        self._pending.clear()


class DataParallel(_SyncBase):
    """One asynchronous all-reduce per gradient tensor, launched as soon as that gradient is ready."""

    def __init__(self, module: nn.Module, process_group: Any = None, record_timeline: bool = False):
        super().__init__(module, process_group, record_timeline)
        for name, p in self._params:
            # Fires once per backward, after *all* contributions to p.grad were added: a tied weight
            # used by two layers is all-reduced once, with both layers' gradients in it.
            p.register_post_accumulate_grad_hook(lambda param, name=name: self._on_grad_ready(name, param))

    def _on_grad_ready(self, name: str, param: nn.Parameter) -> None:
        if self.record_timeline and not self.backward_window:
            self.backward_window.append(self._now())
        if self.require_backward_grad_sync:
            self._pending.append(self._allreduce(param.grad, name))
        if self.record_timeline:
            self.backward_window[1:] = [self._now()]


class BucketedDataParallel(_SyncBase):
    """Gradients packed into ~``bucket_cap_mb`` buckets; one all-reduce per bucket once it is full.

    Buckets are filled in reverse registration order, roughly the order backward produces
    gradients, so the first bucket fills (and starts communicating) early in the backward pass.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, process_group: Any = None,
                 record_timeline: bool = False):
        super().__init__(module, process_group, record_timeline)
        cap = bucket_cap_mb * 1024 * 1024
        self.buckets: list[list[tuple[str, nn.Parameter]]] = [[]]
        size = 0
        for name, p in reversed(self._params):
            nbytes = p.numel() * p.element_size()
            if self.buckets[-1] and size + nbytes > cap:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append((name, p))
            size += nbytes
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for _, p in bucket}
        self._ready: list[set[int]] = [set() for _ in self.buckets]
        self._flat: dict[int, torch.Tensor] = {}
        for _, p in self._params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if self.record_timeline and not self.backward_window:
            self.backward_window.append(self._now())
        if self.require_backward_grad_sync:
            i = self._bucket_of[id(param)]
            self._ready[i].add(id(param))
            if len(self._ready[i]) == len(self.buckets[i]):
                self._launch(i)
        if self.record_timeline:
            self.backward_window[1:] = [self._now()]

    def _launch(self, i: int) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in self.buckets[i]]
        self._flat[i] = torch.cat([g.reshape(-1) for g in grads])  # one message for the whole bucket
        self._pending.append(self._allreduce(self._flat[i], f"bucket {i} ({len(grads)} tensors)"))

    def finish_gradient_synchronization(self) -> None:
        if self.require_backward_grad_sync:
            for i, ready in enumerate(self._ready):  # a parameter unused this step: send its bucket anyway
                if ready and len(ready) < len(self.buckets[i]):
                    self._launch(i)
        super().finish_gradient_synchronization()
        for i, flat in self._flat.items():  # unpack the averaged buckets into .grad
            offset = 0
            for _, p in self.buckets[i]:
                n = p.numel()
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.copy_(flat[offset:offset + n].view_as(p))
                offset += n
        self._flat.clear()
        self._ready = [set() for _ in self.buckets]


def counting_allreduce_hook(counter: list[int]):
    """A DDP communication hook that counts all-reduces: ``ddp.register_comm_hook(None, hook)``.

    Torch DDP calls its hook once per bucket per synced backward; ``counter[0]`` then says how many
    collectives ran (gradient accumulation with ``no_sync`` should make it drop).
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):  # no annotations: DDP inspects them, and ours are strings (__future__)
        counter[0] += 1
        return allreduce_hook(state, bucket)

    return hook
