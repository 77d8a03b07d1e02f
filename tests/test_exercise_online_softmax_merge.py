"""The grader of exercise 16.online_softmax_merge: a correct merge passes; typical wrong ones fail with the right
words."""

import pytest
import torch
from exercise_checks import assert_fails_with

from dtlab.exercises import check, exercise

NAME = "16.online_softmax_merge"


@pytest.mark.cluster
def test_reference_passes():
    report = check(NAME, exercise(NAME).reference(), quiet=True).raise_for_failure()
    assert any("without NaN" in c for c in report.checks) and any("overflows" in c for c in report.checks)


def averaged(out_a, lse_a, out_b, lse_b):
    """The two outputs averaged, whatever share of the softmax mass each block holds."""
    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)


def max_for_lse(out_a, lse_a, out_b, lse_b):
    """Weights right for each pair, but the merged lse is the larger one, not the log-sum-exp."""
    lse = torch.maximum(lse_a, lse_b)
    finite = lse.masked_fill(torch.isinf(lse), 0.0)
    return torch.exp(lse_a - finite)[..., None] * out_a + torch.exp(lse_b - finite)[..., None] * out_b, lse


def naive_exp(out_a, lse_a, out_b, lse_b):
    """The softmax denominators themselves, exp(lse): out of float32's range for large scores."""
    sum_a, sum_b = torch.exp(lse_a), torch.exp(lse_b)
    total = (sum_a + sum_b).clamp_min(torch.finfo(sum_a.dtype).tiny)
    return (sum_a[..., None] * out_a + sum_b[..., None] * out_b) / total[..., None], torch.log(sum_a + sum_b)


def nan_when_both_masked(out_a, lse_a, out_b, lse_b):
    """Right, except where neither block has a visible key yet: exp(-inf - -inf) is NaN."""
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b, lse


def weights_swapped(out_a, lse_a, out_b, lse_b):
    """Each output weighted by the other block's share."""
    lse = torch.logaddexp(lse_a, lse_b)
    finite = lse.masked_fill(torch.isinf(lse), 0.0)
    return torch.exp(lse_b - finite)[..., None] * out_a + torch.exp(lse_a - finite)[..., None] * out_b, lse


WRONG = {
    "average": (averaged, ["scores of order 1", "attention output differs from one process by",
                           "the outputs were averaged", "share of the softmax mass"]),
    "max for lse": (max_for_lse, ["attention lse differs from one process by", "lse is the larger of the two",
                                  "torch.logaddexp"]),
    "naive exp": (naive_exp, ["large scores (|score| up to", "with lse 101.1 and 100.0", "exp(lse) overflows"]),
    "NaN where both are masked": (nan_when_both_masked, ["rank 0 (queries 0-3): attention output holds NaN",
                                                        "merge(0, -inf, 0, -inf) gave out = nan",
                                                        "-inf - (-inf) is NaN"]),
    "weights swapped": (weights_swapped, ["attention output differs from one process by", "the weights are swapped"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(WRONG))
def test_wrong_merges_fail_with_their_cause(variant):
    impl, expected = WRONG[variant]
    assert_fails_with(NAME, impl, expected)


def test_the_large_case_leaves_float32s_exp_range():
    """The case that catches exp(lse) really has log-sum-exps beyond 88.7 (exp overflows) and below -104 (exp is 0)."""
    import math

    module = exercise(NAME)
    q, k, _ = module._qkv(module.NPROCS, 1)
    length = q.shape[-2]
    causal = torch.arange(length)[:, None] >= torch.arange(length)[None, :]
    scores = (q @ k.transpose(-2, -1) * module.DIM ** -0.5).masked_fill(~causal, -math.inf)
    lse = torch.logsumexp(scores, -1)
    assert lse.max() > 89 and lse.min() < -104, (lse.max(), lse.min())
