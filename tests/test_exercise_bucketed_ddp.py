"""The grader of exercise 03.bucketed_ddp: a correct bucketed DDP passes; typical wrong ones fail with the right
words."""

import pytest
import torch
from exercise_checks import assert_fails_with

from dtlab.exercises import check, exercise

NAME = "03.bucketed_ddp"


@pytest.mark.cluster
def test_reference_passes():
    report = check(NAME, exercise(NAME).reference(), quiet=True).raise_for_failure()
    assert any("during loss.backward()" in c for c in report.checks)


def learner_ddp(average=True, broadcast=True, bucketed=True, in_hook=True, launch_on="last", reset=True):
    """A learner's bucketed DDP, right with the defaults; each switch is one typical mistake."""
    import torch.distributed as dist

    class Learner(torch.nn.Module):
        def __init__(self, module, bucket_cap_mb):
            super().__init__()
            self.module = module
            self.world = dist.get_world_size()
            if broadcast:
                for t in list(module.parameters()) + list(module.buffers()):
                    dist.broadcast(t.data, src=0)
            cap = bucket_cap_mb * 2**20 if bucketed else 0
            self.buckets, size = [[]], 0
            for p in reversed(list(module.parameters())):
                if self.buckets[-1] and size + p.numel() * p.element_size() > cap:
                    self.buckets.append([])
                    size = 0
                self.buckets[-1].append(p)
                size += p.numel() * p.element_size()
            self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
            self.ready, self.sent = [0] * len(self.buckets), {}
            for p in module.parameters():
                p.register_post_accumulate_grad_hook(self.on_grad)

        def forward(self, *args):
            return self.module(*args)

        def on_grad(self, p):
            i = self.bucket_of[id(p)]
            self.ready[i] += 1
            due = self.ready[i] == (1 if launch_on == "first" else len(self.buckets[i]))
            if in_hook and due:
                self.send(i)

        def send(self, i):
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                              for p in self.buckets[i]])
            if average:
                flat /= self.world
            self.sent[i] = (flat, dist.all_reduce(flat, async_op=True))

        def finish_gradient_synchronization(self):
            for i in range(len(self.buckets)):
                if i not in self.sent:
                    self.send(i)
            for i, (flat, work) in self.sent.items():
                work.wait()
                offset = 0
                for p in self.buckets[i]:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
            if reset:
                self.ready = [0] * len(self.buckets)
            self.sent = {}

    return Learner


def test_the_learner_template_is_right():
    """The wrong variants below differ from a correct implementation in one switch each."""
    report = check(NAME, learner_ddp(), quiet=True)
    assert report.passed, report.text()


WRONG = {
    "summed, not averaged": (dict(average=False), ["gradient of parameter", "summed, not averaged"]),
    "no initial broadcast": (dict(broadcast=False), ["right after wrapping", "does not start from rank 0's weights",
                                                     "broadcast rank 0's parameters and buffers when you wrap"]),
    "one all-reduce per tensor": (dict(bucketed=False), ["14 dist.all_reduce calls in a step for 14 gradient tensors",
                                                         "no buckets"]),
    "all-reduce only after backward": (dict(in_hook=False), ["no dist.all_reduce was issued during loss.backward()",
                                                            "register_post_accumulate_grad_hook"]),
    "bucket sent at its first gradient": (dict(launch_on="first"), ["gradient of parameter",
                                                                   "before all its gradients had arrived"]),
    "arrivals not reset after a step": (dict(reset=False), ["in some steps no dist.all_reduce was issued during",
                                                           "reset what counts a bucket's arrived gradients"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(WRONG))
def test_wrong_implementations_fail_with_their_cause(variant):
    switches, expected = WRONG[variant]
    assert_fails_with(NAME, learner_ddp(**switches), expected)
