"""Composing parallelism: the 2-D mesh against one process, the mesh's checks, and the layout model's arithmetic."""

import pytest
import torch

from dtlab import composition, fsdp2, hardware, memory
from dtlab.composition import Layout
from dtlab.launch import WorkerError, run


def fsdp_tp_worker() -> dict:
    import logging
    import warnings

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from dtlab import models
    from dtlab.dtensor import full

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


def test_layout_memory_is_the_memory_models_for_each_gpus_share():
    r = composition.cost(7e9, Layout(dp=2, tp=4, pp=2), "g5.12xlarge x4")
    states = memory.model_states(7e9 / 8, 2, 1)
    assert r["memory"]["params"] == states.params and r["memory"]["optimizer"] == states.optimizer
    shape = memory.model_shape(7e9)
    assert r["memory"]["activations"] == pytest.approx(
        memory.activation_bytes(1, 2048, shape.n_layer, shape.n_embd, shape.n_head, recompute="selective") / 4)
    assert r["inside_node"] == {"tp": True, "cp": True, "pp": False, "dp": False}


def test_tp_across_nodes_is_priced_at_the_network_and_the_bubble_follows_the_formula():
    inside = composition.cost(7e9, Layout(dp=4, tp=4), "g5.12xlarge x4")
    across = composition.cost(7e9, Layout(tp=16), "g5.12xlarge x4")
    node = hardware.node("g5.12xlarge")
    ring = lambda n: 2 * (n - 1) / n  # noqa: E731
    per_value = {n: ring(n) for n in (4, 16)}
    m4, m16 = 512 // 4, 512
    assert inside["comm_seconds"]["tp"] == pytest.approx(
        m4 * 32 * 4 * per_value[4] * 2048 * 4096 * 2 / (node.intra_node_gbs * 1e9))
    assert across["comm_seconds"]["tp"] == pytest.approx(
        m16 * 32 * 4 * per_value[16] * 2048 * 4096 * 2 / (node.network_gbps / 8 * 1e9))
    piped = composition.cost(7e9, Layout(dp=4, pp=4), "g5.12xlarge x4")
    assert piped["bubble"] == pytest.approx(3 / (128 + 3))


@pytest.mark.parametrize("layout, words", [(Layout(dp=32), "needs 32 GPUs"), (Layout(dp=4, tp=3), "heads=32"),
                                           (Layout(pp=3, dp=4), "layers=32")])
def test_layouts_that_cannot_run_are_refused_with_the_fix(layout, words):
    with pytest.raises(ValueError, match=words + ".*Fix"):
        composition.cost(7e9, layout, "g5.12xlarge x4")
