"""What a cluster definition gives a training job: nodes, GPUs, memory, bandwidths (``offers``).

The node's facts come from ``dtlab.planner.hardware``; the file says how many nodes train and how.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dtlab.planner import hardware
from dtlab.tooling.clusters.files import load
from dtlab.tooling.clusters.problems import ClusterConfigError
from dtlab.tooling.clusters.rules import GPU_NODE_TYPES, is_single_node, node_type


@dataclass(frozen=True)
class Offer:
    """What a cluster gives a training job: nodes, GPUs, memory and bandwidths (see ``offers``).

    ``gpu_memory_gb`` is the datasheet's label (24 for an A10G); ``gpu_memory_bytes`` is the exact
    total nvidia-smi reports (23,028 MiB = 24.15 GB), which ``dtlab.planner`` uses.
    """

    name: str
    node_type: str
    nodes: int            # nodes whose GPUs train (the driver on a single node, the workers otherwise)
    gpus_per_node: int
    gpu: str
    gpu_memory_gb: float  # per GPU, as the datasheet labels it
    cpu_memory_gib: float  # per node, as AWS lists it
    network_gbps: float   # between nodes, per node
    intra_node_gbs: float  # between GPUs of one node (GB/s, planning figure; see dtlab.planner.hardware.NodeType)
    local_mode: bool      # TorchDistributor's local_mode for this cluster
    processes: int        # training processes: one per GPU
    gpu_memory_bytes: int = 0  # per GPU, as nvidia-smi reports it

    @property
    def gpus(self) -> int:
        """GPUs that train: nodes x GPUs per node."""
        return self.nodes * self.gpus_per_node

    @property
    def gpu_memory_gb_total(self) -> float:
        """Datasheet GPU memory of all training GPUs together."""
        return self.gpus * self.gpu_memory_gb

    @property
    def inter_node_gbs(self) -> float:
        """The network in gigabytes/s (what an all-reduce across nodes can use at best)."""
        return self.network_gbps / 8

    @property
    def cluster(self) -> hardware.Cluster:
        """The training nodes as a ``dtlab.planner.hardware.Cluster`` (the planner's ``advise(cluster=)``)."""
        return hardware.Cluster(self.name or self.node_type, hardware.node(self.node_type), self.nodes)


def offers(source: str | Path | dict) -> Offer:
    """What the GPU cluster in ``source`` offers a training job.

    Args:
        source: a cluster file, or an already loaded cluster spec.

    Returns:
        Nodes that train, GPUs, memory and bandwidths, TorchDistributor's ``local_mode`` and the
        number of training processes (one per GPU).

    Raises:
        ClusterConfigError: for a spec that is not a GPU cluster dtlab knows.
    """
    spec = load(source) if not isinstance(source, dict) else source
    gpu = node_type(spec)
    if gpu is None:
        raise ClusterConfigError([f"{source if not isinstance(source, dict) else 'spec'}: node_type_id "
                                  f"{spec.get('node_type_id')!r} is not a GPU node type dtlab knows. "
                                  f"Fix: one of {', '.join(GPU_NODE_TYPES)}"])
    single = is_single_node(spec)
    nodes = 1 if single else int(spec.get("num_workers") or 0)
    return Offer(name=str(spec.get("cluster_name", "")), node_type=gpu.name, nodes=nodes,
                 gpus_per_node=gpu.gpus, gpu=gpu.gpu, gpu_memory_gb=gpu.gpu_memory_gb, cpu_memory_gib=gpu.memory_gib,
                 network_gbps=gpu.network_gbps, intra_node_gbs=gpu.intra_node_gbs, local_mode=single,
                 processes=nodes * gpu.gpus, gpu_memory_bytes=gpu.gpu_memory_bytes)
