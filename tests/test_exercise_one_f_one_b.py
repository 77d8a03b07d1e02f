"""The grader of exercise 15.one_f_one_b: 1F1B passes; typical wrong schedules fail with the right words."""

import time

import pytest
from exercise_checks import assert_fails_with

from dtlab.exercises import check, exercise
from dtlab.exercises.grading import STARTUP_S

NAME = "15.one_f_one_b"


@pytest.mark.cluster
def test_reference_passes():
    report = check(NAME, exercise(NAME).reference(), quiet=True).raise_for_failure()
    assert any("at most P - s" in c for c in report.checks) and any("no deadlock" in c for c in report.checks)


def _one_f_one_b(micro_batches, stages, stage, warm=None, backward_first=False, last_backwards=None):
    """1F1B with knobs for its typical mistakes: the warm-up count, the steady pair's order, the cool-down."""
    warm = min(stages - stage - 1 if warm is None else warm, micro_batches)
    actions = [("F", m) for m in range(warm)]
    for f, b in zip(range(warm, micro_batches), range(micro_batches)):
        actions += [("B", b), ("F", f)] if backward_first else [("F", f), ("B", b)]
    cool = range(micro_batches - warm, micro_batches if last_backwards is None else last_backwards(micro_batches))
    return actions + [("B", b) for b in cool]


def gpipe(micro_batches, stages, stage):
    """All forwards, then all backwards: right gradients, every micro-batch held at once."""
    return [("F", m) for m in range(micro_batches)] + [("B", m) for m in range(micro_batches)]


def warm_up_reversed(micro_batches, stages, stage):
    """Stage s warms up with s forwards instead of P - s - 1: stage 0 asks for B0's gradient at once, while
    stage 1 waits for F1's activation, which stage 0 sends only after B0."""
    return _one_f_one_b(micro_batches, stages, stage, warm=stage)


def backward_before_forward(micro_batches, stages, stage):
    """The steady state's pair in the wrong order: the last stage starts with B0, before F0."""
    return _one_f_one_b(micro_batches, stages, stage, backward_first=True)


def cool_down_one_short(micro_batches, stages, stage):
    """The cool-down stops one micro-batch early: the last backward is never run."""
    return _one_f_one_b(micro_batches, stages, stage, last_backwards=lambda m: m - 1)


def warm_up_one_too_many(micro_batches, stages, stage):
    """P - s warm-up forwards: no deadlock, the same gradients, one more micro-batch held on every stage."""
    return _one_f_one_b(micro_batches, stages, stage, warm=stages - stage)


def warm_up_one_short(micro_batches, stages, stage):
    """P - s - 2 warm-up forwards: no deadlock and less memory, but stages wait for gradients."""
    return _one_f_one_b(micro_batches, stages, stage, warm=max(stages - stage - 2, 0))


def warm_up_not_capped(micro_batches, stages, stage):
    """P - s - 1 warm-up forwards even when there are fewer micro-batches: forwards of micro-batches that
    do not exist."""
    warm = stages - stage - 1
    actions = [("F", m) for m in range(warm)]
    for f, b in zip(range(warm, micro_batches), range(micro_batches)):
        actions += [("F", f), ("B", b)]
    return actions + [("B", b) for b in range(max(micro_batches - warm, 0), micro_batches)]


WRONG = {
    "GPipe": (gpipe, ["stage 0 held 5 micro-batches' activations at once; 1F1B holds at most 3",
                      "GPipe", "start backward as soon as the warm-up forwards are done"]),
    "B before F": (backward_before_forward, ["M = 1, P = 1, stage 0: action 0 is B0 before F0",
                                             "a backward needs the activations its forward saved"]),
    "a micro-batch missing": (cool_down_one_short, ["M = 1, P = 2, stage 0: B0 never runs"]),
    "warm-up one too many": (warm_up_one_too_many, ["stage 0 held 4 micro-batches' activations at once; 1F1B holds "
                                                    "at most 3", "too many warm-up forwards"]),
    "warm-up one short": (warm_up_one_short, ["finish M = 5 micro-batches at time", "1F1B's at 21",
                                              "too few warm-up forwards"]),
    "warm-up not capped at M": (warm_up_not_capped, ["M = 1, P = 3, stage 0: action 1 is ('F', 1)",
                                                     "0 <= i < M = 1"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(WRONG))
def test_wrong_schedules_fail_with_their_cause(variant):
    impl, expected = WRONG[variant]
    assert_fails_with(NAME, impl, expected)


@pytest.mark.slow
def test_a_deadlocking_schedule_is_stopped_with_each_stage_and_the_action_it_waits_in():
    """Stage 0 (no warm-up) waits in B0 for a gradient; stage 1 waits in F1 for an activation stage 0 sends only
    after B0; stage 2 waits for F1 from stage 1. The report names every stuck rank and its action, in time."""
    start = time.monotonic()
    report = check(NAME, warm_up_reversed, limit_s=4, quiet=True)
    took = time.monotonic() - start
    text = report.text()
    assert not report.passed and "deadlock" in text, text
    assert ("rank 0 was waiting in dist.recv(12 elements from rank 1), during stage 0, action 1 (B0): receiving the "
            "gradient of micro-batch 0 from stage 1") in text, text
    assert ("rank 1 was waiting in dist.recv(12 elements from rank 0), during stage 1, action 1 (F1): receiving the "
            "activation of micro-batch 1 from stage 0") in text, text
    assert "rank 2 was waiting in dist.recv(12 elements from rank 1), during stage 2, action 1 (F1)" in text, text
    assert "compare each stage's warm-up forwards with those of the stages after it" in text, text
    assert took < 4 + STARTUP_S, f"reported after {took:.0f} s"


def test_the_exercise_reports_a_deadlock_sooner_than_the_default():
    from dtlab.exercises.grading import DEFAULT_LIMIT_S

    assert exercise(NAME).LIMIT_S < DEFAULT_LIMIT_S
