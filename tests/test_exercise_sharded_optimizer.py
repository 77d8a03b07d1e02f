"""The grader of exercise 06.sharded_optimizer: a correct ZeRO-1 passes; typical wrong ones fail with the right
words."""

import pytest
from exercise_checks import assert_fails_with

from dtlab.exercises import check, exercise

NAME = "06.sharded_optimizer"


@pytest.mark.cluster
def test_reference_passes():
    report = check(NAME, exercise(NAME).reference(), quiet=True).raise_for_failure()
    assert any("every parameter's on exactly one rank" in c for c in report.checks)


def learner_zero1(whole=False, src="owner", owners="balanced", clear="all"):
    """A learner's ZeRO-1, right with the defaults; each switch is one typical mistake."""
    import torch.distributed as dist

    class Learner:
        def __init__(self, params, optimizer_class, **defaults):
            self.params = list(params)
            rank, world = dist.get_rank(), dist.get_world_size()
            if owners == "balanced":                  # largest first, to the rank owning the fewest elements
                load, self.owner = [0] * world, {}
                for i in sorted(range(len(self.params)), key=lambda i: -self.params[i].numel()):
                    self.owner[i] = min(range(world), key=lambda r: load[r])
                    load[self.owner[i]] += self.params[i].numel()
            else:                                     # round-robin starting at this rank: differs per rank
                self.owner = {i: (rank + i) % world for i in range(len(self.params))}
            mine = self.params if whole else [p for i, p in enumerate(self.params) if self.owner[i] == rank]
            self.optimizer = optimizer_class(mine, **defaults)

        def step(self):
            self.optimizer.step()
            if src is None:
                return
            for i, p in enumerate(self.params):
                dist.broadcast(p.data, src=self.owner[i] if src == "owner" else 0)

        def zero_grad(self, set_to_none=True):
            for p in self.optimizer.param_groups[0]["params"] if clear == "own" else self.params:
                p.grad = None

    return Learner


def test_the_learner_template_is_right():
    """The wrong variants below differ from a correct implementation in one switch each."""
    report = check(NAME, learner_zero1(), quiet=True)
    assert report.passed, report.text()


WRONG = {
    "whole optimizer on every rank": (dict(whole=True), ["holds optimizer state for all 10 parameters",
                                                         "plain data parallelism"]),
    "no broadcast after step": (dict(src=None), ["differs from one process", "never changed on rank",
                                                 "dist.broadcast(p, src=owner)"]),
    "broadcast from rank 0": (dict(src=0), ["differs from one process", "unchanged on every rank",
                                            "not from rank 0"]),
    "owners depend on the rank": (dict(owners="from my rank"), ["deadlock", "dist.broadcast",
                                                                "the ranks disagree about its src"]),
    "zero_grad clears its shard only": (dict(clear="own"), ["after your zero_grad()", "still had a gradient",
                                                            "not only the ones this rank owns"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(WRONG))
def test_wrong_implementations_fail_with_their_cause(variant):
    switches, expected = WRONG[variant]
    assert_fails_with(NAME, learner_zero1(**switches), expected, limit_s=5)
