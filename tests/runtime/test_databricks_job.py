"""The course's Databricks job, run on the learner's runtime stack in a simulated Databricks context.

``make test-runtime`` runs this file with the Python of ``.venv-dbr15.4`` (Databricks Runtime 15.4
LTS ML's library versions: torch 2.3.1, PySpark 3.5.0, MLflow 2.13.1, numpy 1.23.5, ...). Each task
of ``databricks.yml`` runs its notebook as the job would (see ``databricks_sim``): parameters only
through widgets, a single-node SparkSession made beforehand, no console scripts beside the
interpreter, notebooks unreadable as files, MLflow's workspace store. The widgets carry the task's
``base_parameters`` plus the notebook's small CI parameters (strings, as "Run now with different
parameters" passes them), to keep the run short.

Like the job (``run_if: ALL_DONE``), a failing lesson does not stop the later ones; the last test
writes the job summary every lesson's status goes into.
"""

import json
import subprocess
import sys

import pytest
from databricks_sim import ROOT, Job, Task, load_tasks, single_node_spark_conf

pytestmark = pytest.mark.runtime
TASKS = load_tasks()
RESULTS: dict[str, object] = {}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return Job(tmp_path_factory.mktemp("databricks"))


def _ci_widgets(task: Task) -> dict[str, str]:
    from dtlab import course

    return {k: str(v) for k, v in course.ci_parameters(task.notebook).items()}


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("task", TASKS, ids=[t.key for t in TASKS])
def test_each_lesson_runs_as_a_databricks_job_task(job, task):
    folder = job.workspace / "notebooks"
    before = sorted(p.name for p in folder.iterdir())
    result = job.run(task, _ci_widgets(task))
    RESULTS[task.key] = result
    assert result.status == "ok", f"{task.key} failed at cell {result.failing_cell}: {result.error}\n{result.output}"
    assert not result.leftovers, f"{task.key} left processes running: {result.leftovers}"
    # Break 6: checkpoints and scripts went into the notebook's (workspace) folder; now to local scratch.
    assert sorted(p.name for p in folder.iterdir()) == before, f"{task.key} wrote into the workspace folder"


def test_the_job_summary_lists_every_lesson(job, tmp_path):
    """The job's last task (run_if ALL_DONE) reports each lesson; here from the results above."""
    from dtlab import jobs

    if len(RESULTS) < len(TASKS):
        pytest.skip("runs after the lessons (run the whole file)")
    states = [{"task_key": key, "result_state": "SUCCESS" if r.status == "ok" else "FAILED",
               "error": r.error or ""} for key, r in RESULTS.items()]
    text = jobs.summary(states)
    assert all(t.key in text for t in TASKS)
    assert text.count("SUCCESS") == sum(r.status == "ok" for r in RESULTS.values())


def test_the_job_keeps_running_later_lessons_after_a_failure():
    """ALL_SUCCESS (the default) would skip every later lesson after one failure on a paid cluster."""
    import yaml

    doc = yaml.safe_load((ROOT / "databricks.yml").read_text())
    job = next(iter(doc["resources"]["jobs"].values()))
    after_first = [t for t in job["tasks"] if t.get("depends_on")]
    assert after_first and all(t.get("run_if") == "ALL_DONE" for t in after_first)
    assert job["tasks"][-1].get("spark_python_task") or job["tasks"][-1].get("notebook_task"), "a summary task ends it"


# --- the breaks the review found, reproduced on this stack, each with what the course does now --------

@pytest.mark.timeout(300)
def test_barrier_mode_with_gpus_on_the_single_node_cluster_is_refused_by_pyspark_and_foreseen_by_dtlab():
    """Break 1: TorchDistributor(local_mode=False, use_gpu=True) on the single-node cluster raises (GPU
    scheduling is off). PySpark checks the configuration first, so this reproduces without a GPU."""
    from pyspark.ml.torch.distributor import TorchDistributor
    from pyspark.sql import SparkSession

    from dtlab import spark as dtspark

    builder = SparkSession.builder.appName("break-1")
    for key, value in single_node_spark_conf().items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    try:
        with pytest.raises(RuntimeError, match="spark.task.resource.gpu.amount"):
            TorchDistributor(num_processes=2, local_mode=False, use_gpu=True).run(abs, -1)
        problem = dtspark.gpu_problem(spark, local_mode=False)
        assert problem and "single-node" in problem
    finally:
        dtspark.stop(spark)


def test_the_interpreter_has_no_console_scripts_beside_it_but_python_m_works(job):
    """Break 2: launchers were found with Path(sys.executable).with_name(...)."""
    python = job.python
    assert not (python.parent / "torchrun").exists() and not (python.parent / "deepspeed").exists()
    out = subprocess.run([str(python), "-m", "torch.distributed.run", "--help"], capture_output=True, text=True,
                         timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and "nproc" in out.stdout


def test_no_profiler_beside_the_interpreter_and_dtlab_says_where_it_looked(job):
    """Break 3: notebook 10 ran py-spy from beside sys.executable; nothing installs it on the runtime."""
    code = "from dtlab import environment; print(environment.console_script('py-spy'))"
    env = {k: v for k, v in job.environment(TASKS[0], {}).items() if v}
    out = subprocess.run([str(job.python), "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert not (job.python.parent / "py-spy").exists()
    assert out.stdout.strip() == "None", out.stdout + out.stderr     # the runtime's stack has no py-spy


def test_notebooks_cannot_be_read_as_files_and_the_validator_says_so_instead_of_failing(job):
    """Break 5: notebook 11 validated databricks.yml by reading notebooks/*.ipynb."""
    from dtlab import clusters

    nb = next((job.workspace / "notebooks").iterdir())
    with pytest.raises(OSError):
        nb.read_text()
    assert clusters.validate(job.workspace / "databricks.yml") == []


def test_the_workspace_store_refuses_a_missing_parent_folder(job):
    """Break 4: experiments under /Shared/dtlab/... (a folder a fresh workspace lacks)."""
    code = ("import mlflow, sys; mlflow.set_tracking_uri('databricks')\n"
            "try:\n    mlflow.create_experiment('/Shared/dtlab/x')\nexcept Exception as e:\n    print('refused', e)\n"
            "print('created', mlflow.create_experiment('/Shared/dtlab-x'))\n")
    env = {**job.environment(TASKS[0], {}), "HOME": str(job.folder)}
    env = {k: v for k, v in env.items() if v}
    out = subprocess.run([str(job.python), "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert "refused" in out.stdout and "RESOURCE_DOES_NOT_EXIST" in out.stdout, out.stdout + out.stderr
    assert "created" in out.stdout, out.stderr


@pytest.mark.timeout(600)
def test_the_init_script_installs_dtlab_without_pypi_and_keeps_optional_tools_soft(tmp_path, job):
    """Break 7: the init script needed PyPI at boot (build isolation) and failed the cluster on any error."""
    pip = tmp_path / "pip"                     # the node's pip: the runtime's own (PIP_TARGET keeps it clean)
    pip.write_text(f"#!/bin/sh\nexec {sys.executable} -m pip \"$@\"\n")
    pip.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "DTLAB_PIP": str(pip), "DB_IS_DRIVER": "TRUE",
           "DTLAB_SOURCE": str(job.workspace), "PIP_INDEX_URL": "http://127.0.0.1:9/simple",  # no PyPI
           "PIP_TARGET": str(tmp_path / "installed"), "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_CACHE_DIR": "1"}
    out = subprocess.run(["bash", str(job.workspace / "clusters" / "init" / "install-dtlab.sh")],
                         capture_output=True, text=True, timeout=500, env=env)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert (tmp_path / "installed" / "dtlab" / "__init__.py").is_file(), log
    assert "optional" in log and "not installed" in log, log


def test_dtlab_env_reports_this_stack_against_the_runtime_it_imitates():
    from dtlab import environment

    info = environment.report()
    assert info["torch"].startswith("2.3.1") and info["packages"]["mlflow"] == "2.13.1"
    assert json.dumps(info)
