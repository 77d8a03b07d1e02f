"""The grader of exercise 16.online_softmax_merge: a correct merge passes, however it is written; typical wrong ones
fail with the right words."""

import math
import time

import pytest
import torch
from exercise_checks import assert_fails_with

from dtlab.exercises import check, exercise
from dtlab.exercises.grading import LIMITED_STARTUP_S

NAME = "16.online_softmax_merge"
DIRECT = "in case merge called directly"


@pytest.mark.cluster
def test_reference_passes():
    report = check(NAME, exercise(NAME).reference(), quiet=True).raise_for_failure()
    text = report.text()
    assert "on 2, 3 and 4 processes" in text and "merged without NaN" in text and "overflows" in text, text
    assert "your merge on its own: 6 groups" in text, text


# ------------------------------------------------------------------------------------- correct, not the reference

def sigmoid_weights(out_a, lse_a, out_b, lse_b):
    """Block a's share of the mass is sigmoid(lse_a - lse_b); where both are -inf the difference is NaN: 0 instead
    (both outputs are 0 there, so any share gives 0)."""
    share_a = torch.sigmoid((lse_a - lse_b).nan_to_num(nan=0.0))
    return out_b + share_a[..., None] * (out_a - out_b), torch.logaddexp(lse_a, lse_b)


def max_subtracted(out_a, lse_a, out_b, lse_b):
    """The larger lse subtracted before exponentiating (0 where both are -inf), normalised by the sum."""
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    mass_a, mass_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = mass_a + mass_b
    out = (mass_a[..., None] * out_a + mass_b[..., None] * out_b) / total.clamp_min(1e-30)[..., None]
    return out, top + torch.log(total)


def stacked_logsumexp(out_a, lse_a, out_b, lse_b):
    """torch.logsumexp over the two lse stacked (it returns -inf for two -inf), the shares guarded for NaN."""
    stacked = torch.stack([lse_a, lse_b])
    lse = torch.logsumexp(stacked, dim=0)
    shares = torch.exp(stacked - lse).nan_to_num(nan=0.0)
    return shares[0][..., None] * out_a + shares[1][..., None] * out_b, lse


def course_stand_in(out_a, lse_a, out_b, lse_b):
    """As _ring_forward does it: -inf replaced by finfo.min / 2, which exp() keeps at 0 (the merged lse of two
    empty blocks is then that stand-in, not -inf)."""
    low = torch.finfo(lse_a.dtype).min / 2
    lse_a, lse_b = lse_a.clamp_min(low), lse_b.clamp_min(low)
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b, lse


CORRECT = {"sigmoid of the difference": sigmoid_weights, "max subtracted": max_subtracted,
           "logsumexp over a stack": stacked_logsumexp, "the course's finite stand-in": course_stand_in}


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.parametrize("variant", list(CORRECT))
def test_other_correct_merges_pass(variant):
    check(NAME, CORRECT[variant], quiet=True).raise_for_failure()


# ---------------------------------------------------------------------------------------------- wrong

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


def relative_to_a(out_a, lse_a, out_b, lse_b):
    """Only block a's lse subtracted (b's where a is empty): exp(lse_b - lse_a) overflows when b is 89 or more
    above a. Right everywhere else, -inf included."""
    base = torch.where(torch.isinf(lse_a), lse_b, lse_a)
    base = base.masked_fill(torch.isinf(base), 0.0)
    mass_a, mass_b = torch.exp(lse_a - base), torch.exp(lse_b - base)
    total = mass_a + mass_b
    out = (mass_a[..., None] * out_a + mass_b[..., None] * out_b) / total.clamp_min(1e-30)[..., None]
    return out, base + torch.log(total)


def where_guards_one_side(out_a, lse_a, out_b, lse_b):
    """torch.where guards block a's -inf but not block b's: exp(-inf - (-inf)) on b's side is NaN."""
    lse = torch.logaddexp(lse_a, lse_b)
    share_a = torch.where(torch.isinf(lse_a), torch.zeros_like(lse_a), torch.exp(lse_a - lse))
    share_b = torch.exp(lse_b - lse)
    return share_a[..., None] * out_a + share_b[..., None] * out_b, lse


def weighted_by_old_lse(out_a, lse_a, out_b, lse_b):
    """The new lse computed, but the shares measured against lse_a (the running lse before this block)."""
    lse = torch.logaddexp(lse_a, lse_b)
    old = lse_a.masked_fill(torch.isinf(lse_a), 0.0)
    return torch.exp(lse_a - old)[..., None] * out_a + torch.exp(lse_b - old)[..., None] * out_b, lse


def stacked_logsumexp_unguarded(out_a, lse_a, out_b, lse_b):
    """torch.logsumexp over the stack, right, but the shares exp(lse_x - lse) are NaN where both are -inf."""
    stacked = torch.stack([lse_a, lse_b])
    lse = torch.logsumexp(stacked, dim=0)
    shares = torch.exp(stacked - lse)
    return shares[0][..., None] * out_a + shares[1][..., None] * out_b, lse


def in_place(out_a, lse_a, out_b, lse_b):
    """The right numbers, written into out_a (the caller's tensor) and returned."""
    lse = torch.logaddexp(lse_a, lse_b)
    finite = lse.masked_fill(torch.isinf(lse), 0.0)
    out_a *= torch.exp(lse_a - finite)[..., None]
    out_a += torch.exp(lse_b - finite)[..., None] * out_b
    return out_a, lse


def weights_unsqueezed_at_1(out_a, lse_a, out_b, lse_b):
    """Right for out [q, d] and lse [q]; with batch and head dimensions unsqueeze(1) is not the trailing axis."""
    lse = torch.logaddexp(lse_a, lse_b)
    finite = lse.masked_fill(torch.isinf(lse), 0.0)
    return torch.exp(lse_a - finite).unsqueeze(1) * out_a + torch.exp(lse_b - finite).unsqueeze(1) * out_b, lse


WRONG = {
    "average": (averaged, [DIRECT, "group 1 of 6", "your out differs from the merged attention by",
                           "the outputs were averaged", "share of the softmax mass"]),
    "max for lse": (max_for_lse, [DIRECT, "your lse is", "the log-sum-exp over both blocks is",
                                  "lse is the larger of the two"]),
    "naive exp": (naive_exp, [DIRECT, "group 2 of 6", "lse_a = ", "with lse 501.1 and 500.0",
                              "exp(lse) overflows"]),
    "NaN where both are masked": (nan_when_both_masked, [DIRECT, "group 1 of 6", "lse_a = -inf, lse_b = -inf",
                                                        "your out holds NaN", "merge(0, -inf, 0, -inf) gave out = nan",
                                                        "-inf - (-inf) is NaN"]),
    "weights swapped": (weights_swapped, [DIRECT, "your out differs from the merged attention by",
                                          "the weights are swapped"]),
    "only lse_a subtracted": (relative_to_a, [DIRECT, "group 3 of 6 (out [3, 10, 4]: lse_a and lse_b more than 100 "
                                              "apart", "merge(1, 0, 0, 200) gave out = nan",
                                              "more than 88.7 apart: subtract the larger one"]),
    "torch.where guards one side": (where_guards_one_side, [DIRECT, "lse_a = -inf, lse_b = -inf", "your out holds NaN",
                                                            "-inf - (-inf) is NaN"]),
    "shares against the old lse": (weighted_by_old_lse, [DIRECT, "your out", "relative to lse_a",
                                                         "against the merged lse"]),
    "logsumexp over a stack, unguarded": (stacked_logsumexp_unguarded, [DIRECT, "your out holds NaN",
                                                                        "-inf - (-inf) is NaN"]),
    "in place": (in_place, [DIRECT, "merge(a, b) on group 1 of 6", "changed its input out_a in place",
                            "return new tensors"]),
    "unsqueeze(1), not a trailing axis": (weights_unsqueezed_at_1, [DIRECT, "your merge raised RuntimeError",
                                                                    "a trailing axis of size 1"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(WRONG))
def test_wrong_merges_fail_with_their_cause(variant):
    impl, expected = WRONG[variant]
    assert_fails_with(NAME, impl, expected)


def right_alone_wrong_in_a_ring(out_a, lse_a, out_b, lse_b):
    """Right on every direct group, wrong once the running result is 4-D with 4 or more queries and the block's
    lse is finite everywhere (the shape of the ring's later steps): a stand-in for any mistake the direct groups
    miss, to show the ring cases grade on their own."""
    lse = torch.logaddexp(lse_a, lse_b)
    finite = lse.masked_fill(torch.isinf(lse), 0.0)
    out = torch.exp(lse_a - finite)[..., None] * out_a + torch.exp(lse_b - finite)[..., None] * out_b
    if out.dim() == 4 and out.shape[0] == 1 and torch.isfinite(lse_b).all():
        out = out * 1.01
    return out, lse


@pytest.mark.slow
def test_the_ring_cases_grade_what_the_direct_groups_miss():
    assert_fails_with(NAME, right_alone_wrong_in_a_ring, ["in case N = 3, causal, zig-zag layout",
                                                          "attention output differs from one process by"])


@pytest.mark.slow
def test_a_merge_that_never_returns_is_stopped():
    def spins(out_a, lse_a, out_b, lse_b):
        while True:
            pass

    start = time.monotonic()
    report = assert_fails_with(NAME, spins, [DIRECT, "did not return within 3 s"], limit_s=3)
    assert time.monotonic() - start < 3 + LIMITED_STARTUP_S + 5, report.text()     # and a start-up


@pytest.mark.cluster
@pytest.mark.slow
def test_one_world_size_grades_the_direct_groups_and_that_ring_only():
    report = check(NAME, exercise(NAME).reference(), nprocs=2, quiet=True).raise_for_failure()
    assert "on 2 processes" in report.text() and "1 case: N = 2" in report.text(), report.text()


# ---------------------------------------------------------------------------------------------- the inputs

def _ring_block_lses(case):
    """Every (rank, step) block lse and the running lse it is merged into, as the grader's ring makes them."""
    module = exercise(NAME)
    n, params = case.nprocs, case.params
    owned, mask = module._owned(params, n), module._mask(params, module._length(params, n))
    q, k, v = module._qkv(params, n)
    pairs = []
    for rank in range(n):
        mine = owned[rank]
        running = torch.full(q[..., mine, 0].shape, -math.inf)
        for step in range(1, n + 1):
            theirs = owned[(rank - step) % n]
            _, block = module._block(q[..., mine, :], k[..., theirs, :], v[..., theirs, :], mask[mine][:, theirs])
            pairs.append((running, block))
            running = torch.logaddexp(running, block)
    return pairs


def test_the_rings_have_partial_masks_and_scores_far_beyond_exps_range():
    """Blocks in which some queries see keys and others none; a query that sees nothing until its last block; a
    non-causal case; lse beyond exp's float32 range either way, some blocks within 2 of the running lse, some
    thousands apart and of opposite signs."""
    module = exercise(NAME)
    assert sorted(c.nprocs for c in module.CASES) == [2, 3, 4]
    assert any(c.params["mask"] != "causal" for c in module.CASES)
    zigzag = _ring_block_lses(module.CASES[0])
    partial = [b for _, b in zigzag if torch.isinf(b).any() and torch.isfinite(b).any()]
    assert partial, "no block with both visible and empty rows"
    assert any((torch.isinf(r) & torch.isinf(b)).any() for r, b in zigzag), "no query that has seen nothing meets " \
                                                                            "a block it cannot see"
    documents = _ring_block_lses(module.CASES[1])
    assert any(torch.isinf(b).any() and torch.isfinite(b).any() for _, b in documents)
    large = _ring_block_lses(module.CASES[2])
    finite = torch.cat([b[torch.isfinite(b)] for _, b in large])
    assert finite.max() > 5e3 and finite.min() < -5e3, (finite.max(), finite.min())
    gaps = torch.cat([(b - r)[torch.isfinite(b - r)].abs() for r, b in large])
    assert (gaps < 2).sum() >= 5 and (gaps > 1e3).sum() >= 5, gaps
    signs = torch.cat([(b * r)[torch.isfinite(b * r)] for r, b in large])
    assert (signs < -1e6).sum() >= 5, "running and block lse of opposite signs"


def test_the_direct_groups_hold_every_kind_of_pair():
    """-inf in a only, b only and both on queries of one tensor; equal lse; lse 100 or more apart either way; lse
    around +-1e4 with near ties and opposite signs; q = d; no batch dimensions; one query."""
    module = exercise(NAME)
    out_a, lse_a, out_b, lse_b = module._group(0)
    ia, ib = torch.isinf(lse_a), torch.isinf(lse_b)
    assert (ia & ~ib).any() and (ib & ~ia).any() and (ia & ib).any() and (~ia & ~ib).any()
    assert (out_a[ia] == 0).all() and (out_b[ib] == 0).all()
    _, lse_a, _, lse_b = module._group(1)
    assert torch.equal(lse_a, lse_b) and lse_a.abs().max() > 1e3
    _, lse_a, _, lse_b = module._group(2)
    gap = lse_b - lse_a
    assert (gap.abs() >= 100).all() and (gap > 0).any() and (gap < 0).any()
    _, lse_a, _, lse_b = module._group(3)
    assert lse_a.max() > 8e3 and lse_a.min() < -8e3 and ((lse_a - lse_b).abs() < 2).any() and (lse_a * lse_b < 0).any()
    assert module._group(4)[0].shape == (8, 8) and module._group(5)[0].shape == (3, 1, 1)
