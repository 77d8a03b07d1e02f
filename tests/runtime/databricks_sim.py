"""A Databricks job, simulated on this machine from the project's own files.

What the course meets on a Databricks Runtime 15.4 LTS ML single-node job cluster, and how each is
reproduced here (the runtime's Python stack itself is the venv ``make test-runtime`` builds):

* **job parameters arrive as widgets**: a ``dbutils`` object whose ``widgets.get`` returns each task's
  ``base_parameters`` from ``databricks.yml`` — strings, as a job passes them;
* **the runtime is announced** by ``DATABRICKS_RUNTIME_VERSION`` and the cluster's Spark tag
  ``spark.databricks.clusterUsageTags.sparkVersion``;
* **a SparkSession exists before the notebook starts**, made with the ``spark_conf`` of
  ``clusters/g5-12xlarge-single-node.yml`` (single-node profile, ``local[*, 4]``: no GPU scheduling);
* **the notebook's interpreter lives in a folder without the runtime's console scripts**
  (``torchrun``, ``deepspeed``, ``horovodrun``, ``py-spy`` are not beside ``sys.executable`` nor on
  ``PATH``), as a notebook-scoped Python environment on Databricks;
* **the working directory is the notebook's folder in the deployed bundle**, where the notebooks
  themselves cannot be read as files (Databricks Runtime < 16.2), and what it writes lands in the
  "workspace";
* **MLflow's tracking URI is ``databricks``** and its store, like the workspace, refuses an experiment
  whose parent folder does not exist (``RESOURCE_DOES_NOT_EXIST``) or whose name is not a path.

``Job`` builds all of it in a folder; ``Job.run(task)`` executes one task's notebook there with
papermill, passing no parameters but the widgets.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
RUNTIME_VERSION = "15.4"
SPARK_VERSION_TAG = "15.4.x-gpu-ml-scala2.12"
#: Workspace folders a fresh workspace has (the parents MLflow accepts).
EXISTING_FOLDERS = ("/", "/Shared", "/Users", "/Repos", "/Workspace", "/Workspace/Shared", "/Workspace/Users")

_STARTUP = '''
# Run by the simulated Databricks kernel before the notebook: what a Databricks notebook finds defined.
import json as _json
import os as _os

class _Widgets:
    """dbutils.widgets: a job's base_parameters override the defaults a notebook declares."""

    def __init__(self, values):
        self._values, self._defaults = dict(values), {}

    def text(self, name, default_value, label=None):
        self._defaults[name] = default_value

    def get(self, name):
        if name in self._values:
            return self._values[name]
        if name in self._defaults:
            return self._defaults[name]
        raise ValueError(f"InputWidgetNotDefined: No input widget named {name} is defined")


class _NoContext:
    """What MLflow asks dbutils for (the notebook's context): there is none in this simulation."""

    def __getattr__(self, name):
        raise RuntimeError(f"dbutils.entry_point...{name}: no Databricks notebook context in the simulation")


class _EntryPoint:
    def getDbutils(self):
        return self

    def notebook(self):
        return _NoContext()


class _DBUtils:
    def __init__(self, values):
        self.widgets = _Widgets(values)
        self.entry_point = _EntryPoint()   # MLflow 2.13 reads the notebook context through it


dbutils = _DBUtils(_json.loads(_os.environ.get("DTLAB_SIM_WIDGETS", "{}")))

from pyspark.sql import SparkSession as _SparkSession

_builder = _SparkSession.builder.appName("databricks-simulated")
for _key, _value in _json.loads(_os.environ["DTLAB_SIM_SPARK_CONF"]).items():
    _builder = _builder.config(_key, _value)
spark = _builder.getOrCreate()
spark.sparkContext.setLogLevel("ERROR")
'''

_STORE = '''
"""MLflow's 'databricks' tracking store, simulated: a SQLite store that refuses what the workspace refuses."""
import os
import posixpath

from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, RESOURCE_DOES_NOT_EXIST
from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

FOLDERS = set(os.environ.get("DTLAB_SIM_FOLDERS", "/").split(":"))


class WorkspaceStore(SqlAlchemyStore):
    def create_experiment(self, name, artifact_location=None, tags=None):
        if not name.startswith("/"):
            raise MlflowException(f"Experiment name must be an absolute path in the workspace, got {name!r}",
                                  error_code=INVALID_PARAMETER_VALUE)
        parent = posixpath.dirname(name.rstrip("/")) or "/"
        if parent not in FOLDERS:
            raise MlflowException(f"RESOURCE_DOES_NOT_EXIST: Parent directory {parent} does not exist.",
                                  error_code=RESOURCE_DOES_NOT_EXIST)
        return super().create_experiment(name, artifact_location, tags)


def build(store_uri=None, artifact_uri=None):
    return WorkspaceStore(os.environ["DTLAB_SIM_MLFLOW_DB"], os.environ["DTLAB_SIM_ARTIFACTS"])
'''


@dataclass
class Task:
    """One task of the job: its key, notebook and the widget values it receives."""

    key: str
    notebook: Path
    widgets: dict[str, str]


def load_tasks(bundle: Path = ROOT / "databricks.yml") -> list[Task]:
    """The notebook tasks of the bundle's course job, in order, with their ``base_parameters``."""
    doc = yaml.safe_load(bundle.read_text())
    job = next(iter(doc["resources"]["jobs"].values()))
    tasks = []
    for task in job["tasks"]:
        nb = task.get("notebook_task")
        if not nb:
            continue
        tasks.append(Task(task["task_key"], (bundle.parent / nb["notebook_path"]).resolve(),
                          {k: str(v) for k, v in (nb.get("base_parameters") or {}).items()}))
    return tasks


def single_node_spark_conf() -> dict[str, str]:
    """The Spark configuration of the single-node cluster file, as the cluster would have it."""
    spec = yaml.safe_load((ROOT / "clusters" / "g5-12xlarge-single-node.yml").read_text())
    conf = {k: str(v) for k, v in spec["spark_conf"].items()}
    conf.update({"spark.databricks.clusterUsageTags.sparkVersion": SPARK_VERSION_TAG,
                 "spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false"})
    return conf


class Job:
    """The simulated cluster and workspace of one job run, in ``folder``."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.workspace = self.folder / "Workspace" / "bundle" / "files"
        self.python = self._notebook_environment()
        self.site = self._plugins()
        self._deploy()
        (self.folder / "tmp").mkdir(exist_ok=True)
        (self.folder / "mlartifacts").mkdir(exist_ok=True)

    def _deploy(self) -> None:
        """The bundle's files as `databricks bundle deploy` uploads them; notebooks are not files."""
        for name in ("dtlab", "clusters", "scripts"):
            shutil.copytree(ROOT / name, self.workspace / name, ignore=shutil.ignore_patterns("__pycache__"))
        for name in ("databricks.yml", "pyproject.toml", "README.md", "requirements.txt", "requirements-dbr15.4.txt"):
            shutil.copy2(ROOT / name, self.workspace / name)
        (self.workspace / "notebooks").mkdir(parents=True)
        for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
            (self.workspace / "notebooks" / nb.name).mkdir()  # exists, but cannot be read as a file

    def _notebook_environment(self) -> Path:
        """A Python environment of its own (a folder with only `python`) that sees the runtime's packages."""
        env = self.folder / "python-env"
        (env / "bin").mkdir(parents=True)
        real_site = Path(sysconfig.get_paths()["purelib"])
        version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
        (env / "lib").mkdir()
        (env / "lib" / version).mkdir()
        (env / "lib" / version / "site-packages").symlink_to(real_site)
        base = Path(sys.base_prefix) / "bin" / version
        (env / "bin" / "python").symlink_to(base if base.exists() else Path(sys.executable).resolve())
        (env / "pyvenv.cfg").write_text(f"home = {Path(sys.base_prefix) / 'bin'}\ninclude-system-site-packages = "
                                        f"false\nversion = {sys.version_info[0]}.{sys.version_info[1]}\n")
        kernel = env / "share" / "jupyter" / "kernels" / "databricks"
        kernel.mkdir(parents=True)
        (kernel / "kernel.json").write_text(json.dumps({
            "argv": [str(env / "bin" / "python"), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Databricks (simulated)", "language": "python"}))
        startup = self.folder / "ipython" / "profile_default" / "startup"
        startup.mkdir(parents=True)
        (startup / "00-databricks.py").write_text(_STARTUP)
        return env / "bin" / "python"

    def _plugins(self) -> Path:
        """A folder on the kernel's PYTHONPATH with the simulated MLflow 'databricks' store plugin."""
        site = self.folder / "sim-site"
        (site / "dtlab_databricks_sim").mkdir(parents=True)
        (site / "dtlab_databricks_sim" / "__init__.py").write_text(_STORE)
        info = site / "dtlab_databricks_sim-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dtlab-databricks-sim\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text("[mlflow.tracking_store]\ndatabricks = dtlab_databricks_sim:build\n")
        return site

    def environment(self, task: Task, widgets: dict[str, str]) -> dict[str, str]:
        """The kernel's environment variables for ``task`` (PATH without the runtime's scripts)."""
        runtime_bin = str(Path(sys.executable).parent)
        path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                               if p and Path(p).resolve() != Path(runtime_bin).resolve())
        return {
            "DATABRICKS_RUNTIME_VERSION": RUNTIME_VERSION,
            "DB_IS_DRIVER": "TRUE",
            "PATH": path or "/usr/bin:/bin",
            "PYTHONPATH": str(self.site),
            "JUPYTER_PATH": str(self.python.parent.parent / "share" / "jupyter"),
            "IPYTHONDIR": str(self.folder / "ipython"),
            "TMPDIR": str(self.folder / "tmp"),
            "DTLAB_SCRATCH": "",                     # unset: notebooks choose their scratch as on Databricks
            "MLFLOW_TRACKING_URI": "",               # unset: dtlab.tracking picks "databricks"
            "DTLAB_SIM_WIDGETS": json.dumps(widgets),
            "DTLAB_SIM_SPARK_CONF": json.dumps(single_node_spark_conf()),
            "DTLAB_SIM_MLFLOW_DB": f"sqlite:///{self.folder / 'workspace-mlflow.db'}",
            "DTLAB_SIM_ARTIFACTS": (self.folder / "mlartifacts").as_uri(),
            "DTLAB_SIM_FOLDERS": ":".join(EXISTING_FOLDERS),
            "SPARK_LOCAL_IP": "127.0.0.1",
            "PYSPARK_PYTHON": str(self.python),
            "PYSPARK_DRIVER_PYTHON": str(self.python),
        }

    def run(self, task: Task, widgets: dict[str, str] | None = None, timeout: int = 900):
        """Execute ``task``'s notebook as the job would; returns ``dtlab.course.Result``.

        ``widgets`` (strings) are added to the task's ``base_parameters`` (the tests pass each
        notebook's small CI parameters this way, as "Run now with different parameters" would).
        """
        from dtlab import course

        values = {**task.widgets, **(widgets or {})}
        out = self.folder / "runs"
        out.mkdir(exist_ok=True)
        return course.run_one(task.notebook, out, stream=False, cell_timeout=timeout,
                              cwd=self.workspace / "notebooks", kernel_name="databricks",
                              env=self.environment(task, values), inject_parameters=False)
