"""Which library stack runs each notebook's second run: other parameters plus its exercise solutions.

Every notebook runs with its CI parameters on both stacks (``make test`` on the newest libraries,
``make test-runtime`` in the simulated Databricks job). The second run, with the notebook's
``alt_parameters`` (3 processes where it takes ``nprocs``, other batch sizes and epochs) and its
collapsed solution cells, happens once: on Databricks Runtime 15.4 LTS ML's stack for Part 1
but 00 (a check of the machine itself): the lessons a learner runs on that runtime,
built on the libraries that differ most between the stacks (Spark's TorchDistributor, Horovod,
DeepSpeed, MLflow, the fault tools, the cluster lesson) and the PyTorch-only lessons 01-03, 07 and 08,
which that runtime's torch 2.3 runs in full. On the newest stack for Part 2 (12-17): FSDP2, DTensor,
pipelining and Ray need newer libraries than the runtime has, so a second run there would skip
what it should test. Split this way both suites stay within their time budgets.
"""

from pathlib import Path

from dtlab import course

NOTEBOOKS = course.find_notebooks(Path(__file__).resolve().parent.parent / "notebooks")
ON_RUNTIME_STACK = ("01", "02", "03", "04", "05", "06", "07", "08", "09", "10", "11")


def second_runs(stack: str) -> list[Path]:
    """The notebooks whose second run belongs to ``stack`` ("newest" or "runtime")."""
    on_runtime = [nb for nb in NOTEBOOKS if nb.stem[:2] in ON_RUNTIME_STACK]
    return on_runtime if stack == "runtime" else [nb for nb in NOTEBOOKS if nb not in on_runtime]


def check_second_run(notebook: Path, folder: Path) -> None:
    """Run ``notebook`` with its other parameters and its solutions into ``folder``; fail with where."""
    assert course.alt_parameters(notebook), f"{notebook.name} needs alt_parameters in its metadata"
    check_result(course.run_one(notebook, folder, ci=True, alt=True, solutions=True, stream=False), notebook)


def check_result(result: course.Result, notebook: Path) -> None:
    """A notebook run passed: it ran to the end (its claims held) and left no process behind."""
    assert result.status == "ok", (f"{notebook.name} failed at cell {result.failing_cell}: {result.error}\n"
                                   f"executed copy: {result.output}")
    assert not result.leftovers, f"{notebook.name} left processes running: {result.leftovers}"
