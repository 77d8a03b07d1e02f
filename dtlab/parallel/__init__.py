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
    dtlab.parallel.mesh           a checked, named device mesh for composing parallelism (notebook 16)
    dtlab.parallel.side_by_side   DDP, ZeRO-3, FSDP2 and the scratch FSDP trained side by side: step time, bytes

Import the one you need, e.g. ``from dtlab.parallel.data_parallel import DataParallel``.
"""

import importlib

#: The strategies, loaded on first use (``dtlab.parallel.zero`` works after ``import dtlab``).
STRATEGIES = ("data_parallel", "zero", "fsdp", "tensor", "pipeline", "context", "ulysses", "expert")
#: PyTorch's counterparts and the tools that compose and compare the strategies.
WRAPPERS = ("fsdp2", "dtensor", "pipelining", "mesh", "side_by_side")


def __getattr__(name: str):
    if name in STRATEGIES or name in WRAPPERS:
        return importlib.import_module(f"dtlab.parallel.{name}")
    raise AttributeError(f"module 'dtlab.parallel' has no attribute {name!r}. Strategies: {', '.join(STRATEGIES)}; "
                         f"PyTorch's: {', '.join(WRAPPERS)}")
