"""Expert parallelism from scratch (dtlab.parallel.expert) must equal the single-process MoE layer.

Each rank routes its own tokens. The reference is the unsharded ``MoE`` run in one process on every
rank's tokens in turn (capacity applies per rank's tokens, as in the distributed layer), with the
loss summed over ranks. Compared within 1e-6: each rank's output, the gradients of the experts it
holds, and the router's gradient summed over ranks (it is replicated, as in data parallelism).
"""

import pytest
import torch

from dtlab.launch import WorkerError, run
from dtlab.parallel import expert as epmod

D, HIDDEN, TOKENS = 8, 16, 12


pytestmark = pytest.mark.cluster  # code a cluster runs: make test-runtime repeats these on its stack


def make_moe(experts: int, capacity_factor: float) -> epmod.MoE:
    torch.manual_seed(0)
    return epmod.MoE(D, HIDDEN, experts, k=2, capacity_factor=capacity_factor)


def ep_worker(experts: int, capacity_factor: float) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    ep = epmod.ExpertGroup()
    rank, n = ep.rank, ep.size
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(TOKENS, D, generator=g).requires_grad_() for _ in range(n)]   # a layer's input has a gradient
    ws = [torch.randn(TOKENS, D, generator=g) for _ in range(n)]

    reference = make_moe(experts, capacity_factor)
    total, ref_stats = 0.0, []
    for x, w in zip(xs, ws):
        out, stats = reference(x)
        total = total + (out * w).sum() + stats["aux_loss"]
        ref_stats.append((out.detach(), stats))
    total.backward()

    layer = epmod.ExpertParallelMoE(make_moe(experts, capacity_factor), ep)
    x = xs[rank].detach().clone().requires_grad_()
    out, stats = layer(x)
    ((out * ws[rank]).sum() + stats["aux_loss"]).backward()
    router_grad = layer.router.weight.grad.clone()
    dist.all_reduce(router_grad)
    held = [reference.experts[layer.first + i] for i in range(layer.per_rank)]
    expert_diff = max((p.grad - q.grad).abs().max().item()
                      for mine, ref in zip(layer.experts, held) for p, q in zip(mine.parameters(), ref.parameters()))
    result = {"output": (out - ref_stats[rank][0]).abs().max().item(), "experts": expert_diff,
              "input_grad": (x.grad - xs[rank].grad).abs().max().item(),
              "router": (router_grad - reference.router.weight.grad).abs().max().item(),
              "sent": stats["sent"], "received": stats["received"], "dropped": stats["dropped"],
              "ref_dropped": ref_stats[rank][1]["dropped"], "per_expert": stats["per_expert"],
              "counts": dict(ep.counts), "rank": rank, "held": sum(p.numel() for p in layer.experts.parameters()),
              "all_experts": sum(p.numel() for p in reference.experts.parameters())}
    dist.destroy_process_group()
    return result


@pytest.mark.parametrize("world, experts, capacity_factor", [(2, 4, 2.0), (2, 4, 0.5), (4, 8, 1.25)])
def test_expert_parallel_moe_equals_the_single_process_layer(world, experts, capacity_factor):
    results = run(ep_worker, experts, capacity_factor, nprocs=world, timeout=180)
    per = experts // world
    for r in results:
        assert max(r["output"], r["experts"], r["router"], r["input_grad"]) <= 1e-6, r
        assert r["dropped"] == r["ref_dropped"]
        assert r["sent"] + r["dropped"] == TOKENS * 2                      # every assignment sent, or dropped
        assert r["held"] * world == r["all_experts"]
    # conservation: what the ranks received is what they sent; each rank received its experts' kept tokens
    assert sum(r["sent"] for r in results) == sum(r["received"] for r in results)
    for j, r in enumerate(results):
        assert r["received"] == sum(sum(o["per_expert"][j * per:(j + 1) * per]) for o in results)
    # bytes: the dispatch sends D numbers per token going to another rank, the combine D per token coming back
    # from this rank's experts to another; backward, each all-to-all's gradient retraces the other's path
    for j, r in enumerate(results):
        own = sum(r["per_expert"][j * per:(j + 1) * per])
        assert r["counts"]["elements_sent"] == 2 * D * ((r["sent"] - own) + (r["received"] - own))
        assert r["counts"]["all_to_all"] == 1 + 4
    if capacity_factor < 1:
        assert sum(r["dropped"] for r in results) > 0


def test_uniform_router_has_aux_loss_one_and_a_skewed_one_more():
    moe = make_moe(4, 2.0)
    x = torch.randn(64, D) + 1                                                # every token's features sum to ~D
    torch.nn.init.zeros_(moe.router.weight)                                   # every expert equally likely
    assert moe(x)[1]["aux_loss"].item() == pytest.approx(1.0)
    with torch.no_grad():
        moe.router.weight[0] = 2.0                                            # expert 0 wins nearly every token
    assert moe(x)[1]["aux_loss"].item() > 1.8


def uneven():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    epmod.ExpertParallelMoE(make_moe(3, 1.0), epmod.ExpertGroup())


def test_experts_that_do_not_divide_are_refused_with_the_fix():
    with pytest.raises(WorkerError) as err:
        run(uneven, nprocs=2, timeout=60)
    assert "3 experts cannot be spread evenly over 2 ranks" in str(err.value) and "Fix" in str(err.value)
    with pytest.raises(ValueError, match="k=5 over 4 experts"):
        epmod.MoE(D, HIDDEN, 4, k=5)
