"""dtlab changes made for lessons 09-11: bundle notebooks that cannot be read as files, exact resume on
3 processes, and several crashes of one run.
"""

import pytest
import torch

from dtlab import launch, resumable
from dtlab.tooling import clusters
from dtlab.tooling.clusters import bundle

BUNDLE = """
bundle: {name: unreadable-notebooks}
variables:
  policy_id: {description: the cluster policy, given at deploy}
resources:
  jobs:
    course:
      name: course
      job_clusters:
        - job_cluster_key: gpu
          new_cluster:
            policy_id: ${var.policy_id}
            spark_version: 15.4.x-gpu-ml-scala2.12
            node_type_id: g5.12xlarge
            num_workers: 0
            spark_conf: {spark.databricks.cluster.profile: singleNode, spark.master: "local[*, 4]"}
            custom_tags: {ResourceClass: SingleNode}
      tasks:
        - task_key: lesson
          job_cluster_key: gpu
          notebook_task:
            notebook_path: ./notebooks/lesson.ipynb
            base_parameters: {epochs: "1"}
"""


def _bundle(tmp_path):
    (tmp_path / "notebooks").mkdir()
    path = tmp_path / "databricks.yml"
    path.write_text(BUNDLE)
    return path


def test_a_notebook_that_exists_but_is_not_a_readable_file_is_a_note_not_a_problem(tmp_path):
    path = _bundle(tmp_path)
    # As root, a permission bit does not stop a read: a directory is how a test makes "there, but not a file"
    # (what a deployed notebook is on Databricks Runtime before 16.2).
    (tmp_path / "notebooks" / "lesson.ipynb").mkdir()
    assert clusters.validate(path) == []
    assert bundle.bundle_notes(path) == [bundle.UNREADABLE_NOTEBOOKS]
    assert "16.2" in bundle.UNREADABLE_NOTEBOOKS and "dtlab clusters validate" in bundle.UNREADABLE_NOTEBOOKS


def test_a_missing_notebook_is_still_a_problem(tmp_path):
    path = _bundle(tmp_path)
    problems = clusters.validate(path)
    assert len(problems) == 1 and "tasks[0].notebook_task.notebook_path: ./notebooks/lesson.ipynb does not exist" \
        in problems[0] and "Fix: " in problems[0], problems
    assert bundle.bundle_notes(path) == []


def test_crash_steps_accepts_none_one_step_a_list_and_the_command_lines_text():
    assert resumable.crash_steps({}) == []
    assert resumable.crash_steps({"crash_at_step": 7}) == [7]
    assert resumable.crash_steps({"crash_at_step": [7, 15]}) == [7, 15]
    assert resumable.crash_steps({"crash_at_step": "7,15"}) == [7, 15]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_three_process_run_resumes_bitwise(tmp_path):
    """With 3 ranks DDP's bucket regrouping after a restart changes the order of some sums; the ordered hook
    makes the resume exact anyway (with the default all-reduce the weights end ~1e-8 apart)."""
    cfg = {"steps": 20, "every_steps": 7, "seed": 1}
    reference = launch.run(resumable.train, {**cfg, "ckpt_dir": str(tmp_path / "reference")}, nprocs=3)
    killed = {**cfg, "ckpt_dir": str(tmp_path / "killed")}
    with pytest.raises(launch.WorkerError, match=r"rank 1 failed: process exited with code -9"):
        launch.run(resumable.train, {**killed, "crash_at_step": 12}, nprocs=3)
    resumed = launch.run(resumable.train, {**killed, "attempt": 1}, nprocs=3)
    assert resumed[0]["resumed_from"] == 7
    assert all(torch.equal(resumed[r]["weights"], reference[r]["weights"]) for r in range(3))
