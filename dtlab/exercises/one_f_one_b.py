"""Exercise 15.one_f_one_b: the 1F1B pipeline schedule of one stage.

Write ``one_f_one_b(micro_batches, stages, stage)``: the list of actions that stage ``stage`` (0 to P-1) of a
P-stage pipeline runs on one batch cut into M micro-batches. Each action is

* ``("F", i)``: forward of micro-batch i — receive its activation from stage - 1 (stage 0 takes the input),
  run this stage's layers, send the result to stage + 1 (the last stage computes the loss instead);
* ``("B", i)``: backward of micro-batch i — receive the gradient of its output from stage + 1 (the last stage
  starts from its loss), back-propagate through this stage's layers, send the input's gradient to stage - 1.

1F1B's shape: a few warm-up forwards, then one forward and one backward in turn, then the backwards left.
(GPipe, every forward then every backward, computes the same gradients but holds every micro-batch at once.)

What must hold (what the grader checks):

* before anything runs, for P = 1 to 4 and M = 1 to 6 (fewer micro-batches than stages too): every
  micro-batch's F and B appear exactly once on every stage, and B i comes after F i (a backward needs what
  its forward saved);
* run for real, one stage per process (3 by default) with M = 5 and *blocking* receives (an action that
  receives waits until its neighbour has sent): no stage waits forever for another. A deadlock is stopped
  after ``limit_s`` and reported with the action each stuck stage was waiting in;
* every stage's accumulated gradients equal one process's on the whole batch;
* stage s never holds more than P - s micro-batches' activations at once (forwards done whose backward has
  not run yet);
* no more idle time than 1F1B: with a forward costing 1 time unit and a backward 2, your stages finish the
  batch no later than 1F1B's do.

Hints: the last stage can run B0 as soon as F0 is done. Stage s gets the gradient of micro-batch 0 only once
F0 has passed through every stage after it and B0 has come back: how many forwards can it run meanwhile,
and how many activations does that leave it holding? Never schedule more forwards than there are
micro-batches.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtlab.exercises.grading import Rank, Report, compare, learner_error, run_ranks
from dtlab.measure import reduction_tolerance
from dtlab.parallel.pipeline import split_model

NPROCS = 3
#: The exercise's own deadlock limit (seconds): a schedule that deadlocks is reported this quickly.
LIMIT_S = 20.0
MICRO_BATCHES = 5            # in the run (M > P, and not a multiple of it)
ROWS, WIDTH = 2, 6           # rows per micro-batch, width of every layer
SIZES = [(m, p) for p in range(1, 5) for m in range(1, 7)]      # checked before anything runs


def _model(layers: int) -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):            # the same weights everywhere; the caller's RNG untouched
        torch.manual_seed(0)
        return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())][:-1])


def _data(micro_batches: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(micro_batches * ROWS, WIDTH, generator=g),
            torch.randn(micro_batches * ROWS, WIDTH, generator=g))


def _raw(fn: Any) -> Any:
    """The torch.distributed function under the grader's tracer (P2POp accepts only the real ones)."""
    return getattr(fn, "__wrapped__", fn)


def _body(impl: Any, me: Rank, schedules: list[list[tuple[str, int]]]) -> dict[str, Any]:
    """Run this stage's actions. Sends are posted without waiting (gloo's blocking send would wait for the
    receiver), together with this stage's next receive; receives block, labelled with the action."""
    s, stages, m_count = me.rank, me.world, MICRO_BATCHES
    piece = split_model(_model(max(stages, 2)), stages)[s].to(me.device)
    x, y = (t.to(me.device).chunk(m_count) for t in _data(m_count))
    pending: list[dist.P2POp] = []
    posted: list[Any] = []
    held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    peak = 0

    def receive(peer: int, label: str) -> torch.Tensor:
        buffer = torch.empty(ROWS, WIDTH, device=me.device)
        ops = pending + [dist.P2POp(_raw(dist.irecv), buffer, peer)]
        pending.clear()
        with me.tracer.doing(label), me.tracer.waiting(f"dist.recv({buffer.numel()} elements from rank {peer})"):
            works = dist.batch_isend_irecv(ops)
            works[-1].wait()
            if buffer.is_cuda:
                torch.cuda.synchronize(buffer.device)
        posted.extend(works[:-1])
        return buffer

    dist.barrier()
    for k, (kind, i) in enumerate(schedules[s]):
        where = f"stage {s}, action {k} ({kind}{i})"
        if kind == "F":
            a = x[i] if s == 0 else receive(s - 1, f"{where}: receiving the activation of micro-batch {i} "
                                                   f"from stage {s - 1}").requires_grad_()
            out = piece(a)
            if s == stages - 1:
                out = F.mse_loss(out, y[i]) / m_count
            else:
                pending.append(dist.P2POp(_raw(dist.isend), out.detach().contiguous(), s + 1))
            held[i] = (a, out)
            peak = max(peak, len(held))
        else:
            a, out = held.pop(i)
            grad = None if s == stages - 1 else receive(s + 1, f"{where}: receiving the gradient of micro-batch {i} "
                                                                f"from stage {s + 1}")
            torch.autograd.backward(out, grad)
            if s > 0:
                pending.append(dist.P2POp(_raw(dist.isend), a.grad.contiguous(), s - 1))
    if pending:
        posted.extend(dist.batch_isend_irecv(pending))
    with me.tracer.doing(f"stage {s}, after its last action: waiting for its neighbours to receive what it sent"):
        for work in posted:
            work.wait()
    return {"grads": {n: p.grad.detach().cpu() for n, p in piece.named_parameters()}, "peak": peak}


def _validate(impl: Any, m_count: int, stages: int) -> tuple[list[list[tuple[str, int]]], list[str]]:
    """Every stage's actions, and the problems with them (empty: valid)."""
    schedules, problems = [], []
    for s in range(stages):
        where = f"M = {m_count}, P = {stages}, stage {s}"
        actions = [tuple(a) if isinstance(a, (tuple, list)) else a for a in impl(m_count, stages, s)]
        schedules.append(actions)
        done: dict[str, set[int]] = {"F": set(), "B": set()}
        for k, a in enumerate(actions):
            if not (isinstance(a, tuple) and len(a) == 2 and a[0] in ("F", "B") and isinstance(a[1], int)
                    and 0 <= a[1] < m_count):
                problems.append(f"{where}: action {k} is {a!r}; each action is (\"F\", i) or (\"B\", i) with "
                                f"0 <= i < M = {m_count}")
                break
            kind, i = a
            if i in done[kind]:
                problems.append(f"{where}: action {k} runs {kind}{i} a second time; each micro-batch's forward and "
                                "backward run once per stage")
                break
            if kind == "B" and i not in done["F"]:
                problems.append(f"{where}: action {k} is B{i} before F{i}; a backward needs the activations its "
                                "forward saved")
                break
            done[kind].add(i)
        else:
            missing = [f"{kind}{i}" for kind in "FB" for i in range(m_count) if i not in done[kind]]
            if missing:
                problems.append(f"{where}: {', '.join(missing)} never run{'s' if len(missing) == 1 else ''}; "
                                "every micro-batch needs its forward and its backward on every stage")
    return schedules, problems


def _finish_time(schedules: list[list[tuple[str, int]]]) -> float | None:
    """When the last stage finishes, a forward costing 1 and a backward 2, each action starting once its
    stage is free and its input has arrived (None: the stages wait for each other forever)."""
    stages, done, clock, pos = len(schedules), {}, [0.0] * len(schedules), [0] * len(schedules)
    moved = True
    while moved:
        moved = False
        for s in range(stages):
            while pos[s] < len(schedules[s]):
                kind, i = schedules[s][pos[s]]
                if kind == "F":
                    need = ("F", s - 1, i) if s > 0 else None
                else:
                    need = ("B", s + 1, i) if s < stages - 1 else None
                if need is not None and need not in done:
                    break
                clock[s] = done[kind, s, i] = max(clock[s], done.get(need, 0.0)) + (1.0 if kind == "F" else 2.0)
                pos[s], moved = pos[s] + 1, True
    return max(clock) if all(p == len(a) for p, a in zip(pos, schedules)) else None


def grade(impl: Any, report: Report, nprocs: int = NPROCS, limit_s: float = LIMIT_S) -> Report:
    """Grade ``impl`` (your ``one_f_one_b``): checked for P = 1..4, run on ``nprocs`` stages, into ``report``."""
    report.nprocs, stages, m_count = nprocs, nprocs, MICRO_BATCHES
    try:
        for m, p in SIZES + [(m_count, stages)]:
            schedules, problems = _validate(impl, m, p)
            for problem in problems:
                report.fail(problem)
            if problems:
                return report
    except NotImplementedError as exc:
        report.attempted = False
        report.problems.append(f"Your code raised NotImplementedError ({exc or 'NotImplementedError'}): fill in the "
                               "stub and run the cell again.")
        return report
    except Exception as exc:                  # noqa: BLE001 -- the learner's error, in words
        report.fail(f"one_f_one_b raised {learner_error(exc)}")
        return report
    report.ok("for P = 1..4 and M = 1..6, every stage runs each micro-batch's F and B once, B after F")
    out = run_ranks(report, _body, impl, schedules, nprocs=stages, limit_s=limit_s)
    if out is None:
        if any(p.startswith("deadlock") for p in report.problems):
            report.causes.append("in a pipeline: a stage waits in a backward for a gradient while a stage after it "
                                 "waits for a forward that comes later in its neighbour's list; compare each stage's "
                                 "warm-up forwards with those of the stages after it")
        return report
    model = _model(max(stages, 2))
    x, y = _data(m_count)
    F.mse_loss(model(x), y).backward()         # one process, the whole batch
    pieces = split_model(model, stages)
    worst = bound = 0.0
    for s, r in enumerate(out):
        expected = {n: p.grad for n, p in pieces[s].named_parameters()}
        scale = max(g.abs().max().item() for g in expected.values())
        b = reduction_tolerance(len(x) + WIDTH, 1, scale)      # float32 sums in another order
        worst, bound = max(worst, compare(report, f"stage {s}", r["grads"], expected, b, "gradient")), max(bound, b)
    if not report.problems:
        report.ok(f"on {stages} stages with M = {m_count}: no deadlock, and every stage's gradients equal one "
                  f"process's on the whole batch (largest difference {worst:.1e}, bound {bound:.1e})")
    for s, r in enumerate(out):
        if r["peak"] > stages - s:
            gpipe = schedules[s] == [("F", i) for i in range(m_count)] + [("B", i) for i in range(m_count)]
            report.fail(f"stage {s} held {r['peak']} micro-batches' activations at once; 1F1B holds at most "
                        f"{stages - s} (P - s) there",
                        "every forward before any backward is GPipe: the same gradients, but all M micro-batches' "
                        "activations held at once; start backward as soon as the warm-up forwards are done"
                        if gpipe else "too many warm-up forwards: each one left before the first backward is "
                        "one more micro-batch's activations held")
    if not any("activations at once" in p for p in report.problems):
        report.ok(f"stage s held at most P - s micro-batches' activations at once ({[r['peak'] for r in out]})")
    yours = _finish_time(schedules)
    best = _finish_time([reference()(m_count, stages, s) for s in range(stages)])
    if yours is not None and best is not None and yours > best:
        report.fail(f"with a forward costing 1 time unit and a backward 2, your {stages} stages finish "
                    f"M = {m_count} micro-batches at time {yours:g}, 1F1B's at {best:g}: stages sit idle waiting for "
                    "each other",
                    "too few warm-up forwards: a stage that asks for a gradient before the stages after it have "
                    "forwards to run waits for the whole pipeline to drain (stage s can run P - s - 1 forwards "
                    "before the gradient of micro-batch 0 can reach it)")
    elif yours is not None and best is not None:
        report.ok(f"finishes at time {yours:g} (forward 1, backward 2), as 1F1B does")
    return report


def reference() -> Any:
    """A correct implementation (the grader's own test uses it; try yours first): the course's own."""
    from dtlab.parallel.pipeline import one_f_one_b
    return one_f_one_b

