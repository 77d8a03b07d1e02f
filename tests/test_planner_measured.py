"""The planner against runs on this machine: DDP, DeepSpeed's ZeRO-3 and FSDP2 on 2 gloo processes, at 1 and 3
micro-batches per step. The bytes each step puts on the wire are measured (loopback counters) and must be what the
planner's traffic says, priced with each collective's measured bytes per element; ZeRO-3's and FSDP2's grow with the
micro-batches (they gather parameters and reduce gradients for every one), DDP's do not (no_sync).
Step times are compared in notebook 19 and benchmarks/, never asserted here."""

import pytest

from dtlab.bandwidth import loopback_bytes
from dtlab.launch import run
from dtlab.parallel import side_by_side

pytestmark = pytest.mark.cluster  # code a cluster runs: make test-runtime repeats these on its stack


CFG = {"backend": "gloo", "device": "cpu", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab": 32, "block": 8,
       "batch": 4, "micro_batches": [1, 3], "time_steps": 2,
       "strategies": ["DDP", "ZeRO-3 (DeepSpeed)", "FSDP2", "FSDP2, sync deferred"]}


@pytest.fixture(scope="module")
def measured():
    if loopback_bytes() is None:
        pytest.skip("no loopback counters to read here (/proc/net/dev)")
    return run(side_by_side.worker, CFG, nprocs=2, env={"DS_ACCELERATOR": "cpu"}, timeout=300)[0]


@pytest.mark.slow
def test_the_bytes_on_the_wire_are_the_planners_traffic(measured):
    assert set(measured["results"]) >= {"DDP", "ZeRO-3 (DeepSpeed)"}
    for name, by_m in measured["results"].items():
        for m, row in by_m.items():
            predicted = side_by_side.predict(measured, CFG, name, m, 2)["wire"]
            assert row["wire"] == pytest.approx(predicted, rel=0.03), (name, m)


def test_zero3_sends_per_micro_batch_and_ddp_per_step(measured):
    r = measured["results"]
    assert r["DDP"][3]["wire"] == pytest.approx(r["DDP"][1]["wire"], rel=0.02)
    assert r["ZeRO-3 (DeepSpeed)"][3]["wire"] == pytest.approx(3 * r["ZeRO-3 (DeepSpeed)"][1]["wire"], rel=0.03)
    if "FSDP2" in r:
        assert r["FSDP2"][3]["wire"] == pytest.approx(3 * r["FSDP2"][1]["wire"], rel=0.03)
        assert r["FSDP2, sync deferred"][3]["wire"] < 0.8 * r["FSDP2"][3]["wire"]


def test_the_calls_each_strategy_makes_are_counted(measured):
    """DDP: one bucket, one all-reduce per step whatever M. FSDP2: per micro-batch one gather per group in forward,
    one again in backward except the root's (it keeps its weights: reshard_after_forward is False for the root), one
    reduce-scatter per group; sync deferred reduce-scatters only the last micro-batch."""
    r, groups = measured["results"], CFG["n_layer"] + 1
    for m in CFG["micro_batches"]:
        assert r["DDP"][m]["calls"] == {"all_reduce": 1}
        if "FSDP2" in r:
            assert r["FSDP2"][m]["calls"] == {"all_gather": (2 * groups - 1) * m, "reduce_scatter": groups * m}
            assert r["FSDP2, sync deferred"][m]["calls"] == {"all_gather": (2 * groups - 1) * m,
                                                             "reduce_scatter": groups}


def _count_known_calls(cfg):
    import torch
    import torch.distributed as dist

    from dtlab.bandwidth import collective_calls
    from dtlab.distributed import all_gather_single, reduce_scatter_single

    dist.init_process_group("gloo")

    def work():
        for _ in range(3):
            dist.all_reduce(torch.ones(4))
        dist.broadcast(torch.ones(3), 0)
        all_gather_single(torch.empty(4), torch.ones(2))
        reduce_scatter_single(torch.empty(2), torch.ones(4))
    counts = collective_calls(work)
    dist.destroy_process_group()
    return counts


def test_collective_calls_counts_each_kind():
    for counts in run(_count_known_calls, {}, nprocs=2, timeout=120):
        assert counts == {"all_reduce": 3, "broadcast": 1, "all_gather": 1, "reduce_scatter": 1}
