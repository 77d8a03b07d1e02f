"""Expert parallelism built from scratch: a mixture-of-experts layer with its experts spread over ranks.

A mixture-of-experts (MoE) layer has E expert MLPs and a router. For each token the router picks
the k experts with the highest scores and the layer's output is their outputs weighted by the
router's probabilities. Each expert sees only the tokens routed to it, so E experts hold E times the
parameters of one MLP for about k times its compute per token.

Expert parallelism puts E/N experts on each of N ranks. Every rank routes its own tokens, then:

    1. count the tokens it sends to each expert, and exchange the counts (all_to_all_single of E numbers)
    2. dispatch: all_to_all_single of the tokens themselves, sorted by expert, with those split sizes
    3. each rank runs its experts on the tokens it received (from every rank)
    4. combine: all_to_all_single back with the split sizes swapped, weight by the router, add up

The all-to-all is an autograd function (its backward is the all-to-all the other way), so expert
gradients collect contributions from every rank's tokens. Two things keep it honest:

* **capacity** — an expert takes at most ``ceil(capacity_factor * tokens * k / E)`` of one rank's
  tokens per step; the rest are *dropped* (their output for that expert is zero) and counted;
* **load balancing** — the auxiliary loss ``E * sum_e f_e * P_e`` (f: share of tokens sent to e,
  P: mean router probability of e; Switch Transformer) is 1 for a uniform router and grows as the
  router favours few experts.

``MoE`` is the single-process layer (the reference); ``ExpertParallelMoE(moe, ep)`` splits it.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtlab.distributed import AllToAll, GroupTally


class ExpertGroup(GroupTally):
    """The ranks the experts are spread over, and a tally: ``counts["all_to_all"]`` calls and
    ``counts["elements_sent"]`` (token-vector elements sent to *other* ranks, dispatch and combine)."""

    def all_to_all(self, x: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """``x``'s rows cut by ``send_splits`` go to ranks 0..N-1; returns the rows received, by ``recv_splits``."""
        out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=self.group)
        self.counts["all_to_all"] += 1
        width = math.prod(x.shape[1:])
        self.counts["elements_sent"] += (sum(send_splits) - send_splits[self.rank]) * width
        return out


class MoE(nn.Module):
    """A mixture-of-experts layer on one process: ``num_experts`` MLPs (d -> hidden -> d), top-``k`` routing.

    ``forward(x)`` takes tokens ``(n, d)`` and returns ``(output, stats)``; ``stats`` has ``aux_loss``
    (load balancing), ``dropped`` (token-expert assignments over capacity) and ``per_expert`` (kept
    tokens per expert).
    """

    def __init__(self, d: int, hidden: int, num_experts: int, k: int = 2, capacity_factor: float = 1.25):
        super().__init__()
        if not 1 <= k <= num_experts:
            raise ValueError(f"top-k routing with k={k} over {num_experts} experts. Fix: 1 <= k <= num_experts")
        self.k, self.num_experts, self.capacity_factor = k, num_experts, capacity_factor
        self.router = nn.Linear(d, num_experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))
                                     for _ in range(num_experts))

    def capacity(self, tokens: int) -> int:
        """Most tokens one expert takes from ``tokens`` tokens (of one rank, in a step)."""
        return math.ceil(self.capacity_factor * tokens * self.k / self.num_experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        """See ``route``."""
        return route(self.router, x, self.k, self.capacity(x.shape[0]))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        tokens, experts, weights, stats = self.route(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = experts == e
            if rows.any():
                out = out.index_add(0, tokens[rows], weights[rows, None] * expert(x[tokens[rows]]))
        return out, stats


def route(router: nn.Linear, x: torch.Tensor, k: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                              torch.Tensor, dict]:
    """Top-k routing with a capacity per expert.

    Returns (token index, expert, weight) of each kept assignment, sorted by expert (then token), and
    stats: ``aux_loss`` (load balancing), ``dropped`` (assignments beyond an expert's ``capacity``,
    the later tokens), ``per_expert`` (kept assignments per expert), ``demand`` (assignments per
    expert before the capacity cut).
    """
    num_experts = router.out_features
    probs = F.softmax(router(x), dim=-1)
    weights, experts = probs.topk(k, dim=-1)
    tokens = torch.arange(x.shape[0], device=x.device).repeat_interleave(k)
    experts, weights = experts.flatten(), weights.flatten()
    order = torch.argsort(experts * x.shape[0] + tokens)                     # by expert, then token
    tokens, experts, weights = tokens[order], experts[order], weights[order]
    first = torch.searchsorted(experts, experts)                              # where each expert's run starts
    keep = torch.arange(len(experts), device=x.device) - first < capacity
    demand = torch.bincount(experts, minlength=num_experts)
    stats = {"aux_loss": num_experts * (demand.float() / len(experts) * probs.mean(0)).sum(),
             "dropped": int((~keep).sum()), "demand": demand.tolist(),
             "per_expert": torch.bincount(experts[keep], minlength=num_experts).tolist()}
    return tokens[keep], experts[keep], weights[keep], stats


class ExpertParallelMoE(nn.Module):
    """``moe``'s experts spread over the ranks of ``ep`` (rank r keeps experts r·E/N ... (r+1)·E/N − 1);
    the router stays whole on every rank. Each rank passes its own tokens; built from the unsharded
    ``MoE`` (same seed on every rank), so it starts equal to it."""

    def __init__(self, moe: MoE, ep: ExpertGroup):
        super().__init__()
        if moe.num_experts % ep.size:
            fits = ep.size * max(1, moe.num_experts // ep.size)
            raise ValueError(f"{moe.num_experts} experts cannot be spread evenly over {ep.size} ranks. Fix: a number "
                             f"of experts divisible by the expert-parallel degree, e.g. {fits}")
        self.ep, self.k, self.num_experts = ep, moe.k, moe.num_experts
        self.capacity = moe.capacity                                     # the same rule, per rank's tokens
        self.per_rank = moe.num_experts // ep.size
        self.first = ep.rank * self.per_rank
        self.router = copy.deepcopy(moe.router)
        self.experts = nn.ModuleList(copy.deepcopy(moe.experts[self.first + i]) for i in range(self.per_rank))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        ep, n, per = self.ep, self.ep.size, self.per_rank
        tokens, experts, weights, stats = route(self.router, x, self.k, self.capacity(x.shape[0]))
        per_expert = torch.bincount(experts, minlength=self.num_experts)  # rows are sorted by expert already
        # 1. the counts: how many of my tokens go to each expert, and how many each rank sends to mine
        incoming = torch.empty_like(per_expert)
        dist.all_to_all_single(incoming, per_expert, group=ep.group)
        ep.counts["all_to_all"] += 1
        send_splits = per_expert.view(n, per).sum(1).tolist()
        recv_counts = incoming.view(n, per)                              # [source rank, my expert]
        recv_splits = recv_counts.sum(1).tolist()
        # 2. dispatch, 3. my experts on what arrived (grouped by source rank, then by expert)
        arrived = AllToAll.apply(x[tokens], ep, send_splits, recv_splits)
        expert_of_row = torch.arange(per, device=x.device).repeat(n).repeat_interleave(recv_counts.flatten())
        processed = torch.zeros_like(arrived)
        for i, expert in enumerate(self.experts):
            rows = expert_of_row == i
            if rows.any():
                processed = processed.index_put((rows.nonzero().squeeze(1),), expert(arrived[rows]))
        # 4. combine: back to the ranks the tokens came from, weighted, added up per token
        returned = AllToAll.apply(processed, ep, recv_splits, send_splits)
        out = torch.zeros_like(x).index_add(0, tokens, weights[:, None] * returned)
        stats["received"] = int(sum(recv_splits))
        stats["sent"] = int(sum(send_splits))
        return out, stats
