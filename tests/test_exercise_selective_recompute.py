"""The grader of exercise 19.selective_recompute: a correct hand-built recomputation passes (the reference and
three others); typical wrong ones fail with the right words, in the case that shows them."""

import pytest
import torch
from exercise_checks import assert_fails_with
from torch import nn

from dtlab.exercises import check, exercise

NAME = "19.selective_recompute"
ONE_FORWARD = "in case a 2-layer GPT, 4 heads of 8, sequence 24"
TWO_MICRO_BATCHES = "in case two micro-batches before one backward"
SHARED = "in case q, k, v read more than once before backward"


@pytest.mark.cluster
def test_reference_passes():
    report = check(NAME, exercise(NAME).reference(), quiet=True).raise_for_failure()
    assert any("no time x time tensor" in c for c in report.checks)
    assert any("4 cases" in c for c in report.checks)


# ------------------------------------------------------------------------------------------ correct alternatives

def _states(device):
    """The generators dropout draws from on this device: (CPU state, GPU state or None)."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _restore(device, states):
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1], device)


class _WithVjp(torch.autograd.Function):
    """backward through torch.func.vjp of the recomputation (dropout inside vjp draws from the generators)."""

    @staticmethod
    def forward(ctx, core, q, k, v):
        ctx.core, ctx.states = core, _states(q.device)
        ctx.save_for_backward(q, k, v)
        with torch.no_grad():
            return core(q, k, v)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        with torch.random.fork_rng(devices=[q.device] if q.is_cuda else []):
            _restore(q.device, ctx.states)
            _, pullback = torch.func.vjp(ctx.core, q, k, v)
        return (None, *pullback(grad_out))


class WithVjp(nn.Module):
    def __init__(self, core):
        super().__init__()
        self.core = core

    def forward(self, q, k, v):
        return _WithVjp.apply(self.core, q, k, v)


class _ReentrantStyle(torch.autograd.Function):
    """The random states saved as tensors with save_for_backward, put back by hand (no fork_rng), and the
    gradients read from .grad of detached copies after a nested backward (what reentrant checkpoint does)."""

    @staticmethod
    def forward(ctx, core, q, k, v):
        ctx.core = core
        cpu, gpu = _states(q.device)
        ctx.has_gpu = gpu is not None
        ctx.save_for_backward(q, k, v, cpu, *([gpu] if gpu is not None else []))
        with torch.no_grad():
            return core(q, k, v)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, cpu, *gpu = ctx.saved_tensors
        copies = [t.detach().requires_grad_(True) for t in (q, k, v)]
        now = _states(q.device)
        _restore(q.device, (cpu, gpu[0] if ctx.has_gpu else None))
        try:
            with torch.enable_grad():
                out = ctx.core(*copies)
        finally:
            _restore(q.device, now)
        torch.autograd.backward(out, grad_out)
        return (None, *(t.grad for t in copies))


class ReentrantStyle(nn.Module):
    def __init__(self, core):
        super().__init__()
        self.core = core

    def forward(self, q, k, v):
        return _ReentrantStyle.apply(self.core, q, k, v)


class _OnCtxAttributes(torch.autograd.Function):
    """q, k, v kept as ctx attributes (not save_for_backward), the core passed in the closure of the module."""

    @staticmethod
    def forward(ctx, q, k, v, module):
        ctx.inputs, ctx.module = (q, k, v), module
        ctx.devices = [q.device] if q.is_cuda else []
        ctx.states = _states(q.device)
        with torch.no_grad():
            return module.core(q, k, v)

    @staticmethod
    def backward(ctx, grad_out):
        inputs = [t.detach().requires_grad_(True) for t in ctx.inputs]
        with torch.random.fork_rng(devices=ctx.devices), torch.enable_grad():
            _restore(inputs[0].device, ctx.states)
            out = ctx.module.core(*inputs)
        dq, dk, dv = torch.autograd.grad(out, inputs, grad_out)
        return dq, dk, dv, None


class OnCtxAttributes(nn.Module):
    def __init__(self, core):
        super().__init__()
        self.core = core

    def forward(self, q, k, v):
        return _OnCtxAttributes.apply(q, k, v, self)


@pytest.mark.cluster
@pytest.mark.parametrize("impl", [WithVjp, ReentrantStyle, OnCtxAttributes], ids=lambda c: c.__name__)
def test_other_correct_implementations_pass(impl):
    """torch.func.vjp in backward; states as saved tensors restored by hand with a nested backward; inputs on ctx
    attributes: each a correct recomputation, so each passes."""
    check(NAME, impl, quiet=True).raise_for_failure()


# ------------------------------------------------------------------------------------------ wrong variants

class KeepsEverything(nn.Module):
    """No recomputation at all: autograd keeps the probabilities and the mask."""

    def __init__(self, core):
        super().__init__()
        self.core = core

    def forward(self, q, k, v):
        return self.core(q, k, v)


def _function(restore_rng=True, grads_for=("q", "k", "v"), per_input=False, fork=True, detach=True,
              reseed=False, keep_scores=False, gpu_state=True):
    class Recompute(torch.autograd.Function):
        @staticmethod
        def forward(ctx, core, q, k, v):
            if reseed:                   # "the same seed twice gives the same masks"
                torch.manual_seed(1234)
            ctx.core, ctx.state = core, torch.get_rng_state()
            ctx.gpu = torch.cuda.get_rng_state(q.device) if q.is_cuda and gpu_state else None
            if keep_scores:              # "to save a matmul in backward"
                ctx.scores = q @ k.transpose(-2, -1)
            ctx.save_for_backward(q, k, v)
            with torch.no_grad():
                return core(q, k, v)

        @staticmethod
        def backward(ctx, grad_out):
            saved = ctx.saved_tensors
            inputs = [t.detach().requires_grad_(True) for t in saved] if detach else list(saved)
            grads = []
            for i in range(3 if per_input else 1):
                with torch.random.fork_rng(devices=[saved[0].device] if saved[0].is_cuda else [],
                                           enabled=fork):
                    if reseed:
                        torch.manual_seed(1234)
                    elif restore_rng:
                        torch.set_rng_state(ctx.state)
                        if ctx.gpu is not None:
                            torch.cuda.set_rng_state(ctx.gpu, saved[0].device)
                    with torch.enable_grad():
                        out = ctx.core(*inputs)
                    if per_input:        # one recomputation per input's gradient
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


from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # noqa: E402 -- as the lesson imports it
    checkpoint_wrapper as imported_checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointFunction as ImportedCheckpointFunction  # noqa: E402
from torch.utils.checkpoint import checkpoint as imported_checkpoint  # noqa: E402 -- bound before the grader runs


class ImportedCheckpoint(nn.Module):
    """checkpoint imported at the top of the cell: bound before any patch a grader could make."""

    def __init__(self, core):
        super().__init__()
        self.core = core

    def forward(self, q, k, v):
        return imported_checkpoint(self.core, q, k, v, use_reentrant=False)


class ImportedCheckpointWrapper(nn.Module):
    """The lesson's own tool, checkpoint_wrapper, around the core."""

    def __init__(self, core):
        super().__init__()
        self.core = imported_checkpoint_wrapper(core)

    def forward(self, q, k, v):
        return self.core(q, k, v)


class ReentrantCheckpointFunction(nn.Module):
    """torch's reentrant checkpoint Function applied directly (no checkpoint() call at all)."""

    def __init__(self, core):
        super().__init__()
        self.core = core

    def forward(self, q, k, v):
        return ImportedCheckpointFunction.apply(self.core, True, q, k, v)


class CourseRecompute(nn.Module):
    """The course's own recompute (dtlab.activations), applied to a holder shaped like a model of blocks."""

    def __init__(self, core):
        from dtlab.activations import recompute

        super().__init__()
        self.blocks = nn.ModuleList([nn.Module()])
        self.blocks[0].core = core
        recompute(self, "selective", selective="core")

    def forward(self, q, k, v):
        return self.blocks[0].core(q, k, v)


class _StateOnModule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, module, q, k, v):
        ctx.module = module
        ctx.save_for_backward(q, k, v)
        with torch.no_grad():
            return module.core(q, k, v)

    @staticmethod
    def backward(ctx, grad_out):
        inputs = [t.detach().requires_grad_(True) for t in ctx.saved_tensors]
        with torch.random.fork_rng(), torch.enable_grad():
            torch.set_rng_state(ctx.module.rng_state)       # the state of the module's LAST forward
            out = ctx.module.core(*inputs)
        return (None, *torch.autograd.grad(out, inputs, grad_out))


class StateOnModule(nn.Module):
    """The random state kept on the module (self.): right with one forward per backward, wrong with two."""

    def __init__(self, core):
        super().__init__()
        self.core = core

    def forward(self, q, k, v):
        self.rng_state = torch.get_rng_state()
        return _StateOnModule.apply(self, q, k, v)


class _InputsOnModule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, module, q, k, v):
        ctx.module, ctx.state = module, torch.get_rng_state()
        with torch.no_grad():
            return module.core(q, k, v)

    @staticmethod
    def backward(ctx, grad_out):
        inputs = [t.detach().requires_grad_(True) for t in ctx.module.inputs]   # the LAST forward's inputs
        with torch.random.fork_rng(), torch.enable_grad():
            torch.set_rng_state(ctx.state)
            out = ctx.module.core(*inputs)
        return (None, *torch.autograd.grad(out, inputs, grad_out))


class InputsOnModule(nn.Module):
    """q, k, v kept on the module (self.) instead of ctx."""

    def __init__(self, core):
        super().__init__()
        self.core = core

    def forward(self, q, k, v):
        self.inputs = (q, k, v)
        return _InputsOnModule.apply(self, q, k, v)


class _WritesGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, core, q, k, v):
        ctx.core, ctx.state = core, torch.get_rng_state()
        ctx.save_for_backward(q, k, v)
        with torch.no_grad():
            return core(q, k, v)

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(True) for t in saved]
        with torch.random.fork_rng(), torch.enable_grad():
            torch.set_rng_state(ctx.state)
            out = ctx.core(*inputs)
        for t, g in zip(saved, torch.autograd.grad(out, inputs, grad_out)):
            t.grad = g                   # written into the inputs' .grad, nothing returned to autograd
        return None, None, None, None


class WritesGrad(nn.Module):
    """The gradients written into q.grad, k.grad, v.grad by the backward itself, none returned to autograd."""

    def __init__(self, core):
        super().__init__()
        self.core = core

    def forward(self, q, k, v):
        return _WritesGrad.apply(self.core, q, k, v)


WRONG = {
    "keeps everything": (KeepsEverything, [ONE_FORWARD, "time x time", "torch.no_grad()", "0 during backward",
                                           "nothing was recomputed"]),
    "dropout masks not restored": (_function(restore_rng=False), [ONE_FORWARD, "differs from the same cores without "
                                                                  "recomputation", "other dropout masks"]),
    "no gradient for k and v": (_function(grads_for=("q",)), ["got no gradient", "one gradient per input"]),
    "one recomputation per input": (_function(per_input=True), ["core 0: 1 run in forward, 3 during backward",
                                                                "one recomputation"]),
    "torch.utils.checkpoint": (WithCheckpoint, ["your code runs torch.utils.checkpoint.checkpoint",
                                                "torch.autograd.Function of your own"]),
    "checkpoint imported at the top of the cell": (ImportedCheckpoint, [
        ONE_FORWARD, "your code runs torch.utils.checkpoint.checkpoint", "a torch.autograd.Function of your own"]),
    "the lesson's checkpoint_wrapper": (ImportedCheckpointWrapper, [
        "checkpoint_wrapper.CheckpointWrapper", "torch.utils.checkpoint.checkpoint", "does it for you"]),
    "torch's CheckpointFunction applied directly": (ReentrantCheckpointFunction, [
        "your code runs torch.utils.checkpoint.CheckpointFunction", "does it for you"]),
    "the course's own recompute": (CourseRecompute, [
        "your code runs the course's own recompute (dtlab.activations.recompute)", "does it for you"]),
    "random state on the module": (StateOnModule, [TWO_MICRO_BATCHES, "with one micro-batch the gradients are right",
                                                   "not on the module (self.)"]),
    "inputs on the module": (InputsOnModule, [TWO_MICRO_BATCHES, "the second forward overwrote", "on ctx"]),
    "inputs not detached for the recomputation": (_function(detach=False), [
        SHARED, "one tensor passed as both q and k: gradient of q differs", "separate detached copy of each input"]),
    "gradients written into .grad": (WritesGrad, [ONE_FORWARD, "got no gradient", "one gradient per input"]),
    "random stream moved": (_function(fork=False), ["the random stream is not where it is",
                                                    "training's own random numbers must go on unchanged"]),
    "reseeded": (_function(reseed=True), [ONE_FORWARD, "the forward's loss", "without reseeding"]),
    "scores kept on ctx": (_function(keep_scores=True), [ONE_FORWARD, "time x time tensors were alive",
                                                         "on ctx or on the module"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(WRONG))
def test_wrong_implementations_fail_with_their_cause(variant):
    impl, expected = WRONG[variant]
    assert_fails_with(NAME, impl, expected)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU's dropout masks need a GPU")
def test_only_the_cpu_state_restored_fails_on_the_gpu():
    """Dropout on a GPU draws from the GPU's generator: restoring the CPU's alone is right on rank 0 (CPU) only."""
    assert_fails_with(NAME, _function(gpu_state=False), [ONE_FORWARD, "rank 1 (cuda)", "right on the CPU, wrong on "
                                                         "the GPU"])
