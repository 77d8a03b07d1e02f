"""Context parallelism (ring attention) built from scratch: one long sequence split over N ranks.

Attention needs every query to meet every key. Split the sequence over N ranks and each rank holds
1/N of the queries, keys and values; the keys and values then travel around a ring:

    step 0:     attend my queries to my own key/value block
    step 1..N-1: send the block I hold to rank+1, receive rank-1's, attend my queries to it

After N-1 ring steps every query has met every key, and no rank ever held more than two blocks.
Each step's partial attention is merged with the running result by the log-sum-exp trick: keep,
per query, the output so far and the log of its softmax denominator (``lse``); a new block with its
own ``block_lse`` gives ``new = logaddexp(lse, block_lse)`` and rescales both parts by
``exp(old - new)``. The result is exactly softmax attention over the whole sequence.

With a causal mask a query only sees keys at or before its position, so with the sequence cut
into N contiguous pieces rank r needs only blocks 0..r: later blocks are skipped (no compute), and
rank N-1 does about 2N-1 times rank 0's work. The **zig-zag** layout gives rank r the chunks r and
2N-1-r of 2N equal chunks (an early one and a late one), which evens the work out.

The ring pass is an autograd function (forward: send to rank+1, receive from rank-1; backward:
the gradient goes the other way), so ``loss.backward()`` brings each key/value block's gradient
home to the rank that owns it. Every rank must run every pass's backward (each is a send and a
receive), so a rank that skipped a future block still keeps that block in its graph.

Parameters before attention (q/k/v projections) see only their rank's tokens: their gradients are
summed over the context ranks (and divided by N when each rank's loss is a mean over its own
tokens), as data parallelism does.

    cp = ContextGroup()                                      # after dist.init_process_group(...)
    q, k, v = (split_sequence(t, cp, dim=2, layout="zigzag") for t in (q_all, k_all, v_all))
    out = ring_attention(q, k, v, cp, causal=True, layout="zigzag")
    cp.counts                                                # {"ring_steps": N-1, "work": ...}
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtlab.distributed import GroupTally

LAYOUTS = ("contiguous", "zigzag")


class ContextGroup(GroupTally):
    """The ranks one sequence is split over, and a tally: ``counts["ring_steps"]`` (forward passes of a
    block to the next rank), ``counts["work"]`` (query-key scores this rank computed that the mask kept)."""

    def shift(self, x: torch.Tensor, step: int = 1) -> torch.Tensor:
        """Send ``x`` to rank + step and return what rank - step sent (a ring, wrapping around)."""
        received = torch.empty_like(x)
        to, source = self.global_rank((self.rank + step) % self.size), self.global_rank((self.rank - step) % self.size)
        ops = [dist.P2POp(dist.isend, x.contiguous(), to, self.group),
               dist.P2POp(dist.irecv, received, source, self.group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return received


class _RingPass(torch.autograd.Function):
    """Forward: pass a block to the next rank. Backward: pass its gradient back to the previous one."""

    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp = cp
        return cp.shift(x, 1)

    @staticmethod
    def backward(ctx, grad):
        return ctx.cp.shift(grad, -1), None


def positions(seq_len: int, cp: ContextGroup | int, rank: int | None = None,
              layout: str = "contiguous") -> torch.Tensor:
    """The global token positions rank ``rank`` holds (default: this rank) under ``layout``."""
    size = cp if isinstance(cp, int) else cp.size
    rank = rank if rank is not None else (cp.rank if not isinstance(cp, int) else 0)
    _check(seq_len, size, layout)
    if layout == "contiguous":
        per = seq_len // size
        return torch.arange(rank * per, (rank + 1) * per)
    chunk = seq_len // (2 * size)
    first, second = rank, 2 * size - 1 - rank
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk),
                      torch.arange(second * chunk, (second + 1) * chunk)])


def split_sequence(x: torch.Tensor, cp: ContextGroup, dim: int, layout: str = "contiguous") -> torch.Tensor:
    """This rank's part of ``x`` along the sequence dimension ``dim`` (a copy)."""
    return x.index_select(dim, positions(x.shape[dim], cp, layout=layout).to(x.device)).clone()


def gather_sequence(x: torch.Tensor, cp: ContextGroup, dim: int, layout: str = "contiguous") -> torch.Tensor:
    """The whole sequence from every rank's part (an all-gather), in position order."""
    parts = [torch.empty_like(x) for _ in range(cp.size)]
    dist.all_gather(parts, x.contiguous(), group=cp.group)
    seq_len = x.shape[dim] * cp.size
    order = torch.cat([positions(seq_len, cp.size, r, layout) for r in range(cp.size)])
    whole = torch.empty_like(torch.cat(parts, dim=dim))
    return whole.index_copy(dim, order.to(x.device), torch.cat(parts, dim=dim))


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextGroup, causal: bool = True,
                   layout: str = "contiguous") -> torch.Tensor:
    """Softmax attention of this rank's queries over the whole sequence's keys and values.

    ``q``, ``k``, ``v``: ``(batch, heads, local_len, head_dim)``, this rank's part under ``layout``.
    Returns this rank's part of the output. Differentiable (gradients reach every rank's k and v).
    """
    seq_len = q.shape[2] * cp.size
    scale = q.shape[-1] ** -0.5
    mine = positions(seq_len, cp, layout=layout).to(q.device)
    low = torch.finfo(q.dtype).min / 2                        # "minus infinity" whose exp() and gradient stay 0
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], low, dtype=q.dtype, device=q.device)
    kv = torch.stack([k, v])
    for step in range(cp.size):
        if step:
            kv = _RingPass.apply(kv, cp)                       # the block rank - step started with
            cp.counts["ring_steps"] += 1
        theirs = positions(seq_len, cp, (cp.rank - step) % cp.size, layout).to(q.device)
        visible = mine[:, None] >= theirs[None, :] if causal else torch.ones(len(mine), len(theirs), dtype=torch.bool,
                                                                                 device=q.device)
        if not visible.any():
            continue                                           # a block wholly in the future: skip the work
        cp.counts["work"] += int(visible.sum()) * q.shape[0] * q.shape[1]
        scores = (q @ kv[0].transpose(-2, -1) * scale).masked_fill(~visible, low)
        block_lse = torch.logsumexp(scores, dim=-1)
        new_lse = torch.logaddexp(lse, block_lse)
        out = out * torch.exp(lse - new_lse)[..., None] + torch.exp(scores - new_lse[..., None]) @ kv[1]
        lse = new_lse
    # Each ring pass's backward is a send/receive every rank must take part in, even a rank that skipped the
    # blocks the last passes brought: a zero term keeps the whole chain of passes in this rank's graph.
    return out + 0.0 * kv.sum()


def _check(seq_len: int, size: int, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: use one of {LAYOUTS}")
    parts = size if layout == "contiguous" else 2 * size
    if seq_len % parts:
        fix = seq_len // parts * parts or parts
        raise ValueError(f"a sequence of {seq_len} tokens cannot be cut into {parts} equal parts "
                         f"({layout} layout over {size} ranks). Fix: a length divisible by {parts}, e.g. {fix} "
                         f"or {fix + parts}")
