"""The bundle's serverless job, its task run here as serverless compute would run it.

``dtlab_serverless`` has one Python task, ``clusters/serverless_lessons.py``, in the job's environment ``dtlab``:
serverless environment 5 (18 LTS ML's ipykernel, matplotlib, scikit-learn, numpy) plus 18 LTS ML's torch and
papermill and the bundle's wheel. ``make test-runtime RUNTIME=18`` has that stack, so this file runs the task
with its parameters from databricks.yml (the deployed notebooks folder replaced by this checkout's), the
runtime's Python and ``DATABRICKS_RUNTIME_VERSION`` as serverless compute sets it (``client.<environment
version>.<release>``, e.g. ``client.4.9``: Nike-Inc/spark-expectations#286). One lesson, not fourteen: the others'
code runs on this stack in the course job's tasks (Part 2) and on 15.4's (00-03, 07, 08); what this checks is the
task's own path: its file, its parameters, the runner's kernel in that environment, and its exit status.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from variants import test_runtime  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.runtime,
              pytest.mark.skipif(test_runtime() not in ("18", "17.3"),
                                 reason="serverless environment 5 has 18 LTS ML's libraries; this stack is "
                                        f"{test_runtime()}'s")]


def _task() -> dict:
    job = yaml.safe_load((ROOT / "databricks.yml").read_text())["resources"]["jobs"]["dtlab_serverless"]
    (task,) = job["tasks"]
    return task["spark_python_task"]


@pytest.mark.timeout(600)
def test_the_serverless_task_runs_a_lesson_as_serverless_compute_would(tmp_path):
    task = _task()
    params = [p.replace("${workspace.file_path}", str(ROOT)) for p in task["parameters"]]
    first = params.index("00_environment")
    params = [*params[:first], "00_environment"]             # the options, then one lesson
    params[params.index("--runs") + 1] = str(tmp_path / "runs")
    env = {**os.environ, "DATABRICKS_RUNTIME_VERSION": "client.5.0", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(ROOT / task["python_file"]), *params], capture_output=True,
                         text=True, timeout=540, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "| 00_environment | ok |" in out.stdout and "1/1 notebooks ok" in out.stdout, out.stdout[-3000:]
    (copy,) = (tmp_path / "runs").glob("*/00_environment.ipynb")
    assert copy.stat().st_size > 0
