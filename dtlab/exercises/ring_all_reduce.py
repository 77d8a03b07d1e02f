"""Exercise 02.ring_all_reduce: an all-reduce from blocking ``send`` and ``recv``, moving a ring's traffic.

Write ``ring_all_reduce(tensor)``: sum ``tensor`` over every rank of the default process group, **in place**,
with ``dist.send`` and ``dist.recv`` only — no collective, and not ``isend``/``irecv``/``batch_isend_irecv``
(notebook 02's version posts both halves of each exchange at once, which hides the hard part: with blocking
calls *you* must order each rank's send and receive so that no rank waits forever for a peer that is itself
waiting).

What must hold (what the grader checks, on 2, 3 and 4 processes, each with a few tensors: some with fewer
elements than ranks, some not dividing by N, some dividing, a 2-D one; every input seeded, so a report names the
case that failed and it fails the same way again):

* every rank ends with the sum of every rank's input, within float32 rounding of one process adding them;
* every rank ends with the *same bits* (all-reduce's contract: replicas stay identical);
* the result is in ``tensor`` itself (the caller's tensor; return value ignored);
* any shape and any number of elements works, even fewer elements than ranks (some chunks are then empty);
* each rank sends, and receives, at most 2(N-1) chunks of ceil(n/N) elements for a tensor of n elements: a
  ring's traffic, on every rank, whatever N is. Sending your whole tensor to every peer also gives the sum, at
  (N-1)·n per rank; so does sending everything to rank 0 and back, with rank 0 doing N-1 ranks' work;
* only ``send`` and ``recv`` move data: the grader watches the process group itself, so a collective or an
  ``isend`` is seen under whatever name it was imported.

Hints: cut the flattened tensor into N chunks that are views of it, so that writing a chunk writes the tensor
(which of ``chunk`` and ``tensor_split`` always gives N pieces?). The algorithm has two halves, each of N-1
steps in which every rank passes one chunk to its neighbour: after the first half each rank holds one chunk's
full sum, after the second every rank holds all of them. For the ordering: a blocking ``send`` may wait until
its peer receives, so if every rank sends first, who receives? One rank doing things in the other order breaks
the cycle.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dtlab.exercises.grading import COLLECTIVES, Case, Rank, Report, grade_cases, run_ranks, scale_of

NPROCS = 3
#: The cases, in the order they are graded: the tensors each rank all-reduces, in order, on N processes (sizes
#: below N, not dividing by N, dividing by N, and 2-D ones).
CASES = [
    Case("N = 3, tensors of shapes (10,), (4, 5), (2,), (3,)", 3, {"shapes": [(10,), (4, 5), (2,), (3,)]}),
    Case("N = 2, tensors of shapes (7,), (1,), (3, 4)", 2, {"shapes": [(7,), (1,), (3, 4)]}),
    Case("N = 4, tensors of shapes (9,), (3,), (2, 8), (6,)", 4, {"shapes": [(9,), (3,), (2, 8), (6,)]}),
]


def _input(shape: tuple[int, ...], rank: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * k + rank)
    return torch.randn(shape, generator=g)


def _body(impl: Any, me: Rank, shapes: list[tuple[int, ...]]) -> dict[str, Any]:
    results, returned = [], []
    for k, shape in enumerate(shapes):
        t = _input(shape, me.rank, k).to(me.device)
        with me.tracer.doing(f"tensor {k} (shape {shape})"):
            out = impl(t)
        results.append(t.detach().cpu())
        returned.append(out.detach().cpu() if torch.is_tensor(out) else None)
    return {"results": results, "returned": returned}


def grade(impl: Any, report: Report, nprocs: int | None = None, limit_s: float = 30.0) -> Report:
    """Grade ``impl`` (your ``ring_all_reduce``) on each case (those on ``nprocs`` processes, if given)."""
    return grade_cases(report, CASES, lambda case, rep: _grade_case(impl, case, rep, limit_s), nprocs)


def _grade_case(impl: Any, case: Case, report: Report, limit_s: float) -> None:
    n, shapes = case.nprocs, case.params["shapes"]
    out = run_ranks(report, _body, impl, shapes, nprocs=n, limit_s=limit_s)
    if out is None:
        return
    for rank, r in enumerate(out):
        log = r["traffic"]["log"]
        used: dict[str, int] = {}
        for e in log:
            if e["op"] in COLLECTIVES:
                used[e["api"]] = used.get(e["api"], 0) + 1
        if used:
            report.fail(f"rank {rank} called {', '.join(f'dist.{op} ({c}x)' for op, c in used.items())}: build the "
                        "all-reduce from dist.send and dist.recv only")
        async_ops: dict[str, int] = {}
        for e in log:
            if e["op"] in ("send", "recv") and e["asynchronous"]:
                async_ops[e["api"]] = async_ops.get(e["api"], 0) + 1
        if async_ops:
            report.fail(f"rank {rank} called {', '.join(f'dist.{op} ({c}x)' for op, c in async_ops.items())}: use "
                        "the blocking dist.send and dist.recv and order them so no rank waits forever")
    for k, shape in enumerate(shapes):
        inputs = [_input(shape, rank, k) for rank in range(n)]
        expected = torch.zeros(shape)
        for x in inputs:                       # one process adding them up, in rank order
            expected += x
        bound = n * 2.0 ** -23 * sum(x.abs() for x in inputs).max().item() * 2
        for rank, r in enumerate(out):
            got, returned = r["results"][k], r["returned"][k]
            if (returned is not None and returned.shape == expected.shape and not torch.allclose(got, expected)
                    and (returned - expected).abs().max().item() <= bound):
                report.fail(f"rank {rank}, tensor {k} (shape {shape}): your function returned the sum, but the tensor "
                            "it was given still holds something else",
                            "write the result in place (tensor.copy_(...), or add into views of it): callers such as "
                            "DDP keep using their own tensor")
                continue
            if got.shape != expected.shape:
                report.fail(f"rank {rank}, tensor {k}: shape {tuple(got.shape)}, expected {shape}")
                continue
            diff = (got - expected).abs()
            worst = diff.max().item()
            if not worst <= bound:
                i = int(diff.view(-1).argmax())
                report.fail(f"rank {rank}, tensor {k} (shape {shape}): element {i} is {got.view(-1)[i].item():.4f}, "
                            f"the sum over ranks is {expected.view(-1)[i].item():.4f} (off by {worst:.2e}, bound "
                            f"{bound:.1e})", _cause(got, expected, inputs, rank, n))
        first = out[0]["results"][k]
        for rank, r in enumerate(out[1:], start=1):
            got = r["results"][k]
            if got.shape == first.shape and not torch.equal(got, first) and not report.problems:
                report.fail(f"tensor {k}: rank {rank} and rank 0 hold different bits (largest gap "
                            f"{(got - first).abs().max().item():.1e})",
                            "each rank added the chunks in its own order: in a ring, each chunk is summed once, by "
                            "the rank that completes it, and then copied to the others unchanged")
    # the traffic, rank by rank: a ring moves 2(N-1) chunks of at most ceil(n/N) elements through every rank
    numels = [math.prod(s) for s in shapes]
    share = sum(2 * (n - 1) * math.ceil(e / n) for e in numels)
    whole = sum(numels)
    for rank, r in enumerate(out):
        sent = sum(e["sent"] for e in r["traffic"]["log"] if e["op"] == "send")
        received = sum(e["received"] for e in r["traffic"]["log"] if e["op"] == "recv")
        for what, count in (("sent", sent), ("received", received)):
            if count > share:
                report.fail(f"rank {rank} {what} {count} elements for {whole} elements all-reduced; a ring moves at "
                            f"most 2(N-1) x ceil(n/N) = {share} through each rank ({count / share:.2f}x)",
                            _traffic_cause(out, n, whole))
    if not report.problems:
        report.ok("every rank holds the sum of the ranks' tensors within rounding, identical bits on every rank, "
                  "for tensors with fewer elements than ranks, not dividing by N and dividing by N")
        report.ok("each rank sent and received at most 2(N-1) chunks of ceil(n/N) elements: a ring's traffic on "
                  "every rank; only blocking dist.send and dist.recv used (seen at the process group)")


def _traffic_cause(out: list[dict], n: int, whole: int) -> str | None:
    sent = [sum(e["sent"] for e in r["traffic"]["log"] if e["op"] == "send") for r in out]
    if max(sent) >= (n - 1) * whole and min(sent) < max(sent):
        return ("one rank does the others' work: gathering everything on one rank and sending the sum back moves "
                "(N-1) x n through that rank; in a ring every rank passes one chunk per step to its neighbour")
    if min(sent) >= (n - 1) * whole:
        return ("sending the whole tensor to every peer gives the sum but costs (N-1) x n per rank: send one chunk "
                "at a time to the next rank")
    return "each step passes one chunk (1/N of the tensor), not the whole tensor, to the next rank"


def _cause(got: torch.Tensor, expected: torch.Tensor, inputs: list[torch.Tensor], rank: int, n: int) -> str | None:
    c = scale_of(got, expected)
    if abs(c - 1 / n) < 0.02:
        return "the result is the average, not the sum: all-reduce sums (DDP divides by N afterwards)"
    if abs(c - n) < 0.05 * n:
        return "the result is N times the sum: a chunk was added in more than once"
    chunks_got, chunks_exp = got.view(-1).tensor_split(n), expected.view(-1).tensor_split(n)
    right = [torch.allclose(a, b, atol=1e-5) for a, b in zip(chunks_got, chunks_exp)]
    if sum(right) == 1:
        return ("each rank holds the full sum of one chunk only: that is a reduce-scatter; the all-gather half "
                "(N-1 more steps passing the finished chunks around the ring) is missing")
    if torch.allclose(got, inputs[rank], atol=1e-6):
        return "the tensor is unchanged: the received chunks were never added into it (add into views of it)"
    return None


def reference() -> Any:
    """A correct implementation (the grader's own test uses it; try yours first)."""
    def ring_all_reduce(tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
        right, left = (rank + 1) % world, (rank - 1) % world
        chunks = tensor.view(-1).tensor_split(world)

        def exchange(send_i: int, recv_i: int) -> torch.Tensor:
            incoming = torch.empty_like(chunks[recv_i])
            if rank % 2 == 0:
                dist.send(chunks[send_i].contiguous(), right)
                dist.recv(incoming, left)
            else:
                dist.recv(incoming, left)
                dist.send(chunks[send_i].contiguous(), right)
            return incoming

        for step in range(world - 1):
            i = (rank - step - 1) % world
            chunks[i].add_(exchange((rank - step) % world, i))
        for step in range(world - 1):
            i = (rank - step) % world
            chunks[i].copy_(exchange((rank - step + 1) % world, i))
    return ring_all_reduce
