"""The second run of the lessons on Spark, Horovod, DeepSpeed, MLflow and faults, on the learner's stack.

``make test-runtime`` runs this file with the Python of ``.venv-dbr15.4`` (Databricks Runtime 15.4
LTS ML's library versions): each notebook of ``variants.ON_RUNTIME_STACK`` with its other parameters
and its exercise solutions, as a learner changing the parameters and trying the exercises on that
runtime would. The other notebooks' second runs are in ``tests/test_notebooks.py``; why the split,
in ``tests/variants.py``.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from variants import check_second_run, second_runs  # noqa: E402

NOTEBOOKS = second_runs("runtime")


@pytest.mark.notebook
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[nb.stem for nb in NOTEBOOKS])
def test_notebook_holds_with_other_parameters_and_its_solutions_work(notebook, tmp_path):
    check_second_run(notebook, tmp_path)
