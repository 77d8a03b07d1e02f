"""dtlab — the helpers shared by the distributed-training course and your own notebooks.

One module per concept; import the one you need:

    dtlab.environment  what the machine has; backend/device/process count (nccl+GPUs or gloo+CPU)
    dtlab.distributed  rank/world helpers, set-up and teardown, rank-0-only work, seeding
    dtlab.models       MLP, SmallResNet, TinyGPT, count_parameters
    dtlab.data         deterministic synthetic data, scikit-learn digits, DistributedLoader
    dtlab.checkpoint   atomic save, safe load, exact training state, periodic Checkpointer
    dtlab.resumable    the training loop that resumes exactly after being killed (notebook 10)
    dtlab.faults       faults on purpose: kill a checkpoint writer, a stuck or dead peer
    dtlab.tracking     MLflow from rank 0: local SQLite store, Databricks, local server
    dtlab.measure      StepTimer, throughput, profiler breakdown by training phase
    dtlab.live         LiveView: progress + loss curve in Jupyter, plain lines headless
    dtlab.launch       run a function (even one defined in a notebook) on N processes
    dtlab.data_parallel  DDP from scratch: per-tensor and bucketed gradient all-reduce
    dtlab.bandwidth    collective timing, algbw/busbw, memory-copy ceiling
    dtlab.spark        the Databricks Spark session, or a quiet local one
    dtlab.zero         ZeRO-1 from scratch; what a DeepSpeed rank really holds
    dtlab.memory       memory per GPU for DDP and ZeRO stages; DeepSpeed's estimators; advice
    dtlab.ds_config    build and validate DeepSpeed configs
    dtlab.precision    number formats; a DDP compression hook that counts its bytes
    dtlab.speedup      the speed-up model (compute vs all-reduce) and its measurement
    dtlab.clusters     validate Databricks cluster files and the bundle offline
    dtlab.notebook     notebook parameters from Databricks widgets
    dtlab.course       run the course notebooks headless (``dtlab course run``)

Try ``help(dtlab.checkpoint)``, or ``dtlab env`` in a shell.
"""

__version__ = "0.1.0"
