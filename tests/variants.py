"""Which library stack runs each notebook's second run: other parameters plus its exercise solutions.

Every notebook runs with its CI parameters on the newest stack (``make test``). The second run, with
the notebook's ``alt_parameters`` over its CI ones (3 processes where it takes ``nprocs``, other batch
sizes and epochs), its ``edge_parameters`` over those (Part 2: degrees of 1, 4 processes; once a third
run on the newest stack, merged here for CI's time) and its collapsed solution cells, happens once, as a
task of the simulated Databricks job (``tests/runtime/test_databricks_job.py``), on the stack of the
Databricks runtime a learner runs that lesson on:

* **15.4 LTS ML** (torch 2.3, Spark 3.5, MLflow 2.13): Part 1, notebooks 00-09 and 11. Horovod (05) exists
  only there (16.0 ML and later do not preinstall it), and Part 1 is what a learner on an older workspace runs;
  its code paths are the same on 17.3 but for the guarded library calls its tests cover on every stack
  (``cluster`` tests: ``make test-runtime`` runs them on both).
* **18 LTS ML** (the bundle's default): Part 2 and notebook 10, whose torch-gated cells (FSDP2, DTensor's public
  API, pipelining on gloo, context parallelism, torchrun's restarts) skip on torch 2.3 and run there; and the
  capstone (21). ``SKIPPED_ON`` lists what still skips there, each with its reason (tested).

17.3 LTS ML keeps its requirements file, its bundle target and ``make test-runtime RUNTIME=17.3`` (its second runs
are 18's), but CI does not run it (``NOT_IN_CI``: why).

Notebook 18 (Ray) runs once, on the newest stack, with its solutions (``RUN_ONCE``: why). Each lesson thus
runs twice in CI, on two stacks, which keeps the three suites within their time budgets on 2 cores.
"""

import os
from pathlib import Path

from dtlab.tooling import runner as course

NOTEBOOKS = course.find_notebooks(Path(__file__).resolve().parent.parent / "notebooks")
#: The runtime each notebook's second run belongs to (the rest run theirs on the newest stack).
SECOND_RUN_ON = {**{nb: "15.4" for nb in ("00", "01", "02", "03", "04", "05", "06", "07", "08", "09", "11")},
                 **{nb: "18" for nb in ("10", "12", "13", "14", "15", "16", "17", "19", "20", "21")}}
RUNTIMES = ("15.4", "18")
#: Runtimes with a requirements file that CI does not run (why); ``make test-runtime RUNTIME=...`` runs them.
NOT_IN_CI = {"17.3": "18 LTS ML replaced it as the bundle's default; both lack Horovod and run Part 2's torch-gated "
                     "cells, and a third runtime stack does not fit CI's 70 minutes on 2 cores "
                     "(README, 'What CI runs')"}
#: Notebooks that run once, with their solutions, on the newest stack only (the reason).
RUN_ONCE = {"18": "Ray 2.60 would replace the runtime stack's pandas/pyarrow/packaging, and each Ray Train fit "
                  "costs 15-40 s of fixed start-up on 2 cores: a second full run would cost 5-6 minutes of make test"}


def test_runtime() -> str:
    """The runtime ``make test-runtime RUNTIME=...`` is testing (``DTLAB_TEST_RUNTIME``; 18 by default)."""
    return os.environ.get("DTLAB_TEST_RUNTIME", "18")


test_runtime.__test__ = False   # not a test, despite its name


def second_runs(stack: str) -> list[Path]:
    """The notebooks whose second run belongs to ``stack`` ("newest", "15.4", "18"; "17.3": 18's, off CI)."""
    if stack in NOT_IN_CI:
        stack = "18"
    if stack in RUNTIMES:
        return [nb for nb in NOTEBOOKS if SECOND_RUN_ON.get(nb.stem[:2]) == stack]
    if stack != "newest":
        raise ValueError(f"stack={stack!r}: one of 'newest', {', '.join(map(repr, (*RUNTIMES, *NOT_IN_CI)))}")
    return [nb for nb in NOTEBOOKS if nb.stem[:2] not in SECOND_RUN_ON and nb.stem[:2] not in RUN_ONCE]


def run_once(notebook: Path) -> bool:
    """True for a notebook whose only run (CI parameters) also runs its solutions (``RUN_ONCE``)."""
    return notebook.stem[:2] in RUN_ONCE


def check_second_run(notebook: Path, folder: Path) -> None:
    """Run ``notebook`` with its other parameters and its solutions into ``folder``; fail with where."""
    assert course.alt_parameters(notebook), f"{notebook.name} needs alt_parameters in its metadata"
    check_result(course.run_one(notebook, folder, ci=True, alt=True, solutions=True, stream=False), notebook)


def check_result(result: course.Result, notebook: Path) -> None:
    """A notebook run passed: it ran to the end (its claims held) and left no process behind."""
    assert result.status == "ok", (f"{notebook.name} failed at cell {result.failing_cell}: {result.error}\n"
                                   f"executed copy: {result.output}")
    assert not result.leftovers, f"{notebook.name} left processes running: {result.leftovers}"
