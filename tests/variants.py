"""Which library stack runs each notebook's second run: other parameters plus its exercise solutions.

Every notebook runs with its CI parameters on the newest stack (``make test``). The second run, with
the notebook's ``alt_parameters`` over its CI ones (3 processes where it takes ``nprocs``, other batch
sizes and epochs) and its collapsed solution cells, happens once, on Databricks Runtime 15.4 LTS ML's
stack, as a task of the simulated Databricks job (``tests/runtime/test_databricks_job.py``): the
lessons a learner runs on that runtime, as the job runs them, with other values than the defaults.
Part 1 runs there in full; in Part 2 the cells that need a newer torch (FSDP2, DTensor's public API,
pipelining) say so and skip on torch 2.3, so for them the second run tests the from-scratch code and
the arithmetic with other parameters, and the newest stack's run tests the library paths (and, at the
edge of their parameters, a third run). Notebook 17 (Ray) runs once, on the newest stack, with its
solutions (``RUN_ONCE``: why). Each lesson thus runs once per stack, which keeps both suites within
their time budgets on 2 cores.
"""

from pathlib import Path

from dtlab.tooling import runner as course

NOTEBOOKS = course.find_notebooks(Path(__file__).resolve().parent.parent / "notebooks")
ON_RUNTIME_STACK = ("00", "01", "02", "03", "04", "05", "06", "07", "08", "09", "10", "11", "12", "13", "14", "15",
                    "16", "18", "19", "20")
#: Notebooks that run once, with their solutions, on the newest stack only (the reason).
RUN_ONCE = {"17": "Ray 2.60 would replace the runtime stack's pandas/pyarrow/packaging, and each Ray Train fit "
                  "costs 15-40 s of fixed start-up on 2 cores: a second full run would cost 5-6 minutes of make test"}


def second_runs(stack: str) -> list[Path]:
    """The notebooks whose second run belongs to ``stack`` ("newest" or "runtime")."""
    on_runtime = [nb for nb in NOTEBOOKS if nb.stem[:2] in ON_RUNTIME_STACK]
    if stack == "runtime":
        return on_runtime
    return [nb for nb in NOTEBOOKS if nb not in on_runtime and nb.stem[:2] not in RUN_ONCE]


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
