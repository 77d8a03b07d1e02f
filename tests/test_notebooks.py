"""Every course notebook, executed headless: once as the course runs it, once with other parameters and
its exercise solutions.

Each notebook ends with a cell of claims on values it computed, so a pass here means the lesson's
claims held on this machine, not just that the code ran. The second run uses the notebook's
``alt_parameters`` (more processes, other batch sizes and epochs) on top of its CI parameters, and
also runs the collapsed solution cells: a lesson must hold for any sensible parameters, and its
solutions must keep working. Nothing a notebook starts may outlive it. New notebooks are picked up
automatically.
"""

from pathlib import Path

import pytest

from dtlab import course

NOTEBOOKS = course.find_notebooks(Path(__file__).resolve().parent.parent / "notebooks")


def test_the_course_has_notebooks():
    assert [nb.stem[:2] for nb in NOTEBOOKS][:2] == ["00", "01"]


def _check(result, notebook):
    assert result.status == "ok", (f"{notebook.name} failed at cell {result.failing_cell}: {result.error}\n"
                                   f"executed copy: {result.output}")
    assert not result.leftovers, f"{notebook.name} left processes running: {result.leftovers}"


@pytest.mark.notebook
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[nb.stem for nb in NOTEBOOKS])
def test_notebook_runs_and_its_claims_hold(notebook, tmp_path):
    _check(course.run_one(notebook, tmp_path, ci=True, stream=False), notebook)


@pytest.mark.notebook
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[nb.stem for nb in NOTEBOOKS])
def test_notebook_holds_with_other_parameters_and_its_solutions_work(notebook, tmp_path):
    assert course.alt_parameters(notebook), f"{notebook.name} needs alt_parameters in its metadata"
    _check(course.run_one(notebook, tmp_path, ci=True, alt=True, solutions=True, stream=False), notebook)
