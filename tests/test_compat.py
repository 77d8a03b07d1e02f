"""The work-arounds dtlab applies for the learner's library versions."""

import time

import torch

from dtlab import launch


def _sweep_then_destroy():
    import torch.distributed as dist

    from dtlab.bandwidth import time_all_reduce

    dist.init_process_group("gloo")
    seconds = [time_all_reduce(n, "cpu", iters=2) for n in (4096, 262144, 4194304)]
    patched = getattr(dist.destroy_process_group, "_dtlab", False)
    dist.destroy_process_group()
    return len(seconds), patched


def test_destroying_a_gloo_group_right_after_collectives_does_not_deadlock():
    """torch 2.3.1 (Databricks 15.4) hung in ~ProcessGroupGloo in 9 of 15 such launches without dtlab._compat."""
    major, minor = (int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    needed = (major, minor) < (2, 4)
    start = time.monotonic()
    for _ in range(8):  # the work-around is in place in the workers exactly where it is needed
        assert launch.run(_sweep_then_destroy, nprocs=2, timeout=60) == [(3, needed), (3, needed)]
    assert time.monotonic() - start < 400  # a hang would end in LaunchTimeout above, not here


def test_deepspeed_pads_its_zero3_reduce_scatter_with_zeros_not_leftover_memory():
    """ZeRO-3's coalesced reduce-scatter pads gradients with ``torch.empty``; dtlab makes that padding zeros, so
    what the allocator last held cannot reach the gradients (it sent bf16 ZeRO-3 to NaN on the runtime stack)."""
    from deepspeed.runtime.comm import coalesced_collectives

    import dtlab  # noqa: F401  (applies the work-arounds)
    from dtlab import _compat

    assert isinstance(coalesced_collectives.torch, _compat._TorchWithZeroedEmpty)
    junk = torch.full((4096,), float("nan"))
    del junk                                                   # leave NaNs where the next block may come from
    assert torch.equal(coalesced_collectives.torch.empty(4096), torch.zeros(4096))
    assert coalesced_collectives.torch.cat is torch.cat       # everything else is torch itself
