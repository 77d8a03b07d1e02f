"""The course's Databricks job, run on the learner's runtime stack in a simulated Databricks context.

``make test-runtime RUNTIME=15.4`` runs this file with the Python of ``.venv-dbr15.4`` (Databricks Runtime 15.4
LTS ML's library versions: torch 2.3.1, PySpark 3.5.0, MLflow 2.13.1, numpy 1.23.5, ...), ``RUNTIME=18``
with ``.venv-dbr18``'s (``RUNTIME=17.3``, not in CI, with 17.3's); each runs the tasks whose lesson's second run
belongs to that runtime (``tests/variants.py``). Each task
of ``databricks.yml`` runs its notebook as the job would (see ``databricks_sim``): parameters only
through widgets, a single-node SparkSession made beforehand (on the job cluster's one driver, which the tasks
share), no console scripts beside the
interpreter, notebooks unreadable as files, dtlab from the bundle's wheel, a job run's context and
MLflow's workspace store behind a token. The widgets carry the task's ``base_parameters`` plus the
notebook's other parameters (its ``alt_parameters`` over its small CI ones: 3 processes where it takes
``nprocs``, other batch sizes and epochs; strings, as "Run now with different parameters" passes them),
and the run includes the exercise solutions: this is each lesson's second run (``tests/variants.py``),
while ``make test`` runs it with its CI parameters on the newest stack.

Like the job (``run_if: ALL_DONE``), a failing lesson does not stop the later ones; the last test
writes the job summary every lesson's status goes into.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from databricks_sim import ROOT, UNITY_CATALOG, Job, Task, load_tasks, single_node_spark_conf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jobs_api import JobsAPI  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from variants import second_runs, test_runtime  # noqa: E402

pytestmark = pytest.mark.runtime
#: In lesson order (notebook 05 is the dtlab_horovod job's, after the course job's tasks in databricks.yml).
TASKS = sorted((t for t in load_tasks() if t.notebook in second_runs(test_runtime())), key=lambda t: t.notebook.name)
RESULTS: dict[str, object] = {}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    job = Job(tmp_path_factory.mktemp("databricks"))
    yield job
    job.close()


def _run_in_the_job(job, tmp_path, *cells: str, widgets: dict[str, str] | None = None) -> dict:
    """Execute ``cells`` as a notebook task of the job (its kernel, context and environment, the job's parameters
    ``widgets``); each cell may put values into ``out``, which is returned."""
    import nbformat

    result_file = tmp_path / "out.json"
    cells = ("import json\nout = {}", *cells, f"json.dump(out, open({str(result_file)!r}, 'w'))")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "databricks", "display_name": "Databricks (simulated)", "language": "python"}
    path = tmp_path / "task.ipynb"
    nbformat.write(nb, path)
    result = job.run(Task("adhoc", path, {}), widgets, timeout=300)
    assert result.status == "ok", f"cell {result.failing_cell}: {result.error}"
    return json.loads(result_file.read_text())


def _workspace_get(job, path: str, token: str | None = None) -> tuple[int, dict]:
    """GET the simulated workspace's REST API, as a client with ``token`` (the job's by default)."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(job.api_url + path, headers={"Authorization": f"Bearer {token or job.token}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def _other_widgets(task: Task) -> dict[str, str]:
    """The notebook's second-run parameters (other values, and the edge of their range) over its CI ones, as
    strings (widgets)."""
    from dtlab.tooling import runner as course

    merged = {**course.ci_parameters(task.notebook), **course.second_parameters(task.notebook)}
    if "catalog" in course.notebook_parameters(task.notebook):   # the capstone: the workspace's Unity Catalog places
        merged.update(UNITY_CATALOG)
    return {k: str(v) for k, v in merged.items()}


def test_the_job_runs_every_lesson_whose_second_run_belongs_to_this_stack():
    assert [t.notebook for t in TASKS] == second_runs(test_runtime())


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("task", TASKS, ids=[t.key for t in TASKS])
def test_each_lesson_runs_as_a_databricks_job_task(job, task):
    folder = job.workspace / "notebooks"
    before = sorted(p.name for p in folder.iterdir())
    result = job.run(task, _other_widgets(task), solutions=True)
    RESULTS[task.key] = result
    assert result.status == "ok", f"{task.key} failed at cell {result.failing_cell}: {result.error}\n{result.output}"
    assert not result.leftovers, f"{task.key} left processes running: {result.leftovers}"
    # Break 6: checkpoints and scripts went into the notebook's (workspace) folder; now to local scratch.
    assert sorted(p.name for p in folder.iterdir()) == before, f"{task.key} wrote into the workspace folder"


def test_the_job_summary_lists_every_lesson(job, tmp_path):
    """The job's last task (run_if ALL_DONE) reports each lesson; here from the results above."""
    from dtlab.tooling import jobs

    if len(RESULTS) < len(TASKS):
        pytest.skip("runs after the lessons (run the whole file)")
    states = [{"task_key": key, "result_state": "SUCCESS" if r.status == "ok" else "FAILED",
               "error": r.error or ""} for key, r in RESULTS.items()]
    text = jobs.summary(states)
    assert all(t.key in text for t in TASKS)
    assert text.count("SUCCESS") == sum(r.status == "ok" for r in RESULTS.values())


#: What still skips on each runtime's stack when its lessons run as job tasks: per notebook, a piece of each line that
#: says "skipped" (it carries the reason). A cell that starts or stops skipping there fails the test below.
SKIPPED_ON = {
    "15.4": {},
    "18": {
        # Horovod is not on 16.0 ML and later: notebook 10's Horovod restart section says so
        "10_checkpoints_and_faults": ["Horovod section skipped: horovod is not installed"],
        # torch 2.9's pipeline schedules abort on gloo (a size mismatch; pipelining.GLOO_FAILS): nccl is not affected
        "15_pipeline_parallelism": ["skipped: on gloo, torch 2.9.0"],
        # torch's context_parallel swaps the fused CUDA attention kernels: a GPU path on every torch
        "16_context_and_expert_parallelism": ["skipped: context_parallel replaces the fused CUDA attention kernels"],
        # FSDP2's HSDP on CPU processes was measured to fail on torch 2.7 and run on 2.13 (fsdp2.hsdp_problem)
        "17_composing_parallelism": ["skipped: HSDP on CPU processes fails in torch 2.9.0"],
        # DeepSpeed 0.18.1's ZeRO-3 on CPU processes reads parameters before their gloo all-gathers end
        # (zero.zero3_cpu_fault): the capstone still launches it, but does not hold its weights to one process's
        "21_from_table_to_registered_model": ["skipped: the comparison with one process: DeepSpeed 0.18.1"],
    },
    "17.3": {
        # Horovod is not on 16.0 ML and later: notebook 10's Horovod restart section says so
        "10_checkpoints_and_faults": ["Horovod section skipped: horovod is not installed"],
        # torch's context_parallel swaps the fused CUDA attention kernels: a GPU path on every torch (the CPU's
        # kernel has no context-parallel rule: tests/test_context_parallel.py); the lesson's own ring runs
        "16_context_and_expert_parallelism": ["skipped: context_parallel replaces the fused CUDA attention kernels"],
        # torch 2.7's FSDP2 cannot run HSDP (a replicated 2-D mesh) on CPU processes: on GPUs it runs
        "17_composing_parallelism": ["skipped: HSDP on CPU processes fails in torch 2.7.0"],
        # DeepSpeed 0.16.5's ZeRO-3 on CPU processes sometimes trains wrong weights (zero.zero3_cpu_fault): the
        # capstone still launches it, but does not hold its weights to one process's there
        "21_from_table_to_registered_model": ["skipped: the comparison with one process: DeepSpeed 0.16.5"],
    },
}
#: Printed lines with "skipped" that are not a skipped cell: the claims' verdict lines (``holds``/``FAILED``: 07 claims
#: that its GradScaler skipped a step), a GradScaler's count of skipped steps (07), DeepSpeed's log of its own
#: (``skipped=0``) and the planner's count of layouts it left out (20).
NOT_A_SKIP = re.compile(r"^(holds|FAILED) |skipped steps|skipped=\d|that cannot run skipped")


def _skip_lines(executed: str) -> list[str]:
    """The printed lines of an executed notebook that say a cell or section was skipped."""
    import nbformat

    lines = []
    for cell in nbformat.read(executed, as_version=4).cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream" and out.get("name") == "stdout":
                lines += [line.strip() for line in out["text"].splitlines()
                          if re.search(r"\bskipped\b", line) and not NOT_A_SKIP.search(line)]
    return lines


def test_the_cells_that_skip_on_this_runtime_are_the_listed_ones_with_their_reasons():
    if len(RESULTS) < len(TASKS):
        pytest.skip("runs after the lessons (run the whole file)")
    expected = SKIPPED_ON[test_runtime()]
    found = {key: _skip_lines(r.output) for key, r in RESULTS.items() if r.status == "ok"}
    for task in TASKS:
        lines, pieces = found.get(task.key, []), expected.get(task.notebook.stem, [])
        unexplained = [line for line in lines if not any(piece in line for piece in pieces)]
        assert not unexplained, f"{task.notebook.stem} skips on {test_runtime()} without a listed reason: {unexplained}"
        gone = [piece for piece in pieces if not any(piece in line for line in lines)]
        assert not gone, f"{task.notebook.stem} no longer skips {gone} on {test_runtime()}: take it off SKIPPED_ON"


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
        dtspark.stop(spark, force=True)                  # this test's own session


def test_the_interpreter_has_no_console_scripts_beside_it_but_python_m_works(job):
    """Break 2: launchers were found with Path(sys.executable).with_name(...)."""
    python = job.python
    assert not (python.parent / "torchrun").exists() and not (python.parent / "deepspeed").exists()
    out = subprocess.run([str(python), "-m", "torch.distributed.run", "--help"], capture_output=True, text=True,
                         timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and "nproc" in out.stdout


def test_no_profiler_beside_the_interpreter_and_dtlab_says_where_it_looked(job):
    """Break 3: notebook 10 ran py-spy from beside sys.executable. 15.4's stack has no py-spy; 17.3's has (its
    package list), and dtlab finds its script beside the runtime's packages, not beside the notebook's python."""
    code = "from dtlab import environment; print(environment.console_script('py-spy'))"
    env = {k: v for k, v in job.environment(TASKS[0], {}).items() if v}
    out = subprocess.run([str(job.python), "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert not (job.python.parent / "py-spy").exists()
    if test_runtime() == "15.4":
        assert out.stdout.strip() == "None", out.stdout + out.stderr
    else:
        found = out.stdout.strip()
        assert found.endswith("/py-spy") and Path(found).parent != job.python.parent, out.stdout + out.stderr


def test_notebooks_cannot_be_read_as_files_before_16_2_and_the_validator_says_so_instead_of_failing(job):
    """Break 5: notebook 11 validated databricks.yml by reading notebooks/*.ipynb (15.4: not files; 17.3: files)."""
    from databricks_sim import NOTEBOOKS_ARE_FILES

    from dtlab.tooling import clusters

    nb = next((job.workspace / "notebooks").iterdir())
    if NOTEBOOKS_ARE_FILES:
        assert json.loads(nb.read_text())["cells"]
    else:
        with pytest.raises(OSError):
            nb.read_text()
    assert clusters.validate(job.workspace / "databricks.yml") == []


def _worker_env(job, **extra) -> dict[str, str]:
    """The environment of a process the notebook starts: the job's, without the notebook's context."""
    env = {**job.environment(TASKS[0], {}), "HOME": str(job.folder), **extra}
    return {k: v for k, v in env.items() if v and not k.startswith("DTLAB_SIM_API")}


def test_the_workspace_store_refuses_a_missing_parent_folder(job):
    """Break 4: experiments under /Shared/dtlab/... (a folder a fresh workspace lacks)."""
    code = ("import mlflow, sys; mlflow.set_tracking_uri('databricks')\n"
            "try:\n    mlflow.create_experiment('/Shared/dtlab/x')\nexcept Exception as e:\n    print('refused', e)\n"
            "print('created', mlflow.create_experiment('/Shared/dtlab-x'))\n")
    env = _worker_env(job, DATABRICKS_HOST=job.api_url, DATABRICKS_TOKEN=job.token)
    out = subprocess.run([str(job.python), "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert "refused" in out.stdout and "RESOURCE_DOES_NOT_EXIST" in out.stdout, out.stdout + out.stderr
    assert "created" in out.stdout, out.stderr


@pytest.mark.timeout(300)
def test_experiments_go_to_the_folder_of_the_user_the_job_runs_as_and_workers_know_it(job, tmp_path):
    """Issue 38: experiments under /Shared could be changed by every workspace user; now /Users/<who runs it>."""
    from databricks_sim import USER

    out = _run_in_the_job(job, tmp_path, """
import mlflow
from dtlab import tracking
out["path"] = tracking.experiment_path("x")
out["worker"] = tracking.worker_env()["DTLAB_DATABRICKS_USER"]
mlflow.set_tracking_uri("databricks")
out["id"] = mlflow.set_experiment(out["path"]).experiment_id
""")
    assert out["path"] == f"/Users/{USER}/dtlab-x" and out["worker"] == USER and out["id"], out


# --- issue 27: the paths a real workspace takes ----------------------------------------------------------

@pytest.mark.timeout(600)
def test_launched_workers_log_to_the_workspace_with_the_job_runs_host_and_token(job, tmp_path):
    """Item 1: worker_env built the host from browserHostName, absent in job runs (https://None), and
    swallowed the error. Now: the context's apiUrl and apiToken; a worker logs a run with them, end to end."""
    out = _run_in_the_job(job, tmp_path, """
import os
from dtlab import launch, tracking

def log_a_run(env):
    os.environ.update(env)
    from dtlab import tracking
    with tracking.start("from-a-worker") as run:
        run.log_metrics({"answer": 42.0})
    return run.run_id

env = tracking.worker_env()
out["env"] = env
out["kernel_env"] = [k for k in ("DATABRICKS_HOST", "DATABRICKS_TOKEN") if k in os.environ]
out["run_id"] = launch.run(log_a_run, env, nprocs=1)[0]
""")
    assert out["kernel_env"] == [], "a job run's environment has no DATABRICKS_HOST/TOKEN: the context must be used"
    from databricks_sim import USER

    assert out["env"] == {"MLFLOW_TRACKING_URI": "databricks", "DATABRICKS_HOST": job.api_url,
                          "DATABRICKS_TOKEN": job.token, "DTLAB_DATABRICKS_USER": USER}
    status, body = _workspace_get(job, f"/api/2.0/mlflow/runs/get?run_id={out['run_id']}")
    assert status == 200 and body["run"]["data"]["metrics"][0]["value"] == 42.0, body


@pytest.mark.timeout(600)
def test_unity_catalog_places_are_checked_and_a_model_registered_there_loads_by_alias_without_dtlab(job, tmp_path):
    """Issue 50: the capstone's Unity Catalog branch. The catalog's places and privileges are checked before any
    write (a missing CREATE MODEL is refused with its GRANT); a model registers in Unity Catalog's registry
    (databricks-uc: its files uploaded through the workspace's presigned URLs) under an alias, and a process
    where `import dtlab` fails loads it by that alias and gives the logged model's answer.

    On the stack that runs the capstone as a job task (18) the capstone's own run does all this but the refusal,
    with its model (`UNITY_CATALOG` widgets, `local_mode=False`): this test runs where it does not (15.4)."""
    if any(t.notebook.stem.startswith("21") for t in TASKS):
        pytest.skip("the capstone's job task on this stack registers in Unity Catalog and serves without dtlab")
    out = _run_in_the_job(job, tmp_path, """
import os, subprocess, sys
import numpy as np, torch
from dtlab import delta, tracking

c, s, v = dbutils.widgets.get("catalog"), dbutils.widgets.get("schema"), dbutils.widgets.get("volume")
delta.check_catalog(spark, c, s, v)                    # they exist and the job's groups may write: no error
out["volume"] = str(delta.volume_path(c, s, v))
rows = spark.table("information_schema.schema_privileges").collect()
columns = spark.table("information_schema.schema_privileges").schema


def grant(kept):
    spark.createDataFrame(kept, columns).write.mode("overwrite").saveAsTable("information_schema.schema_privileges")


grant([r for r in rows if r["privilege_type"] != "CREATE MODEL"])     # the schema's CREATE MODEL taken away
try:
    delta.check_catalog(spark, c, s, v)
except PermissionError as err:
    out["refused"] = str(err)
grant(rows)
registry = tracking.registry_for(c, s)
torch.manual_seed(0)
model = torch.nn.Linear(3, 2)
x = np.ones((1, 3), np.float32)
with tracking.start("uc-round-trip") as run:
    uri = run.log_model(model, input_example=x)
name = tracking.registry_name("tiny", c, s)
out["registry"], out["name"] = registry, name
out["version"] = tracking.register(uri, name, alias="champion", registry_uri=registry)
out["expected"] = model(torch.from_numpy(x)).tolist()
code = ("import sys; sys.modules['dtlab'] = None\\n"
        "import json, mlflow, numpy as np\\n"
        "mlflow.set_registry_uri('databricks-uc')\\n"
        f"model = mlflow.pyfunc.load_model('models:/{name}@champion')\\n"
        "print(json.dumps(np.asarray(model.predict(np.ones((1, 3), np.float32))).tolist()))")
done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                      env={**os.environ, **tracking.worker_env()})
out["served"] = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else done.stderr[-3000:]
""", widgets={k: str(v) for k, v in UNITY_CATALOG.items()})
    c, s, v = UNITY_CATALOG["catalog"], UNITY_CATALOG["schema"], UNITY_CATALOG["volume"]
    assert out["volume"] == str(job.folder / "Volumes" / c / s / v)
    assert "lack schema CREATE MODEL" in out["refused"]
    assert f"GRANT CREATE MODEL ON SCHEMA `{c}`.`{s}`" in out["refused"]
    assert out["registry"] == "databricks-uc" and out["name"] == f"{c}.{s}.tiny" and out["version"] == 1
    registry = json.loads((job.folder / "uc-storage" / "registry.json").read_text())["models"][out["name"]]
    assert registry["aliases"] == {"champion": "1"} and registry["versions"]["1"]["status"] == "READY"
    assert (job.folder / "uc-storage" / "Models" / c / s / "tiny" / "1" / "MLmodel").is_file()
    assert isinstance(out["served"], list), out["served"]
    assert max(abs(a - b) for a, b in zip(out["served"][0], out["expected"][0])) < 1e-6


def test_without_a_context_or_credentials_worker_env_names_the_fix_and_the_workspace_refuses_a_bad_token(job):
    """Item 1: no host or token is one clear error (never https://None); a wrong token is refused by the
    workspace, so the runs the lessons log prove the token reached their workers."""
    code = ("from dtlab import tracking\ntry:\n    print(tracking.worker_env('databricks'))\n"
            "except tracking.TrackingError as e:\n    print('refused:', e)\n")
    out = subprocess.run([str(job.python), "-c", code], capture_output=True, text=True, timeout=120,
                         env=_worker_env(job))
    assert out.stdout.startswith("refused:") and "DATABRICKS_TOKEN" in out.stdout and "secret" in out.stdout, \
        out.stdout + out.stderr
    assert "None" not in out.stdout
    status, body = _workspace_get(job, "/api/2.0/mlflow/experiments/search?max_results=1", token="wrong")
    assert status == 401 and body["error_code"] == "UNAUTHENTICATED"


@pytest.mark.timeout(300)
def test_the_tasks_share_the_job_clusters_driver_and_each_has_a_session_of_its_own(job, tmp_path):
    """As notebooks attached to one cluster: every task's session runs on the same driver (one Spark application),
    and what one task sets in its session (a SQL setting, a temporary view) is not the next task's."""
    cell = """
out["app"] = spark.sparkContext.applicationId
out["partitions"] = spark.conf.get("spark.sql.shuffle.partitions")
out["views"] = [t.name for t in spark.catalog.listTables() if t.isTemporary]
spark.conf.set("spark.sql.shuffle.partitions", "7")
spark.range(3).createOrReplaceTempView("left_by_a_task")
out["count"] = spark.range(3).groupBy().count().collect()[0][0]
"""
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    first = _run_in_the_job(job, tmp_path / "first", cell)
    second = _run_in_the_job(job, tmp_path / "second", cell)
    assert first["app"] == second["app"]
    assert second["partitions"] == first["partitions"] != "7" and "left_by_a_task" not in second["views"]
    assert first["count"] == second["count"] == 3


@pytest.mark.timeout(300)
def test_dtlab_spark_stop_leaves_the_clusters_own_session_running(job, tmp_path):
    """Item 3: notebook 18 ended with dtspark.stop(spark), which stopped the cluster's session (and, on
    Databricks, the notebook's Py4J gateway). Now stop() stops only sessions dtlab.spark.session started."""
    out = _run_in_the_job(job, tmp_path, """
from dtlab import spark as dtspark
s = dtspark.session()
out["same"] = s.sparkContext is spark.sparkContext
out["stopped"] = dtspark.stop(s)
out["count"] = spark.range(5).count()
""")
    assert out == {"same": True, "stopped": False, "count": 5}


def test_the_summary_task_reads_the_run_with_the_job_clusters_credentials_or_names_the_fix(job):
    """Item 2: the summary task called WorkspaceClient() (default auth, which fails on some job clusters) and
    was tested only for its table. Here clusters/job_summary.py runs as the job's Python task does, against
    the Jobs API of a run with one failed lesson, through the runtime's databricks-sdk."""
    run = {"run_id": 2002, "tasks": [
        {"task_key": "nb00_environment", "start_time": 1000, "end_time": 61000,
         "state": {"life_cycle_state": "TERMINATED", "result_state": "SUCCESS"}},
        {"task_key": "nb01_single_device_baseline", "start_time": 62000, "end_time": 92000,
         "state": {"life_cycle_state": "TERMINATED", "result_state": "FAILED", "state_message": "cell 7: boom"}},
        {"task_key": "job_summary", "start_time": 93000,
         "state": {"life_cycle_state": "RUNNING"}}]}
    api = JobsAPI("jobs-token", run)
    script = str(job.workspace / "clusters" / "job_summary.py")
    try:
        with_secret = subprocess.run([str(job.python), script, "2002"], capture_output=True, text=True, timeout=120,
                                     env=_worker_env(job, DATABRICKS_HOST=api.url, DATABRICKS_TOKEN="jobs-token"))
        without = subprocess.run([str(job.python), script, "2002"], capture_output=True, text=True, timeout=120,
                                 env=_worker_env(job))
    finally:
        api.close()
    assert with_secret.returncode == 1, with_secret.stdout + with_secret.stderr    # a lesson failed: the run fails
    assert api.calls == 1
    lines = with_secret.stdout.splitlines()
    assert any("nb00_environment" in line and "SUCCESS" in line for line in lines), with_secret.stdout
    assert any("nb01_single_device_baseline" in line and "FAILED" in line and "boom" in line for line in lines)
    assert "job_summary" not in with_secret.stdout.replace("job_summary:", "")
    assert without.returncode == 2 and "DATABRICKS_HOST" in without.stderr and "secrets/" in without.stderr, \
        without.stdout + without.stderr


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


def test_the_tasks_import_dtlab_from_the_bundles_wheel_and_the_init_script_leaves_it_to_them(job, tmp_path):
    """Item 7: the job's init script built dtlab from workspace files at cluster start; now the bundle builds a
    wheel that the tasks install, and the init script (DTLAB_SOURCE unset) installs only the optional tools."""
    out = _run_in_the_job(job, tmp_path, """
import dtlab
from dtlab.planner import published
out["file"] = dtlab.__file__
out["runs"] = len(published.runs())
""")
    assert out["file"].startswith(str(job.libraries)), out["file"]
    assert out["runs"] > 20                     # the planner's data file travels in the wheel
    pip = tmp_path / "pip"
    pip.write_text("#!/bin/sh\necho \"pip $*\" >> \"$(dirname \"$0\")/calls\"; exit 1\n")   # PyPI unreachable
    pip.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "DTLAB_PIP": str(pip), "DB_IS_DRIVER": "TRUE"}
    run = subprocess.run(["bash", str(job.workspace / "clusters" / "init" / "install-dtlab.sh")],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0 and "the tasks' library" in run.stdout and "optional tools not installed" in run.stdout
    assert "dtlab" not in (tmp_path / "calls").read_text().replace("databricks-bundles", "")


def test_dtlab_env_reports_this_stack_against_the_runtime_it_imitates():
    from dtlab import environment

    info = environment.report()
    shipped = environment.DATABRICKS_RUNTIME_STACKS[test_runtime()]
    assert info["torch"].startswith(shipped["torch"]) and info["packages"]["mlflow"] == shipped["mlflow"]
    assert json.dumps(info)
