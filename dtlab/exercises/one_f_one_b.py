"""Exercise 15.one_f_one_b: the 1F1B pipeline schedule of one stage.

Write ``one_f_one_b(micro_batches, stages, stage)``: the actions that stage ``stage`` (0 to P-1) of a P-stage
pipeline runs on one batch cut into M micro-batches, in order (a list; a tuple or a generator works too). Each
action is

* ``("F", i)``: forward of micro-batch i — receive its activation from stage - 1 (stage 0 takes the input),
  run this stage's layers, send the result to stage + 1 (the last stage computes the loss instead);
* ``("B", i)``: backward of micro-batch i — receive the gradient of its output from stage + 1 (the last stage
  starts from its loss), back-propagate through this stage's layers, send the input's gradient to stage - 1.

``i`` is any integer (``int``, ``numpy.int64``, ...); an action may be a tuple or a list. A stage receives from
its neighbour in the order the neighbour sent (no tags), like a real pipeline's point-to-point messages.

1F1B's shape: a few warm-up forwards, then one forward and one backward in turn, then the backwards left.
(GPipe, every forward then every backward, computes the same gradients but holds every micro-batch at once.)
Write it yourself: the grader rejects a function that runs the course's own ``dtlab.parallel.pipeline``
schedules.

What must hold (what the grader checks):

* first, your function is called for every P = 1 to 4 and M = 1 to 8 (fewer micro-batches than stages too),
  every stage, in a separate process stopped after a few seconds (an endless loop is reported, not waited for).
  For each of these 32 sizes, the grader then checks the lists themselves, naming the size (M, P) and the stage
  that fails:

  - every micro-batch's F and B appear exactly once on every stage, with 0 <= i < M, and B i after F i (a
    backward needs what its forward saved);
  - every stage runs the forwards in the same order, and the backwards in the same order (what stage s sends
    is what stage s + 1 receives next);
  - the stages, each receive blocking until its neighbour has sent, never wait for each other forever;
  - stage s never holds more than min(M, P - s) micro-batches' activations at once (forwards done whose
    backward has not run yet): what 1F1B holds there;
  - no more idle time than 1F1B: with a forward costing 1 time unit and a backward 2, and again with both
    costing 1, your stages finish the batch no later than 1F1B's do;

* then the schedules run for real, one stage per process, with blocking receives, in three cases: P = 3 with
  M = 5, P = 4 with M = 2 (fewer micro-batches than stages) and P = 2 with M = 4. In each, no stage waits
  forever for another (a deadlock is stopped after ``limit_s`` and reported with the action each stuck stage
  was waiting in), every stage's accumulated gradients equal one process's on the whole batch, and stage s held
  at most min(M, P - s) micro-batches' activations.

Hints: draw P = 3 and M = 4 as a grid, one row per stage and one column per time step, and place every action
as early as what it receives allows (the last stage can run B0 as soon as F0 is done). The shape that appears
is 1F1B. What decides how many forwards a stage runs before its first backward, and what if there are fewer
micro-batches than that?
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtlab.exercises.grading import (
    Case,
    Rank,
    Report,
    as_index,
    compare,
    course_code,
    grade_cases,
    learner_error,
    run_limited,
    run_ranks,
)
from dtlab.measure import reduction_tolerance
from dtlab.parallel.pipeline import split_model

NPROCS = 3
#: The exercise's own deadlock limit (seconds): a schedule that deadlocks is reported this quickly.
LIMIT_S = 20.0
#: Seconds your function may take for all the sizes together (it is called in a child process stopped after this).
SCHEDULE_LIMIT_S = 5.0
ROWS, WIDTH = 2, 6           # rows per micro-batch, width of every layer
#: Every (M, P) whose schedules are checked before anything runs (fewer micro-batches than stages too).
SIZES = [(m, p) for p in range(1, 5) for m in range(1, 9)]
#: (forward, backward) costs in time units: your stages must finish no later than 1F1B's under each.
COSTS = [(1.0, 2.0), (1.0, 1.0)]
#: The runs on real processes, in the order they are graded.
CASES = [
    Case("P = 3 stages, M = 5 micro-batches", 3, {"micro_batches": 5}),
    Case("P = 4 stages, M = 2 micro-batches (fewer micro-batches than stages)", 4, {"micro_batches": 2}),
    Case("P = 2 stages, M = 4 micro-batches", 2, {"micro_batches": 4}),
]
#: Actions read back per stage at most (a generator that never ends is cut there).
_MOST = 8


def _model(layers: int) -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):            # the same weights everywhere; the caller's RNG untouched
        torch.manual_seed(0)
        return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())][:-1])


def _data(micro_batches: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(micro_batches * ROWS, WIDTH, generator=g),
            torch.randn(micro_batches * ROWS, WIDTH, generator=g))


def _label(a: Any) -> str:
    return f"{a[0]}{a[1]}" if isinstance(a, tuple) else str(a)


# ---------------------------------------------------------------------------------------------- in a child process

def _plain(actions: Any, m_count: int) -> dict[str, Any]:
    """What one call returned, as plain data: {"actions": [(kind, int) or repr], "cut": bool} or {"not_a_list"}."""
    if isinstance(actions, (str, bytes, dict)) or not hasattr(actions, "__iter__"):
        return {"not_a_list": repr(actions)[:80]}
    out: list[Any] = []
    for k, a in enumerate(actions):
        if k >= 2 * m_count + _MOST:
            return {"actions": out, "cut": True}
        index = None
        if isinstance(a, (tuple, list)) and len(a) == 2 and isinstance(a[0], str) and a[0] in ("F", "B"):
            index = as_index(a[1])
        out.append((str(a[0]), index) if index is not None else repr(a)[:60])
    return {"actions": out, "cut": False}


def _schedules_of(impl: Any, sizes: list[tuple[int, int]], progress: str) -> dict[str, Any]:
    """Call ``impl`` for every size and stage (in the child ``run_limited`` starts), noting whether the course's own
    schedule functions run (by code object: whatever name they were imported under)."""
    from dtlab.parallel import pipeline

    codes = course_code(pipeline.one_f_one_b, pipeline.interleaved_one_f_one_b)
    seen: list[str] = []

    def watch(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            name = codes.get(frame.f_code)
            if name is not None and name not in seen:
                seen.append(name)

    out: dict[tuple[int, int, int], Any] = {}
    previous = sys.getprofile()
    with open(progress, "w") as note:
        sys.setprofile(watch)
        try:
            for m, p in sizes:
                for s in range(p):
                    note.seek(0)
                    note.write(f"{m}, {p}, {s}  ")
                    note.flush()
                    try:
                        out[m, p, s] = _plain(impl(m, p, s), m)
                    except NotImplementedError:
                        raise
                    except Exception as exc:        # noqa: BLE001 -- the learner's error, in words
                        return {"error": f"your function, called as ({m}, {p}, {s}) (M = {m}, P = {p}, stage {s}), "
                                         f"raised {learner_error(exc)}", "size": (m, p), "seen": seen}
        finally:
            sys.setprofile(previous)
    return {"schedules": out, "seen": seen}


# ---------------------------------------------------------------------------------------------- on real processes

def _body(impl: Any, me: Rank, schedules: list[list[tuple[str, int]]], m_count: int) -> dict[str, Any]:
    """Run this stage's actions. Sends are posted without waiting (gloo's blocking send would wait for the
    receiver), together with this stage's next receive; receives block, labelled with the action."""
    s, stages = me.rank, me.world
    piece = split_model(_model(max(stages, 2)), stages)[s].to(me.device)
    x, y = (t.to(me.device).chunk(m_count) for t in _data(m_count))
    pending: list[dist.P2POp] = []
    posted: list[Any] = []
    held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    peak = 0

    def receive(peer: int, label: str) -> torch.Tensor:
        buffer = torch.empty(ROWS, WIDTH, device=me.device)
        ops = pending + [dist.P2POp(dist.irecv, buffer, peer)]
        pending.clear()
        with me.tracer.doing(label), me.tracer.quiet(), \
                me.tracer.waiting(f"dist.recv({buffer.numel()} elements from rank {peer})"):
            works = dist.batch_isend_irecv(ops)
            works[-1].wait()
            if buffer.is_cuda:
                torch.cuda.synchronize(buffer.device)
        posted.extend(works[:-1])
        return buffer

    with me.tracer.quiet():                 # the grader's own communication (your function sends nothing)
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
                pending.append(dist.P2POp(dist.isend, out.detach().contiguous(), s + 1))
            held[i] = (a, out)
            peak = max(peak, len(held))
        else:
            a, out = held.pop(i)
            grad = None if s == stages - 1 else receive(s + 1, f"{where}: receiving the gradient of micro-batch {i} "
                                                                f"from stage {s + 1}")
            torch.autograd.backward(out, grad)
            if s > 0:
                pending.append(dist.P2POp(dist.isend, a.grad.contiguous(), s - 1))
    with me.tracer.quiet():
        if pending:
            posted.extend(dist.batch_isend_irecv(pending))
    with me.tracer.doing(f"stage {s}, after its last action: waiting for its neighbours to receive what it sent"), \
            me.tracer.quiet():
        for work in posted:
            work.wait()
    return {"grads": {n: p.grad.detach().cpu() for n, p in piece.named_parameters()}, "peak": peak}


# ---------------------------------------------------------------------------------------------- the lists themselves

def _structure(got: dict[str, Any], m_count: int, stages: int, s: int) -> str | None:
    """The first problem with one stage's list (None: every F and B once, in range, B after F)."""
    where = f"M = {m_count}, P = {stages}, stage {s}"
    call = f"one_f_one_b({m_count}, {stages}, {s})"
    if "not_a_list" in got:
        return f"{where}: {call} returned {got['not_a_list']}; return the stage's actions, a list of (\"F\", i) and " \
               "(\"B\", i)"
    if got["cut"]:
        return f"{where}: {call} gave more than {2 * m_count + _MOST} actions (it was cut there); a stage runs " \
               f"2M = {2 * m_count}"
    done: dict[str, set[int]] = {"F": set(), "B": set()}
    for k, a in enumerate(got["actions"]):
        if not isinstance(a, tuple) or not 0 <= a[1] < m_count:
            shown = repr(a) if isinstance(a, tuple) else a
            return f"{where}: action {k} is {shown}; each action is (\"F\", i) or (\"B\", i) with 0 <= i < " \
                   f"M = {m_count}"
        kind, i = a
        if i in done[kind]:
            return f"{where}: action {k} runs {kind}{i} a second time; each micro-batch's forward and backward run " \
                   "once per stage"
        if kind == "B" and i not in done["F"]:
            return f"{where}: action {k} is B{i} before F{i}; a backward needs the activations its forward saved"
        done[kind].add(i)
    missing = [f"{kind}{i}" for kind in "FB" for i in range(m_count) if i not in done[kind]]
    if missing:
        return f"{where}: {', '.join(missing)} never run{'s' if len(missing) == 1 else ''}; every micro-batch " \
               "needs its forward and its backward on every stage"
    return None


def _order(schedules: list[list[tuple[str, int]]], m_count: int) -> str | None:
    """A problem when two neighbouring stages run the forwards (or the backwards) in different orders."""
    for kind, what, plural in (("F", "activations", "forwards"), ("B", "gradients", "backwards")):
        orders = [[i for k, i in actions if k == kind] for actions in schedules]
        for s in range(1, len(orders)):
            if orders[s] != orders[s - 1]:
                a, b = (s - 1, s) if kind == "F" else (s, s - 1)
                return (f"M = {m_count}, P = {len(schedules)}: stage {s - 1} runs the {plural} "
                        f"in the order {' '.join(kind + str(i) for i in orders[s - 1])}, stage {s} in the order "
                        f"{' '.join(kind + str(i) for i in orders[s])}: stage {b} receives the {what} of stage {a} in "
                        "the order they were sent, so it would take one micro-batch's for another's; every stage "
                        "must run the forwards in one same order, and the backwards in one same order")
    return None


def _need(kind: str, s: int, i: int, stages: int) -> tuple[str, int, int] | None:
    """What action (kind, stage, micro-batch) must have finished before stage s can run (kind, i)."""
    if kind == "F":
        return ("F", s - 1, i) if s > 0 else None
    return ("B", s + 1, i) if s < stages - 1 else None


def _simulate(schedules: list[list[tuple[str, int]]], forward: float, backward: float) -> tuple[float, list[str]]:
    """(when the last stage finishes, []) with each action starting once its stage is free and what it receives
    has been sent; or (inf, the stuck stages in words) when the stages wait for each other forever."""
    stages = len(schedules)
    done: dict[tuple[str, int, int], float] = {}
    clock, pos = [0.0] * stages, [0] * stages
    moved = True
    while moved:
        moved = False
        for s in range(stages):
            while pos[s] < len(schedules[s]):
                kind, i = schedules[s][pos[s]]
                need = _need(kind, s, i, stages)
                if need is not None and need not in done:
                    break
                cost = forward if kind == "F" else backward
                clock[s] = done[kind, s, i] = max(clock[s], done.get(need, 0.0)) + cost
                pos[s], moved = pos[s] + 1, True
    stuck = []
    for s in range(stages):
        if pos[s] < len(schedules[s]):
            kind, i = schedules[s][pos[s]]
            _, peer, _ = _need(kind, s, i, stages)
            stuck.append(f"stage {s}, action {pos[s]} ({kind}{i}) waits for the "
                         f"{'activation' if kind == 'F' else 'gradient'} of micro-batch {i} from stage {peer}")
    return (max(clock) if not stuck else float("inf")), stuck


def _peaks(schedules: list[list[tuple[str, int]]]) -> list[int]:
    """Each stage's most micro-batches held at once (forwards done whose backward has not run)."""
    peaks = []
    for actions in schedules:
        held = peak = 0
        for kind, _ in actions:
            held += 1 if kind == "F" else -1
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def _warm_up(actions: list[tuple[str, int]]) -> int:
    return next((k for k, (kind, _) in enumerate(actions) if kind == "B"), len(actions))


def _gpipe(m_count: int) -> list[tuple[str, int]]:
    return [("F", i) for i in range(m_count)] + [("B", i) for i in range(m_count)]


def _memory(m: int, p: int, mine: list, best: list, gpipe: bool) -> tuple[str, str] | None:
    """A problem (and its cause) when a stage holds more micro-batches than 1F1B does there (``gpipe``: every
    stage's list is GPipe's at every size)."""
    for s, peak in enumerate(_peaks(mine)):
        bound = min(m, p - s)
        if peak > bound:
            return (f"M = {m}, P = {p}, stage {s} held {peak} micro-batches' activations at once; 1F1B holds at most "
                    f"{bound} there (min(M, P - s))",
                    "every forward before any backward is GPipe: the same gradients, but all M micro-batches' "
                    "activations held at once; start backward as soon as the warm-up forwards are done" if gpipe else
                    "too many warm-up forwards: each one left before the first backward is one more micro-batch's "
                    "activations held" if _warm_up(mine[s]) > _warm_up(best[s]) else
                    "a stage runs a forward where 1F1B runs a backward: a backward frees what its forward saved, so "
                    "run each backward as soon as its gradient can have arrived")
    return None


def _timing(m: int, p: int, mine: list, best: list) -> tuple[str, str] | None:
    """A problem (and its cause) when the stages finish later than 1F1B's under one of ``COSTS``."""
    for forward, backward in COSTS:
        yours, _ = _simulate(mine, forward, backward)
        theirs, _ = _simulate(best, forward, backward)
        if yours > theirs:
            short = [s for s in range(p) if _warm_up(mine[s]) < _warm_up(best[s])]
            return (f"M = {m}, P = {p}: with a forward costing {forward:g} time unit and a backward {backward:g}, your "
                    f"stages finish at time {yours:g}, 1F1B's at {theirs:g}: stages sit idle waiting for each other",
                    f"too few warm-up forwards (stage {short[0]} starts its backwards early): a stage that asks for a "
                    "gradient before it can have come back waits idle, and the stages before it wait for it" if short
                    else "a stage waits for a gradient while it could run a forward: place each action as early as "
                    "what it receives allows")
    return None


def _deadlock(m: int, p: int, mine: list) -> tuple[str, str] | None:
    _, stuck = _simulate(mine, *COSTS[0])
    if not stuck:
        return None
    return (f"M = {m}, P = {p}: the stages wait for each other forever (a receive blocks until the neighbour has "
            "sent): " + "; ".join(stuck),
            "a stage waits in a backward for a gradient while a stage after it waits for a forward that comes later "
            "in its neighbour's list; compare each stage's warm-up forwards with those of the stages after it")


def _check_lists(report: Report, got: dict[tuple[int, int, int], Any]) -> bool:
    """The checks on the lists themselves, at every size of ``SIZES``: True when all hold (else report filled:
    for each kind of problem, the first size (M, P) it shows at, and how many more)."""
    structure = {}
    for m, p in SIZES:
        problems = [q for s in range(p) if (q := _structure(got[m, p, s], m, p, s))]
        if problems:
            structure[m, p] = problems
    if structure:
        (m, p), problems = next(iter(structure.items()))
        for q in problems:
            report.fail(q)
        return _failed(report, list(structure))
    schedules = {(m, p): [got[m, p, s]["actions"] for s in range(p)] for m, p in SIZES}
    best = {(m, p): [reference()(m, p, s) for s in range(p)] for m, p in SIZES}
    gpipe = all(actions == _gpipe(m) for (m, p), stages in schedules.items() for actions in stages)
    checks = [[lambda m, p: (q, None) if (q := _order(schedules[m, p], m)) else None],
              [lambda m, p: _deadlock(m, p, schedules[m, p])],
              [lambda m, p: _memory(m, p, schedules[m, p], best[m, p], gpipe),
               lambda m, p: _timing(m, p, schedules[m, p], best[m, p])]]
    for group in checks:                   # order, then deadlock, then memory and time (both shown)
        failed: list[tuple[int, int]] = []
        for check in group:
            found = [(size, problem) for size in SIZES if (problem := check(*size))]
            if found:
                (m, p), (problem, cause) = found[0]
                report.fail(problem, cause)
                failed += [size for size, _ in found if size not in failed]
        if failed:
            return _failed(report, failed)
    report.ok(f"for P = 1..4 and M = 1..8 ({len(SIZES)} sizes, fewer micro-batches than stages too): every stage "
              "runs each micro-batch's F and B once, B after F, the forwards and the backwards in the same order on "
              "every stage")
    report.ok("at each of these sizes, with blocking receives: no deadlock; stage s holds at most min(M, P - s) "
              "micro-batches' activations; the stages finish no later than 1F1B's with a forward costing 1 and a "
              "backward 2, and with both costing 1")
    return True


def _failed(report: Report, failed: list[tuple[int, int]]) -> bool:
    """Name the first failing size as the report's case, and count the others."""
    m, p = failed[0]
    report.case = f"M = {m}, P = {p}, checked before anything runs"
    others = failed[1:]
    if others:
        report.fail(f"... and at {len(others)} more of the {len(SIZES)} sizes checked, e.g. (M, P) = "
                    + ", ".join(f"({a}, {b})" for a, b in others[:3]))
    return False


# ---------------------------------------------------------------------------------------------- grading

def grade(impl: Any, report: Report, nprocs: int | None = None, limit_s: float = LIMIT_S) -> Report:
    """Grade ``impl`` (your ``one_f_one_b``): its lists for every (M, P) of ``SIZES``, then each case of ``CASES``
    (those on ``nprocs`` processes, if given) run for real."""
    chosen = [c for c in CASES if nprocs is None or c.nprocs == nprocs]
    if not chosen:
        return grade_cases(report, CASES, lambda case, rep: None, nprocs)
    report.worlds.extend(c.nprocs for c in chosen)
    sizes = SIZES + [(c.params["micro_batches"], c.nprocs) for c in CASES if
                     (c.params["micro_batches"], c.nprocs) not in SIZES]
    fd, progress = tempfile.mkstemp(prefix="dtlab-1f1b-")
    os.close(fd)
    what = "your one_f_one_b"
    try:
        ok, got = run_limited(report, _schedules_of, impl, sizes, progress, limit_s=min(limit_s, SCHEDULE_LIMIT_S),
                              what=what)
        if not ok and report.attempted and report.problems and "did not return" in report.problems[-1]:
            with open(progress) as f:
                call = f.read().strip()
            if call:
                report.problems[-1] = report.problems[-1].replace(what, f"your one_f_one_b({call})")
    finally:
        os.unlink(progress)
    if not ok:
        return report
    for name in got["seen"]:
        module, _, function = name.rpartition(".")
        report.fail(f"your function runs the course's own {function} ({module}): the exercise is to write it")
    if got["seen"]:
        return report
    if "error" in got:
        report.fail(got["error"])
        report.case = f"M = {got['size'][0]}, P = {got['size'][1]}, checked before anything runs"
        return report
    if not _check_lists(report, got["schedules"]):
        return report
    return grade_cases(report, CASES, lambda case, rep: _grade_case(case, rep, got["schedules"], limit_s), nprocs)


def _grade_case(case: Case, report: Report, got: dict[tuple[int, int, int], Any], limit_s: float) -> None:
    stages, m_count = case.nprocs, case.params["micro_batches"]
    schedules = [got[m_count, stages, s]["actions"] for s in range(stages)]
    out = run_ranks(report, _body, None, schedules, m_count, nprocs=stages, limit_s=limit_s)
    if out is None:
        if any(p.startswith("deadlock") for p in report.problems):
            report.causes.append("in a pipeline: a stage waits in a backward for a gradient while a stage after it "
                                 "waits for a forward that comes later in its neighbour's list; compare each stage's "
                                 "warm-up forwards with those of the stages after it")
        return
    model = _model(max(stages, 2))
    x, y = _data(m_count)
    F.mse_loss(model(x), y).backward()         # one process, the whole batch
    pieces = split_model(model, stages)
    worst = bound = 0.0
    before = len(report.problems)
    for s, r in enumerate(out):
        expected = {n: p.grad for n, p in pieces[s].named_parameters()}
        scale = max(g.abs().max().item() for g in expected.values())
        b = reduction_tolerance(len(x) + WIDTH, 1, scale)      # float32 sums in another order
        worst, bound = max(worst, compare(report, f"stage {s}", r["grads"], expected, b, "gradient")), max(bound, b)
    for s, r in enumerate(out):
        if r["peak"] > min(m_count, stages - s):
            report.fail(f"stage {s} held {r['peak']} micro-batches' activations at once; 1F1B holds at most "
                        f"{min(m_count, stages - s)} there (min(M, P - s))")
    if len(report.problems) == before:
        report.ok(f"P = {stages}, M = {m_count}, on {stages} processes: no deadlock; every stage's gradients equal one "
                  f"process's on the whole batch (largest difference {worst:.1e}, bound {bound:.1e}); activations "
                  f"held at most {[r['peak'] for r in out]} by stage")


def reference() -> Any:
    """A correct implementation (the grader's own test uses it; try yours first)."""
    def one_f_one_b(micro_batches: int, stages: int, stage: int) -> list[tuple[str, int]]:
        # stage s can run P - s - 1 forwards before the gradient of micro-batch 0 can be back (F0 has P - s - 1
        # stages still to cross, and B0 as many to come back); never more than there are micro-batches
        warm_up = min(stages - stage - 1, micro_batches)
        actions = [("F", i) for i in range(warm_up)]
        for i in range(micro_batches - warm_up):
            actions += [("F", warm_up + i), ("B", i)]
        actions += [("B", i) for i in range(micro_batches - warm_up, micro_batches)]
        return actions
    return one_f_one_b
