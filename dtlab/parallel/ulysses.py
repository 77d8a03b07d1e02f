"""DeepSpeed-Ulysses sequence parallelism from scratch: split the heads instead of the sequence, by all-to-all.

Each of N ranks holds a contiguous 1/N of the sequence, for every head (what a sequence-parallel split
leaves). Attention needs whole sequences; Ulysses (Jacobs et al. 2023) re-partitions with one all-to-all per
tensor so that rank r holds the *whole* sequence for its 1/N of the heads, runs ordinary attention on them
(any kernel: fused, written out, FlashAttention), and a fourth all-to-all brings the output back:

    q, k, v  (batch, heads,   seq/N, head_dim)   every head, my tokens
       all-to-all: scatter heads, gather tokens
             (batch, heads/N, seq,   head_dim)   my heads, every token  -> attention, unchanged
       all-to-all: scatter tokens, gather heads
    out      (batch, heads,   seq/N, head_dim)

The backward pass runs the same all-to-alls the other way round (an all-to-all's gradient is the inverse
all-to-all).

**Bytes per rank**, one attention forward, ``v`` bytes per value, ``h = heads x head_dim`` and ``h_kv`` for the
keys and values (smaller with grouped-query attention): each all-to-all sends all but 1/N of the local
tensor, so Ulysses sends ``(2h + 2h_kv) * b * s/N * v * (N-1)/N``; the ring (``dtlab.parallel.context``) passes
its key and value blocks on N-1 times, ``2 * h_kv * b * s/N * v * (N-1)`` (``sent_per_rank``). Ulysses' bytes
fall as N grows, the ring's do not; but Ulysses needs the query *and* key/value heads to divide by N (with
grouped-query attention, N <= the key/value heads) and an all-to-all among all N ranks, where the ring needs
only neighbours, and can hide each transfer behind a block's compute.

    sp = UlyssesGroup()                                        # after dist.init_process_group(...)
    out = ulysses_attention(q, k, v, sp, causal=True)          # q, k, v: this rank's tokens, every head
    sp.counts                                                  # {"all_to_all": 4}
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlab.distributed import AllToAll, GroupTally


class UlyssesGroup(GroupTally):
    """The ranks one sequence is split over, and a tally: ``counts["all_to_all"]`` calls (forward and backward)
    and ``counts["elements_sent"]`` (elements this rank sent to the others)."""

    def all_to_all(self, x: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        """Cut ``x`` into N pieces along ``scatter_dim``, send piece i to rank i, and join what arrives, in rank
        order, along ``gather_dim``."""
        n = self.size
        pieces = torch.stack(x.chunk(n, dim=scatter_dim))       # (N, ...): piece i is for rank i
        received = torch.empty_like(pieces)
        dist.all_to_all_single(received, pieces, group=self.group)
        self.counts["all_to_all"] += 1
        self.counts["elements_sent"] += pieces.numel() * (n - 1) // n
        return torch.cat(received.unbind(0), dim=gather_dim)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sp: UlyssesGroup,
                      causal: bool = True) -> torch.Tensor:
    """Attention over the whole sequence for this rank's tokens, heads exchanged by all-to-all.

    ``q``: ``(batch, heads, seq/N, head_dim)``, this rank's contiguous part of the sequence (rank r holds
    tokens r*seq/N ... (r+1)*seq/N - 1); ``k``, ``v``: the same with ``kv_heads`` heads (grouped-query attention
    when fewer than ``heads``: query head j uses key/value head j // (heads / kv_heads)). Returns this rank's
    part of the output, shaped like ``q``. Differentiable.

    Raises:
        ValueError: heads or key/value heads that do not divide by the ranks, or query heads that are not a
            multiple of the key/value heads — with the fix.
    """
    heads, kv_heads, n = q.shape[1], k.shape[1], sp.size
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} key/value heads. Fix: query heads a "
                         "multiple of the key/value heads")
    if heads % n or kv_heads % n:
        raise ValueError(f"Ulysses splits the heads over the {n} ranks: {heads} query and {kv_heads} key/value heads "
                         f"must both divide by {n}. Fix: a number of ranks that divides {kv_heads} (or ring attention, "
                         "dtlab.parallel.context, which has no such limit)")
    q_all, k_all, v_all = (AllToAll.apply(t, sp, 1, 2) for t in (q, k, v))   # my heads, every token
    group = heads // kv_heads
    if group > 1:
        k_all, v_all = k_all.repeat_interleave(group, dim=1), v_all.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q_all, k_all, v_all, is_causal=causal)
    return AllToAll.apply(out, sp, 2, 1)                                      # every head, my tokens


def sent_per_rank(kind: str, batch: int, seq_len: int, heads: int, head_dim: int, n: int,
                  kv_heads: int | None = None, bytes_per_value: int = 4) -> float:
    """Bytes one rank sends in one attention forward over ``n`` ranks: ``kind`` "ulysses" (four all-to-alls of
    its q, k, v and output, each all but 1/n of it) or "ring" (its key and value blocks passed on n - 1 times).
    The backward pass sends as much again (Ulysses) or twice as much (the ring also returns dk, dv)."""
    kv_heads = kv_heads or heads
    local_tokens = batch * seq_len / n
    h, h_kv = heads * head_dim, kv_heads * head_dim
    if kind == "ulysses":
        return (2 * h + 2 * h_kv) * local_tokens * bytes_per_value * (n - 1) / n
    if kind == "ring":
        return 2 * h_kv * local_tokens * bytes_per_value * (n - 1)
    raise ValueError(f"kind={kind!r}: use 'ulysses' or 'ring'")
