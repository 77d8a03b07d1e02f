"""Exercise 02.ring_all_reduce: an all-reduce from blocking ``send`` and ``recv``, moving a ring's traffic.

Write ``ring_all_reduce(tensor)``: sum ``tensor`` over every rank of the default process group, **in place**,
with ``dist.send`` and ``dist.recv`` only — no collective, and not ``isend``/``irecv``/``batch_isend_irecv``
(notebook 02's version posts both halves of each exchange at once, which hides the hard part: with blocking
calls *you* must order each rank's send and receive so that no rank waits forever for a peer that is itself
waiting).

What must hold (what the grader checks, on 3 processes by default):

* every rank ends with the sum of every rank's input, within float32 rounding of one process adding them;
* every rank ends with the *same bits* (all-reduce's contract: replicas stay identical);
* the result is in ``tensor`` itself (the caller's tensor; return value ignored);
* any shape works, and a number of elements that does not divide by the world size (at least one per rank);
* the ranks send 2(N-1)·n elements in all for a tensor of n elements (each rank 2(N-1)/N·n): a ring's traffic,
  whatever N is. Sending your whole tensor to every peer also gives the sum, at N(N-1)·n.

Hints: split the flattened tensor into N chunks (``tensor.view(-1).tensor_split(N)`` gives views that write
through); N-1 reduce-scatter steps (send a chunk right, receive one from the left, add it), then N-1
all-gather steps (the same, copying). For the ordering: think of even and odd ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from dtlab.exercises.grading import COLLECTIVES, Rank, Report, run_ranks, scale_of

NPROCS = 3
#: The tensors each rank all-reduces, in order (elements not dividing by 3, and a 2-D one).
SHAPES = [(10,), (4, 5), (3,)]


def _input(shape: tuple[int, ...], rank: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * k + rank)
    return torch.randn(shape, generator=g)


def _body(impl: Any, me: Rank) -> dict[str, Any]:
    results, returned = [], []
    for k, shape in enumerate(SHAPES):
        t = _input(shape, me.rank, k).to(me.device)
        out = impl(t)
        results.append(t.detach().cpu())
        returned.append(out.detach().cpu() if torch.is_tensor(out) else None)
    return {"results": results, "returned": returned}


def grade(impl: Any, report: Report, nprocs: int = NPROCS, limit_s: float = 30.0) -> Report:
    """Grade ``impl`` (your ``ring_all_reduce``) on ``nprocs`` processes into ``report``."""
    out = run_ranks(report, _body, impl, nprocs=nprocs, limit_s=limit_s)
    if out is None:
        return report
    n = nprocs
    for rank, r in enumerate(out):
        used = {op: c for op, c in r["traffic"]["calls"].items() if op in COLLECTIVES}
        if used:
            report.fail(f"rank {rank} called {', '.join(f'dist.{op} ({c}x)' for op, c in used.items())}: build the "
                        "all-reduce from dist.send and dist.recv only")
        async_ops = {op: c for op, c in r["traffic"]["calls"].items() if op in ("isend", "irecv")}
        if async_ops:
            report.fail(f"rank {rank} called {', '.join(f'dist.{op} ({c}x)' for op, c in async_ops.items())}: use "
                        "the blocking dist.send and dist.recv and order them so no rank waits forever")
    for k, shape in enumerate(SHAPES):
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
    elements = sum(x.numel() for x in (torch.empty(s) for s in SHAPES))
    sent = sum(r["traffic"]["elements"].get("send", 0) + r["traffic"]["elements"].get("isend", 0) for r in out)
    ring = 2 * (n - 1) * elements
    if sent > ring:
        report.fail(f"the ranks sent {sent} elements in all for {elements} elements all-reduced; a ring sends "
                    f"2(N-1) x n = {ring} ({sent / ring:.2f}x)",
                    "sending the whole tensor to every peer gives the sum but costs N(N-1) x n: send one chunk "
                    "at a time to the next rank" if sent >= n * (n - 1) * elements else None)
    elif not report.problems:
        report.ok(f"every rank holds the sum of {n} ranks' tensors for shapes {SHAPES}, within rounding, "
                  "with identical bits on every rank")
        report.ok(f"{sent} elements sent in all = 2(N-1) x n, a ring's traffic; only dist.send and dist.recv used")
    return report


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
