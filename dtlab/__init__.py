"""dtlab — the helpers shared by the distributed-training course and your own notebooks.

One module per concept; import the one you need:

    dtlab.environment  what the machine has; backend/device/process count (nccl+GPUs or gloo+CPU)
    dtlab.distributed  rank/world helpers, set-up and teardown, rank-0-only work, seeding
    dtlab.models       MLP, SmallResNet, TinyGPT, count_parameters
    dtlab.data         deterministic synthetic data, scikit-learn digits, DistributedLoader
    dtlab.checkpoint   atomic save, safe load, exact training state, periodic Checkpointer
    dtlab.sharded_checkpoint  DCP checkpoints: one file per rank, any world size loads them; atomic, checked
    dtlab.resumable    the training loop that resumes exactly after being killed (notebook 10)
    dtlab.faults       faults on purpose: kill a checkpoint writer, a stuck or dead peer
    dtlab.tracking     MLflow from rank 0: local SQLite store, Databricks, local server
    dtlab.measure      StepTimer, throughput, profiler breakdown by training phase
    dtlab.live         LiveView: progress + loss curve in Jupyter, plain lines headless
    dtlab.launch       run a function (even one defined in a notebook) on N processes
    dtlab.parallel     from-scratch strategies, one file each: data_parallel (DDP), zero (ZeRO-1), fsdp (FSDP),
                       tensor, pipeline, context (ring attention), expert (mixture of experts)
    dtlab.fsdp2        PyTorch's fully_shard: which torch has it, what a rank holds
    dtlab.dtensor      PyTorch's DTensor names on torch 2.3 and newer; collectives counted, activations saved
    dtlab.pipelining   which torch runs torch.distributed.pipelining, on which backend
    dtlab.composition  a checked, named device mesh for composing parallelism
    dtlab.planner      will it fit, how fast, which strategy: formulas, cost model, advice (``dtlab advise``),
                       held to published training runs
    dtlab.side_by_side DDP, ZeRO-3, FSDP2 and the scratch FSDP trained side by side: step time, bytes on the wire
    dtlab.bandwidth    collective timing, algbw/busbw, memory-copy ceiling
    dtlab.spark        the Databricks Spark session, or a quiet local one
    dtlab.raytrain     Ray for the lessons: a quiet local Ray, data as Parquet, requests checked, strays found
    dtlab.hardware     GPUs, instance types and clusters: memory, FLOP/s, links (one home for these facts)
    dtlab.memory, dtlab.advise  old names of dtlab.planner's parts (kept one release, with a warning)
    dtlab.ds_config    build and validate DeepSpeed configs
    dtlab.precision    number formats; a DDP compression hook that counts its bytes
    dtlab.speedup      the speed-up model (compute vs all-reduce) and its measurement
    dtlab.clusters     validate Databricks cluster files and the bundle offline
    dtlab.notebook     notebook parameters from Databricks widgets
    dtlab.course       run the course notebooks headless (``dtlab course run``)
    dtlab.website      a course run as a static website, checked page by page in headless Chromium (``make site``)
    dtlab.jobs         the Databricks job's summary of every lesson's status
    dtlab.cli          the ``dtlab`` command: env, advise (memory), course, site, clusters

Modules load on first use, so ``import dtlab`` is quick and ``dtlab.checkpoint`` just works.
Try ``help(dtlab.checkpoint)``, or ``dtlab env`` in a shell.
"""

import importlib

from dtlab import _compat  # noqa: F401  (work-arounds for the learner's torch and DeepSpeed, on any dtlab import)

__version__ = "0.1.0"

def _find_modules() -> tuple[str, ...]:
    """The package's public modules and subpackages, found on disk (names starting with ``_`` are private)."""
    import pkgutil

    return tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")))


#: The modules ``dtlab.<name>`` loads on first use (PEP 562), found rather than listed by hand.
MODULES = _find_modules()


def __getattr__(name: str):
    if name in MODULES:
        return importlib.import_module(f"dtlab.{name}")
    raise AttributeError(f"module 'dtlab' has no attribute {name!r}. Its modules: {', '.join(MODULES)}")


def __dir__() -> list[str]:
    return sorted([*globals(), *MODULES])
