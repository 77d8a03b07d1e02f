"""One way to test a strategy: the model, the batches, the single-process references and the bound.

Every strategy test (DDP and the from-scratch wrappers, ZeRO-1, Horovod) trains the same model from the
same seed on the same global batches: once in one process, once on N gloo processes that each see 1/N of
every batch, and compares the weights with ``dtlab.measure.max_diff``:

- ``reference``: the full batch in one process, SGD; a correct N-process run is within ``tolerance``,
  the bound ``dtlab.measure.reduction_tolerance`` derives from the summed terms, the steps and the
  weights' size.
- ``per_rank_reference``: each rank's share of the batch, its gradient divided by N and summed in rank
  order, as DDP's all-reduce sums them: for optimizers such as AdamW, where a rounding-level
  difference can become a learning-rate-sized step, a strategy must match it bit for bit.

``train_data_parallel`` is the DDP family's training function (DDP, the scratch wrappers, or no
synchronisation at all), the baseline other strategies compare with. Functions run on N processes with
``dtlab.launch.run`` (forked workers; no pickling by module name needed).
"""

import contextlib

import torch
import torch.nn.functional as F

from dtlab import models
from dtlab.measure import max_diff, reduction_tolerance
from dtlab.parallel import data_parallel

__all__ = ["LOCAL_BATCH", "LR", "STEPS", "loss_of", "make_batches", "make_model", "max_diff", "per_rank_reference",
           "perturbed", "rank_gradients", "train_rank_share", "combine_as_ranks_do", "reference", "tolerance",
           "train_data_parallel"]

STEPS, LOCAL_BATCH, LR = 4, 6, 0.1


def tolerance(ref, world, accum=1):
    """How far a correct N-process SGD run may be from the full-batch one: the gradient sums
    LOCAL_BATCH x world x accum terms in another order, over STEPS steps (float32)."""
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


def rank_gradients(params, loss_on_rows, world, local_batch):
    """Each rank's gradient of its share of the batch, computed in one process: ``[rank][parameter]``.
    ``loss_on_rows(rows)`` is the loss of the batch rows ``rows`` (a slice)."""
    per_rank = []
    for rank in range(world):
        for p in params:
            p.grad = None
        loss_on_rows(slice(rank * local_batch, (rank + 1) * local_batch)).backward()
        per_rank.append([p.grad.clone() for p in params])
    return per_rank


def combine_as_ranks_do(per_rank, world, divide_first=True):
    """The gradients as the ranks' collective leaves them, in rank order: DDP divides each rank's gradient by
    ``world`` and sums (``divide_first``); a reduce-scatter of sums divides the total afterwards."""
    combined = []
    for i in range(len(per_rank[0])):
        total = per_rank[0][i] / world if divide_first else per_rank[0][i]
        for grads in per_rank[1:]:
            total = total + (grads[i] / world if divide_first else grads[i])
        combined.append(total if divide_first else total / world)
    return combined


def per_rank_reference(kind, world, make_optimizer):
    """One process, each step's gradient computed as DDP's ranks compute it: the sum of g_r / world in rank
    order. ``make_optimizer(model)`` builds the optimizer (with its parameter groups)."""
    model = make_model(kind)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(model)
    xs, ys = make_batches(kind, LOCAL_BATCH * world)
    for step in range(STEPS):
        per_rank = rank_gradients(params, lambda rows, x=xs[step], y=ys[step]: loss_of(model, kind, x[rows], y[rows]),
                                  world, LOCAL_BATCH)
        for p, g in zip(params, combine_as_ranks_do(per_rank, world)):
            p.grad = g
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_rank_share(model, opt, kind, rank, world, device=None):
    """This rank's STEPS steps on its share of each global batch (rows ``rank * LOCAL_BATCH ...``): what every
    strategy's worker trains; ``model`` may be the wrapped one (DDP, Horovod's optimizer does the rest)."""
    xs, ys = make_batches(kind, LOCAL_BATCH * world)
    rows = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = xs[step][rows], ys[step][rows]
        loss_of(model, kind, x.to(device) if device else x, y.to(device) if device else y).backward()
        opt.step()


def train_data_parallel(kind, wrapper, accum=1, sync_every_micro_step=False, bucket_cap_mb=0.0005):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100 + rank)  # different on purpose: the wrapper must broadcast rank 0's weights
    model = make_model(kind) if rank == 0 else perturbed(make_model(kind))
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
            ctx = wrapped.no_sync() if not sync else nullcontext()
            with ctx:
                (loss_of(wrapped, kind, xs[step][rows], ys[step][rows]) / accum).backward()
        if hasattr(wrapped, "finish_gradient_synchronization"):
            wrapped.finish_gradient_synchronization()
        opt.step()
    calls = counter[0] if wrapper == "ddp" else getattr(wrapped, "allreduce_calls", 0)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dist.destroy_process_group()
    return {"state": state, "allreduce_calls": calls}


def perturbed(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    return model


def nullcontext():
    return contextlib.nullcontext()
