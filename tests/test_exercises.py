"""The build exercises as a whole: each is registered, named in its lesson's introduction, has a stub that the
grader reports as "not attempted yet" and a self-contained solution that the grader passes — run here, from the
notebook's own cells, on whichever stack runs the tests (``cluster``: both runtime stacks too).

Each grader's wrong variants are in ``tests/test_exercise_<module>.py``."""

import contextlib
import io
import json
from pathlib import Path

import pytest

from dtlab import exercises
from dtlab.exercises import EXERCISES, check, exercise

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def notebook_of(name: str) -> Path:
    found = sorted(NOTEBOOKS.glob(f"{name.split('.')[0]}_*.ipynb"))
    assert len(found) == 1, f"{name}: no single notebook numbered {name.split('.')[0]} ({found})"
    return found[0]


def cells_calling(name: str) -> tuple[str, str]:
    """(stub, solution): the sources of the notebook's two cells that call check(name, ...)."""
    nb = json.loads(notebook_of(name).read_text())
    calls = [c for c in nb["cells"] if c["cell_type"] == "code" and f'check("{name}"' in "".join(c["source"])]
    stubs = [c for c in calls if "solution" not in c["metadata"].get("tags", [])]
    solutions = [c for c in calls if "solution" in c["metadata"].get("tags", [])]
    assert len(stubs) == 1 and len(solutions) == 1, f"{name}: expected one stub and one solution cell calling check"
    return "".join(stubs[0]["source"]), "".join(solutions[0]["source"])


def run_cell(source: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(source, "<cell>", "exec"), {"__name__": "__main__"})
    return out.getvalue()


def test_at_least_eight_exercises_each_with_a_grader_and_a_reference():
    assert len(EXERCISES) >= 8
    for name, (module, what) in EXERCISES.items():
        m = exercise(name)
        assert m.__name__ == f"dtlab.exercises.{module}" and what
        assert callable(m.grade) and callable(m.reference) and m.NPROCS >= 2
        assert m.__doc__ and "What must hold" in m.__doc__ and "Hints" in m.__doc__, f"{name}: the statement"
        assert name in exercises.__doc__, f"{name} is listed in help(dtlab.exercises)"


@pytest.mark.parametrize("name", list(EXERCISES))
def test_each_lesson_names_its_build_exercise_and_has_a_stub_and_a_collapsed_solution(name):
    nb = json.loads(notebook_of(name).read_text())
    intro = "".join(nb["cells"][0]["source"])
    assert "**Build it:**" in intro and f"`{name}`" in intro, f"{name}: the introduction names the build exercise"
    stub, solution = cells_calling(name)
    assert "raise NotImplementedError" in stub and "raise_for_failure" not in stub
    assert solution.rstrip().endswith(".raise_for_failure()")
    headings = ["".join(c["source"]).splitlines()[0] for c in nb["cells"] if c["cell_type"] == "markdown"]
    build = next(i for i, h in enumerate(headings) if h.startswith("## Build it"))
    assert headings[build + 1].startswith("## Exercises"), f"{name}: Build it comes just before the exercises"


def test_an_unknown_exercise_names_the_ones_there_are():
    with pytest.raises(ValueError, match="Did you mean '03.bucketed_ddp'"):
        check("03.bucketed", object)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXERCISES))
def test_the_stub_is_reported_as_not_attempted(name):
    printed = run_cell(cells_calling(name)[0])
    assert "not attempted yet" in printed and "NotImplementedError" in printed, printed


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.parametrize("name", list(EXERCISES))
def test_the_notebooks_solution_passes_its_grader(name):
    printed = run_cell(cells_calling(name)[1])                 # raises ExerciseFailed with the report if not
    assert f"PASSED {name}" in printed, printed


def test_a_report_says_what_failed_and_raises_with_it():
    from dtlab.exercises.grading import ExerciseFailed, Report

    report = Report("03.bucketed_ddp", "DDP")
    report.fail("rank 1, parameter w: differs from one process by 2.0e+00 (bound 1.0e-06)", "summed, not averaged")
    assert not report.passed and "likely cause: summed, not averaged" in report.text()
    with pytest.raises(ExerciseFailed, match="rank 1, parameter w"):
        report.raise_for_failure()
    passing = Report("x", "y")
    passing.ok("held")
    assert passing.raise_for_failure() is passing and "PASSED" in passing.text()
