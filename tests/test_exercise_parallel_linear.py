"""The grader of exercise 14.parallel_linear: correct column/row layers pass (several ways of writing them); typical
wrong ones fail with the right words: the case, what is wrong, and its likely cause."""

import pytest
import torch
import torch.nn.functional as F
from exercise_checks import assert_fails_with
from torch import nn

from dtlab.exercises import check, exercise

NAME = "14.parallel_linear"
FIRST = "in case N = 3, Linear(20, 48) -> GELU -> Linear(48, 12), input of shape (6, 20)"
SHARED = "in case N = 2, x + row(gelu(h1) + tanh(h2) / 2)"


@pytest.mark.cluster
def test_reference_passes():
    report = check(NAME, exercise(NAME).reference(), quiet=True).raise_for_failure()
    text = report.text()
    assert "on 2, 3 and 4 processes" in text and "3 cases" in text, text
    assert "one all-reduce of the output's size in forward, nothing in backward" in text, text


def test_reference_is_the_modules_own_code():
    """The answer is not the course's layers under another name: reference() defines its own."""
    column, row = exercise(NAME).reference()
    from dtlab.parallel import tensor

    for cls in (column, row):
        assert not issubclass(cls, (tensor.ColumnParallelLinear, tensor.RowParallelLinear))
        assert cls.__module__ == "dtlab.exercises.parallel_linear"


# ---------------------------------------------------------------------------------------------- building blocks

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
        self.rank, self.world = rank, world
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


# ---------------------------------------------------------------------------------------------- wrong: values

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


class ColumnGatheringItsOutput(Column):
    """Returns the whole hidden layer (its slice all-gathered, differentiably), the row layer picks its slice: the
    final output is right, the column layer's own output is not what it should be (nor its traffic)."""

    def forward(self, x):
        import torch.distributed.nn.functional as dnn

        return torch.cat(dnn.all_gather(super().forward(x)), dim=-1)


class RowPickingItsSlice(RowSplittingAgain):
    pass


class RowWithDifferentiableAllReduce(Row):
    """g as torch.distributed.nn.functional.all_reduce: its backward all-reduces (sums) the output's gradient,
    which every rank already holds whole, so every gradient before it is N times too large. Not correct for g."""

    reduce = False

    def forward(self, x_slice):
        import torch.distributed.nn.functional as dnn

        return dnn.all_reduce(F.linear(x_slice, self.weight)) + self.bias


class ColumnHookOnX(Column):
    """f as a hook on x itself, registered at each forward: the hook sees x's whole gradient (every use of x,
    summed), and each call adds one more hook: right when x feeds this layer once and nothing else."""

    f = _Identity

    def forward(self, x):
        import torch.distributed as dist

        if x.requires_grad:
            def all_reduced(grad):
                grad = grad.clone()
                dist.all_reduce(grad)
                return grad
            x.register_hook(all_reduced)
        return super().forward(x)


class ColumnHookOnXOnce(ColumnHookOnX):
    """The same, but the hook put on x once only (remembered by the tensor's id): x's other use is summed too."""

    def forward(self, x):
        if getattr(self, "_hooked", None) is x:
            return F.linear(x, self.weight, self.bias)
        self._hooked = x
        return super().forward(x)


# ---------------------------------------------------------------------------------------------- wrong: traffic

class _GatherThenMultiply(torch.autograd.Function):
    """The row layer as one process would do it: all-gather the input slices and the weight's columns, multiply by
    the whole weight; backward returns this rank's own gradients (so every value is right)."""

    @staticmethod
    def forward(ctx, x_slice, weight):
        import torch.distributed as dist

        world = dist.get_world_size()
        xs = [torch.empty_like(x_slice) for _ in range(world)]
        ws = [torch.empty_like(weight) for _ in range(world)]
        dist.all_gather(xs, x_slice.contiguous())
        dist.all_gather(ws, weight.contiguous())
        ctx.save_for_backward(x_slice, weight)
        return F.linear(torch.cat(xs, -1), torch.cat(ws, -1))

    @staticmethod
    def backward(ctx, grad):
        x_slice, weight = ctx.saved_tensors
        return grad @ weight, (grad.reshape(-1, grad.shape[-1]).T @ x_slice.reshape(-1, x_slice.shape[-1]))


class RowGatheringEverything(Row):
    def forward(self, x_slice):
        return _GatherThenMultiply.apply(x_slice, self.weight) + self.bias


class _GatherPartials(torch.autograd.Function):
    """g by all-gathering every rank's partial product and adding them up locally: right values, N times the
    traffic received."""

    @staticmethod
    def forward(ctx, y):
        import torch.distributed as dist

        parts = [torch.empty_like(y) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, y.contiguous())
        return sum(parts)

    @staticmethod
    def backward(ctx, grad):
        return grad


class RowAllGatheringPartials(Row):
    def forward(self, x_slice):
        return _GatherPartials.apply(F.linear(x_slice, self.weight)) + self.bias


class RowAveragingItsBiasGradient(Row):
    """Treats the replicated bias like DDP: its gradient averaged over the ranks in backward. The values stay right
    (it is the same everywhere), the row layer's backward communicates."""

    def __init__(self, full, rank, world):
        super().__init__(full, rank, world)
        import torch.distributed as dist

        def averaged(grad):
            grad = grad.clone()
            dist.all_reduce(grad)
            return grad / world
        self.bias.register_hook(averaged)


class ColumnAllReducingItsWeightGradient(Column):
    """All-reduces its weight slice's gradient (as DDP would): the slices are different on each rank."""

    def __init__(self, full, rank, world):
        super().__init__(full, rank, world)
        import torch.distributed as dist

        def summed(grad):
            grad = grad.clone()
            dist.all_reduce(grad)
            return grad
        self.weight.register_hook(summed)


# ---------------------------------------------------------------------------------------------- wrong: the course's

class CourseColumn(nn.Module):
    """The course's own layers, subclassed (the old reference)."""

    def __new__(cls, full, rank, world):
        from dtlab.parallel.tensor import ColumnParallelLinear, TPGroup

        return ColumnParallelLinear(full, TPGroup())


class CourseRow(nn.Module):
    def __new__(cls, full, rank, world):
        from dtlab.parallel.tensor import RowParallelLinear, TPGroup

        return RowParallelLinear(full, TPGroup())


class ColumnWithCoursesF(Column):
    """Own slicing, but the course's f (copy_to_parallel) imported under another name."""

    def forward(self, x):
        from dtlab.parallel.tensor import TPGroup
        from dtlab.parallel.tensor import copy_to_parallel as f

        return F.linear(f(x, TPGroup()), self.weight, self.bias)


WRONG = {
    "row layer without all-reduce": ((Column, RowWithoutAllReduce),
                                     [FIRST, "rank 0: the output differs from one process", "only its partial sum",
                                      "the row layer must all-reduce"]),
    "bias added on every rank": ((Column, BiasOnEveryRank),
                                 [FIRST, "the output differs from one process", "off by (N-1) x bias",
                                  "bias added on every rank"]),
    "column split along in_features": ((ColumnSplitAlongInFeatures, Row),
                                       [FIRST, "column layer: weight has shape (48, 7), expected (16, 20)",
                                        "slice of the OUTPUT features"]),
    "no all-reduce of the input gradient": ((ColumnWithoutBackwardAllReduce, Row),
                                            [FIRST, "the gradient of the input differs from one process",
                                             "the column layer's input gradient must be all-reduced in backward",
                                             "your column layer's backward: nothing; expected exactly 1 "
                                             "dist.all_reduce of the input gradient's 120 elements"]),
    "row layer splits its input again": ((Column, RowSplittingAgain),
                                         [FIRST, "your row layer's forward raised", "must not split it again"]),
    "column returns the gathered whole, row picks its slice": (
        (ColumnGatheringItsOutput, RowPickingItsSlice),
        [FIRST, "rank 0, your column layer returned shape (6, 48), expected (6, 16)",
         "the column layer returns its own slice (no gathering)"]),
    "g as torch.distributed.nn.functional.all_reduce": (
        (Column, RowWithDifferentiableAllReduce),
        [FIRST, "x's gradient is 3 x the part that flows through your column layer",
         "your row layer's backward: dist.all_reduce(72 elements", "torch.distributed.nn.functional.all_reduce",
         "N times too large"]),
    "f as a hook on x, one per forward": (
        (ColumnHookOnX, Row),
        [SHARED, "rank 0: x's gradient is 2 x the part that flows through your column layer + 4 x the part from "
         "x's other use", "summed x's whole gradient, accumulated over all its uses",
         "with your layer called twice it was all-reduced twice"]),
    "f as a hook on x, once": (
        (ColumnHookOnXOnce, Row),
        [SHARED, "+ 2 x the part from x's other use", "the residual's part is already whole on every rank",
         "expected exactly 2 dist.all_reduce of the input gradient's 160 elements (one per call)"]),
    "row gathers the input slices and the weight, multiplies whole": (
        (Column, RowGatheringEverything),
        [FIRST, "your row layer's forward: dist.all_gather(96 elements, received 288", "dist.all_gather(192 "
         "elements, received 576", "expected exactly one dist.all_reduce of the output's 72 elements",
         "gathering the input slices and multiplying by the whole weight"]),
    "row all-gathers the partial products and adds them": (
        (Column, RowAllGatheringPartials),
        [FIRST, "ranks 0, 1, 2, your row layer's forward: dist.all_gather(72 elements, received 216",
         "expected exactly one dist.all_reduce of the output's 72 elements"]),
    "row averages its replicated bias gradient": (
        (Column, RowAveragingItsBiasGradient),
        [FIRST, "ranks 0, 1, 2, your row layer's backward: dist.all_reduce(12 elements",
         "expected nothing (g is the identity in backward)", "so is the bias's gradient"]),
    "column all-reduces its weight slice's gradient": (
        (ColumnAllReducingItsWeightGradient, Row),
        [FIRST, "rank 0, column layer: gradient of weight differs from one process", "dist.all_reduce(320 elements",
         "expected exactly 1 dist.all_reduce of the input gradient's 120 elements",
         "weight and bias slices get their own gradients, which must not be summed"]),
    "the course's own layers": ((CourseColumn, CourseRow),
                                [FIRST, "your code runs the course's own ColumnParallelLinear, RowParallelLinear",
                                 "the exercise is to write it"]),
    "the course's f under another name": ((ColumnWithCoursesF, Row),
                                          [FIRST, "your code runs the course's own", "dtlab.parallel.tensor"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(WRONG))
def test_wrong_implementations_fail_with_their_cause(variant):
    impl, expected = WRONG[variant]
    assert_fails_with(NAME, impl, expected)


# ---------------------------------------------------------------------------------------------- correct, differently

class _AllReduceBackwardInPlace(torch.autograd.Function):
    """f all-reducing the very gradient autograd hands it, in place. Correct here: what f receives is the input
    gradient that F.linear's backward has just computed (a fresh tensor nobody else holds), also when x feeds the
    layer twice, another layer, or a residual (each use has its own f, autograd adds their results)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        dist.all_reduce(grad)
        return grad


class ColumnInPlaceF(Column):
    f = _AllReduceBackwardInPlace


class _AllReduceForwardInPlace(torch.autograd.Function):
    """g all-reducing its input in place, told to autograd with ctx.mark_dirty."""

    @staticmethod
    def forward(ctx, y):
        import torch.distributed as dist

        ctx.mark_dirty(y)
        dist.all_reduce(y, async_op=True).wait()
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad


class ColumnIndexed(nn.Module):
    """Slices by explicit index ranges (not chunk), f as a hook on a tensor of its own (x's clone)."""

    def __init__(self, full, rank, world):
        super().__init__()
        size = full.out_features // world
        rows = torch.arange(rank * size, (rank + 1) * size)
        self.weight = nn.Parameter(full.weight.detach()[rows].clone())
        self.bias = nn.Parameter(full.bias.detach()[rows].clone())

    def forward(self, x):
        import torch.distributed as dist

        mine = x.clone()
        if mine.requires_grad:
            def all_reduced(grad):
                grad = grad.clone()
                dist.all_reduce(grad)
                return grad
            mine.register_hook(all_reduced)              # sees only what flows into this layer
        return mine @ self.weight.T + self.bias


class RowSplit(nn.Module):
    """tensor_split of the weight's columns; g in place with mark_dirty, an asynchronous all-reduce waited on."""

    def __init__(self, full, rank, world):
        super().__init__()
        self.weight = nn.Parameter(full.weight.detach().tensor_split(world, dim=1)[rank].clone())
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x_slice):
        return _AllReduceForwardInPlace.apply(x_slice @ self.weight.T) + self.bias


from torch.distributed import all_reduce as imported_all_reduce  # noqa: E402 -- bound before the grader runs


class _FWithImportedAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        imported_all_reduce(grad)
        return grad


class ColumnImported(Column):
    f = _FWithImportedAllReduce


CORRECT = {
    "f all-reducing autograd's own gradient in place": (ColumnInPlaceF, Row),
    "index slices, f as a hook on x's clone; tensor_split, g in place with mark_dirty and async_op": (ColumnIndexed,
                                                                                                       RowSplit),
    "f with an imported all_reduce and a clone forward": (ColumnImported, Row),
}


@pytest.mark.cluster
@pytest.mark.parametrize("variant", list(CORRECT))
def test_correct_alternatives_pass(variant):
    check(NAME, CORRECT[variant], quiet=True).raise_for_failure()


def test_one_class_instead_of_two_names_the_pair():
    report = check(NAME, Column, quiet=True)
    assert not report.passed and "(MyColumnParallelLinear, MyRowParallelLinear)" in report.text(), report.text()


def test_a_lone_stub_is_not_attempted():
    class Stub(nn.Module):
        def __init__(self, full, rank, world):
            super().__init__()
            raise NotImplementedError("MyColumnParallelLinear.__init__")

    report = check(NAME, Stub, quiet=True)
    assert not report.attempted and "not attempted yet" in report.text(), report.text()


@pytest.mark.slow
def test_nprocs_picks_the_cases():
    report = check(NAME, exercise(NAME).reference(), nprocs=4, quiet=True).raise_for_failure()
    assert "1 case: N = 4" in report.text() and report.worlds == [4], report.text()
