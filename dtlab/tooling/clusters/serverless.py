"""The tasks of a bundle's job that run on serverless compute, and the environments they run in.

A task with no cluster (no ``job_cluster_key``, ``existing_cluster_id`` or ``new_cluster``) runs on serverless
compute. There (Databricks, "Bundle configuration examples" and the Jobs API's ``environment_key``):

* a task installs no ``libraries``: a Python script, Python wheel or dbt task names an environment of the job
  (``environment_key``, required for those three), whose ``spec.dependencies`` are pip requirement lines; a
  notebook task takes its libraries from the notebook's own Environment panel;
* each of the job's ``environments`` says which serverless environment it builds on: ``environment_version``
  (e.g. "5") or ``base_environment``;
* a local wheel in ``dependencies`` (``./dist/*.whl``) is uploaded by ``databricks bundle deploy`` only when an
  artifact builds it, and a task whose Python file imports dtlab needs the dtlab wheel there.
"""

from __future__ import annotations

import re
from pathlib import Path

from dtlab.tooling.clusters.artifacts import built_by_an_artifact
from dtlab.tooling.clusters.problems import suggest

#: Task types that need an environment on serverless compute (the Jobs API's ``environment_key``).
NEEDS_ENVIRONMENT = ("spark_python_task", "python_wheel_task", "dbt_task")
_CLUSTER_KEYS = ("job_cluster_key", "existing_cluster_id", "new_cluster")
_IMPORTS_DTLAB = re.compile(r"^\s*(import dtlab|from dtlab[\s.])", re.M)
_LOCAL_WHEEL = re.compile(r"^\.{0,2}/?[^:]*\.whl$")


def is_serverless(task: dict) -> bool:
    """True for a task that names no cluster: Databricks runs it on serverless compute."""
    return not any(task.get(key) for key in _CLUSTER_KEYS)


def _uses_dtlab(task: dict, base: Path) -> bool:
    """The task runs dtlab: a wheel task of the dtlab package, or a Python file that imports it."""
    if (task.get("python_wheel_task") or {}).get("package_name") == "dtlab":
        return True
    python_file = (task.get("spark_python_task") or {}).get("python_file")
    if not python_file or "://" in str(python_file) or str(python_file).startswith("/"):
        return False
    path = base / python_file
    return path.is_file() and bool(_IMPORTS_DTLAB.search(path.read_text(errors="replace")))


def serverless_problems(job: dict, where: str, base: Path, outputs: list[str]) -> list[str]:
    """What Databricks would refuse, or what would fail at the first import, in a job's serverless tasks.

    Args:
        job: the job (``resources.jobs.<name>``), variables resolved.
        where: its key path, e.g. ``resources.jobs.dtlab_serverless``.
        base: the bundle's folder (local paths are relative to it).
        outputs: the file patterns the bundle's artifacts build (``artifacts.artifact_outputs``).

    Returns:
        Problems as ``"key.path: what. Fix: how"``.
    """
    problems: list[str] = []
    environments = {}
    for i, env in enumerate(job.get("environments") or []):
        at = f"{where}.environments[{i}]"
        environments[env.get("environment_key")] = env
        spec = env.get("spec") or {}
        if not spec.get("environment_version") and not spec.get("base_environment"):
            problems.append(f"{at}.spec: no environment_version (or base_environment), so serverless compute does "
                            "not know which Python and client libraries to start from. Fix: environment_version: "
                            "\"5\" (Python 3.12, 18 LTS's libraries)")
        for j, dependency in enumerate(spec.get("dependencies") or []):
            text = str(dependency).strip()
            if _LOCAL_WHEEL.match(text) and not text.startswith(("/Workspace/", "/Volumes/")) \
                    and not built_by_an_artifact(text, base, outputs):
                problems.append(f"{at}.spec.dependencies[{j}]: {text} is built by no artifact, so deploying "
                                "uploads no file. Fix: an artifacts entry {type: whl, path: .} (it builds "
                                "./dist/*.whl), or the path of the wheel it builds")
    for i, task in enumerate(job.get("tasks") or []):
        if not is_serverless(task):
            continue
        at = f"{where}.tasks[{i}]"
        kind = next((k for k in (*NEEDS_ENVIRONMENT, "notebook_task") if task.get(k)), None)
        if task.get("libraries"):
            home = ("the notebook's Environment panel (its dependencies)" if kind == "notebook_task" else
                    "an environment of the job: environments: [{environment_key: ..., spec: {environment_version: "
                    "\"5\", dependencies: [...]}}] and environment_key on the task")
            problems.append(f"{at}.libraries: a task on serverless compute (it names no cluster) installs no "
                            f"libraries; the Jobs API refuses them. Fix: list them in {home}")
        key = task.get("environment_key")
        if kind in NEEDS_ENVIRONMENT and not key:
            fix = (f"environment_key: {next(iter(environments))}" if environments else
                   "declare environments: [{environment_key: default, spec: {environment_version: \"5\", "
                   "dependencies: [...]}}] and set environment_key: default")
            problems.append(f"{at}: a {kind} on serverless compute needs an environment_key (the job's "
                            f"environment it runs in). Fix: {fix}")
            continue
        if key is None:
            continue
        if key not in environments:
            problems.append(f"{at}.environment_key: the job has no environment {key!r}. "
                            f"Fix: {suggest(key, [k for k in environments if k])}")
            continue
        dependencies = [str(d).strip() for d in (environments[key].get("spec") or {}).get("dependencies") or []]
        if _uses_dtlab(task, base) and not any(re.search(r"(^|/)(dtlab|\*)[^/]*\.whl$", d) or d.startswith("dtlab")
                                               for d in dependencies):
            problems.append(f"{at}: it imports dtlab, but environment {key!r} does not install it "
                            "(ModuleNotFoundError at its first line). Fix: add ./dist/*.whl (the wheel this bundle "
                            "builds) to that environment's dependencies")
    return problems
