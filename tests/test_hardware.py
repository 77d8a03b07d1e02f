"""dtlab.planner.hardware: the one home of GPU, instance-type and cluster facts, and its look-ups."""

from pathlib import Path

import pytest

from dtlab.planner import advise, formulas, hardware
from dtlab.tooling import clusters

ROOT = Path(__file__).resolve().parent.parent


def test_units_are_decimal_gb_and_binary_gib():
    assert hardware.GB == 10**9 and hardware.GiB == 2**30 and hardware.MiB == 2**20
    assert formulas.GB == hardware.GB and formulas.GiB == hardware.GiB


def test_the_a10g_as_nvidia_smi_reports_it():
    a10g = hardware.gpu("A10G")
    assert a10g.memory_bytes == 23_028 * 2**20 and a10g.memory_gb == pytest.approx(24.15, abs=0.005)
    assert a10g.datasheet_gb == 24 and a10g.bf16
    assert a10g.peak_flops("bf16") == a10g.bf16_tflops * 1e12 > a10g.peak_flops("fp32")


@pytest.mark.parametrize("name", list(hardware.GPUS))
def test_every_gpu_has_consistent_figures(name):
    g = hardware.GPUS[name]
    assert g.name == name and 10e9 < g.memory_bytes < 200e9
    # nvidia-smi's total is within 10% of the datasheet's figure, whatever unit the datasheet meant
    assert 0.9 < g.memory_bytes / (g.datasheet_gb * hardware.GB) < 1.1
    assert g.fp16_tflops > g.fp32_tflops > 0
    assert (g.bf16_tflops > 0) == g.bf16
    if not g.bf16:
        with pytest.raises(ValueError, match="no bf16"):
            g.peak_flops("bf16")


def test_known_peaks_from_the_datasheets():
    assert hardware.gpu("A100").bf16_tflops == 312 and hardware.gpu("A100").fp32_tflops == 19.5
    assert hardware.gpu("H100").bf16_tflops == 989 and hardware.gpu("T4").fp16_tflops == 65
    assert hardware.gpu("V100").fp16_tflops == 125 and not hardware.gpu("V100").bf16


def test_the_course_node():
    g5 = hardware.node("g5.12xlarge")
    assert (g5.gpus, g5.gpu, g5.vcpus, g5.memory_gib) == (4, "A10G", 48, 192)
    assert (g5.network_gbps, g5.intra_node_gbs, g5.interconnect) == (40, 10, "PCIe Gen4, no NVLink")
    assert g5.gpu_type is hardware.gpu("A10G") and g5.gpu_memory_gb == 24
    assert g5.cpu_memory_bytes_per_gpu == 48 * 2**30 == pytest.approx(51.54e9, rel=1e-3)


@pytest.mark.parametrize("name", list(hardware.NODE_TYPES))
def test_every_node_type_names_a_known_gpu(name):
    n = hardware.NODE_TYPES[name]
    assert n.name == name and n.gpu in hardware.GPUS and hardware.has_gpus(name)
    assert (n.intra_node_gbs > 0) == (n.gpus > 1)


def test_gpu_families():
    assert hardware.has_gpus("g6.12xlarge") and hardware.has_gpus("p4de.24xlarge")
    assert not hardware.has_gpus("m5.xlarge") and not hardware.has_gpus("")


def test_look_ups_ignore_case_and_pass_objects_through():
    assert hardware.gpu("a10g") is hardware.gpu("A10G") is hardware.gpu(hardware.gpu("A10G"))
    assert hardware.node("G5.12XLARGE") is hardware.NODE_TYPES["g5.12xlarge"]


@pytest.mark.parametrize("lookup, name, expected", [
    (hardware.gpu, "A10", ["unknown GPU 'A10'", "did you mean 'A10G'?", "A100", "H100", "T4"]),
    (hardware.gpu, "tpu", ["unknown GPU 'tpu'", "known: T4, A10G, V100, A100, H100"]),
    (hardware.node, "g5.12xl", ["did you mean 'g5.12xlarge'?", "p4d.24xlarge"]),
    (hardware.cluster, "g5.12xlarg x4", ["unknown cluster 'g5.12xlarg x4'", "did you mean 'g5.12xlarge x4'?"]),
    (hardware.cluster, "nothing", ["known: g5.12xlarge, g5.12xlarge x4, or '<node type> x<N>'"]),
    (hardware.cluster, "g5.12xlarge x0", ["has no nodes", "N >= 1"]),
])
def test_an_unknown_name_lists_the_known_ones(lookup, name, expected):
    with pytest.raises(hardware.UnknownHardware) as err:
        lookup(name)
    assert isinstance(err.value, ValueError) and isinstance(err.value, LookupError)
    for text in expected:
        assert text in str(err.value), str(err.value)
    assert "Fix:" in str(err.value)


def test_named_clusters_are_the_course_files():
    one, four = hardware.cluster("g5.12xlarge"), hardware.cluster("g5.12xlarge x4")
    assert (one.nodes, one.gpus, four.nodes, four.gpus) == (1, 4, 4, 16)
    assert four.gpu.name == "A10G" and four.inter_node_gbs == 5 and four.slowest_link_gbs == 5
    assert one.slowest_link_gbs == 10
    for c in hardware.CLUSTERS.values():
        path = ROOT / c.source
        assert path.is_file(), c.source
        offer = clusters.offers(path)
        assert (offer.node_type, offer.nodes, offer.gpus) == (c.node.name, c.nodes, c.gpus), c.name


def test_any_node_type_times_n_is_a_cluster():
    two = hardware.cluster("p4d.24xlarge x2")
    assert (two.name, two.gpus, two.gpu.name, two.source) == ("p4d.24xlarge x2", 16, "A100", "")
    assert hardware.cluster("g5.12xlarge  X4") is hardware.CLUSTERS["g5.12xlarge x4"]
    assert hardware.cluster("g5.12xlarge x1") is hardware.CLUSTERS["g5.12xlarge"]
    assert hardware.cluster(two) is two


def test_the_validator_and_the_planner_read_hardware():
    assert clusters.GPU_NODE_TYPES is hardware.NODE_TYPES and clusters.NodeType is hardware.NodeType
    a100 = advise.advise(7e9, cluster="p4d.24xlarge", layouts=False)
    a10g = advise.advise(7e9, cluster="g5.48xlarge", layouts=False)                  # 8 GPUs each

    def states(a):
        return [sum(r["memory_bytes"][k] for k in ("params", "grads", "optimizer")) for r in a.priced]
    assert states(a100) == states(a10g)
    assert [r["fits"] for r in a100.priced] != [r["fits"] for r in a10g.priced]  # 40 GB vs 24 GB per GPU
    assert hardware.DEFAULT_CLUSTER in hardware.CLUSTERS


def test_the_g6_and_g6e_families_are_known_with_their_datasheets_dense_peaks():
    """L4 and L40S: NVIDIA's datasheets give bf16 tensor peaks with sparsity (242 and 733 TFLOPS): dense is half."""
    for name, gpu, sparse in (("g6.12xlarge", "L4", 242), ("g6e.12xlarge", "L40S", 733)):
        node = hardware.node(name)
        assert node.gpu_type is hardware.gpu(gpu) and node.gpus == 4 and "no NVLink" in node.interconnect
        assert abs(hardware.gpu(gpu).bf16_tflops - sparse / 2) <= 0.02 * sparse / 2
    assert hardware.gpu("L40S").memory_bytes > 1.9 * hardware.gpu("L4").memory_bytes       # 48 GB against 24 GB
    assert hardware.cluster("g6e.12xlarge x2").gpus == 8


def test_p3_is_marked_as_being_retired_and_the_validator_refuses_it_naming_a_current_type():
    from dtlab.tooling import clusters

    assert all(n.retiring for name, n in hardware.NODE_TYPES.items() if name.startswith("p3."))
    assert not any(n.retiring for name, n in hardware.NODE_TYPES.items() if not name.startswith("p3."))
    problems = clusters.cluster_problems({"node_type_id": "p3.8xlarge", "spark_version": "17.3.x-gpu-ml-scala2.13",
                                          "num_workers": 2, "autotermination_minutes": 30,
                                          "spark_conf": {"spark.task.resource.gpu.amount": "1"}})
    assert any("node_type_id: p3.8xlarge" in p and "AWS retires" in p and "Fix: g6e" in p for p in problems), problems
