"""Distributed must equal single-process: DDP and the from-scratch wrappers against one process.

Every test trains the same model from the same seed on the same global batches: once in this
process on the full batch, once on N gloo processes that each see 1/N of every batch. With
gradients averaged correctly the weights agree to float32 rounding — within ``tolerance``, the bound
``dtlab.measure.reduction_tolerance`` derives from the number of summed terms, the steps and the
weights' size; without synchronisation they do not (a test below shows the bound would catch that).
"""

import pytest
import torch
import torch.nn.functional as F

from dtlab import models
from dtlab.launch import run
from dtlab.parallel import data_parallel

STEPS, LOCAL_BATCH, LR = 4, 6, 0.1


def tolerance(ref, world, accum=1):
    """How far a correct N-process SGD run may be from the full-batch one: the gradient sums
    LOCAL_BATCH x world x accum terms in another order, over STEPS steps (float32)."""
    from dtlab.measure import reduction_tolerance

    scale = max(v.abs().max().item() for v in ref.values() if v.is_floating_point())
    return reduction_tolerance(LOCAL_BATCH * world * accum, STEPS, scale)


def make_model(kind):
    torch.manual_seed(0)
    if kind == "mlp":
        return models.MLP(12, 16, 5, depth=2)
    if kind == "tied":  # the output head shares the embedding's weight
        return models.TinyGPT(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16)
    if kind == "frozen":  # the first layer does not train
        m = models.MLP(12, 16, 5, depth=2)
        m.net[0].weight.requires_grad_(False)
        return m
    raise ValueError(kind)


def make_batches(kind, n):
    g = torch.Generator().manual_seed(1)
    if kind == "tied":
        x = torch.randint(0, 16, (STEPS, n, 8), generator=g)
        return x, torch.randint(0, 16, (STEPS, n, 8), generator=g)
    return torch.randn(STEPS, n, 12, generator=g), torch.randint(0, 5, (STEPS, n), generator=g)


def loss_of(model, kind, x, y):
    if kind == "tied":
        return model(x, y)[1]
    return F.cross_entropy(model(x), y)


def reference(kind, world, accum=1):
    model = make_model(kind)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    xs, ys = make_batches(kind, LOCAL_BATCH * world * accum)
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(model, kind, xs[step], ys[step]).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_distributed(kind, wrapper, accum=1, sync_every_micro_step=False, bucket_cap_mb=0.0005):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100 + rank)  # different on purpose: the wrapper must broadcast rank 0's weights
    model = make_model(kind) if rank == 0 else _perturbed(make_model(kind))
    counter = [0]
    if wrapper == "ddp":
        wrapped = DDP(model, bucket_cap_mb=bucket_cap_mb)
        wrapped.register_comm_hook(None, data_parallel.counting_allreduce_hook(counter))
    elif wrapper == "naive":
        wrapped = data_parallel.DataParallel(model)
    elif wrapper == "bucketed":
        wrapped = data_parallel.BucketedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    else:  # "none": every rank trains alone — what forgetting to synchronise looks like
        wrapped = model
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    xs, ys = make_batches(kind, LOCAL_BATCH * world * accum)
    for step in range(STEPS):
        opt.zero_grad()
        micro = [slice((rank * accum + m) * LOCAL_BATCH, (rank * accum + m + 1) * LOCAL_BATCH) for m in range(accum)]
        for m, rows in enumerate(micro):
            last = m == accum - 1
            sync = last or sync_every_micro_step or wrapper == "none"
            ctx = wrapped.no_sync() if not sync else _nullcontext()
            with ctx:
                (loss_of(wrapped, kind, xs[step][rows], ys[step][rows]) / accum).backward()
        if hasattr(wrapped, "finish_gradient_synchronization"):
            wrapped.finish_gradient_synchronization()
        opt.step()
    calls = counter[0] if wrapper == "ddp" else getattr(wrapped, "allreduce_calls", 0)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dist.destroy_process_group()
    return {"state": state, "allreduce_calls": calls}


def _perturbed(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    return model


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["mlp", "tied", "frozen"])
@pytest.mark.parametrize("wrapper", ["ddp", "naive", "bucketed"])
def test_n_processes_equal_one_process_on_the_full_batch(wrapper, kind, world):
    ref = reference(kind, world)
    results = run(train_distributed, kind, wrapper, nprocs=world)
    for r, res in enumerate(results):
        assert max_diff(res["state"], ref) <= tolerance(ref, world), f"rank {r} of {world} drifted from one process"
    if kind == "frozen":
        assert torch.equal(results[0]["state"]["net.0.weight"], ref["net.0.weight"]), "frozen layer unchanged"


def test_unsynchronised_training_is_caught_by_the_same_tolerance():
    ref = reference("mlp", 2)
    results = run(train_distributed, "mlp", "none", nprocs=2)
    assert max_diff(results[0]["state"], ref) > 100 * tolerance(ref, 2)
    assert max_diff(results[0]["state"], results[1]["state"]) > 100 * tolerance(ref, 2), "replicas diverged"


@pytest.mark.parametrize("wrapper", ["ddp", "naive", "bucketed"])
def test_no_sync_accumulation_equals_the_big_batch_with_fewer_all_reduces(wrapper):
    accum = 3
    ref = reference("mlp", 2, accum=accum)
    lean = run(train_distributed, "mlp", wrapper, accum, False, 25, nprocs=2)[0]
    naive = run(train_distributed, "mlp", wrapper, accum, True, 25, nprocs=2)[0]
    bound = tolerance(ref, 2, accum)
    assert max_diff(lean["state"], ref) <= bound and max_diff(naive["state"], ref) <= bound
    per_step = 1 if wrapper != "naive" else len(list(make_model("mlp").parameters()))  # one 25 MB bucket
    assert lean["allreduce_calls"] == STEPS * per_step
    assert naive["allreduce_calls"] == accum * STEPS * per_step


def test_buckets_group_gradients_into_fewer_messages():
    def count(cap):
        return run(train_distributed, "mlp", "bucketed", 1, False, cap, nprocs=2)[0]["allreduce_calls"]

    per_tensor = run(train_distributed, "mlp", "naive", nprocs=2)[0]["allreduce_calls"]
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
