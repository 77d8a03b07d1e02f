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


def summed(full_grad):
    return reduce_grad(full_grad, average=False)


def all_reduce_then_slice(full_grad):
    import torch.distributed as dist

    return reduce_grad(full_grad, index=dist.get_rank())


def next_ranks_piece(full_grad):
    import torch.distributed as dist

    return reduce_grad(full_grad, index=(dist.get_rank() + 1) % dist.get_world_size())


def unpadded_shard(flat, rank, world):
    return flat.tensor_split(world)[rank].clone()


def untrimmed_gather(piece, numel):
    return gather(piece, 10 ** 9)


def next_ranks_shard(flat, rank, world):
    return shard(flat, (rank + 1) % world, world)


WRONG = {
    "summed, not averaged": ((shard, gather, summed), ["reduce_grad returned a piece", "summed, not averaged"]),
    "all-reduce, then slice": ((shard, gather, all_reduce_then_slice),
                               ["reduce_grad called dist.all_reduce", "an all-reduce where a reduce-scatter is "
                                "needed", "2.0x the traffic of a reduce-scatter's"]),
    "pieces not padded": ((unpadded_shard, gather, reduce_grad),
                          ["must hold a 1-D piece of ceil(49/3) = 17 elements", "the pieces are not padded"]),
    "padding not removed": ((shard, untrimmed_gather, reduce_grad),
                            ["gather returned 51 elements; the parameter has 49", "still holds the padding"]),
    "reduce_grad keeps another rank's piece": ((shard, gather, next_ranks_piece),
                                               ["ranks 0, 1, 2, layer 0", "rank 0 got piece 1, rank 1 got piece 2"]),
    "shard keeps another rank's piece": ((next_ranks_shard, gather, reduce_grad),
                                         ["it is rank 1's piece", "a rank takes another rank's piece"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(WRONG))
def test_wrong_implementations_fail_with_their_cause(variant):
    impl, expected = WRONG[variant]
    assert_fails_with(NAME, impl, expected)


def test_one_function_instead_of_three_names_the_tuple():
    report = check(NAME, shard, quiet=True)
    assert not report.passed and "(shard, gather, reduce_grad)" in report.text(), report.text()
