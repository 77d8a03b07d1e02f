"""The grader of exercise 15.one_f_one_b: 1F1B passes, however it is built and returned; typical wrong schedules fail
with the size (M, P), the stage and the cause named; none can hang the caller."""

import time

import numpy as np
import pytest
from exercise_checks import assert_fails_with

from dtlab.exercises import check, exercise
from dtlab.exercises.grading import LIMITED_STARTUP_S, STARTUP_S, Case, Report
from dtlab.parallel import pipeline as pp

NAME = "15.one_f_one_b"


@pytest.mark.cluster
def test_reference_passes():
    report = check(NAME, exercise(NAME).reference(), quiet=True).raise_for_failure()
    assert any("min(M, P - s)" in c and "both costing 1" in c for c in report.checks), report.text()
    for m, p in ((5, 3), (2, 4), (4, 2)):
        assert any(f"P = {p}, M = {m}, on {p} processes: no deadlock" in c for c in report.checks), report.text()


def test_the_reference_is_the_exercises_own_not_the_courses():
    import inspect

    source = inspect.getsource(exercise(NAME).reference)
    assert "dtlab.parallel" not in source and "import" not in source
    made = exercise(NAME).reference()
    assert made.__code__ is not pp.one_f_one_b.__code__
    assert all(made(m, p, s) == pp.one_f_one_b(m, p, s) for p in range(1, 5) for m in range(1, 9) for s in range(p))


# ------------------------------------------------------------------------------------ correct, built otherwise

def by_memory_budget(micro_batches, stages, stage):
    """No warm-up formula: run a forward while this stage holds fewer micro-batches than 1F1B allows, else the oldest
    backward — as a generator of lists with numpy integers."""
    budget = min(micro_batches, stages - stage)
    forwards = backwards = 0
    while backwards < micro_batches:
        if forwards < micro_batches and forwards - backwards < budget:
            yield ["F", np.int64(forwards)]
            forwards += 1
        else:
            yield ["B", np.int64(backwards)]
            backwards += 1


def by_simulation(micro_batches, stages, stage):
    """The whole pipeline simulated step by step: every stage runs, at each step, the backward whose gradient has
    arrived, else the forward whose activation has (while it holds fewer than P - s), else waits. Returns a tuple of
    lists whose indices are numpy integers."""
    arrived_f = [set(range(micro_batches)) if s == 0 else set() for s in range(stages)]
    arrived_b = [set() for _ in range(stages)]
    held = [[] for _ in range(stages)]
    next_f = [0] * stages
    actions = [[] for _ in range(stages)]
    while any(len(a) < 2 * micro_batches for a in actions):
        sent = []
        for s in range(stages):
            ready_b = [i for i in held[s] if s == stages - 1 or i in arrived_b[s]]
            if ready_b:
                i = min(ready_b)
                held[s].remove(i)
                actions[s].append(["B", np.int32(i)])
                if s > 0:
                    sent.append(("B", s - 1, i))
            elif next_f[s] in arrived_f[s] and len(held[s]) < stages - s:
                i = next_f[s]
                next_f[s] += 1
                held[s].append(i)
                actions[s].append(["F", np.int64(i)])
                if s < stages - 1:
                    sent.append(("F", s + 1, i))
        for kind, s, i in sent:                # what was sent this step arrives for the next
            (arrived_f if kind == "F" else arrived_b)[s].add(i)
    return tuple(actions[stage])


def last_micro_batch_first(micro_batches, stages, stage):
    """1F1B on the micro-batches taken in reverse order (the same on every stage: the same gradients)."""
    return [(kind, micro_batches - 1 - i) for kind, i in exercise(NAME).reference()(micro_batches, stages, stage)]


def test_the_alternatives_build_1f1b_itself():
    for p in range(1, 5):
        for m in range(1, 9):
            for s in range(p):
                want = pp.one_f_one_b(m, p, s)
                assert [(k, int(i)) for k, i in by_memory_budget(m, p, s)] == want
                assert [(k, int(i)) for k, i in by_simulation(m, p, s)] == want


@pytest.mark.cluster
@pytest.mark.parametrize("impl", [by_memory_budget, by_simulation, last_micro_batch_first])
def test_a_correct_schedule_built_or_returned_otherwise_passes(impl):
    """Lists for tuples, numpy integers, a generator, a tuple of lists, another micro-batch order: all 1F1B."""
    check(NAME, impl, quiet=True).raise_for_failure()


# ---------------------------------------------------------------------------------------------- wrong

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


def min_forgotten(micro_batches, stages, stage):
    """The notebook's loops with ``warm_up = stages - stage - 1`` (no min): right while M >= P - s - 1; with fewer
    micro-batches, forwards of micro-batches that do not exist and backwards of negative ones."""
    warm_up = stages - stage - 1
    actions = [("F", i) for i in range(warm_up)]
    for i in range(micro_batches - warm_up):
        actions += [("F", warm_up + i), ("B", i)]
    return actions + [("B", i) for i in range(micro_batches - warm_up, micro_batches)]


def warm_up_from_micro_batches(micro_batches, stages, stage):
    """The warm-up counted from M instead of P (M - s - 1): right when M = P, too many forwards when M > P."""
    return _one_f_one_b(micro_batches, stages, stage, warm=max(micro_batches - stage - 1, 0))


def cool_down_in_reverse(micro_batches, stages, stage):
    """1F1B whose cool-down runs the backwards left last-first: stage 1 sends B(M-1)'s gradient first, stage 0
    (whose cool-down is longer) takes it for B(M-2)'s."""
    actions = _one_f_one_b(micro_batches, stages, stage)
    steady = len(actions) - min(stages - stage - 1, micro_batches)
    return actions[:steady] + actions[steady:][::-1]


def refuses_fewer_micro_batches_than_stages(micro_batches, stages, stage):
    """Like torch's Schedule1F1B, refuses M < P: the exercise's schedule takes any M."""
    if micro_batches < stages:
        raise ValueError(f"need at least {stages} micro-batches")
    return _one_f_one_b(micro_batches, stages, stage)


def the_courses_own(micro_batches, stages, stage):
    """The lesson's pp.one_f_one_b, called from the learner's function."""
    return pp.one_f_one_b(micro_batches, stages, stage)


def the_courses_interleaved(micro_batches, stages, stage):
    """The course's interleaved 1F1B with one chunk, the chunk index dropped."""
    return [(kind, i) for kind, i, _ in pp.interleaved_one_f_one_b(micro_batches, stages, stage, chunks=1)]


def return_forgotten(micro_batches, stages, stage):
    """The actions built, and never returned."""
    actions = _one_f_one_b(micro_batches, stages, stage)
    actions.append(None)
    actions.pop()


def never_ends(micro_batches, stages, stage):
    """A generator whose loop never stops once the stage's actions are done (``<=`` for ``<``)."""
    i = 0
    while True:
        yield ("F", i % micro_batches) if i % 2 == 0 else ("B", i % micro_batches)
        i += 1


WRONG = {
    "GPipe": (gpipe, ["in case M = 2, P = 1", "M = 2, P = 1, stage 0 held 2 micro-batches' activations at once; 1F1B "
                      "holds at most 1 there (min(M, P - s))", "GPipe",
                      "start backward as soon as the warm-up forwards are done",
                      "and at 27 more of the 32 sizes checked"]),
    "B before F": (backward_before_forward, ["M = 1, P = 1, stage 0: action 0 is B0 before F0",
                                             "a backward needs the activations its forward saved"]),
    "a micro-batch missing": (cool_down_one_short, ["M = 1, P = 2, stage 0: B0 never runs"]),
    "warm-up one too many": (warm_up_one_too_many, ["M = 2, P = 1, stage 0 held 2 micro-batches' activations at "
                                                    "once; 1F1B holds at most 1", "too many warm-up forwards"]),
    "warm-up one short": (warm_up_one_short, ["M = 2, P = 2: with a forward costing 1 time unit and a backward 2, "
                                              "your stages finish at time 12, 1F1B's at 9",
                                              "too few warm-up forwards (stage 0 starts its backwards early)"]),
    "warm-up not capped at M": (warm_up_not_capped, ["M = 1, P = 3, stage 0: action 1 is ('F', 1)",
                                                     "0 <= i < M = 1"]),
    "min forgotten (the notebook's loops)": (min_forgotten, ["M = 1, P = 3, stage 0: action 1 is ('F', 1)",
                                                             "in case M = 1, P = 3"]),
    "warm-up from M": (warm_up_from_micro_batches, ["M = 2, P = 1, stage 0 held 2", "too many warm-up forwards"]),
    "cool-down in reverse": (cool_down_in_reverse, ["M = 2, P = 3: stage 0 runs the backwards in the order B1 B0, "
                                                    "stage 1 in the order B0 B1", "one same order"]),
    "deadlock": (warm_up_reversed, ["M = 2, P = 2: the stages wait for each other forever",
                                    "stage 0, action 1 (B0) waits for the gradient of micro-batch 0 from stage 1",
                                    "stage 1, action 1 (F1) waits for the activation of micro-batch 1 from stage 0",
                                    "compare each stage's warm-up forwards with those of the stages after it"]),
    "refuses M < P": (refuses_fewer_micro_batches_than_stages, ["in case M = 1, P = 2", "called as (1, 2, 0)",
                                                                "raised ValueError: need at least 2 micro-batches"]),
    "return forgotten": (return_forgotten, ["M = 1, P = 1, stage 0: one_f_one_b(1, 1, 0) returned None"]),
    "the course's own": (the_courses_own, ["runs the course's own one_f_one_b (dtlab.parallel.pipeline)",
                                           "the exercise is to write it"]),
    "the course's own, by its name": (pp.one_f_one_b, ["runs the course's own one_f_one_b"]),
    "the course's interleaved": (the_courses_interleaved, ["runs the course's own interleaved_one_f_one_b"]),
    "a generator that never ends": (never_ends, ["M = 1, P = 1, stage 0: one_f_one_b(1, 1, 0) gave more than 10 "
                                                 "actions (it was cut there)"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(WRONG))
def test_wrong_schedules_fail_with_their_cause(variant):
    impl, expected = WRONG[variant]
    assert_fails_with(NAME, impl, expected)


def test_each_wrong_schedule_is_rejected_before_any_process_runs():
    """The lists are checked at every size first: a wrong schedule never reaches the real runs (fast reports)."""
    report = check(NAME, gpipe, quiet=True)
    assert not report.passed and report.worlds == [3, 4, 2] and "checked before anything runs" in report.text()


@pytest.mark.slow
def test_a_function_that_never_returns_is_stopped_and_the_call_named():
    def stuck_when_fewer_micro_batches(micro_batches, stages, stage):
        warm = stages - stage - 1
        while warm > micro_batches:                   # meant to cap the warm-up at M: the decrement is missing
            warm - 1                                  # noqa: B018
        return _one_f_one_b(micro_batches, stages, stage, warm=warm)

    start = time.monotonic()
    report = check(NAME, stuck_when_fewer_micro_batches, limit_s=1, quiet=True)
    took = time.monotonic() - start
    assert not report.passed and "your one_f_one_b(1, 3, 0) did not return within 1 s" in report.text(), report.text()
    assert took < 1 + LIMITED_STARTUP_S + 5, f"reported after {took:.0f} s"


@pytest.mark.slow
def test_a_deadlock_in_the_real_run_is_stopped_with_each_stage_and_the_action_it_waits_in():
    """The real run's own deadlock report (the lists' simulation catches the same schedules first): stage 0 waits
    in B0 for a gradient; stage 1 waits in F1 for an activation stage 0 sends only after B0; stage 2 waits for F1
    from stage 1. The report names every stuck rank and its action, in time."""
    from dtlab.exercises import one_f_one_b as grader

    got = {(5, 3, s): {"actions": warm_up_reversed(5, 3, s)} for s in range(3)}
    report = Report(NAME, "the 1F1B pipeline schedule")
    start = time.monotonic()
    grader._grade_case(Case("P = 3 stages, M = 5 micro-batches", 3, {"micro_batches": 5}), report, got, limit_s=4)
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


def test_every_size_and_both_costs_are_checked():
    from dtlab.exercises import one_f_one_b as grader

    assert {(m, p) for p in range(1, 5) for m in range(1, 9)} <= set(grader.SIZES)
    assert (1.0, 2.0) in grader.COSTS and (1.0, 1.0) in grader.COSTS
    assert {(c.nprocs, c.params["micro_batches"]) for c in grader.CASES} == {(3, 5), (4, 2), (2, 4)}


def test_the_exercise_reports_a_deadlock_sooner_than_the_default():
    from dtlab.exercises.grading import DEFAULT_LIMIT_S

    assert exercise(NAME).LIMIT_S < DEFAULT_LIMIT_S


@pytest.mark.cluster
def test_nprocs_grades_the_lists_and_that_case_only():
    report = check(NAME, by_memory_budget, nprocs=4, quiet=True).raise_for_failure()
    assert report.worlds == [4, 4] and any("P = 4, M = 2, on 4 processes" in c for c in report.checks)
