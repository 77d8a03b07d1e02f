"""Parallelism built from scratch, one file per strategy, beside the thin wrappers of PyTorch's own API.

Each strategy module is the naive-but-correct version of what a library does for you, with its own
small communication helpers and no global state, so a learner can read it beside the library's API
and the tests can compare it with a single process. Tensor, pipeline, context (ring and Ulysses) and
expert parallelism count what they send with ``dtlab.distributed.GroupTally`` (a process group and a tally); data
parallelism counts its all-reduce calls and the scratch FSDP its gathers in flight, which is what
their lessons measure:

    dtlab.parallel.data_parallel  DDP: per-tensor and bucketed gradient all-reduce, no_sync
    dtlab.parallel.zero           ZeRO-1: optimizer state sharded over ranks; what a DeepSpeed rank holds
    dtlab.parallel.fsdp           FSDP (ZeRO-3): weights sharded, gathered per layer, gradients reduce-scattered
    dtlab.parallel.tensor         tensor parallelism: column/row-parallel layers, heads and vocabulary split
    dtlab.parallel.pipeline       pipeline parallelism: stages over ranks, GPipe, 1F1B and interleaved 1F1B
    dtlab.parallel.context        context parallelism: ring attention over a sequence split across ranks
    dtlab.parallel.ulysses        Ulysses sequence parallelism: heads and sequence swapped by all-to-all
    dtlab.parallel.expert         expert parallelism: a mixture-of-experts layer, experts spread over ranks

PyTorch's counterparts, each a thin wrapper that says which torch has the API and what a rank holds:

    dtlab.parallel.fsdp2          fully_shard (FSDP2): which torch has it, what a rank holds
    dtlab.parallel.dtensor        DTensor's names on torch 2.3 and newer; collectives counted, activations saved
    dtlab.parallel.pipelining     which torch runs torch.distributed.pipelining, on which backend
    dtlab.parallel.mesh           a checked, named device mesh for composing parallelism (notebook 17)
    dtlab.parallel.side_by_side   DDP, ZeRO-3, FSDP2 and the scratch FSDP trained side by side: step time, bytes

Import the one you need, e.g. ``from dtlab.parallel.data_parallel import DataParallel``.

``held_elements(model, optimizer=None)`` answers, for every sharded strategy, what this rank holds:
``{"params", "grads", "optimizer", ...}`` element counts, comparable with ``dtlab.planner.formulas``.
"""

import importlib
from typing import Any

#: The strategies, loaded on first use (``dtlab.parallel.zero`` works after ``import dtlab``).
STRATEGIES = ("data_parallel", "zero", "fsdp", "tensor", "pipeline", "context", "ulysses", "expert")
#: PyTorch's counterparts and the tools that compose and compare the strategies.
WRAPPERS = ("fsdp2", "dtensor", "pipelining", "mesh", "side_by_side")


def __getattr__(name: str):
    if name in STRATEGIES or name in WRAPPERS:
        return importlib.import_module(f"dtlab.parallel.{name}")
    raise AttributeError(f"module 'dtlab.parallel' has no attribute {name!r}. Strategies: {', '.join(STRATEGIES)}; "
                         f"PyTorch's: {', '.join(WRAPPERS)}")


def held_elements(model: Any, optimizer: Any = None) -> dict[str, int]:
    """Elements this rank holds of ``model`` and ``optimizer``: ``{"params", "grads", "optimizer"}`` (and what
    the strategy adds: DeepSpeed's ``master_weights``, the scratch FSDP's ``sharded_params``...), whatever
    the strategy: a DeepSpeed engine (``zero.held_elements``), a ``ScratchFSDP`` model (``fsdp.held_elements``),
    or a model sharded by PyTorch's ``fully_shard``, wrapped in DDP or plain (``fsdp2.held_elements``: the
    local parts of its DTensors). Read gradients after the backward that ends an accumulation cycle and the
    optimizer state after the first step.

    >>> held = held_elements(model, optimizer)        # doctest: +SKIP
    >>> held["optimizer"] / formulas.model_states(psi, N, 3).optimizer * 4    # doctest: +SKIP
    """
    if hasattr(model, "module") and hasattr(model, "optimizer") and hasattr(model, "backward"):   # DeepSpeed engine
        return importlib.import_module("dtlab.parallel.zero").held_elements(model, optimizer)
    fsdp = importlib.import_module("dtlab.parallel.fsdp")
    if isinstance(model, fsdp.ScratchFSDP):
        return fsdp.held_elements(model, optimizer)
    return importlib.import_module("dtlab.parallel.fsdp2").held_elements(model, optimizer)
