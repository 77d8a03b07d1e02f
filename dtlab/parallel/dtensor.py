"""PyTorch's DTensor and tensor-parallel API under one set of names, on torch 2.3 and newer.

Torch 2.4 made DTensor public: ``torch.distributed.tensor`` has ``DTensor``, ``Shard``,
``Replicate``, ``Partial`` and ``distribute_tensor``, and ``torch.distributed.tensor.debug`` has
``CommDebugMode``. Torch 2.3 (Databricks Runtime 15.4 LTS ML) has the same things in
``torch.distributed._tensor`` (``Partial`` is ``_Partial`` there). Import them from here and a
lesson runs on both::

    from dtlab.parallel.dtensor import DTensor, Shard, Replicate, Partial, distribute_tensor, CommDebugMode

``parallelize_module``, ``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel`` and
``PrepareModuleInput`` are in ``torch.distributed.tensor.parallel`` in both (on 2.3 give
``PrepareModuleInput`` both ``input_layouts`` and ``desired_input_layouts``).

Helpers the lessons use to look at what the API did:

* ``comm_counts(mode)`` — a ``CommDebugMode``'s counts by short name (``all_reduce``, ``all_gather``,
  ``reduce_scatter``, ``all_to_all``);
* ``full(t)`` — a plain tensor from a DTensor (gathered) or a tensor;
* ``SavedActivations`` — bytes of the tensors autograd saves for backward inside a ``with`` block
  (each DTensor's local part: what this rank holds).
"""

from __future__ import annotations

import torch

from dtlab.measure import SavedBytes

try:                                                     # torch >= 2.4
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
except ImportError:                                      # torch 2.3
    from torch.distributed._tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed._tensor.placement_types import _Partial as Partial
try:
    from torch.distributed.tensor.debug import CommDebugMode
except ImportError:
    from torch.distributed._tensor.debug import CommDebugMode

__all__ = ["DTensor", "Partial", "Replicate", "Shard", "distribute_tensor", "CommDebugMode", "comm_counts", "full",
           "SavedActivations"]

_SHORT = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
          "all_to_all_single": "all_to_all", "allreduce_": "all_reduce", "_allgather_base_": "all_gather",
          "_reduce_scatter_base_": "reduce_scatter", "alltoall_base_": "all_to_all", "shard_dim_alltoall": "all_to_all"}


def comm_counts(mode: CommDebugMode) -> dict[str, int]:
    """The collectives a ``CommDebugMode`` saw, by short name, e.g. ``{"all_reduce": 4}``."""
    counts: dict[str, int] = {}
    for op, n in mode.get_comm_counts().items():
        name = str(op).split(".")[-1]
        short = _SHORT.get(name, name)
        counts[short] = counts.get(short, 0) + n
    return counts


def full(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor: a DTensor is gathered to its full value (a collective), a tensor returned as is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


class SavedActivations(SavedBytes):
    """``dtlab.measure.SavedBytes`` under the name notebook 14 uses: the bytes autograd saves for backward
    inside the ``with`` block, a DTensor counting its local part."""
