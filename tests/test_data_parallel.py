"""Distributed must equal single-process: DDP and the from-scratch wrappers against one process.

Every test trains the same model from the same seed on the same global batches: once in this
process on the full batch, once on N gloo processes that each see 1/N of every batch. With
gradients averaged correctly the weights agree to float32 rounding — within ``tolerance``, the bound
``dtlab.measure.reduction_tolerance`` derives from the number of summed terms, the steps and the
weights' size; without synchronisation they do not (a test below shows the bound would catch that).
The model, batches, references and bound are the strategy tests' shared ones (``tests/strategy.py``).
"""

import pytest
import torch
from strategy import (
    LR,
    STEPS,
    make_model,
    max_diff,
    reference,
    tolerance,
    train_data_parallel,
    train_rank_share,
)

from dtlab.launch import run
from dtlab.parallel import data_parallel


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["mlp", "tied", "frozen"])
@pytest.mark.parametrize("wrapper", ["ddp", "naive", "bucketed"])
def test_n_processes_equal_one_process_on_the_full_batch(wrapper, kind, world):
    ref = reference(kind, world)
    results = run(train_data_parallel, kind, wrapper, nprocs=world)
    for r, res in enumerate(results):
        assert max_diff(res["state"], ref) <= tolerance(ref, world), f"rank {r} of {world} drifted from one process"
    if kind == "frozen":
        assert torch.equal(results[0]["state"]["net.0.weight"], ref["net.0.weight"]), "frozen layer unchanged"


def test_unsynchronised_training_is_caught_by_the_same_tolerance():
    ref = reference("mlp", 2)
    results = run(train_data_parallel, "mlp", "none", nprocs=2)
    assert max_diff(results[0]["state"], ref) > 100 * tolerance(ref, 2)
    assert max_diff(results[0]["state"], results[1]["state"]) > 100 * tolerance(ref, 2), "replicas diverged"


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", ["ddp", "naive", "bucketed"])
def test_no_sync_accumulation_equals_the_big_batch_with_fewer_all_reduces(wrapper):
    accum = 3
    ref = reference("mlp", 2, accum=accum)
    lean = run(train_data_parallel, "mlp", wrapper, accum, False, 25, nprocs=2)[0]
    naive = run(train_data_parallel, "mlp", wrapper, accum, True, 25, nprocs=2)[0]
    bound = tolerance(ref, 2, accum)
    assert max_diff(lean["state"], ref) <= bound and max_diff(naive["state"], ref) <= bound
    per_step = 1 if wrapper != "naive" else len(list(make_model("mlp").parameters()))  # one 25 MB bucket
    assert lean["allreduce_calls"] == STEPS * per_step
    assert naive["allreduce_calls"] == accum * STEPS * per_step


def test_buckets_group_gradients_into_fewer_messages():
    def count(cap):
        return run(train_data_parallel, "mlp", "bucketed", 1, False, cap, nprocs=2)[0]["allreduce_calls"]

    per_tensor = run(train_data_parallel, "mlp", "naive", nprocs=2)[0]["allreduce_calls"]
    n_tensors = len(list(make_model("mlp").parameters()))
    assert per_tensor == STEPS * n_tensors
    assert count(0.0000001) == per_tensor  # a bucket smaller than any tensor: one tensor per bucket
    assert count(25) == STEPS  # everything fits one bucket: one message per step


def test_wrapping_before_init_process_group_names_the_fix():
    with pytest.raises(RuntimeError, match="after dist.init_process_group"):
        data_parallel.DataParallel(make_model("mlp"))


def test_forgetting_set_epoch_repeats_the_shuffle():
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(32), num_replicas=2, rank=0, shuffle=True, seed=0)
    without = [list(sampler) for _epoch in range(3)]
    assert without[0] == without[1] == without[2]
    with_set = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        with_set.append(list(sampler))
    assert with_set[0] != with_set[1] != with_set[2]


def _ddp_on_gpus(kind):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 as on the CPU
    model = make_model(kind).cuda()
    ddp = DDP(model, device_ids=[rank])
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    train_rank_share(ddp, opt, kind, rank, world, device="cuda")
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    dist.destroy_process_group()
    return state


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["mlp", "tied"])
def test_ddp_over_nccl_on_gpus_trains_what_one_cpu_process_trains(kind):
    """The course's promise that the lessons run unchanged on CUDA GPUs (nccl): the same bound as on gloo."""
    world = min(2, torch.cuda.device_count())
    ref = reference(kind, world)
    for rank, state in enumerate(run(_ddp_on_gpus, kind, nprocs=world, backend="nccl")):
        assert max_diff(state, ref) <= tolerance(ref, world), f"rank {rank} on GPU drifted from one CPU process"
