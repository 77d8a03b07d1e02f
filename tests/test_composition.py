"""Composing parallelism: the 2-D mesh against one process, and the mesh's checks (the layout model on paper is
dtlab.planner.cost: tests/test_planner_cost.py)."""

import pytest
import torch

from dtlab.launch import WorkerError, run
from dtlab.parallel import fsdp2
from dtlab.parallel import mesh as composition

pytestmark = pytest.mark.cluster  # code a cluster runs: make test-runtime repeats these on its stack


def fsdp_tp_worker() -> dict:
    import logging
    import warnings

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from dtlab import models
    from dtlab.parallel.dtensor import full

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    dist.init_process_group("gloo")
    mesh = composition.device_mesh("cpu", dp=2, tp=2)

    def make():
        torch.manual_seed(0)
        return models.TinyGPT(16, 6, 2, 2, 8, tie_weights=False)

    reference, model = make(), make()
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                                               "attn.v": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                               "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 16, (4, 6), generator=g), torch.randint(0, 16, (4, 6), generator=g)
    rows = slice(2 * mesh["dp"].get_local_rank(), 2 * mesh["dp"].get_local_rank() + 2)
    for net, data in ((model, (x[rows], y[rows])), (reference, (x, y))):
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        for _ in range(2):
            opt.zero_grad()
            net(*data)[1].backward()
            opt.step()
    ref = dict(reference.named_parameters())
    diff = max((full(p.detach()) - ref[n].detach()).abs().max().item() for n, p in model.named_parameters())
    dist.destroy_process_group()
    return diff


@pytest.mark.slow
@pytest.mark.skipif(not fsdp2.AVAILABLE,
                    reason=f"fully_shard needs torch >= {fsdp2.NEEDS_TORCH}; this is {torch.__version__}")
def test_fsdp2_times_tensor_parallel_on_a_2d_mesh_equals_one_process():
    assert max(run(fsdp_tp_worker, nprocs=4, timeout=180)) <= 1e-5


def ask_for_mesh(dims: dict, name: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    composition.submesh(composition.device_mesh("cpu", **dims), name)


@pytest.mark.parametrize("dims, name, words", [({"dp": 2, "tp": 3}, "tp", "has 6 ranks but the job has 2"),
                                               ({"dp": 1, "tp": 2}, "pp", "no dimension 'pp'")])
def test_a_mesh_that_does_not_fit_or_a_missing_name_is_refused_with_the_fix(dims, name, words):
    with pytest.raises(WorkerError) as err:
        run(ask_for_mesh, dims, name, nprocs=2, timeout=60)
    assert words in str(err.value) and "Fix" in str(err.value)
