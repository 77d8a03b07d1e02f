"""Every course notebook, executed headless with its small CI parameters.

Each notebook ends with a cell of assertions on values it computed, so a pass here means the
lesson's claims held on this machine, not just that the code ran. New notebooks are picked up
automatically.
"""

from pathlib import Path

import pytest

from dtlab import course

NOTEBOOKS = course.find_notebooks(Path(__file__).resolve().parent.parent / "notebooks")


def test_the_course_has_notebooks():
    assert [nb.stem[:2] for nb in NOTEBOOKS][:2] == ["00", "01"]


@pytest.mark.notebook
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[nb.stem for nb in NOTEBOOKS])
def test_notebook_runs_and_its_claims_hold(notebook, tmp_path):
    result = course.run_one(notebook, tmp_path, ci=True, stream=False)
    assert result.status == "ok", (f"{notebook.name} failed at cell {result.failing_cell}: {result.error}\n"
                                   f"executed copy: {result.output}")
