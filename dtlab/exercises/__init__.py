"""Build it yourself: the course's graded "build" exercises, one per mechanism it implements from scratch.

Each lesson that builds a mechanism ends with a stub for you to fill in — the signature, a docstring saying
what must hold, hints — and a call to the grader:

    from dtlab.exercises import check
    check("03.bucketed_ddp", MyBucketedDDP)

``check`` runs your code on N real processes (gloo on CPUs, nccl on GPUs; in a Jupyter or Databricks
notebook alike), in a few cases chosen so the usual mistakes show (several N, sizes that do not divide by N or
are smaller than N, settings that are not the defaults), compares what it produces with one process doing the
same work, and prints a report: PASSED with what it checked, or NOT YET with the case, which rank, which tensor,
by how much, against which bound, and the likely cause when it recognises one. It watches the process group
itself, so every collective and every send is seen, whatever name it was imported under. A stub that still
raises ``NotImplementedError`` is "not attempted yet"; a deadlock, or learner code that never returns, is stopped
after ``limit_s`` seconds with the stuck ranks and the operation each waits in.

The exercises (``list_exercises()`` prints them; ``help(dtlab.exercises.<module>)`` explains one):

    02.ring_all_reduce        an all-reduce from send and recv, with a ring's traffic       (notebook 02)
    03.bucketed_ddp           DDP with gradient buckets all-reduced during backward         (notebook 03)
    06.sharded_optimizer      ZeRO-1: optimizer state sharded, parameters re-synchronised   (notebook 06)
    12.fsdp_unit              FSDP: gather before use, free after, reduce-scatter grads     (notebook 12)
    14.parallel_linear        column- and row-parallel linear layers                       (notebook 14)
    15.one_f_one_b            the 1F1B pipeline schedule                                    (notebook 15)
    16.online_softmax_merge   ring attention's merge of partial softmax results             (notebook 16)
    19.selective_recompute    recompute a block's attention core in backward                (notebook 19)

Each solution is in the collapsed cell under its stub (``dtlab course run --solutions`` runs them).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from dtlab.exercises.grading import ExerciseFailed, Report

__all__ = ["EXERCISES", "ExerciseFailed", "Report", "check", "exercise", "list_exercises"]

#: name -> (module in dtlab.exercises, what you build). The name starts with the lesson's number.
EXERCISES: dict[str, tuple[str, str]] = {
    "02.ring_all_reduce": ("ring_all_reduce", "an all-reduce from send and recv, with a ring's traffic"),
    "03.bucketed_ddp": ("bucketed_ddp", "DDP with gradient buckets all-reduced during backward"),
    "06.sharded_optimizer": ("sharded_optimizer", "ZeRO-1: optimizer state sharded, parameters re-synchronised"),
    "12.fsdp_unit": ("fsdp_unit", "FSDP: gather before use, free after, reduce-scatter the gradients"),
    "14.parallel_linear": ("parallel_linear", "column- and row-parallel linear layers"),
    "15.one_f_one_b": ("one_f_one_b", "the 1F1B pipeline schedule"),
    "16.online_softmax_merge": ("online_softmax_merge", "ring attention's merge of partial softmax results"),
    "19.selective_recompute": ("selective_recompute", "recompute a block's attention core in backward"),
}


def exercise(name: str) -> ModuleType:
    """The module that grades exercise ``name`` (its docstring is the exercise's full statement)."""
    if name not in EXERCISES:
        close = [n for n in EXERCISES if name.split(".")[-1] in n or n.startswith(name.split(".")[0] + ".")]
        raise ValueError(f"no exercise {name!r}. " + (f"Did you mean {', '.join(map(repr, close))}? " if close else "")
                         + f"The exercises: {', '.join(EXERCISES)}")
    return importlib.import_module(f"dtlab.exercises.{EXERCISES[name][0]}")


def check(name: str, impl: Any, nprocs: int | None = None, limit_s: float | None = None,
          quiet: bool = False) -> Report:
    """Grade your implementation of exercise ``name``; print the report and return it.

    Args:
        name: the exercise, e.g. ``"03.bucketed_ddp"`` (``list_exercises()``).
        impl: your function or class, as the stub's signature says (defined in a notebook cell is fine).
        nprocs: grade only the cases on this many processes (default: every case; each exercise runs on 2, 3 and
            4 processes where its mechanism allows).
        limit_s: seconds before a run that has not finished is stopped and reported as a deadlock.
        quiet: return the report without printing it.

    The report's ``passed`` says whether it holds; ``report.raise_for_failure()`` raises ``ExerciseFailed`` with
    the report as message (what a test or a solution cell calls).
    """
    from dtlab.exercises.grading import DEFAULT_LIMIT_S

    module = exercise(name)
    report = Report(name, EXERCISES[name][1])
    module.grade(impl, report, nprocs=nprocs if nprocs or hasattr(module, "CASES") else module.NPROCS,
                 limit_s=limit_s or getattr(module, "LIMIT_S", DEFAULT_LIMIT_S))
    if not quiet:
        print(report.text())
        report._printed = True            # a notebook cell ending with check(...) does not show it twice
    return report


def list_exercises() -> list[str]:
    """Print and return the exercises' names, each with what you build."""
    for name, (_, what) in EXERCISES.items():
        print(f"{name:26s} {what}")
    return list(EXERCISES)
