"""The grader of exercise 19.selective_recompute: a correct hand-built recomputation passes; typical wrong ones
fail with the right words."""

import pytest
import torch
from exercise_checks import assert_fails_with
from torch import nn

from dtlab.exercises import check, exercise

NAME = "19.selective_recompute"


@pytest.mark.cluster
def test_reference_passes():
    report = check(NAME, exercise(NAME).reference(), quiet=True).raise_for_failure()
    assert any("no time x time tensor" in c for c in report.checks)


class KeepsEverything(nn.Module):
    """No recomputation at all: autograd keeps the probabilities and the mask."""

    def __init__(self, core):
        super().__init__()
        self.core = core

    def forward(self, q, k, v):
        return self.core(q, k, v)


def _function(restore_rng=True, grads_for=("q", "k", "v"), per_input=False):
    class Recompute(torch.autograd.Function):
        @staticmethod
        def forward(ctx, core, q, k, v):
            ctx.core, ctx.state = core, torch.get_rng_state()
            ctx.save_for_backward(q, k, v)
            with torch.no_grad():
                return core(q, k, v)

        @staticmethod
        def backward(ctx, grad_out):
            inputs = [t.detach().requires_grad_(True) for t in ctx.saved_tensors]
            grads = []
            for i in range(3 if per_input else 1):
                with torch.random.fork_rng():
                    if restore_rng:
                        torch.set_rng_state(ctx.state)
                    with torch.enable_grad():
                        out = ctx.core(*inputs)
                if per_input:            # one recomputation per input's gradient
                    grads.append(torch.autograd.grad(out, inputs[i], grad_out)[0])
                else:
                    grads = list(torch.autograd.grad(out, inputs, grad_out))
            return (None, *[g if name in grads_for else None for g, name in zip(grads, "qkv")])

    class Wrapped(nn.Module):
        def __init__(self, core):
            super().__init__()
            self.core = core

        def forward(self, q, k, v):
            return Recompute.apply(self.core, q, k, v)

    return Wrapped


class WithCheckpoint(nn.Module):
    def __init__(self, core):
        super().__init__()
        self.core = core

    def forward(self, q, k, v):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.core, q, k, v, use_reentrant=False)


WRONG = {
    "keeps everything": (KeepsEverything, ["time x time", "torch.no_grad()", "expected once in forward"]),
    "dropout masks not restored": (_function(restore_rng=False), ["differs from the model without recomputation",
                                                                  "other dropout masks"]),
    "no gradient for k and v": (_function(grads_for=("q",)), ["got no gradient", "one gradient per input"]),
    "one recomputation per input": (_function(per_input=True), ["[1, 1] times in forward and [4, 4] in all"]),
    "torch.utils.checkpoint": (WithCheckpoint, ["torch.utils.checkpoint was called", "torch.autograd.Function"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(WRONG))
def test_wrong_implementations_fail_with_their_cause(variant):
    impl, expected = WRONG[variant]
    assert_fails_with(NAME, impl, expected)
