"""The grader of exercise 02.ring_all_reduce: a correct ring passes; typical wrong ones fail with the right words."""

import pytest
import torch
from exercise_checks import assert_fails_with

from dtlab.exercises import check, exercise
from dtlab.exercises.grading import STARTUP_S

NAME = "02.ring_all_reduce"


@pytest.mark.cluster
def test_reference_passes():
    report = check(NAME, exercise(NAME).reference(), quiet=True).raise_for_failure()
    assert any("2(N-1)" in c for c in report.checks)


def everyone_to_everyone(tensor):
    """The sum, right on every rank, but each rank sends its whole tensor to every peer: N(N-1) x n."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    total = tensor.clone()
    for peer in range(world):
        if peer != rank:
            incoming = torch.empty_like(tensor)
            if rank < peer:
                dist.send(tensor.contiguous(), peer)
                dist.recv(incoming, peer)
            else:
                dist.recv(incoming, peer)
                dist.send(tensor.contiguous(), peer)
            total += incoming
    tensor.copy_(total)


def _steps(tensor, phases, average=False):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = tensor.view(-1).tensor_split(world)

    def exchange(send_i, recv_i):
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
    if "all-gather" in phases:
        for step in range(world - 1):
            i = (rank - step) % world
            chunks[i].copy_(exchange((rank - step + 1) % world, i))
    if average:
        tensor.div_(world)


def reduce_scatter_only(tensor):
    _steps(tensor, ["reduce-scatter"])


def averaged(tensor):
    _steps(tensor, ["reduce-scatter", "all-gather"], average=True)


def with_all_reduce(tensor):
    import torch.distributed as dist

    dist.all_reduce(tensor)


def not_in_place(tensor):
    out = tensor.clone()
    _steps(out, ["reduce-scatter", "all-gather"])
    return out


def star_through_rank_0(tensor):
    """Everyone sends to rank 0, which adds and sends the sum back: a ring's total traffic at N = 2 and 3, but
    rank 0 moves (N-1) x n."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        incoming = torch.empty_like(tensor)
        for peer in range(1, world):
            dist.recv(incoming, peer)
            tensor += incoming
        for peer in range(1, world):
            dist.send(tensor.contiguous(), peer)
    else:
        dist.send(tensor.contiguous(), 0)
        dist.recv(tensor, 0)


def with_chunk(tensor):
    """The ring with chunk() instead of tensor_split(): fewer than N pieces when n < N (or n = 10, N = 4)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = tensor.view(-1).chunk(world)
    for phase in ("reduce", "gather"):
        for step in range(world - 1):
            i = (rank - step - (1 if phase == "reduce" else 0)) % world
            j = (rank - step + (0 if phase == "reduce" else 1)) % world
            incoming = torch.empty_like(chunks[i])
            if rank % 2 == 0:
                dist.send(chunks[j].contiguous(), right)
                dist.recv(incoming, left)
            else:
                dist.recv(incoming, left)
                dist.send(chunks[j].contiguous(), right)
            chunks[i].add_(incoming) if phase == "reduce" else chunks[i].copy_(incoming)


from torch.distributed import all_gather as imported_all_gather  # noqa: E402 -- bound before the grader runs
from torch.distributed import isend as imported_isend  # noqa: E402


def all_gather_then_add(tensor):
    """Every rank's tensor gathered with a collective imported at the top of the cell, then summed locally."""
    import torch.distributed as dist

    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    imported_all_gather(parts, tensor)
    tensor.copy_(sum(parts))


def ring_with_imported_isend(tensor):
    """A correct ring whose sends are isend imported at the top of the cell (not blocking: the exercise's point)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = tensor.view(-1).tensor_split(world)
    for phase in ("reduce", "gather"):
        for step in range(world - 1):
            i = (rank - step - (1 if phase == "reduce" else 0)) % world
            j = (rank - step + (0 if phase == "reduce" else 1)) % world
            incoming = torch.empty_like(chunks[i])
            work = imported_isend(chunks[j].contiguous(), right)
            dist.recv(incoming, left)
            work.wait()
            chunks[i].add_(incoming) if phase == "reduce" else chunks[i].copy_(incoming)


def left_ring(tensor):
    """A correct ring running the other way round (send left, receive from the right), rank 0 receiving first."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = tensor.view(-1).tensor_split(world)
    for phase in ("reduce", "gather"):
        for step in range(world - 1):
            i = (rank + step + (1 if phase == "reduce" else 0)) % world
            j = (rank + step + (0 if phase == "reduce" else -1)) % world
            incoming = torch.empty_like(chunks[i])
            if rank == 0:
                dist.recv(incoming, right)
                dist.send(chunks[j].contiguous(), left)
            else:
                dist.send(chunks[j].contiguous(), left)
                dist.recv(incoming, right)
            chunks[i].add_(incoming) if phase == "reduce" else chunks[i].copy_(incoming)


@pytest.mark.cluster
def test_another_correct_ring_passes():
    """Direction and the rank that receives first are the learner's choice."""
    check(NAME, left_ring, quiet=True).raise_for_failure()


WRONG = {
    "everyone to everyone": (everyone_to_everyone, ["a ring moves at most 2(N-1) x ceil(n/N)", "(N-1) x n per rank"]),
    "star through rank 0": (star_through_rank_0, ["rank 0 sent", "one rank does the others' work"]),
    "chunk() instead of tensor_split()": (with_chunk, ["in case N = 3, tensors of shapes (10,), (4, 5), (2,)"]),
    "all_gather imported, then added": (all_gather_then_add, ["called dist.all_gather", "send and dist.recv only"]),
    "isend imported": (ring_with_imported_isend, ["called dist.isend", "blocking"]),
    "reduce-scatter only": (reduce_scatter_only, ["the sum over ranks is", "all-gather half"]),
    "average": (averaged, ["the average, not the sum"]),
    "dist.all_reduce": (with_all_reduce, ["called dist.all_reduce", "from dist.send and dist.recv only"]),
    "returned, not in place": (not_in_place, ["returned the sum", "in place"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(WRONG))
def test_wrong_implementations_fail_with_their_cause(variant):
    impl, expected = WRONG[variant]
    assert_fails_with(NAME, impl, expected)


@pytest.mark.slow
def test_a_deadlock_is_stopped_with_the_stuck_ranks_and_the_call_they_wait_in():
    """Every rank receives before it sends: all wait forever. The grader stops them within its limit and says
    where each one waits (the call, its peer and the learner's line)."""
    import time

    def everyone_receives_first(tensor):
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
        incoming = torch.empty_like(tensor)
        dist.recv(incoming, (rank - 1) % world)
        dist.send(tensor, (rank + 1) % world)

    start = time.monotonic()
    report = check(NAME, everyone_receives_first, limit_s=4, quiet=True)
    took = time.monotonic() - start
    text = report.text()
    assert not report.passed and "deadlock" in text, text
    for rank in range(3):
        assert f"rank {rank} was waiting in dist.recv(10 elements from rank {(rank - 1) % 3})" in text, text
    assert "of everyone_receives_first" in text, text       # the learner's own line is named
    assert took < 4 + STARTUP_S, f"reported after {took:.0f} s"
