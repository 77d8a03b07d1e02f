"""dtlab — the helpers shared by the distributed-training course and your own notebooks.

Its folders are its map. At the top, what a learner imports, one module per concept:

    dtlab.environment  what the machine has; backend/device/process count (nccl+GPUs or gloo+CPU)
    dtlab.distributed  rank/world helpers, set-up and teardown, rank-0-only work, seeding
    dtlab.launch       run a function (even one defined in a notebook) on N processes
    dtlab.processes    stopping what was started: wait until processes are gone, then force the rest
    dtlab.models       MLP, SmallResNet, TinyGPT, count_parameters; LogitsOnly (a Hugging Face LM, logged)
    dtlab.activations  activation memory measured (allocator, saved tensors); recomputation per block
    dtlab.data         deterministic synthetic data, scikit-learn digits, DistributedLoader
    dtlab.text         real text with no download, a BPE learnt from it, token rows (also packed by Spark)
    dtlab.delta        a Delta table: Spark's on Databricks (Unity Catalog names checked), delta-rs elsewhere
    dtlab.shards       a table as shards in a volume; ShardStream: each rank's samples once, resumable at any N
    dtlab.pretrained   your Hugging Face folder into FSDP2 (meta, shard, broadcast from rank 0); back to a folder
    dtlab.checkpoint   atomic save, safe load, exact training state, periodic Checkpointer
    dtlab.sharded_checkpoint  DCP checkpoints: one file per rank, any world size loads them; manifest, async
    dtlab.resumable    the training loop that resumes exactly after being killed (notebook 10)
    dtlab.faults       faults on purpose: kill a checkpoint writer, a stuck or dead peer
    dtlab.measure      StepTimer, throughput, profiler breakdown, max_diff against the rounding bound
    dtlab.live         LiveView: progress + loss curve in Jupyter, plain lines headless
    dtlab.bandwidth    collective timing, algbw/busbw, memory-copy ceiling, collectives counted
    dtlab.precision    number formats; a DDP compression hook that counts its bytes
    dtlab.ds_config    build and validate DeepSpeed configs
    dtlab.tracking     MLflow from rank 0: local SQLite store, Databricks, local server
    dtlab.spark        the Databricks Spark session, or a quiet local one; task slots checked
    dtlab.raytrain     Ray for the lessons: a quiet local Ray, data as Parquet, requests checked, strays found
    dtlab.notebook     notebook parameters from Databricks widgets, and Claims: what a lesson asserts

Then four folders:

    dtlab.parallel     each strategy from scratch (data_parallel, zero, fsdp, tensor, pipeline, context,
                       ulysses, expert) beside the thin wrappers of its PyTorch API (fsdp2, dtensor, pipelining),
                       the named device mesh that composes them (mesh) and the side-by-side measurement
    dtlab.planner      will it fit, how fast, which strategy (``dtlab advise``): hardware facts, formulas,
                       cost model, advice, the speed-up model, held to published training runs
    dtlab.exercises    the graded build exercises: check("03.bucketed_ddp", YourClass) runs your code on N
                       processes against one process and says what is wrong, where and why (one module each)
    dtlab.tooling      the course's own tooling: the ``dtlab`` command (cli), the notebook runner (runner),
                       the website, the Databricks job summary (jobs) and cluster validation (clusters)

``dtlab.memory`` and ``dtlab.advise`` are old names of the planner's parts, and the modules that moved
into the folders (``dtlab.fsdp2``, ``dtlab.hardware``, ``dtlab.course``, ...) keep their old paths: each
works for one release with a DeprecationWarning naming the new one.

Modules load on first use, so ``import dtlab`` is quick and ``dtlab.checkpoint`` just works.
Try ``help(dtlab.checkpoint)``, or ``dtlab env`` in a shell.
"""

import importlib

from dtlab import _compat  # noqa: F401  (work-arounds for the learner's torch and DeepSpeed, on any dtlab import)
from dtlab._moved import MOVED, install_old_paths

install_old_paths()

__version__ = "0.1.0"

def _find_modules() -> tuple[str, ...]:
    """The package's public modules and subpackages, found on disk (names starting with ``_`` are private)."""
    import pkgutil

    return tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")))


#: The modules ``dtlab.<name>`` loads on first use (PEP 562), found rather than listed by hand.
MODULES = _find_modules()


def __getattr__(name: str):
    if name in MODULES or name in MOVED:
        return importlib.import_module(f"dtlab.{name}")
    raise AttributeError(f"module 'dtlab' has no attribute {name!r}. Its modules: {', '.join(MODULES)}")


def __dir__() -> list[str]:
    return sorted([*globals(), *MODULES])
