"""Parallelism built from scratch: one file per strategy, each readable in one sitting.

Each module is the naive-but-correct version of what a library does for you, with its own small
communication helpers (on ``dtlab.distributed.GroupTally``: a process group and a tally of what
was sent) and no global state, so a learner can read it beside the library's API
and the tests can compare it with a single process:

    dtlab.parallel.data_parallel  DDP: per-tensor and bucketed gradient all-reduce, no_sync
    dtlab.parallel.zero           ZeRO-1: optimizer state sharded over ranks; what a DeepSpeed rank holds
    dtlab.parallel.fsdp           FSDP (ZeRO-3): weights sharded, gathered per layer, gradients reduce-scattered
    dtlab.parallel.tensor         tensor parallelism: column/row-parallel layers, heads and vocabulary split
    dtlab.parallel.pipeline       pipeline parallelism: stages over ranks, GPipe and 1F1B schedules
    dtlab.parallel.context        context parallelism: ring attention over a sequence split across ranks
    dtlab.parallel.expert         expert parallelism: a mixture-of-experts layer, experts spread over ranks

Import the one you need, e.g. ``from dtlab.parallel.data_parallel import DataParallel``.
"""

import importlib

#: The strategies, loaded on first use (``dtlab.parallel.zero`` works after ``import dtlab``).
STRATEGIES = ("data_parallel", "zero", "fsdp", "tensor", "pipeline", "context", "expert")


def __getattr__(name: str):
    if name in STRATEGIES:
        return importlib.import_module(f"dtlab.parallel.{name}")
    raise AttributeError(f"module 'dtlab.parallel' has no attribute {name!r}. Strategies: {', '.join(STRATEGIES)}")
