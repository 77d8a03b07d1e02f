"""Every course notebook, executed headless with its CI parameters on the course's own stack.

Each notebook ends with a cell of claims on values it computed, so a pass here means the lesson's
claims held on this machine, not just that the code ran. Nothing a notebook starts may outlive it.
New notebooks are picked up automatically. Each notebook also runs a second time, with other
parameters (3 processes where it takes ``nprocs``, other batch sizes and epochs; in Part 2 the edge of
their range over them: degrees of 1, 4 processes) and its exercise solutions, on the learner's
runtime stack as a task of the simulated Databricks job (``tests/runtime/test_databricks_job.py``),
except those that run once, with their solutions, here (why, in ``tests/variants.py``).
"""


import pytest
from variants import NOTEBOOKS, RUN_ONCE, RUNTIMES, SECOND_RUN_ON, check_result, check_second_run, run_once, second_runs

from dtlab.tooling import runner as course


def test_the_course_has_notebooks():
    assert [nb.stem[:2] for nb in NOTEBOOKS][:2] == ["00", "01"]


@pytest.mark.notebook
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[nb.stem for nb in NOTEBOOKS])
def test_notebook_runs_and_its_claims_hold(notebook, tmp_path):
    check_result(course.run_one(notebook, tmp_path, ci=True, stream=False, solutions=run_once(notebook)), notebook)


@pytest.mark.notebook
@pytest.mark.parametrize("notebook", second_runs("newest"), ids=[nb.stem for nb in second_runs("newest")])
def test_notebook_holds_with_other_parameters_and_its_solutions_work(notebook, tmp_path):
    check_second_run(notebook, tmp_path)


EDGE = [nb for nb in NOTEBOOKS if course.edge_parameters(nb)]
#: Part 2 notebooks without edge-of-range values, and why.
NO_EDGE_RUN = {"18": "each Ray Train fit costs 15-40 s of fixed start-up on 2 cores; its one run (with solutions) "
                     "already takes 3 minutes of make test",
               "21": "its own runs already span process counts (N, then N + 1 from the same checkpoint, and one "
                     "process); its second run resumes 2 -> 3 on Spark's workers (local_mode=False)"}


def test_every_part_2_notebook_reaches_the_edge_of_its_parameters_in_its_second_run():
    """Degrees of 1, the most processes the notebook allows, another node type: a claim must hold for every value
    the parameters cell accepts. The edge values go over the other ones in the notebook's second run (one run on
    its runtime's stack instead of a third run here: CI's time), which must therefore keep them."""
    part_2 = [nb for nb in NOTEBOOKS if int(nb.stem[:2]) >= 12 and nb.stem[:2] not in NO_EDGE_RUN]
    assert part_2 and all(nb in EDGE for nb in part_2), [nb.stem for nb in part_2 if nb not in EDGE]
    for nb in EDGE:
        second = course.second_parameters(nb)
        assert all(second[k] == v for k, v in course.edge_parameters(nb).items()), nb.stem
        assert set(course.alt_parameters(nb)) <= set(second), nb.stem


def test_every_notebook_has_its_second_run_on_one_stack():
    runs = {stack: second_runs(stack) for stack in ("newest", *RUNTIMES)}
    once = [nb for nb in NOTEBOOKS if run_once(nb)]
    everything = [nb for stack in runs.values() for nb in stack] + once
    assert sorted(everything) == NOTEBOOKS, "a notebook runs its second run twice, or never"
    assert len(once) == len(RUN_ONCE) and not set(once) & {nb for stack in RUNTIMES for nb in runs[stack]}
    assert sum(len(runs[stack]) for stack in RUNTIMES) == len(SECOND_RUN_ON), f"one of {SECOND_RUN_ON} is missing"
    assert [nb.stem for nb in runs["15.4"] if nb.stem.startswith("05")], "Horovod's lesson runs where Horovod is"
