"""The second layer: rules the strict models cannot express, about GPUs and one process per GPU.

* a GPU node type needs a GPU ML runtime (``...-gpu-ml-...``), and a GPU runtime a GPU node type;
  node types come from ``dtlab.planner.hardware.NODE_TYPES`` (a GPU family missing there is refused);
* the single-node profile (``spark.databricks.cluster.profile: singleNode``) goes with
  ``num_workers: 0``, ``spark.master: local[...]`` and the tag ``ResourceClass: SingleNode``;
  ``num_workers: 0`` without the profile is a driver with no workers;
* a multi-node GPU cluster sets ``spark.task.resource.gpu.amount`` to 1 (one GPU per Spark task,
  so one TorchDistributor process per GPU), uses a fixed ``num_workers`` (no autoscale), and any
  ``spark.executor.resource.gpu.amount`` equals the node's GPU count;
* **process counts**: the optional tag ``custom_tags.dtlab_processes`` must equal what the cluster
  offers: the node's GPUs on a single node (``local_mode=True``), ``num_workers x GPUs per node``
  on a multi-node cluster (``local_mode=False``);
* a node type being retired (``NodeType.retiring``: P3) is refused, naming a current one;
* spot clusters keep an on-demand driver (``first_on_demand >= 1``); all-purpose clusters set
  ``autotermination_minutes``.
"""

from __future__ import annotations

import re

from dtlab.planner import hardware
from dtlab.planner.hardware import NodeType
from dtlab.tooling.clusters.problems import join, suggest

#: GPU node types the course knows: ``dtlab.planner.hardware.NODE_TYPES`` (add a row there to use another one).
GPU_NODE_TYPES: dict[str, NodeType] = hardware.NODE_TYPES


def node_type(spec: dict) -> NodeType | None:
    """The ``NodeType`` of a cluster spec's ``node_type_id``.

    Args:
        spec: a cluster spec (the loaded YAML of a cluster file, or a job cluster's ``new_cluster``).

    Returns:
        The node type from ``dtlab.planner.hardware``, or None for a CPU or unknown type.
    """
    return GPU_NODE_TYPES.get(str(spec.get("node_type_id", "")))


def is_single_node(spec: dict) -> bool:
    """Whether ``spec`` uses the single-node profile (or the newer ``is_single_node: true``).

    Args:
        spec: a cluster spec.

    Returns:
        True for a single-node cluster (its driver's GPUs train, TorchDistributor ``local_mode=True``).
    """
    conf = spec.get("spark_conf") or {}
    return conf.get("spark.databricks.cluster.profile") == "singleNode" or spec.get("is_single_node") is True


def cluster_problems(spec: dict, where: str = "", all_purpose: bool = True) -> list[str]:
    """The course's own rules (see the module docstring) for one cluster spec.

    Args:
        spec: a cluster spec that the strict ``Cluster`` model already accepted.
        where: its key path in the file ("" for a cluster file).
        all_purpose: False for a job cluster (it ends with its run, so no autotermination needed).

    Returns:
        Problems as ``"key.path: what. Fix: how"``; empty when the spec follows every rule.
    """
    at = lambda key: join(where, key)  # the key path inside ``where``
    problems: list[str] = []
    node_id = str(spec.get("node_type_id", ""))
    runtime = str(spec.get("spark_version", ""))
    conf = spec.get("spark_conf") or {}
    tags = spec.get("custom_tags") or {}
    gpu = GPU_NODE_TYPES.get(node_id)
    unresolved = "${" in node_id + runtime  # an interpolation only the deployed bundle knows: no guessing
    if not unresolved and gpu is None and hardware.has_gpus(node_id):
        problems.append(f"{at('node_type_id')}: {node_id!r} is a GPU instance type dtlab does not know. "
                        f"Fix: {suggest(node_id, list(GPU_NODE_TYPES))} "
                        "(or add it to dtlab.planner.hardware.NODE_TYPES)")
    if gpu and gpu.retiring:
        problems.append(f"{at('node_type_id')}: {node_id}: {gpu.retiring}")
    if gpu and not unresolved and "-gpu-ml-" not in runtime:
        problems.append(f"{at('spark_version')}: {runtime!r} has no CUDA libraries, but {node_id} is a GPU node. "
                        "Fix: a GPU ML runtime, e.g. spark_version: 15.4.x-gpu-ml-scala2.12")
    if not gpu and not unresolved and "-gpu-" in runtime and not hardware.has_gpus(node_id):
        problems.append(f"{at('spark_version')}: the GPU runtime {runtime!r} on {node_id or 'no node type'!r}, "
                        "which has no GPU. Fix: a GPU node_type_id such as g5.12xlarge, or a CPU runtime "
                        "(e.g. 15.4.x-cpu-ml-scala2.12)")

    workers = spec.get("num_workers")
    if isinstance(workers, str) and workers.isdigit():
        workers = int(workers)
    if is_single_node(spec):
        if workers not in (0, None) or spec.get("autoscale"):
            problems.append(f"{at('num_workers')}: the single-node profile with {workers or 'autoscaled'} workers. "
                            "Fix: num_workers: 0 (or remove spark.databricks.cluster.profile: singleNode "
                            "for a multi-node cluster)")
        if not str(conf.get("spark.master", "")).startswith("local"):
            problems.append(f"{at('spark_conf')}.spark.master: a single node runs Spark in local mode. "
                            "Fix: spark.master: \"local[*, 4]\"")
        if tags.get("ResourceClass") != "SingleNode":
            problems.append(f"{at('custom_tags')}.ResourceClass: a single-node cluster is tagged SingleNode. "
                            "Fix: custom_tags: {ResourceClass: SingleNode}")
    elif spec.get("autoscale"):
        if gpu:
            problems.append(f"{at('autoscale')}: a GPU training cluster that grows and shrinks changes the number "
                            "of processes under a running job. Fix: a fixed num_workers instead of autoscale")
    elif workers in (0, None):
        problems.append(f"{at('num_workers')}: {workers} workers without the single-node profile is a driver with "
                        "nothing to run Spark tasks (TorchDistributor(local_mode=False) waits forever). Fix: "
                        "num_workers >= 1, or the single-node profile: spark_conf spark.databricks.cluster.profile: "
                        "singleNode, spark.master: \"local[*, 4]\", custom_tags ResourceClass: SingleNode")
    elif gpu:
        amount = conf.get("spark.task.resource.gpu.amount")
        if amount is None:
            problems.append(f"{at('spark_conf')}: a multi-node GPU cluster needs spark.task.resource.gpu.amount, "
                            "or Spark tasks get no GPU. Fix: spark.task.resource.gpu.amount: \"1\"")
        elif not re.fullmatch(r"\d+", str(amount).strip()):
            problems.append(f"{at('spark_conf')}.spark.task.resource.gpu.amount: {amount!r}: PySpark 3.5's "
                            "TorchDistributor reads it with int(), so anything but a whole number raises ValueError "
                            "before training starts. Fix: spark.task.resource.gpu.amount: \"1\"")
        elif int(amount) == 0:
            problems.append(f"{at('spark_conf')}.spark.task.resource.gpu.amount: 0 gives Spark tasks no GPU: "
                            "TorchDistributor(use_gpu=True) refuses to start (\"was unset\"). Fix: "
                            "spark.task.resource.gpu.amount: \"1\" (0 is for a Ray on Spark cluster)")
        elif int(amount) != 1:
            problems.append(f"{at('spark_conf')}.spark.task.resource.gpu.amount: {amount} gives "
                            f"{gpu.gpus // int(amount)} tasks per {gpu.gpus}-GPU node, and PySpark 3.5's "
                            "TorchDistributor starts num_processes / amount tasks that each run one process with "
                            "torchrun --nnodes=num_processes: the world never assembles (SPARK-41916). Fix: "
                            "spark.task.resource.gpu.amount: \"1\"")
        per_executor = conf.get("spark.executor.resource.gpu.amount")
        if per_executor is not None and str(per_executor) not in (str(gpu.gpus), f"{gpu.gpus}.0"):
            problems.append(f"{at('spark_conf')}.spark.executor.resource.gpu.amount: {per_executor}, but a "
                            f"{node_id} has {gpu.gpus} GPUs. Fix: spark.executor.resource.gpu.amount: \"{gpu.gpus}\" "
                            "(or leave it out: Databricks sets it from the node)")

    declared = tags.get("dtlab_processes")
    if declared is not None and gpu and not problems:
        single = is_single_node(spec)
        offered = gpu.gpus if single else (workers or 0) * gpu.gpus
        how = (f"one per GPU of the single {node_id}" if single
               else f"{workers} workers x {gpu.gpus} GPUs per {node_id}, one process per GPU")
        if str(declared) != str(offered):
            problems.append(f"{at('custom_tags')}.dtlab_processes: {declared}, but this cluster runs {offered} "
                            f"processes ({how}). Fix: dtlab_processes: \"{offered}\", or change num_workers")

    aws = spec.get("aws_attributes") or {}
    on_demand = str(aws.get("first_on_demand") or 0)
    if str(aws.get("availability", "")).startswith("SPOT") and on_demand.isdigit() and int(on_demand) < 1:
        problems.append(f"{at('aws_attributes')}.first_on_demand: a spot driver can be reclaimed, ending the "
                        "cluster and every notebook's state. Fix: first_on_demand: 1 (an on-demand driver)")
    if all_purpose and not spec.get("autotermination_minutes"):
        problems.append(f"{at('autotermination_minutes')}: an all-purpose GPU cluster without it bills until "
                        "someone stops it. Fix: autotermination_minutes: 30")
    return problems
