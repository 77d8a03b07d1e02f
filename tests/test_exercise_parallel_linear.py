"""The grader of exercise 14.parallel_linear: correct column/row layers pass; typical wrong ones fail with the right
words."""

import pytest
import torch
import torch.nn.functional as F
from exercise_checks import assert_fails_with
from torch import nn

from dtlab.exercises import check, exercise

NAME = "14.parallel_linear"


@pytest.mark.cluster
def test_reference_passes():
    report = check(NAME, exercise(NAME).reference(), quiet=True).raise_for_failure()
    assert any("1 all-reduce(s) in forward, 1 in backward" in c for c in report.checks), report.text()


class _Identity(torch.autograd.Function):
    """Megatron's f done wrong: identity both ways (the input gradient is never all-reduced)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _AllReduceBackward(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class _AllReduceForward(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        import torch.distributed as dist

        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class Column(nn.Module):
    f = _AllReduceBackward
    dim = 0

    def __init__(self, full, rank, world):
        super().__init__()
        self.weight = nn.Parameter(full.weight.detach().chunk(world, self.dim)[rank].clone())
        self.bias = nn.Parameter(full.bias.detach().chunk(world, 0)[rank].clone())

    def forward(self, x):
        return F.linear(self.f.apply(x), self.weight, self.bias)


class Row(nn.Module):
    reduce = True
    bias_before_sum = False
    split_input = False

    def __init__(self, full, rank, world):
        super().__init__()
        self.rank, self.world = rank, world
        self.weight = nn.Parameter(full.weight.detach().chunk(world, 1)[rank].clone())
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x_slice):
        if self.split_input:
            x_slice = x_slice.chunk(self.world, -1)[self.rank]
        y = F.linear(x_slice, self.weight, self.bias if self.bias_before_sum else None)
        if self.reduce:
            y = _AllReduceForward.apply(y)
        return y if self.bias_before_sum else y + self.bias


class RowWithoutAllReduce(Row):
    reduce = False


class BiasOnEveryRank(Row):
    bias_before_sum = True


class RowSplittingAgain(Row):
    split_input = True


class ColumnSplitAlongInFeatures(Column):
    dim = 1


class ColumnWithoutBackwardAllReduce(Column):
    f = _Identity


WRONG = {
    "row layer without all-reduce": ((Column, RowWithoutAllReduce),
                                     ["rank 0: the output differs from one process", "only its partial sum",
                                      "the row layer must all-reduce"]),
    "bias added on every rank": ((Column, BiasOnEveryRank),
                                 ["the output differs from one process", "off by (N-1) x bias",
                                  "bias added on every rank"]),
    "column split along in_features": ((ColumnSplitAlongInFeatures, Row),
                                       ["column layer: weight has shape (12, 2), expected (6, 3)",
                                        "slice of the OUTPUT features"]),
    "no all-reduce of the input gradient": ((ColumnWithoutBackwardAllReduce, Row),
                                            ["the gradient of the input differs from one process",
                                             "the column layer's input gradient must be all-reduced in backward"]),
    "row layer splits its input again": ((Column, RowSplittingAgain),
                                         ["your row layer's forward raised", "must not split it again"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(WRONG))
def test_wrong_implementations_fail_with_their_cause(variant):
    impl, expected = WRONG[variant]
    assert_fails_with(NAME, impl, expected)


def test_one_class_instead_of_two_names_the_pair():
    report = check(NAME, Column, quiet=True)
    assert not report.passed and "(MyColumnParallelLinear, MyRowParallelLinear)" in report.text(), report.text()
