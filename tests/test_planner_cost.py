"""The cost model: traffic where the strategies send it, recomputation's compute, links shared by the groups that
use them, memory by part, and layouts that cannot run refused with the fix. Its numbers against published runs are
tests/test_published_runs.py; against runs on this machine, tests/test_planner_measured.py."""

import dataclasses
import math

import pytest

from dtlab.planner import cost, formulas, hardware
from dtlab.planner.cost import Layout, LayoutError, Setup

# Issue 41's probes hold on every stack: the runtime stacks rerun this file (make test-runtime).
pytestmark = pytest.mark.cluster

G5X4 = hardware.cluster("g5.12xlarge x4")
SEVEN = formulas.model_shape(7e9)


def price(layout, micro_batches=1, cluster=G5X4, **setup):
    return cost.cost(7e9, layout, cluster, Setup(global_batch=layout.dp * micro_batches, **setup), SEVEN)


def test_zero3_gathers_and_reduces_every_micro_batch_ddp_once_per_step():
    # The issue's probe: ZeRO-3's communication was 7.875 s at 1 and at 32 micro-batches per step.
    one, many = price(Layout(dp=16, zero=3)), price(Layout(dp=16, zero=3), 32)
    assert many["bytes_sent"]["dp"] == pytest.approx(32 * one["bytes_sent"]["dp"])
    z3 = many["seconds"]["comm_exposed"] + many["seconds"]["comm_hidden"]
    assert z3 == pytest.approx(32 * (one["seconds"]["comm_exposed"] + one["seconds"]["comm_hidden"]))
    ddp1, ddp32 = price(Layout(dp=16, zero=0)), price(Layout(dp=16, zero=0), 32)
    assert ddp32["bytes_sent"]["dp"] == ddp1["bytes_sent"]["dp"]        # no_sync: one all-reduce per step
    # per micro-batch a GPU sends (N-1)/N of its 16-bit parameters twice (gathers) and of its gradients once, the
    # gradients in fp32 (Setup.grad_reduce's default, as DDP under autocast, Megatron-LM and torchtitan reduce them)
    assert one["bytes_sent"]["dp"] == pytest.approx(15 / 16 * (2 * 2 + 4) * 7e9)
    assert ddp1["bytes_sent"]["dp"] == pytest.approx(2 * 15 / 16 * 4 * 7e9)   # as much: an fp32 all-reduce
    # the ZeRO paper's 3 psi over 2 psi is with 16-bit gradients on the wire (DeepSpeed's default)
    half = price(Layout(dp=16, zero=3), grad_reduce="bf16")["bytes_sent"]["dp"]
    assert half / price(Layout(dp=16, zero=0), grad_reduce="bf16")["bytes_sent"]["dp"] == pytest.approx(1.5)
    with pytest.raises(ValueError, match="grad_reduce='int8'"):
        Setup(grad_reduce="int8")


def test_zero2_reduce_scatters_every_micro_batch_and_gathers_once():
    one, four = price(Layout(dp=16, zero=2)), price(Layout(dp=16, zero=2), 4)
    per_rs = 15 / 16 * 4 * 7e9                                     # fp32 gradients (Setup.grad_reduce)
    assert four["bytes_sent"]["dp"] - one["bytes_sent"]["dp"] == pytest.approx(3 * per_rs)


def test_deferred_gradient_sync_reduces_once_and_holds_whole_gradients():
    every, deferred = price(Layout(dp=16, zero=3), 8), price(Layout(dp=16, zero=3, defer_grad_sync=True), 8)
    per = 15 / 16 * 4 * 7e9                                        # one reduce-scatter of fp32 gradients
    assert every["bytes_sent"]["dp"] - deferred["bytes_sent"]["dp"] == pytest.approx(7 * per)
    # PyTorch keeps fp32 gradients (dtlab.planner.memory.states_per_param): sharded, or whole until the one reduction
    assert deferred["memory"]["grads"] == 4 * 7e9 and every["memory"]["grads"] == pytest.approx(4 * 7e9 / 16)
    with pytest.raises(LayoutError, match="Fix"):
        Layout(dp=16, zero=2, defer_grad_sync=True)


def test_overlap_hides_ddps_all_reduce_behind_the_last_micro_batch_only():
    # exposed = all-reduce - one micro-batch's backward, whatever the number of micro-batches
    one, eight = price(Layout(dp=16, zero=0)), price(Layout(dp=16, zero=0), 8)
    assert one["seconds"]["comm_exposed"] == pytest.approx(eight["seconds"]["comm_exposed"])
    assert one["seconds"]["comm_exposed"] > 0


def test_recomputation_costs_compute():
    base = {m: price(Layout(dp=16, zero=3), recompute=m) for m in formulas.RECOMPUTE}
    f = formulas.training_flops(2048, SEVEN, 2048, "full", 7e9)
    # full recomputation runs the layers' forward again: the FLOPs' ratio where every kernel runs at one rate ...
    flat = {m: price(Layout(dp=16, zero=3), recompute=m, efficiency=0.5) for m in ("none", "full")}
    assert flat["full"]["seconds"]["compute"] / flat["none"]["seconds"]["compute"] == pytest.approx(
        f.hardware / f.model)
    assert 1.25 < f.hardware / f.model < 1.34                        # about one more forward pass of the layers
    # ... and about that with each kernel at its own rate (the output layer and the loss are not recomputed)
    assert base["full"]["seconds"]["recompute"] == pytest.approx(
        base["full"]["seconds"]["compute"] - base["none"]["seconds"]["compute"])
    assert 1.2 < base["full"]["seconds"]["compute"] / base["none"]["seconds"]["compute"] < 1.34
    # with a fused attention kernel (the default) selective recomputation has nothing to recompute: it costs nothing
    # and saves nothing (issue 41 item 3); per-operator recomputation repeats half the matrix products
    assert base["none"]["seconds"]["compute"] == base["selective"]["seconds"]["compute"] < \
        base["op"]["seconds"]["compute"] < base["full"]["seconds"]["compute"]
    assert base["none"]["memory"]["activations"] == base["selective"]["memory"]["activations"]
    eager = {m: price(Layout(dp=16, zero=3), recompute=m, flash_attention=False) for m in ("none", "selective")}
    assert eager["none"]["seconds"]["compute"] < eager["selective"]["seconds"]["compute"]     # it recomputes scores
    assert eager["none"]["memory"]["activations"] > eager["selective"]["memory"]["activations"]   # it drops them
    op = formulas.training_flops(2048, SEVEN, 2048, "op", 7e9)
    assert op.recomputed == 2048 * min(7e9, SEVEN.n_layer * SEVEN.layer_params)      # half of 2 x Psi_layers
    for r in base.values():                                          # MFU counts the model's FLOPs only
        assert r["mfu"] <= r["hfu"] <= cost.efficiency_for(G5X4.gpu)[0] + 1e-12


def test_a_nodes_network_is_shared_by_the_groups_that_cross_it():
    # TP4 x DP4 on 4 nodes of 4: four DP groups, each with one GPU per node, push their rings through each NIC
    crossing = (cost.collective_seconds(1e9, "all_reduce", 1, 4, G5X4)
                - cost.collective_latency("all_reduce", 1, 4, G5X4))
    alone = formulas.ring_factor(4) * 1e9 / (G5X4.inter_node_gbs * 1e9)
    assert crossing == pytest.approx(4 * alone)
    # one DP group over all 16 GPUs: its 4 members on a node split the tensor, the NIC carries it once
    whole = (cost.collective_seconds(1e9, "all_reduce", 4, 4, G5X4)
             - cost.collective_latency("all_reduce", 4, 4, G5X4))
    assert whole == pytest.approx(formulas.ring_factor(4) * 1e9 / (10e9) + alone)


def test_collective_latency_is_nccls_ring_model():
    # NCCL's tuning.cc: base + (steps - network steps) x intra + network steps x network latency (Simple protocol)
    a100 = hardware.cluster("p4d.24xlarge x4")
    lat = cost.collective_latency("all_gather", 8, 4, a100)
    us = cost.NCCL_LATENCY_US
    assert lat == pytest.approx((us["base"] + (31 - 3) * us["nvlink"] + 3 * us["network"]) * 1e-6)
    assert cost.collective_latency("all_gather", 1, 1, a100) == 0


def test_the_bubble_is_its_share_of_the_pipelines_time():
    piped = price(Layout(dp=4, pp=4), 32)
    s = piped["seconds"]
    pipeline = s["total"] - s["by_dimension"]["dp"] - s["offload"]     # what the pipeline's schedule spans
    assert s["bubble"] / pipeline == pytest.approx(3 / (32 + 3))      # (P - 1) / (M + P - 1)
    v2 = price(Layout(dp=4, pp=4, virtual=2), 32)["seconds"]
    assert v2["bubble"] / (v2["total"] - v2["by_dimension"]["dp"]) == pytest.approx(3 / (2 * 32 + 3))


def test_memory_by_part():
    z3 = price(Layout(dp=16, zero=3))["memory"]
    # PyTorch's FSDP: sharded fp32 parameters (the master weights), fp32 gradients and Adam's two moments
    assert z3["params"] == pytest.approx(4 * 7e9 / 16) and z3["optimizer"] == pytest.approx(8 * 7e9 / 16)
    unit = max(SEVEN.layer_params, SEVEN.vocab * SEVEN.n_embd)          # the largest unit: a layer, or the output
    assert z3["buffers"] == 2 * 2 * unit + (2 + 4) * unit   # two units gathered in bf16; one's bf16 and fp32 gradient
    tp = price(Layout(dp=4, tp=4, zero=3))["memory"]
    assert tp["peak_at"] == z3["peak_at"] == "backward"
    assert tp["activations"] == pytest.approx(z3["activations"] / 4)
    parts = ("params", "grads", "optimizer", "activations", "loss", "buffers")
    assert z3["allocated"] == pytest.approx(sum(z3[k] for k in parts))
    assert z3["total"] == pytest.approx(z3["allocated"] + z3["runtime"])


ODD = formulas.ModelShape("36 heads", 32, 4032, 36)


@pytest.mark.parametrize("layout, cluster, batch, shape, words", [
    (Layout(dp=32), G5X4, 32, SEVEN, "needs 32 GPUs"),
    (Layout(dp=8), G5X4, 8, SEVEN, "uses 8 of"),
    (Layout(dp=4, tp=3), hardware.cluster("g5.12xlarge x3"), 4, SEVEN, "straddle"),
    (Layout(dp=2, tp=8), G5X4, 3, SEVEN, "does not divide into DP 2"),
    (Layout(dp=2, tp=8), G5X4, 2, ODD, "36 heads do not divide by TP 8"),
    (Layout(pp=16), G5X4, 1, SEVEN, "at least 2"),
    (Layout(pp=8, dp=2), G5X4, 1, SEVEN, "larger than global_batch"),
])
def test_layouts_that_cannot_run_are_refused_with_the_fix(layout, cluster, batch, shape, words):
    micro = 2 if words == "larger than global_batch" else 1
    with pytest.raises(LayoutError, match=words) as err:
        cost.cost(7e9, layout, cluster, Setup(global_batch=batch, micro_batch=micro), shape)
    assert "Fix" in str(err.value)


def test_a_cluster_without_speeds_prices_memory_only():
    bare = hardware.custom_cluster(16, 80)
    r = cost.cost(7e9, Layout(dp=16, zero=3), bare, Setup(global_batch=16), SEVEN)
    assert r["seconds"] is None and r["tokens_per_second"] is None and r["memory"]["total"] > 0


def test_hsdp_gathers_inside_the_shard_group_and_all_reduces_a_slice_across_replicas():
    # 4 nodes of 4: ZeRO-3 inside each node, 4 replicas; per micro-batch a rank gathers its layers twice and
    # reduce-scatters once in the node, then all-reduces its quarter of the gradients with the other 3 nodes
    hsdp, z3 = price(Layout(dp=16, zero=3, shard=4), 8), price(Layout(dp=16, zero=3), 8)
    params, grads = 2 * 7e9, 4 * 7e9                     # on the wire: 16-bit parameters, fp32 gradients
    assert hsdp["bytes_sent"]["dp"] == pytest.approx(3 / 4 * 8 * (2 * params + grads))
    assert hsdp["bytes_sent"]["replicate"] == pytest.approx(2 * 3 / 4 * 8 * grads / 4)
    assert "replicate" not in z3["bytes_sent"]
    assert cost.spread(Layout(dp=16, zero=3, shard=4), 4)["shard"] == (4, 1)          # inside one node
    assert cost.spread(Layout(dp=16, zero=3, shard=4), 4)["replicate"] == (1, 4)      # one GPU on each node
    assert cost.spread(Layout(dp=16, zero=3, shard=8), 4)["shard"] == (4, 2)
    # model states shared by the 4 GPUs of a node, not by all 16
    for part, per_param in (("params", 4), ("grads", 4), ("optimizer", 8)):      # PyTorch's: fp32 params and grads
        assert hsdp["memory"][part] == pytest.approx(per_param * 7e9 / 4)
        assert hsdp["memory"][part] == pytest.approx(4 * z3["memory"][part])


def test_hsdp_keeps_fsdps_gathers_off_the_40_gbps_network():
    # ZeRO-3 over 16 GPUs on 4 g5 nodes crosses the network with every layer's gathers; HSDP only with the
    # gradients' all-reduce: less time exposed, faster steps, for 4x the model states
    # (with 16-bit gradients on the wire; in fp32 the gradients' all-reduce across nodes doubles and eats the gain)
    hsdp, z3 = (price(Layout(dp=16, zero=3, shard=4), 8, grad_reduce="bf16"),
                price(Layout(dp=16, zero=3), 8, grad_reduce="bf16"))
    assert hsdp["seconds"]["comm_exposed"] < 0.8 * z3["seconds"]["comm_exposed"]
    assert hsdp["seconds"]["total"] < z3["seconds"]["total"]
    fp32_gain = (price(Layout(dp=16, zero=3, shard=4), 8)["seconds"]["total"]
                 / price(Layout(dp=16, zero=3), 8)["seconds"]["total"])
    assert fp32_gain > hsdp["seconds"]["total"] / z3["seconds"]["total"]
    # with the network as fast as the node's PCIe (a custom cluster) the network stops mattering and HSDP's gain goes
    fast = hardware.custom_cluster(16, 24, 4, 125, True, intra_node_gbs=10, inter_node_gbs=4 * 10)
    fast_hsdp = price(Layout(dp=16, zero=3, shard=4), 8, cluster=fast, grad_reduce="bf16")["seconds"]["total"]
    fast_z3 = price(Layout(dp=16, zero=3), 8, cluster=fast, grad_reduce="bf16")["seconds"]["total"]
    assert fast_hsdp / fast_z3 > hsdp["seconds"]["total"] / z3["seconds"]["total"]


def test_hsdp_can_defer_its_all_reduce_alone_or_all_its_gradient_sync():
    every = price(Layout(dp=16, zero=3, shard=4), 8)
    ar_once = price(Layout(dp=16, zero=3, shard=4, defer_all_reduce=True), 8)
    sync_once = price(Layout(dp=16, zero=3, shard=4, defer_grad_sync=True), 8)
    grads, on_wire = 4 * 7e9, 4 * 7e9                    # held and reduced in fp32 (PyTorch's FSDP, grad_reduce)
    assert every["bytes_sent"]["replicate"] == pytest.approx(8 * ar_once["bytes_sent"]["replicate"])
    assert ar_once["bytes_sent"]["dp"] == every["bytes_sent"]["dp"]                   # still reduce-scatters each
    assert sync_once["bytes_sent"]["dp"] == pytest.approx(every["bytes_sent"]["dp"] - 7 * 3 / 4 * on_wire)
    assert ar_once["memory"]["grads"] == every["memory"]["grads"] == pytest.approx(grads / 4)   # kept sharded
    assert sync_once["memory"]["grads"] == grads                                                # held whole
    assert sync_once["seconds"]["total"] <= ar_once["seconds"]["total"] < every["seconds"]["total"]


def test_hsdp_on_one_node_is_zero3():
    one = hardware.cluster("g5.12xlarge")
    for m in (1, 8):
        same = price(Layout(dp=4, zero=3, shard=4), m, cluster=one)
        assert same == price(Layout(dp=4, zero=3), m, cluster=one)
    assert not Layout(dp=4, zero=3, shard=4).hsdp and Layout(dp=4, zero=3, shard=4).name == "ZeRO-3"


@pytest.mark.parametrize("kwargs, words", [
    ({"dp": 16, "zero": 2, "shard": 4}, "not stage 3. Fix: zero=3"),
    ({"dp": 16, "zero": 3, "shard": 5}, "does not divide dp=16"),
    ({"dp": 16, "zero": 3, "defer_all_reduce": True}, "no HSDP here. Fix: zero=3 with shard"),
    ({"dp": 16, "zero": 3, "shard": 4, "defer_all_reduce": True, "defer_grad_sync": True}, "drop one"),
])
def test_impossible_hsdp_layouts_are_refused_with_the_fix(kwargs, words):
    with pytest.raises(LayoutError, match=words) as err:
        Layout(**kwargs)
    assert "Fix" in str(err.value)


# --- Issue 41 item 2: context parallelism -----------------------------------------------------------------

LONG = cost.Setup(16, 1, 32768, "none")


def test_context_parallel_ranks_reduce_gradients_and_shard_zero_like_data_parallel_ranks_of_the_same_count():
    """CP ranks hold the same weights and see different tokens: their gradients are reduced, and ZeRO shards its
    states, over DP x CP (Megatron-LM, torchtitan). CP4 therefore sends what DP4 sends over its gradient group and
    holds what DP4 holds of the optimizer. Before the fix CP4 sent 0 bytes and kept all of Adam's state."""
    cp4 = cost.cost(7e9, Layout(cp=4), "g5.12xlarge", LONG)
    dp4 = cost.cost(7e9, Layout(dp=4), "g5.12xlarge", cost.Setup(16, 1, 32768 // 4, "none"))
    assert cp4["bytes_sent"]["dp"] == dp4["bytes_sent"]["dp"] == 0.75 * (4 + 2) * 7e9   # fp32 RS + bf16 AG, ring 3/4
    assert cp4["memory"]["optimizer"] == dp4["memory"]["optimizer"] == 8 * 7e9 / 4          # Adam's two fp32 moments
    ddp = cost.cost(7e9, Layout(cp=2, dp=2, zero=0), "g5.12xlarge", LONG)
    assert ddp["bytes_sent"]["dp"] == 2 * 3 / 4 * 4 * 7e9          # the all-reduce over the 4 ranks of DP x CP


def test_ring_attention_hides_k_v_hops_behind_the_chunks_attention_as_far_as_it_lasts():
    """At 32k tokens a chunk's attention outlasts its K/V hop on the g5's PCIe: nothing is exposed. On a network
    100x slower than the attention could hide, the excess is exposed, and never more than the whole transfer."""
    fast = cost.cost(7e9, Layout(cp=4), "g5.12xlarge", LONG)
    assert fast["bytes_sent"]["cp"] > 0 and fast["seconds"]["by_dimension"]["cp"] == 0.0
    slow_net = hardware.custom_cluster(4, 24, 4, 125, True, 0.05, 0.05)
    slow = cost.cost(7e9, Layout(cp=4), slow_net, LONG)
    members, nodes = cost.spread(Layout(cp=4), 4)["cp"]
    whole = cost.p2p_seconds(cost.traffic(7e9, formulas.model_shape(7e9), Layout(cp=4), LONG, 16)["cp"]["send"],
                             members, nodes, slow_net)
    assert 0 < slow["seconds"]["by_dimension"]["cp"] < whole


def test_advise_lists_context_parallel_layouts_for_long_sequences_only():
    from dtlab.planner import advise

    long = advise.advise(7e9, cluster="g5.12xlarge x4", seq_len=32768, global_batch=64, recompute="full")
    cp_rows = [r for r in long.priced if r["layout"]["cp"] > 1]
    assert cp_rows and all(r["bytes_sent"]["dp"] > 0 for r in cp_rows)
    assert {r["layout"]["zero"] for r in cp_rows} == {1, 3}
    assert all(32768 // r["layout"]["cp"] >= advise.MIN_CP_CHUNK for r in cp_rows)
    short = advise.advise(7e9, cluster="g5.12xlarge x4")
    assert not [r for r in short.rows if r["layout"]["cp"] > 1]


def test_a_mixture_of_experts_config_is_refused_with_what_to_do():
    mixtral = {"model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
               "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000, "num_local_experts": 8}
    with pytest.raises(ValueError, match="8 experts per MoE layer.*not priced.*notebook 16"):
        formulas.shape_from_hf(mixtral)
    assert formulas.shape_from_hf({**mixtral, "num_local_experts": 1}).n_layer == 32    # one expert is dense


# --- Issue 41 item 5: the frameworks' schedule assumptions as settings ------------------------------------

GPT = formulas.ModelShape("GPT layer", n_layer=24, n_embd=2048, n_head=16, source="test", dropout=True)


def _layer_activations(setup, layout):
    """Activations of the layers alone (the fp32 logits, split by TP either way, taken out)."""
    mem = cost.memory(1.3e9, GPT, layout, setup)
    return mem["activations"] - formulas.logits_bytes(setup.micro_batch, setup.seq_len, GPT.vocab) / layout.tp


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallelism_without_sequence_parallelism_keeps_korthikantis_replicated_10sbh(tp):
    """Korthikanti et al. 2022, Table 2: per layer with selective recomputation, sbh(10 + 24/t) bytes with tensor
    parallelism alone and sbh(34/t) with sequence parallelism: their ratio is (10 + 24/t) / (34/t)."""
    setup = Setup(64, 1, 2048, "selective")
    with_sp = _layer_activations(setup, Layout(dp=1, tp=tp))
    without = _layer_activations(Setup(64, 1, 2048, "selective", sequence_parallel=False), Layout(dp=1, tp=tp))
    assert without / with_sp == pytest.approx((10 + 24 / tp) / (34 / tp), rel=1e-9)


def test_gpipe_holds_every_micro_batch_where_1f1b_holds_as_many_as_stages():
    layout, m = Layout(dp=1, pp=4), 16
    one_f = _layer_activations(Setup(m, 1, 2048, "selective"), layout)
    gpipe = _layer_activations(Setup(m, 1, 2048, "selective", schedule="gpipe"), layout)
    assert gpipe / one_f == pytest.approx(m / 4, rel=1e-9)
    with pytest.raises(ValueError, match="schedule='zb'"):
        Setup(schedule="zb")


def test_megatrons_bucket_rule_pays_the_rings_latency_fewer_times_at_large_dp():
    """DDP's 25 MB buckets split 7B's fp32 gradients into 1,120 all-reduces; Megatron-LM's max(40M, 1M x DP)
    parameters makes 7 at DP 1,024 (1.024B parameters each): 1,113 latencies fewer, and nothing else changes."""
    cluster = hardware.cluster("p4d.24xlarge x128")
    layout, setup = Layout(dp=1024, zero=0), Setup(1024, 1, 2048, "selective")
    ddp = cost.cost(7e9, layout, cluster, setup)
    megatron = cost.cost(7e9, layout, cluster, Setup(1024, 1, 2048, "selective", bucket_bytes=None))
    assert cost.megatron_bucket_bytes(1024) == 1024e6 * 4
    assert math.ceil(4 * 7e9 / 25e6) - math.ceil(7e9 / 1024e6) == 1113
    members, nodes = cost.spread(layout, 8)["dp"]
    saved = 1113 * cost.collective_latency("all_reduce", members, nodes, cluster)
    total = {k: r["seconds"]["comm_hidden"] + r["seconds"]["by_dimension"]["dp"] for k, r in
             (("ddp", ddp), ("megatron", megatron))}
    assert total["ddp"] - total["megatron"] == pytest.approx(saved, rel=1e-6)


def test_zero_offload_copies_gradients_to_the_host_every_micro_batch():
    layout = Layout(dp=4, zero=2, offload_optimizer=True)
    one, eight = (cost.cost(7e9, layout, "g5.12xlarge", Setup(4 * m, 1, 2048, "selective"))["seconds"]["offload"]
                  for m in (1, 8))
    assert eight - one == pytest.approx(7 * 2 * 7e9 / 4 / (cost.PCIE_GBS * 1e9), rel=1e-9)


def test_layers_are_shared_out_evenly_or_with_lighter_ends_as_llama_3():
    assert cost.stage_layers(126, 16) == [8] * 14 + [7] * 2
    assert cost.stage_layers(126, 16, "lighter_ends") == [7] + [8] * 14 + [7]
    assert sum(cost.stage_layers(32, 8, "lighter_ends")) == 32
    with pytest.raises(LayoutError, match="without a layer"):
        cost.stage_layers(3, 3, "lighter_ends")


def test_each_pipeline_stage_holds_its_own_in_flight_micro_batches_and_the_busiest_is_priced():
    """1F1B: stage s holds min(M, P - s) micro-batches of its layers. With Llama 3's split (7 layers on the first
    stage, 8 on the next) the busiest stage is the second, holding 15 x 8 layer-micro-batches where an even split's
    first stage holds 16 x 8: activations 15/16 of it (no logits and nothing recomputed on either stage)."""
    from dtlab.planner import published

    run = published.run("Llama 3 405B, 8192 H100, 8K context")
    layout, setup = run.layouts()[0], run.setup()
    even = cost.memory(run.params, run.shape, layout, dataclasses.replace(setup, pipeline_split="even"), 32)
    ends = cost.memory(run.params, run.shape, layout, setup, 32)
    assert setup.pipeline_split == "lighter_ends"
    assert ends["activations"] / even["activations"] == pytest.approx(15 / 16, rel=1e-9)
    assert ends["total"] < even["total"]
