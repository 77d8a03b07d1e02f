"""PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``): which torch has it, and what a rank holds.

``fully_shard(module, mesh=...)`` turns each parameter of ``module`` into a ``DTensor`` whose local
part is this rank's slice (dimension 0 split N ways). The lessons need three readings of that:

* ``hsdp_problem(device)`` — why HSDP (a replicate x shard mesh) cannot run here ("" when it can);
* ``AVAILABLE`` / ``require()`` — the public API is in torch >= 2.6 (Databricks Runtime 15.4 LTS ML
  has torch 2.3, where only the ``torch.distributed._composable`` prototype exists, without
  ``CPUOffloadPolicy``): ``require()`` raises a ``RuntimeError`` that names the version.
* ``held_elements(model, optimizer)`` — elements this rank keeps: parameters, gradients and
  optimizer state (the local parts of the DTensors), comparable with ``dtlab.planner.formulas``.
* ``unsharded_elements(model)`` — parameter elements currently gathered in full (after a forward
  with ``reshard_after_forward=False`` they stay; with ``True`` they are freed).
* ``full_state(model)`` — the whole model as plain tensors on every rank (a collective).
"""

from __future__ import annotations

from typing import Any

import torch

#: The torch version from which ``torch.distributed.fsdp.fully_shard`` is public.
NEEDS_TORCH = "2.6"

try:
    from torch.distributed.fsdp import fully_shard as _fully_shard  # noqa: F401

    AVAILABLE = True
except ImportError:
    AVAILABLE = False


#: The first torch measured to run HSDP (``fully_shard`` on a 2-D replicate x shard mesh) on CPU processes.
HSDP_CPU_NEEDS_TORCH = (2, 13)


def hsdp_problem(device: str) -> str:
    """Why FSDP2's HSDP cannot run here on ``device`` (``"cpu"`` or ``"cuda"``); ``""`` when it can.

    torch 2.7.0's FSDP2 (Databricks Runtime 17.3 LTS ML) fails HSDP on CPU processes: its all-reduce between
    replicas expects an event from a device stream, which a CPU does not record (``assert all_reduce_event is
    not None``). Measured to run from torch 2.13 (the versions between were not measured), and on GPUs.
    """
    from dtlab._compat import _version

    if not AVAILABLE:
        return f"fully_shard needs torch >= {NEEDS_TORCH} (this is {torch.__version__})"
    if device == "cpu" and _version() < HSDP_CPU_NEEDS_TORCH:
        return (f"HSDP on CPU processes fails in torch {torch.__version__}'s FSDP2 (its replica all-reduce waits on "
                "a stream event a CPU does not record). Fix: torch >= 2.13, or GPUs with nccl")
    return ""


def require() -> None:
    """Raise ``RuntimeError`` naming the torch version FSDP2 needs, when this torch lacks it."""
    if not AVAILABLE:
        raise RuntimeError(f"FSDP2 (torch.distributed.fsdp.fully_shard) needs torch >= {NEEDS_TORCH}; this is "
                           f"{torch.__version__}. Fix: use a runtime with a newer torch (or "
                           "pip install 'torch>=2.6'), or dtlab.parallel.fsdp.ScratchFSDP, which runs on 2.3.")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def held_elements(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Elements this rank holds: ``params`` and ``grads`` (local slices) and ``optimizer`` state.

    Read gradients after ``backward()`` and optimizer state after the first ``step()``.
    """
    params = list(model.parameters())
    held = {"params": sum(_local(p).numel() for p in params),
            "grads": sum(_local(p.grad).numel() for p in params if p.grad is not None)}
    state: Any = optimizer.state.values() if optimizer is not None else []
    held["optimizer"] = sum(_local(t).numel() for s in state for t in s.values() if torch.is_tensor(t) and t.dim())
    return held


def unsharded_elements(model: torch.nn.Module) -> int:
    """Parameter elements held in full right now (FSDP2 swaps a gathered parameter in for its DTensor)."""
    return sum(p.numel() for p in model.parameters() if not hasattr(p, "to_local"))


@torch.no_grad()
def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every DTensor gathered into a plain tensor; every rank must call it."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def shard_blocks(model: torch.nn.Module, mesh: Any, blocks: str = "blocks", **options: Any) -> torch.nn.Module:
    """``fully_shard`` each block of ``model`` (the ``ModuleList`` at the dotted path ``blocks``: ``"blocks"`` for
    TinyGPT, ``"model.layers"`` for a Hugging Face Llama), then the model itself (what is left: embeddings, the last
    norm, the output layer), all on ``mesh``; returns ``model``. ``options`` go to every ``fully_shard`` call
    (``mp_policy``, ``reshard_after_forward``...). One all-gather per block then brings in one block's weights at a
    time. Apply recomputation (``dtlab.activations.recompute``) first.
    """
    require()
    from torch.distributed.fsdp import fully_shard

    from dtlab.activations import blocks_of

    for block in blocks_of(model, blocks):
        fully_shard(block, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return model
