"""The grader of exercise 12.fsdp_unit: a correct shard/gather/reduce_grad passes; typical wrong ones fail with the
right words."""

import math

import pytest
import torch
import torch.nn.functional as F
from exercise_checks import assert_fails_with

from dtlab.exercises import check, exercise

NAME = "12.fsdp_unit"


@pytest.mark.cluster
def test_reference_passes():
    report = check(NAME, exercise(NAME).reference(), quiet=True).raise_for_failure()
    assert any("no all-reduce" in c for c in report.checks), report.text()
    assert any("smaller than N" in c for c in report.checks), report.text()
    assert "on 2, 3 and 4 processes" in report.text(), report.text()


def shard(flat, rank, world):
    chunk = math.ceil(flat.numel() / world)
    return F.pad(flat, (0, chunk * world - flat.numel()))[rank * chunk:(rank + 1) * chunk].clone()


def gather(piece, numel):
    import torch.distributed as dist

    full = torch.empty(piece.numel() * dist.get_world_size(), dtype=piece.dtype, device=piece.device)
    dist.all_gather_into_tensor(full, piece)
    return full[:numel]


def _padded(full_grad):
    import torch.distributed as dist

    world = dist.get_world_size()
    chunk = math.ceil(full_grad.numel() / world)
    return F.pad(full_grad, (0, chunk * world - full_grad.numel())), chunk


def reduce_grad(full_grad, average=True, index=None):
    import torch.distributed as dist

    padded, chunk = _padded(full_grad)
    piece = torch.empty(chunk, dtype=padded.dtype, device=padded.device)
    if index is None:
        dist.reduce_scatter_tensor(piece, padded)
    else:                                    # a reduce-scatter from an all-reduce, keeping piece `index`
        dist.all_reduce(padded)
        piece = padded[index * chunk:(index + 1) * chunk].clone()
    return piece / dist.get_world_size() if average else piece


# ---------------------------------------------------------------------------------------------- correct, otherwise

def cat_zeros_shard(flat, rank, world):
    """Padding with torch.cat and zeros, the pieces as rows of a (world, chunk) view, the row cloned."""
    chunk = (flat.numel() + world - 1) // world
    padded = torch.cat([flat, torch.zeros(chunk * world - flat.numel(), dtype=flat.dtype, device=flat.device)])
    return padded.view(world, chunk)[rank].clone()


def list_all_gather(piece, numel):
    """The list form of all-gather, then a cat."""
    import torch.distributed as dist

    parts = [torch.empty_like(piece) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, piece.contiguous())
    return torch.cat(parts)[:numel]


def padded_reduce_scatter(full_grad):
    """F.pad, then reduce_scatter_tensor with an explicit SUM, averaged by multiplying."""
    import torch.distributed as dist

    world = dist.get_world_size()
    chunk = -(-full_grad.numel() // world)
    padded = F.pad(full_grad, (0, chunk * world - full_grad.numel()))
    out = padded.new_empty(chunk)
    dist.reduce_scatter_tensor(out, padded, op=dist.ReduceOp.SUM)
    return out * (1.0 / world)


def zeros_copy_shard(flat, rank, world):
    """torch.zeros for the piece, and a copy of the elements it holds (none for a piece that is all padding)."""
    chunk = (flat.numel() + world - 1) // world
    piece = torch.zeros(chunk, dtype=flat.dtype, device=flat.device)
    start, stop = min(rank * chunk, flat.numel()), min((rank + 1) * chunk, flat.numel())
    piece[:stop - start] = flat[start:stop]
    return piece


def async_helper_gather(piece, numel):
    """The course's portability helper (all_gather_into_tensor under torch 2.13's name), started asynchronously
    and waited for."""
    import torch.distributed as dist

    from dtlab.distributed import all_gather_single

    full = piece.new_empty(piece.numel() * dist.get_world_size())
    all_gather_single(full, piece.contiguous(), async_op=True).wait()
    return full[:numel].clone()


def list_reduce_scatter(full_grad):
    """The list form of reduce-scatter where gloo has it (torch >= 2.6), the tensor form elsewhere."""
    import torch.distributed as dist

    world = dist.get_world_size()
    chunk = -(-full_grad.numel() // world)
    padded = torch.cat([full_grad, full_grad.new_zeros(chunk * world - full_grad.numel())])
    out = full_grad.new_empty(chunk)
    if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 6):
        dist.reduce_scatter(out, list(padded.split(chunk)))
    else:
        dist.reduce_scatter_tensor(out, padded)
    return out.div_(world)


@pytest.mark.cluster
@pytest.mark.parametrize("impl", [(cat_zeros_shard, list_all_gather, padded_reduce_scatter),
                                  (zeros_copy_shard, async_helper_gather, list_reduce_scatter)],
                         ids=["cat zeros, list all_gather, reduce_scatter_tensor",
                              "zeros and copy, all_gather_single async, list reduce_scatter"])
def test_other_correct_implementations_pass(impl):
    report = check(NAME, impl, quiet=True)
    if "ProcessGroupGloo does not support reduce_scatter" in report.text():   # gloo gained the list form later
        pytest.skip(f"this torch's gloo has no list reduce_scatter (torch {torch.__version__})")
    report.raise_for_failure()


# ---------------------------------------------------------------------------------------------- wrong

def summed(full_grad):
    return reduce_grad(full_grad, average=False)


def all_reduce_then_slice(full_grad):
    import torch.distributed as dist

    return reduce_grad(full_grad, index=dist.get_rank())


def all_gather_then_sum(full_grad):
    """Every rank's whole gradient gathered, summed locally, this rank's piece kept."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    grads = [torch.empty_like(full_grad) for _ in range(world)]
    dist.all_gather(grads, full_grad.contiguous())
    padded, chunk = _padded(torch.stack(grads).sum(0))
    return padded[rank * chunk:(rank + 1) * chunk] / world


def through_rank_0(full_grad):
    """Every gradient gathered on rank 0, summed and cut there, the pieces scattered back."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    grads = [torch.empty_like(full_grad) for _ in range(world)] if rank == 0 else None
    dist.gather(full_grad.contiguous(), grads, dst=0)
    padded, chunk = _padded(full_grad)
    out = torch.empty(chunk, dtype=full_grad.dtype)
    pieces = list(_padded(torch.stack(grads).sum(0) / world)[0].split(chunk)) if rank == 0 else None
    dist.scatter(out, pieces, src=0)
    return out


def next_ranks_piece(full_grad):
    """A reduce-scatter of the gradient rolled by one piece: each rank receives the next rank's piece."""
    import torch.distributed as dist

    padded, chunk = _padded(full_grad)
    piece = torch.empty(chunk, dtype=padded.dtype)
    dist.reduce_scatter_tensor(piece, padded.roll(-chunk))
    return piece / dist.get_world_size()


def wrapped_padding_reduce_grad(full_grad):
    """Pads the gradient with its first elements again (wrapping around), not with zeros."""
    import torch.distributed as dist

    world = dist.get_world_size()
    chunk = math.ceil(full_grad.numel() / world)
    padded = torch.cat([full_grad, full_grad.repeat(world)[:chunk * world - full_grad.numel()]])
    piece = torch.empty(chunk, dtype=padded.dtype)
    dist.reduce_scatter_tensor(piece, padded)
    return piece / world


def all_reduce_gather(piece, numel):
    """Each rank puts its piece in its place in a zero-padded full tensor; an all-reduce sums them."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    full = piece.new_zeros(piece.numel() * world)
    full[rank * piece.numel():(rank + 1) * piece.numel()] = piece
    dist.all_reduce(full)
    return full[:numel]


def unpadded_shard(flat, rank, world):
    return flat.tensor_split(world)[rank].clone()


def chunk_shard(flat, rank, world):
    return flat.chunk(world)[rank].clone()


def chunk_then_pad_the_piece(flat, rank, world):
    """chunk(), then each piece padded to ceil(numel/N): right whenever chunk() gives N pieces."""
    chunk = math.ceil(flat.numel() / world)
    piece = flat.chunk(world)[rank]
    return F.pad(piece, (0, chunk - piece.numel())).clone()


def floor_shard(flat, rank, world):
    chunk = flat.numel() // world
    return flat[rank * chunk:(rank + 1) * chunk].clone()


def always_padded_shard(flat, rank, world):
    """Pads world - numel % world elements: a whole extra row when numel divides by world."""
    padded = F.pad(flat, (0, world - flat.numel() % world))
    chunk = padded.numel() // world
    return padded[rank * chunk:(rank + 1) * chunk].clone()


def wrapped_padding_shard(flat, rank, world):
    """Pads with the first elements again (wrapping around), not with zeros."""
    chunk = math.ceil(flat.numel() / world)
    padded = torch.cat([flat, flat.repeat(world)[:chunk * world - flat.numel()]])
    return padded[rank * chunk:(rank + 1) * chunk].clone()


def view_shard(flat, rank, world):
    """The right piece, but a view into the padded full tensor (no clone)."""
    chunk = math.ceil(flat.numel() / world)
    return F.pad(flat, (0, chunk * world - flat.numel()))[rank * chunk:(rank + 1) * chunk]


def untrimmed_gather(piece, numel):
    return gather(piece, 10 ** 9)


def next_ranks_shard(flat, rank, world):
    return shard(flat, (rank + 1) % world, world)


def course_shard(flat, rank, world):
    """The course's ScratchFSDP cuts a weight exactly this way: its method called on a stand-in."""
    from types import SimpleNamespace

    from dtlab.parallel.fsdp import ScratchFSDP

    return ScratchFSDP._slice(SimpleNamespace(world_size=world, rank=rank), flat)


def course_reduce_grad(full_grad):
    """The course's ScratchFSDP's reduce-scatter, called on stand-ins."""
    from collections import Counter
    from types import SimpleNamespace

    import torch.distributed as dist

    from dtlab.parallel.fsdp import ScratchFSDP

    world = dist.get_world_size()
    chunk = math.ceil(full_grad.numel() / world)
    fsdp = SimpleNamespace(world_size=world, group=None, collectives=Counter(), elements_moved=Counter(),
                           _pending_grads=[])
    param = SimpleNamespace(numel=lambda: chunk, device=full_grad.device, grad=None)
    ScratchFSDP._start_reduce_scatter(fsdp, SimpleNamespace(param=param, numel=full_grad.numel(), grad_sum=full_grad))
    out, handle = fsdp._pending_grads[0][:2]
    handle.wait()
    return out / world


FIRST = "in case N = 3, flat parameters of 49, 40, 12, 3 and 2 elements"
WRONG = {
    "summed, not averaged": ((shard, gather, summed), ["reduce_grad returned a piece", "summed, not averaged", FIRST]),
    "all-reduce, then slice": ((shard, gather, all_reduce_then_slice),
                               ["ranks 0, 1, 2, unit 0 (Linear(6, 7): 49 elements): reduce_grad called "
                                "dist.all_reduce (1x)", "received 51 elements to keep its piece of 17",
                                "an all-reduce where a reduce-scatter is needed",
                                "2x the traffic of a reduce-scatter's", FIRST]),
    "all-gather, then sum": ((shard, gather, all_gather_then_sum),
                             ["reduce_grad called dist.all_gather (1x)", "received 147 elements to keep its piece "
                              "of 17", "every rank receives every rank's whole gradient and adds them up itself",
                              FIRST]),
    "gathered on rank 0, scattered back": ((shard, gather, through_rank_0),
                                           ["rank 0, unit 0 (Linear(6, 7): 49 elements): reduce_grad called "
                                            "dist.gather (1x), dist.scatter (1x): this rank sent 100 and received "
                                            "164 elements", "one rank collects", FIRST]),
    "gather by all-reduce": ((shard, all_reduce_gather, reduce_grad),
                             ["gather called dist.all_reduce (1x)", "sent 51 and received 51 elements",
                              "twice an all-gather's traffic", FIRST]),
    "pieces not padded": ((unpadded_shard, gather, reduce_grad),
                          ["must hold a 1-D piece of ceil(49/3) = 17 elements", "the pieces are not padded", FIRST]),
    "chunk(), not padded": ((chunk_shard, gather, reduce_grad),
                            ["shard(flat, rank=2, world=3) for unit 0", "gave a piece of shape (15,)",
                             "the pieces are not padded"]),
    "chunk(), then the piece padded": ((chunk_then_pad_the_piece, gather, reduce_grad),
                                       ["shard(flat, rank=2, world=3) for unit 4 (Linear(1, 1): 2 elements) raised "
                                        "IndexError", "cutting 2 elements with chunk() gives 2 pieces, not 3",
                                        FIRST]),
    "numel // N per piece": ((floor_shard, gather, reduce_grad),
                             ["gave a piece of shape (16,)", "ceil(49/3) = 17", "rounds down", FIRST]),
    "a whole row of padding when N divides numel": ((always_padded_shard, gather, reduce_grad),
                                                    ["unit 2 (Linear(5, 2): 12 elements)", "shape (5,)",
                                                     "12 elements already divide by 3", FIRST]),
    "padding not zeros": ((wrapped_padding_shard, gather, reduce_grad),
                          ["shard(flat, rank=2, world=3) for unit 0", "elements 49-50 are padding",
                           "the padding must be zeros", FIRST]),
    "a view, not the piece's own memory": ((view_shard, gather, reduce_grad),
                                           ["returned a view into a tensor of 51 elements", "own its memory",
                                            FIRST]),
    "padding not removed": ((shard, untrimmed_gather, reduce_grad),
                            ["gather returned 51 elements; the parameter has 49", "still holds the padding", FIRST]),
    "gradient padding not zeros": ((shard, gather, wrapped_padding_reduce_grad),
                                   ["rank 2, unit 0 (Linear(6, 7): 49 elements): at step 1 reduce_grad returned a "
                                    "piece that differs", "only the padding differs", FIRST]),
    "reduce_grad keeps another rank's piece": ((shard, gather, next_ranks_piece),
                                               ["ranks 0, 1, 2, unit 0", "rank 0 got piece 1, rank 1 got piece 2",
                                                FIRST]),
    "shard keeps another rank's piece": ((next_ranks_shard, gather, reduce_grad),
                                         ["it is rank 1's piece", "a rank takes another rank's piece", FIRST]),
    "the course's shard": ((course_shard, gather, reduce_grad),
                           ["your shard runs the course's own dtlab.parallel.fsdp.ScratchFSDP", "write it"]),
    "the course's reduce-scatter": ((shard, gather, course_reduce_grad),
                                    ["your code runs the course's own dtlab.parallel.fsdp.ScratchFSDP", "write it",
                                     FIRST]),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(WRONG))
def test_wrong_implementations_fail_with_their_cause(variant):
    impl, expected = WRONG[variant]
    assert_fails_with(NAME, impl, expected)


@pytest.mark.slow
def test_a_case_on_two_processes_alone():
    """nprocs picks the cases on that many processes: the unpadded shard fails there too, named."""
    report = assert_fails_with(NAME, (unpadded_shard, gather, reduce_grad),
                               ["in case N = 2, flat parameters of 15, 8, 3 and 2 elements", "ceil(15/2) = 8"],
                               nprocs=2)
    assert report.worlds and set(report.worlds) == {2}, report.worlds


def test_shard_runs_in_a_child_process_not_the_callers():
    """shard needs no process group, so the grader runs it alone, in a child it stops after the time limit (never
    in the notebook's own process, where an endless loop would hang the caller; run_limited's stopping is tested
    with 15.one_f_one_b's schedules)."""
    import os

    def tells_its_pid(flat, rank, world):
        raise RuntimeError(f"pid {os.getpid()}")

    report = check(NAME, (tells_its_pid, gather, reduce_grad), quiet=True)
    assert not report.passed and "shard(flat, rank=0, world=3) for unit 0" in report.text(), report.text()
    assert "raised RuntimeError: pid " in report.text() and f"pid {os.getpid()} " not in report.text(), report.text()


def test_one_function_instead_of_three_names_the_tuple():
    report = check(NAME, shard, quiet=True)
    assert not report.passed and "(shard, gather, reduce_grad)" in report.text(), report.text()
