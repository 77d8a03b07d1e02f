"""Exercise 16.online_softmax_merge: ring attention's merge of two partial softmax results.

Write ``merge(out_a, lse_a, out_b, lse_b) -> (out, lse)``. ``out_a`` (shape ``[..., q, d]``) is attention of q
queries over one block of keys, normalised within that block (softmax over the block's keys, times their
values); ``lse_a`` (shape ``[..., q]``) is the log-sum-exp of those queries' scores over the block. ``out_b``,
``lse_b``: the same over another block of keys. Return the attention over both blocks together, and its
log-sum-exp — as if the two blocks had been one. This is the step ring attention runs each time a new key/value
block arrives from its neighbour (``dtlab.parallel.context._ring_forward`` does it inline).

What must hold (what the grader checks, on 3 processes by default): each rank holds 4 queries, keys and values
of a sequence split over the ranks; the grader passes the key/value blocks around the ring with ``send`` and
``recv``, starts each query from nothing seen (``out = 0``, ``lse = -inf``) and calls your ``merge`` once per
block as it arrives (its own block last). Then, for every rank:

* the output equals causal softmax attention over the whole sequence computed in one process (in float64),
  and ``lse`` equals the log-sum-exp of each query's visible scores over the whole sequence, both within
  8·N float32 epsilons times (1 + the largest possible |score|) (times the largest |value| for the output):
  float32 rounding, not an approximation;
* with a causal mask a query sees no key of a later block: that block has ``lse = -inf`` (and ``out = 0``),
  and a query may have seen nothing yet when it arrives. Both must merge without NaN;
* the same with large scores, up to a few hundred in magnitude: ``exp`` overflows float32 above 88.7 and
  underflows below about -103, so no ``exp`` of a raw log-sum-exp may appear.

Hints: the merged denominator is the sum of the two blocks' denominators, exp(lse_a) + exp(lse_b), so each
block's output counts in proportion to its share of it. ``torch.logaddexp`` adds two numbers given by their
logs without leaving float32's range. What is ``-inf - (-inf)``?
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from dtlab.exercises.grading import Rank, Report, compare, run_ranks

NPROCS = 3
HEADS, PER_RANK, DIM = 2, 4, 8
#: (name, multiplier of q and k): scores of order 1, then scores well beyond exp's float32 range
CASES = [("scores of order 1", 1.0), ("large scores", 7.0)]
EPS = 2.0 ** -23


def _qkv(world: int, case: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole sequence's q, k, v (the same on every rank)."""
    g = torch.Generator().manual_seed(11 + case)
    q, k, v = (torch.randn(1, HEADS, PER_RANK * world, DIM, generator=g) for _ in range(3))
    q, k = q * CASES[case][1], k * CASES[case][1]
    k[..., 0, :] = -2 * q[..., 0, :]      # the first query sees only the first key: its score is -2|q|^2 / sqrt(d)
    return q, k, v


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Attention of q over one key block, normalised within it, and its log-sum-exp (-inf, output 0, where a
    query sees no key of the block)."""
    scores = (q @ k.transpose(-2, -1) * DIM ** -0.5).masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0)[..., None]) @ v, lse


def _shift(kv: torch.Tensor, me: Rank) -> torch.Tensor:
    """Send the block to rank + 1, receive the one rank - 1 holds (even ranks send first: no one waits forever)."""
    received = torch.empty_like(kv)
    right, left = (me.rank + 1) % me.world, (me.rank - 1) % me.world
    if me.rank % 2 == 0:
        dist.send(kv, right)
        dist.recv(received, left)
    else:
        dist.recv(received, left)
        dist.send(kv, right)
    return received


def _body(impl: Any, me: Rank) -> dict[str, Any]:
    results = []
    mine = torch.arange(me.rank * PER_RANK, (me.rank + 1) * PER_RANK)
    for case in range(len(CASES)):
        q, k, v = (t[..., mine, :].to(me.device) for t in _qkv(me.world, case))
        kv = torch.stack([k, v]).contiguous()
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], -math.inf, device=me.device)
        for step in range(1, me.world + 1):
            kv = _shift(kv, me)                           # the block rank - step started with; its own last
            source = (me.rank - step) % me.world
            theirs = torch.arange(source * PER_RANK, (source + 1) * PER_RANK)
            visible = (mine[:, None] >= theirs[None, :]).to(me.device)
            out, lse = impl(out, lse, *_block(q, kv[0], kv[1], visible))
        results.append({"output": out.detach().cpu(), "lse": lse.detach().cpu()})
    return {"results": results}


def grade(impl: Any, report: Report, nprocs: int = NPROCS, limit_s: float = 30.0) -> Report:
    """Grade ``impl`` (your ``merge``) in a ring attention over ``nprocs`` processes, into ``report``."""
    out = run_ranks(report, _body, impl, nprocs=nprocs, limit_s=limit_s)
    if out is None:
        return report
    n, length = nprocs, PER_RANK * nprocs
    causal = torch.arange(length)[:, None] >= torch.arange(length)[None, :]
    largest = []
    for case, (name, _) in enumerate(CASES):
        q, k, v = (t.double() for t in _qkv(n, case))
        scores = (q @ k.transpose(-2, -1) * DIM ** -0.5).masked_fill(~causal, -math.inf)
        expected_out, expected_lse = torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)
        size = (q.abs() @ k.abs().transpose(-2, -1) * DIM ** -0.5).max().item()    # bounds |score| and its rounding
        bound_lse = 8 * n * EPS * (1 + size)
        bound_out = bound_lse * v.abs().max().item()
        largest.append(scores[causal.expand_as(scores)].abs().max().item())
        for rank, r in enumerate(out):
            rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            where = f"{name} (|score| up to {largest[-1]:.0f}), rank {rank} (queries {rows.start}-{rows.stop - 1})"
            got = r["results"][case]
            compare(report, where, {"output": got["output"]}, {"output": expected_out[..., rows, :]}, bound_out,
                    "attention")
            compare(report, where, {"lse": got["lse"]}, {"lse": expected_lse[..., rows]}, bound_lse, "attention")
    if report.problems:
        for problem, cause in _causes(impl):
            if problem:
                report.fail(problem, cause)
            elif cause not in report.causes:
                report.causes.append(cause)
        return report
    report.ok(f"every rank's output and log-sum-exp equal causal attention over the whole sequence in one process, "
              f"within 8N float32 eps x (1 + |score|) (x |value|), after merging {n} blocks each")
    report.ok("blocks a query may not see (lse = -inf), also before it has seen any key, merged without NaN")
    report.ok(f"scores up to {largest[-1]:.0f} in magnitude merged without inf or NaN (exp overflows float32 above "
              "88.7 and is 0 below -103)")
    return report


def _causes(impl: Any) -> list[tuple[str, str]]:
    """Likely causes, from your merge on a few tiny cases: (a problem to add or "", the cause)."""
    def run(lse_a: float, lse_b: float, a: float = 1.0, b: float = 0.0) -> tuple[float, float]:
        got = impl(torch.tensor([[a]]), torch.tensor([lse_a]), torch.tensor([[b]]), torch.tensor([lse_b]))
        return float(got[0].reshape(-1)[0]), float(got[1].reshape(-1)[0])

    found = []
    try:
        out, lse = run(math.log(3.0), 0.0)         # block a holds 3/4 of the softmax mass: out 0.75, lse log 4
        if abs(out - 0.5) < 1e-4:
            found.append(("", "the outputs were averaged: weight each block by its share of the softmax mass, "
                              "exp(lse_a - lse) and exp(lse_b - lse), where lse is over both blocks"))
        elif abs(out - 0.25) < 1e-4:
            found.append(("", "the weights are swapped: out_a's weight is its own block's share, exp(lse_a - lse)"))
        if abs(lse - math.log(3.0)) < 1e-4:
            found.append(("", "lse is the larger of the two, not the log-sum-exp over both blocks: "
                              "log(exp(lse_a) + exp(lse_b)), which torch.logaddexp computes"))
        out, lse = run(-math.inf, -math.inf, 0.0, 0.0)
        if math.isnan(out) or math.isnan(lse):
            found.append((f"merge(0, -inf, 0, -inf) gave out = {out}, lse = {lse}: a query that has seen no key "
                          "yet, and a block it may not see either",
                          "-inf - (-inf) is NaN: when both lse are -inf the merged lse is -inf and both weights "
                          "must be 0, not NaN (subtract a finite stand-in for an infinite lse)"))
        small_out, small_lse = run(math.log(3.0), 0.0)
        for big in (100.0, -120.0):               # adding a constant to both lse changes lse by it, out not at all
            out, lse = run(big + math.log(3.0), big)
            if not (abs(out - small_out) < 1e-4 and abs(lse - big - small_lse) < 1e-3):
                found.append((f"merge of two blocks with lse {big + math.log(3.0):.1f} and {big:.1f} gave out = "
                              f"{out:.4g}, lse = {lse:.4g}; the same blocks with every score {big:g} lower (lse "
                              f"{math.log(3.0):.1f} and 0.0) give out = {small_out:.4g}, lse = {small_lse:.4g}: "
                              "shifting every score must leave out unchanged and shift lse by as much",
                              "exp(lse) overflows float32 above 88.7 (and is 0 below about -103): subtract the "
                              "larger lse before exponentiating, or use torch.logaddexp"))
                break
    except Exception:                  # noqa: BLE001 -- a probe the learner's code does not take: no cause
        pass
    return found


def reference() -> Any:
    """A correct implementation (the grader's own test uses it; try yours first)."""
    def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
              lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lse = torch.logaddexp(lse_a, lse_b)
        finite = lse.masked_fill(torch.isinf(lse), 0.0)       # both blocks empty: weights 0, not NaN
        out = torch.exp(lse_a - finite)[..., None] * out_a + torch.exp(lse_b - finite)[..., None] * out_b
        return out, lse
    return merge
