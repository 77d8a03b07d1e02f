"""Context parallelism (ring attention) built from scratch: one long sequence split over N ranks.

Attention needs every query to meet every key. Split the sequence over N ranks and each rank holds
1/N of the queries, keys and values; the keys and values then travel around a ring:

    step 0:      attend my queries to my own key/value block
    step 1..N-1: attend them to the block rank - step started with, passed on by my neighbour

While a rank computes with the block it holds, the next block is already on its way: each step
posts the send and receive first and waits for them after its compute, so the transfer hides
behind the work. Each step's partial attention is merged with the running result by the
log-sum-exp trick: keep, per query, the output so far and the log of its softmax denominator
(``lse``); a new block with its own ``block_lse`` gives ``new = logaddexp(lse, block_lse)`` and
rescales both parts by ``exp(old - new)``. The result is exactly softmax attention over the whole
sequence.

**Memory.** The forward pass keeps, for backward, only this rank's q, k, v, its output and ``lse``
(``ring_attention``); the backward pass runs the ring again: for each block it recomputes the
probabilities from the saved ``lse`` (``p = exp(q k^T * scale - lse)``, as FlashAttention and the
Ring Attention paper do), adds the block's share of dq, and sends the block's dk and dv on with the
block, so that after the last step they arrive at the rank that owns it. No rank keeps more than
its own block, the one it works on and the one in flight. ``naive_ring_attention`` is the same
forward written with autograd: it is correct too, but autograd saves every received block and each
step's probabilities — the whole sequence's keys and values on every rank, the memory context
parallelism exists to remove (notebook 16 measures both).

With a causal mask a query only sees keys at or before its position, so with the sequence cut
into N contiguous pieces rank r needs only blocks 0..r: later blocks are skipped (no compute), and
rank N-1 does about 2N-1 times rank 0's work. The **zig-zag** layout gives rank r the chunks r and
2N-1-r of 2N equal chunks (an early one and a late one), which evens the work out.

Parameters before attention (q/k/v projections) see only their rank's tokens: their gradients are
summed over the context ranks (and divided by N when each rank's loss is a mean over its own
tokens), as data parallelism does.

    cp = ContextGroup()                                      # after dist.init_process_group(...)
    q, k, v = (split_sequence(t, cp, dim=2, layout="zigzag") for t in (q_all, k_all, v_all))
    out = ring_attention(q, k, v, cp, causal=True, layout="zigzag")
    cp.counts                                                # {"ring_steps": ..., "work": ...}
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dtlab.distributed import GroupTally

LAYOUTS = ("contiguous", "zigzag")


@dataclass
class ContextGroup(GroupTally):
    """The ranks one sequence is split over, and a tally: ``counts["ring_steps"]`` (blocks passed to the next rank
    in the forward pass), ``counts["work"]`` (query-key scores this rank computed that the mask kept).

    With ``record_timeline=True`` each step appends ``{"what": "compute"|"wait", "pass": "forward"|"backward",
    "start", "end"}`` (seconds) to ``timeline``: a transfer that hid behind the compute shows a short wait.
    """

    record_timeline: bool = False
    timeline: list = field(default_factory=list)

    def start_shift(self, x: torch.Tensor, step: int = 1) -> tuple[torch.Tensor, list]:
        """Post the send of ``x`` to rank + step and the receive from rank - step; return the buffer being
        filled and the pending works (``finish`` waits for them)."""
        received = torch.empty_like(x)
        to, source = self.global_rank((self.rank + step) % self.size), self.global_rank((self.rank - step) % self.size)
        ops = [dist.P2POp(dist.isend, x.contiguous(), to, self.group),
               dist.P2POp(dist.irecv, received, source, self.group)]
        return received, dist.batch_isend_irecv(ops)

    def finish(self, works: list) -> None:
        """Wait for the transfers ``start_shift`` posted."""
        for work in works:
            work.wait()

    def shift(self, x: torch.Tensor, step: int = 1) -> torch.Tensor:
        """Send ``x`` to rank + step and return what rank - step sent (a ring, wrapping around)."""
        received, works = self.start_shift(x, step)
        self.finish(works)
        return received

    def _log(self, what: str, phase: str, start: float) -> None:
        if self.record_timeline:
            self.timeline.append({"what": what, "pass": phase, "start": start, "end": time.perf_counter()})


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


def _visible(q: torch.Tensor, cp: ContextGroup, step: int, causal: bool, layout: str) -> torch.Tensor:
    """Which of this rank's queries see which keys of the block that started on rank - step."""
    seq_len = q.shape[2] * cp.size
    mine = positions(seq_len, cp, layout=layout).to(q.device)
    theirs = positions(seq_len, cp, (cp.rank - step) % cp.size, layout).to(q.device)
    if causal:
        return mine[:, None] >= theirs[None, :]
    return torch.ones(len(mine), len(theirs), dtype=torch.bool, device=q.device)


def _ring_forward(q, k, v, cp, causal, layout):
    scale, low = q.shape[-1] ** -0.5, torch.finfo(q.dtype).min / 2   # low: a "minus infinity" exp() keeps at 0
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], low, dtype=q.dtype, device=q.device)
    kv = torch.stack([k, v])
    for step in range(cp.size):
        if step + 1 < cp.size:
            arriving, works = cp.start_shift(kv)           # the next block travels while this one is used
        start = time.perf_counter()
        visible = _visible(q, cp, step, causal, layout)
        if visible.any():                                  # a block wholly in the future needs no work
            cp.counts["work"] += int(visible.sum()) * q.shape[0] * q.shape[1]
            scores = (q @ kv[0].transpose(-2, -1) * scale).masked_fill(~visible, low)
            new_lse = torch.logaddexp(lse, torch.logsumexp(scores, dim=-1))
            out = out * torch.exp(lse - new_lse)[..., None] + torch.exp(scores - new_lse[..., None]) @ kv[1]
            lse = new_lse
        cp._log("compute", "forward", start)
        if step + 1 < cp.size:
            start = time.perf_counter()
            cp.finish(works)
            cp._log("wait", "forward", start)
            kv = arriving
            cp.counts["ring_steps"] += 1
    return out, lse


def _ring_backward(dout, q, k, v, out, lse, cp, causal, layout):
    scale, low = q.shape[-1] ** -0.5, torch.finfo(q.dtype).min / 2
    delta = (dout * out).sum(-1, keepdim=True)           # softmax's backward needs rowsum(dout * out)
    dq = torch.zeros_like(q)
    kv = torch.stack([k, v])
    dkv = torch.zeros_like(kv)                            # the held block's dk, dv: they travel with it
    for step in range(cp.size):
        if step + 1 < cp.size:
            arriving, works = cp.start_shift(kv)
        start = time.perf_counter()
        visible = _visible(q, cp, step, causal, layout)
        if visible.any():
            scores = (q @ kv[0].transpose(-2, -1) * scale).masked_fill(~visible, low)
            p = torch.exp(scores - lse[..., None])        # this block's probabilities, from the saved lse
            dkv[1] += p.transpose(-2, -1) @ dout          # dv
            dp = dout @ kv[1].transpose(-2, -1)
            ds = p * (dp - delta) * scale
            dq += ds @ kv[0]
            dkv[0] += ds.transpose(-2, -1) @ q            # dk
        cp._log("compute", "backward", start)
        dkv = cp.shift(dkv)                                # on with the block; after the last step: home
        if step + 1 < cp.size:
            start = time.perf_counter()
            cp.finish(works)
            cp._log("wait", "backward", start)
            kv = arriving
    return dq, dkv[0], dkv[1]


class _RingAttention(torch.autograd.Function):
    """Ring attention that saves only this rank's q, k, v, output and log-sum-exp for backward."""

    @staticmethod
    def forward(ctx, q, k, v, cp, causal, layout):
        out, lse = _ring_forward(q, k, v, cp, causal, layout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.causal, ctx.layout = cp, causal, layout
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout.contiguous(), q, k, v, out, lse, ctx.cp, ctx.causal, ctx.layout)
        return dq, dk, dv, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextGroup, causal: bool = True,
                   layout: str = "contiguous") -> torch.Tensor:
    """Softmax attention of this rank's queries over the whole sequence's keys and values.

    ``q``, ``k``, ``v``: ``(batch, heads, local_len, head_dim)``, this rank's part under ``layout``.
    Returns this rank's part of the output. Differentiable: the backward pass runs the ring again and
    brings each rank's dk and dv home; only this rank's q, k, v, output and log-sum-exp are saved.
    """
    _check(q.shape[2] * cp.size, cp.size, layout)
    return _RingAttention.apply(q, k, v, cp, causal, layout)


class _RingPass(torch.autograd.Function):
    """Forward: pass a block to the next rank. Backward: pass its gradient back to the previous one."""

    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp = cp
        return cp.shift(x, 1)

    @staticmethod
    def backward(ctx, grad):
        return ctx.cp.shift(grad, -1), None


def naive_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextGroup, causal: bool = True,
                         layout: str = "contiguous") -> torch.Tensor:
    """The same attention with autograd doing the backward: simple, exact, and it keeps every block it received
    and each step's probabilities until backward (for comparison; use ``ring_attention``)."""
    scale, low = q.shape[-1] ** -0.5, torch.finfo(q.dtype).min / 2
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], low, dtype=q.dtype, device=q.device)
    kv = torch.stack([k, v])
    for step in range(cp.size):
        if step:
            kv = _RingPass.apply(kv, cp)
            cp.counts["ring_steps"] += 1
        visible = _visible(q, cp, step, causal, layout)
        if not visible.any():
            continue
        cp.counts["work"] += int(visible.sum()) * q.shape[0] * q.shape[1]
        scores = (q @ kv[0].transpose(-2, -1) * scale).masked_fill(~visible, low)
        new_lse = torch.logaddexp(lse, torch.logsumexp(scores, dim=-1))
        out = out * torch.exp(lse - new_lse)[..., None] + torch.exp(scores - new_lse[..., None]) @ kv[1]
        lse = new_lse
    # each pass's backward is a send/receive every rank takes part in: keep the whole chain in the graph
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
