"""Facts about hardware, in one place: GPUs, AWS GPU instances, and the clusters the course describes.

The planner (``dtlab.planner``), the cluster validator (``dtlab.tooling.clusters``), the command line and
the notebooks read their numbers from here, so a figure is corrected once::

    from dtlab.planner import hardware
    hardware.gpu("A10G")                  # GPU: 24.15 GB (nvidia-smi's 23,028 MiB), bf16, 70 TFLOP/s bf16
    hardware.node("g5.12xlarge")          # NodeType: 4 x A10G, 48 vCPUs, 192 GiB, 40 Gbps, PCIe
    hardware.cluster("g5.12xlarge x4")    # Cluster: 4 nodes = 16 GPUs (clusters/g5-12xlarge-4-nodes.yml)
    hardware.cluster("p4d.24xlarge x2")   # any known node type, "x N" nodes
    hardware.gpu("A10")                   # UnknownHardware: ... did you mean 'A10G'? known: T4, A10G, ...

**Units.** ``GB`` is 10**9 bytes (the unit of GPU datasheets and of the ZeRO paper); ``GiB`` is 2**30
bytes (AWS lists host memory in GiB; nvidia-smi prints MiB = 2**20 bytes). Networks are in gigabits
per second (Gbps, as AWS lists them), GPU-to-GPU bandwidth in gigabytes per second (GB/s).
Peak TFLOP/s are dense (no 2:4 sparsity), 10**12 floating-point operations per second.

To use another GPU or instance type, add a row to ``GPUS`` or ``NODE_TYPES`` with its sources.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, replace

GB = 10**9
GiB = 2**30
MiB = 2**20


class UnknownHardware(LookupError, ValueError):
    """A GPU, node type or cluster name this module does not know (the message lists the known ones)."""


@dataclass(frozen=True)
class GPU:
    """One GPU model: memory and peak arithmetic throughput.

    ``memory_bytes`` is the total memory nvidia-smi reports (with ECC on, as on AWS): an upper bound
    on what training can use. CUDA itself reports slightly less (``torch.cuda.mem_get_info``; on an
    A10G about 22,600-22,700 MiB of nvidia-smi's 23,028), and the CUDA context, communication
    buffers and fragmentation take more: ``dtlab.planner`` keeps a headroom for all of that.
    ``datasheet_gb`` is the figure printed on the datasheet ("24 GB"), for labels only.
    """

    name: str
    memory_bytes: int
    datasheet_gb: int
    bf16: bool            # bfloat16 supported by the tensor cores (Ampere and later)
    fp16_tflops: float    # peak dense fp16 tensor-core TFLOP/s (fp32 accumulate)
    bf16_tflops: float    # peak dense bf16 tensor-core TFLOP/s (0 where bf16 is not supported)
    fp32_tflops: float    # peak fp32 TFLOP/s without tensor cores

    @property
    def memory_gb(self) -> float:
        """Total memory in GB (10**9 bytes)."""
        return self.memory_bytes / GB

    def peak_flops(self, precision: str = "bf16") -> float:
        """Peak FLOP/s (not TFLOP/s) for ``precision``: ``"bf16"``, ``"fp16"`` or ``"fp32"``.

        Args:
            precision: the number format of the matrix multiplications.

        Returns:
            Floating-point operations per second at the datasheet peak (real training reaches
            perhaps 30-60% of it; notebook 00 measures this device's matmul speed).

        Raises:
            ValueError: for an unknown precision, or bf16 on a GPU without it (T4, V100).
        """
        if precision not in ("bf16", "fp16", "fp32"):
            raise ValueError(f"precision={precision!r}: use 'bf16', 'fp16' or 'fp32'")
        if precision == "bf16" and not self.bf16:
            raise ValueError(f"the {self.name} has no bf16 tensor cores. Fix: precision='fp16' (with a loss scaler)")
        return {"bf16": self.bf16_tflops, "fp16": self.fp16_tflops, "fp32": self.fp32_tflops}[precision] * 1e12


#: GPU models the course knows. Memory: the total nvidia-smi reports (MiB), as listed by Modal's
#: "Why does an NVIDIA H100 80GB card offer 85.52 GB?" (thundergolfer.com/blog/nvidia-gpu-memory-capacity)
#: and, for the A10G and V100, nvidia-smi / torch output from AWS g5 and p3 instances.
GPUS: dict[str, GPU] = {
    # NVIDIA T4 datasheet: 16 GB GDDR6, 65 TFLOPS mixed precision (fp16 tensor), 8.1 TFLOPS fp32; no bf16
    # (Turing). nvidia-smi: 15,360 MiB.
    "T4": GPU("T4", 15_360 * MiB, 16, False, 65.0, 0.0, 8.1),
    # NVIDIA A10G (AWS g5 only; NVIDIA publishes no A10G datasheet): 24 GB GDDR6; nvidia-smi shows
    # 23,028 MiB = 24.15 GB. Peaks as compiled by Baseten, "NVIDIA A10 vs A10G for ML model inference":
    # 70 TFLOPS bf16/fp16 tensor, 35 TFLOPS fp32 (the A10's datasheet says 125 and 31.2: the A10G runs
    # its tensor cores at a lower rate; a measured cuBLAS fp16 matmul on an A10G reaches ~67 TFLOP/s).
    "A10G": GPU("A10G", 23_028 * MiB, 24, True, 70.0, 70.0, 35.0),
    # NVIDIA V100 datasheet (SXM2, as in p3): 16 GB HBM2, 125 TFLOPS tensor (fp16), 15.7 TFLOPS fp32;
    # no bf16. torch/nvidia-smi on a p3: 16,160 MiB.
    "V100": GPU("V100", 16_160 * MiB, 16, False, 125.0, 0.0, 15.7),
    # NVIDIA A100 datasheet (SXM4 40GB, as in p4d): 312 TFLOPS bf16/fp16 tensor dense (624 with sparsity),
    # 19.5 TFLOPS fp32. nvidia-smi: 40,960 MiB.
    "A100": GPU("A100", 40_960 * MiB, 40, True, 312.0, 312.0, 19.5),
    # NVIDIA H100 datasheet (SXM5 80GB, as in p5): 1,979 TFLOPS bf16/fp16 tensor with sparsity = 989
    # dense; 67 TFLOPS fp32. nvidia-smi: 81,559 MiB.
    "H100": GPU("H100", 81_559 * MiB, 80, True, 989.0, 989.0, 67.0),
    # NVIDIA L4 datasheet (as in g6): 24 GB GDDR6; 242 TFLOPS bf16/fp16 tensor with sparsity = 121 dense;
    # 30.3 TFLOPS fp32. nvidia-smi: 23,034 MiB.
    "L4": GPU("L4", 23_034 * MiB, 24, True, 121.0, 121.0, 30.3),
    # NVIDIA L40S datasheet (as in g6e): 48 GB GDDR6 with ECC; 733 TFLOPS bf16/fp16 tensor (fp32 accumulate)
    # with sparsity = 366 dense (the datasheet's dense figure: 362.05); 91.6 TFLOPS fp32. nvidia-smi: 46,068 MiB.
    "L40S": GPU("L40S", 46_068 * MiB, 48, True, 362.0, 362.0, 91.6),
}


@dataclass(frozen=True)
class NodeType:
    """One GPU instance type: its GPUs, host CPUs and memory, and its bandwidths.

    ``network_gbps`` is the instance's network (gigabits/s; "up to" figures taken at their burst
    value). ``intra_node_gbs`` is a planning figure for GPU-to-GPU bandwidth inside the node
    (gigabytes/s per GPU, one direction): nominal NVLink where the GPUs have it; for PCIe-only
    nodes, what a collective can expect when traffic crosses the host (g5: ~10 GB/s, the figure
    notebook 08 uses). Measure your own with notebook 02 on the node.
    """

    name: str
    gpus: int
    gpu: str | GPU        # a key of GPUS (or a GPU, for a cluster described by hand: ``custom_cluster``)
    vcpus: int
    memory_gib: float     # host memory, in GiB as AWS lists it
    network_gbps: float
    intra_node_gbs: float
    interconnect: str
    retiring: str = ""    # why a new cluster should not use it (being retired), with the source; "" when current

    @property
    def gpu_type(self) -> GPU:
        """The ``GPU`` of this node type."""
        return self.gpu if isinstance(self.gpu, GPU) else GPUS[self.gpu]

    @property
    def gpu_memory_gb(self) -> float:
        """Memory per GPU as the datasheet labels it (24 for an A10G); ``gpu_memory_bytes`` is the exact figure."""
        return float(self.gpu_type.datasheet_gb)

    @property
    def gpu_memory_bytes(self) -> int:
        """Memory per GPU in bytes, as nvidia-smi reports it."""
        return self.gpu_type.memory_bytes

    @property
    def memory_bytes(self) -> int:
        """Host (CPU) memory of the node in bytes."""
        return int(self.memory_gib * GiB)

    @property
    def cpu_memory_bytes_per_gpu(self) -> float:
        """Host memory per GPU in bytes: where offloaded optimizer states and parameters go."""
        return self.memory_bytes / self.gpus


#: AWS GPU instance types the course knows. Sources: the AWS instance-type pages
#: (aws.amazon.com/ec2/instance-types/g4/, /g5/, /g6/, /g6e/, /p3/, /p4/, /p5/): GPUs, vCPUs, memory (GiB), network.
#: Columns: name, GPUs, GPU, vCPUs, memory GiB, network Gbps, GPU-to-GPU GB/s (planning), interconnect.
#: g6 (L4) and g6e (L40S) have no NVLink: their GPUs talk over PCIe Gen4 like g5's, so they get g5's planning
#: figure (10 GB/s, measured on g5 by notebook 08's model; not measured on g6 or g6e). g6e.xlarge's network is AWS's
#: "up to" figure (20 Gbps; only its 2.5 Gbps baseline was confirmed here).
_P3_RETIRING = ("Databricks no longer supports creating compute on P3, as AWS retires these instances (Databricks, "
                "\"GPU-enabled compute\", docs.databricks.com/aws/en/compute/gpu; AWS asked users to migrate off P3 by "
                "December 20, 2025). Fix: g6e (L40S), p4d (A100) or p5 (H100)")
NODE_TYPES: dict[str, NodeType] = {n.name: n for n in [
    NodeType("g4dn.xlarge", 1, "T4", 4, 16, 25, 0.0, "single GPU"),
    NodeType("g4dn.12xlarge", 4, "T4", 48, 192, 50, 8.0, "PCIe Gen3"),
    NodeType("g5.xlarge", 1, "A10G", 4, 16, 10, 0.0, "single GPU"),
    NodeType("g5.12xlarge", 4, "A10G", 48, 192, 40, 10.0, "PCIe Gen4, no NVLink"),
    NodeType("g5.24xlarge", 4, "A10G", 96, 384, 50, 10.0, "PCIe Gen4, no NVLink"),
    NodeType("g5.48xlarge", 8, "A10G", 192, 768, 100, 10.0, "PCIe Gen4, no NVLink"),
    NodeType("g6.xlarge", 1, "L4", 4, 16, 10, 0.0, "single GPU"),
    NodeType("g6.12xlarge", 4, "L4", 48, 192, 40, 10.0, "PCIe Gen4, no NVLink"),
    NodeType("g6.48xlarge", 8, "L4", 192, 768, 100, 10.0, "PCIe Gen4, no NVLink"),
    NodeType("g6e.xlarge", 1, "L40S", 4, 32, 20, 0.0, "single GPU"),
    NodeType("g6e.12xlarge", 4, "L40S", 48, 384, 100, 10.0, "PCIe Gen4, no NVLink"),
    NodeType("g6e.48xlarge", 8, "L40S", 192, 1536, 400, 10.0, "PCIe Gen4, no NVLink"),
    NodeType("p3.2xlarge", 1, "V100", 8, 61, 10, 0.0, "single GPU", _P3_RETIRING),
    NodeType("p3.8xlarge", 4, "V100", 32, 244, 10, 150.0, "NVLink 2", _P3_RETIRING),
    NodeType("p3.16xlarge", 8, "V100", 64, 488, 25, 150.0, "NVLink 2", _P3_RETIRING),
    NodeType("p4d.24xlarge", 8, "A100", 96, 1152, 400, 300.0, "NVSwitch"),
    NodeType("p5.48xlarge", 8, "H100", 192, 2048, 3200, 450.0, "NVSwitch"),
]}

#: AWS instance families with GPUs (a type of these families missing from NODE_TYPES is still a GPU node).
GPU_FAMILY = re.compile(r"^(g4ad|g4dn|g5g?|g6e?|gr6|p2|p3dn|p3|p4de?|p5e?n?)\.")


def has_gpus(instance_type: str) -> bool:
    """True when ``instance_type`` belongs to an AWS family with GPUs, whether or not ``NODE_TYPES`` lists it.

    Args:
        instance_type: an AWS instance type such as ``"g5.12xlarge"`` or ``"m5.xlarge"``.

    Returns:
        True for g4dn, g5, g6, p3, p4d, p5, ... types; False otherwise.
    """
    return bool(GPU_FAMILY.match(str(instance_type)))


@dataclass(frozen=True)
class Cluster:
    """``nodes`` identical nodes of one type: what a training job on them has.

    ``source`` names the course file that defines the cluster, where there is one.
    """

    name: str
    node: NodeType
    nodes: int
    source: str = ""

    @property
    def gpus(self) -> int:
        """GPUs in all nodes together."""
        return self.nodes * self.node.gpus

    @property
    def gpu(self) -> GPU:
        """The ``GPU`` of every node."""
        return self.node.gpu_type

    @property
    def inter_node_gbs(self) -> float:
        """The network between nodes in gigabytes/s (Gbps / 8): the best an all-reduce across nodes can use."""
        return self.node.network_gbps / 8

    @property
    def slowest_link_gbs(self) -> float:
        """GB/s of the slowest link a collective over all GPUs crosses (inside the node, or the network)."""
        if self.nodes == 1:
            return self.node.intra_node_gbs
        return min(self.node.intra_node_gbs or self.inter_node_gbs, self.inter_node_gbs)


def custom_cluster(gpus: int, gpu_memory_gb: float, gpus_per_node: int | None = None, tflops: float = 0.0,
                   bf16: bool = True, intra_node_gbs: float = 0.0, inter_node_gbs: float = 0.0,
                   host_memory_gb_per_gpu: float = 0.0, gpu_name: str | None = None,
                   gpu: GPU | str | None = None) -> Cluster:
    """A cluster described by its numbers rather than its name (for GPUs and instances the course does not list).

    Args:
        gpus: GPUs in all (must divide by ``gpus_per_node``).
        gpu_memory_gb: memory per GPU in GB (10**9 bytes).
        gpus_per_node: GPUs per node (default: ``gpus`` up to 8).
        tflops: peak dense 16-bit TFLOP/s per GPU; 0 when unknown (no step time can then be computed;
            nor for fp32, whose peak is not asked for).
        bf16: whether the GPU has bf16 tensor cores.
        intra_node_gbs: GPU-to-GPU GB/s inside a node (per GPU, one direction); 0 when unknown.
        inter_node_gbs: a node's network in GB/s (all its NICs together, one direction); 0 when unknown.
        host_memory_gb_per_gpu: CPU memory per GPU in GB (for offloading); 0 when unknown.
        gpu_name: what to call the GPU (default: its memory, "80 GB GPU"); a name starting with a known GPU's
            ("A100 80GB") lets the planner use what it knows of that GPU (its measured efficiency).
        gpu: a known GPU (``GPUS``' key or a ``GPU``): the cluster's GPUs are that one — its name, peaks and
            measured efficiency kept — with ``gpu_memory_gb`` of memory (an 80 GB part of a 40 GB datasheet),
            and ``tflops`` where given instead of its peak.

    Raises:
        ValueError: for sizes below 1, or GPUs that do not fill whole nodes (the message names the fix).
    """
    per_node = gpus_per_node or min(gpus, 8)
    if gpus < 1 or gpu_memory_gb <= 0 or per_node < 1:
        raise ValueError(f"gpus={gpus}, gpu_memory_gb={gpu_memory_gb:g}, gpus_per_node={per_node}: each must be "
                         "positive. Fix: e.g. gpus=64, gpu_memory_gb=32")
    if gpus % per_node:
        raise ValueError(f"{gpus} GPUs do not fill whole nodes of {per_node}. Fix: a multiple of {per_node} GPUs, "
                         "or another gpus_per_node")
    if gpu is not None:                                                  # a known GPU keeps what is known of it
        known = gpu if isinstance(gpu, GPU) else _lookup("GPU", gpu, GPUS)
        peaks = {"fp16_tflops": tflops, "bf16_tflops": tflops if known.bf16 else 0.0} if tflops else {}
        memory = int(gpu_memory_gb * GB)
        gpu_spec = replace(known, name=gpu_name or known.name, memory_bytes=memory, **peaks,
                           datasheet_gb=known.datasheet_gb if memory == known.memory_bytes else round(gpu_memory_gb))
    else:
        gpu_spec = GPU(gpu_name or f"{gpu_memory_gb:g} GB GPU", int(gpu_memory_gb * GB), round(gpu_memory_gb), bf16,
                       tflops, tflops if bf16 else 0.0, 0.0)              # fp32 peak: unknown
    node_spec = NodeType(f"{per_node} x {gpu_spec.name}", per_node, gpu_spec, 0,
                         host_memory_gb_per_gpu * per_node * GB / GiB, inter_node_gbs * 8,
                         intra_node_gbs if per_node > 1 else 0.0, "described by hand")
    return Cluster(f"{gpus} x {gpu_spec.name}", node_spec, gpus // per_node)


#: The clusters the course's files describe (clusters/*.yml), by name.
CLUSTERS: dict[str, Cluster] = {
    "g5.12xlarge": Cluster("g5.12xlarge", NODE_TYPES["g5.12xlarge"], 1, "clusters/g5-12xlarge-single-node.yml"),
    "g5.12xlarge x4": Cluster("g5.12xlarge x4", NODE_TYPES["g5.12xlarge"], 4, "clusters/g5-12xlarge-4-nodes.yml"),
}

#: The course's cluster: what ``dtlab advise`` assumes when told nothing else.
DEFAULT_CLUSTER = "g5.12xlarge"


def _lookup(kind: str, name: str, table: dict, known: str = "", suffix: str = ""):
    """``table[name]``, case-insensitively, or UnknownHardware with "did you mean" and the known names."""
    by_lower = {key.lower(): value for key, value in table.items()}
    found = by_lower.get(str(name).strip().lower())
    if found is not None:
        return found
    close = difflib.get_close_matches(str(name).strip().lower(), list(by_lower), n=1, cutoff=0.6)
    hint = f"did you mean {next(k for k in table if k.lower() == close[0]) + suffix!r}? " if close else ""
    raise UnknownHardware(f"unknown {kind} {str(name) + suffix!r}. Fix: {hint}known: {known or ', '.join(table)} "
                          "(or add it to dtlab.planner.hardware)")


def gpu(name: str | GPU) -> GPU:
    """The ``GPU`` called ``name`` (case does not matter).

    Args:
        name: a key of ``GPUS`` such as ``"A10G"``, or a ``GPU`` (returned as it is).

    Returns:
        The GPU's memory and peak throughput.

    Raises:
        UnknownHardware: for a name not in ``GPUS``; the message lists the known names.
    """
    return name if isinstance(name, GPU) else _lookup("GPU", name, GPUS)


def node(name: str | NodeType) -> NodeType:
    """The ``NodeType`` of the AWS instance type ``name``.

    Args:
        name: a key of ``NODE_TYPES`` such as ``"g5.12xlarge"``, or a ``NodeType`` (returned as it is).

    Returns:
        The instance type's GPUs, vCPUs, host memory and bandwidths.

    Raises:
        UnknownHardware: for a name not in ``NODE_TYPES``; the message lists the known names.
    """
    return name if isinstance(name, NodeType) else _lookup("node type", name, NODE_TYPES)


def cluster(name: str | Cluster) -> Cluster:
    """The ``Cluster`` called ``name``: one of ``CLUSTERS``, or ``"<node type> x<N>"`` for N nodes.

    Args:
        name: ``"g5.12xlarge"`` (one node), ``"g5.12xlarge x4"`` (four), ``"p4d.24xlarge x2"``, ...;
            a bare node type means one node. A ``Cluster`` is returned as it is.

    Returns:
        The cluster: node type, node count, and the course file that defines it (if any).

    Raises:
        UnknownHardware: for a node type not in ``NODE_TYPES`` or a malformed name.
    """
    if isinstance(name, Cluster):
        return name
    text = str(name).strip()
    named = {key.lower(): value for key, value in CLUSTERS.items()}
    if text.lower() in named:
        return named[text.lower()]
    match = re.fullmatch(r"(\S+?)(?:\s*x\s*(\d+))?", text, flags=re.I)
    if match and match.group(1).lower() in {key.lower() for key in NODE_TYPES}:
        nodes, kind = int(match.group(2) or 1), node(match.group(1))
        if nodes < 1:
            raise UnknownHardware(f"cluster {name!r} has no nodes. Fix: '<node type> x<N>' with N >= 1")
        label = kind.name if nodes == 1 else f"{kind.name} x{nodes}"
        return CLUSTERS.get(label) or Cluster(label, kind, nodes)
    base, suffix = (match.group(1), f" x{match.group(2)}" if match.group(2) else "") if match else (text, "")
    known = f"{', '.join(CLUSTERS)}, or '<node type> x<N>' with a node type from: {', '.join(NODE_TYPES)}"
    return _lookup("cluster", base, NODE_TYPES if suffix else {**CLUSTERS, **NODE_TYPES}, known, suffix)
