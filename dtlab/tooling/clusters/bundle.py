"""Checks of a Databricks bundle (``databricks.yml``) and its jobs, and of credentials in any file.

* top-level keys are bundle keys, and the bundle has a name;
* ``${var.x}`` refers to a declared variable (and is replaced by its default before the checks);
* each job passes the strict ``Job`` model; its tasks' ``depends_on`` and ``job_cluster_key``
  exist, its notebooks exist, and ``base_parameters`` are parameters of the notebook (a widget
  nobody reads is a typo); a notebook's ``nprocs`` does not exceed the GPUs of its node;
* job clusters and ``resources.clusters`` follow the course's cluster rules (``rules.py``);
* ``artifacts`` have the CLI's fields (``type`` whl or jar, ``build``, ``path``, ``files``, ``executable``,
  ``dynamic_version``); a task's local ``whl`` library is a file an artifact builds, and its cluster runs
  Databricks Runtime 13.3 or later (the CLI refuses local libraries before);
* a task with no cluster runs on serverless compute: no ``libraries``, an environment of the job for a Python or
  wheel task, and dtlab's wheel in it when the task imports dtlab (``serverless.py``);
* no literal credentials anywhere (only ``{{secrets/scope/key}}`` references).

What could not be checked is not a problem but a *note* (``bundle_notes``): on Databricks Runtime
before 16.2 a deployed notebook exists in the workspace but cannot be read as a file, so its
parameters are not compared with ``base_parameters`` there; a checkout can check them.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

from dtlab.tooling import runner as course
from dtlab.tooling.clusters.artifacts import artifact_outputs, library_problems
from dtlab.tooling.clusters.problems import join, suggest
from dtlab.tooling.clusters.rules import cluster_problems, node_type
from dtlab.tooling.clusters.schema import model_problems, strict_models
from dtlab.tooling.clusters.serverless import serverless_problems

#: Said once per bundle when some notebook exists but cannot be read as a file.
UNREADABLE_NOTEBOOKS = ("notebooks are not readable as files on this runtime (Databricks Runtime 16.2+ makes them "
                        "readable): their parameters were not checked here; `dtlab clusters validate` in a checkout "
                        "checks them")

_VAR = re.compile(r"\$\{var\.([A-Za-z_][\w-]*)\}")
_SECRET_REF = re.compile(r"^\{\{secrets/[^/{}]+/[^/{}]+\}\}$")
_TOKEN_VALUE = re.compile(r"dapi[0-9a-f]{32}|ghp_[A-Za-z0-9]{36}|github_pat_\w{20,}|AKIA[0-9A-Z]{16}")
_SECRET_KEY = re.compile(r"token|password|secret|api_?key", re.I)
#: The top-level keys a bundle may have.
BUNDLE_KEYS = ["bundle", "variables", "include", "workspace", "artifacts", "resources", "sync", "targets",
               "permissions", "run_as", "presets", "experimental", "python", "scripts", "git"]


def _resolve(value: Any, variables: dict[str, Any], problems: list[str], where: str = "") -> Any:
    """Replace ``${var.name}`` with the variable's default (other ``${...}`` stay for the bundle)."""
    if isinstance(value, dict):
        return {k: _resolve(v, variables, problems, join(where, k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, variables, problems, join(where, i)) for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value
    for name in _VAR.findall(value):
        if name not in variables:
            problems.append(f"{where}: ${{var.{name}}} is not declared under variables. "
                            f"Fix: {suggest(name, list(variables))}")
    whole = _VAR.fullmatch(value)
    if whole and whole.group(1) in variables:
        return variables[whole.group(1)]
    return _VAR.sub(lambda m: str(variables.get(m.group(1), m.group(0))), value)


def secret_problems(value: Any, where: str = "") -> list[str]:
    """Literal credentials anywhere in a loaded file (tokens belong in ``{{secrets/scope/key}}`` references).

    Args:
        value: the loaded YAML (any nesting of mappings and lists).
        where: the key path of ``value`` ("" at the top).

    Returns:
        One problem per key that names a credential (token, password, secret, api key) with a literal
        value, and per string that looks like a Databricks, GitHub or AWS token.
    """
    if isinstance(value, dict):
        out = []
        for k, v in value.items():
            if isinstance(v, (str, int)) and not isinstance(v, bool) and _SECRET_KEY.search(str(k)) \
                    and str(v).strip() and not _SECRET_REF.match(str(v)) and not str(v).startswith("${"):
                out.append(f"{join(where, k)}: a literal credential. Fix: store it with `databricks secrets "
                           f"put-secret <scope> <key>` and write \"{{{{secrets/<scope>/<key>}}}}\" here")
            else:
                out += secret_problems(v, join(where, k))
        return out
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in secret_problems(v, join(where, i))]
    if isinstance(value, str) and _TOKEN_VALUE.search(value):
        return [f"{where}: looks like a token. Fix: use a secret reference \"{{{{secrets/<scope>/<key>}}}}\""]
    return []


def job_problems(job: dict, where: str, base: Path, notes: list[str] | None = None) -> list[str]:
    """Tasks, job clusters and notebooks of one job of a bundle.

    Args:
        job: the job (``resources.jobs.<name>``), with variables already resolved.
        where: its key path, e.g. ``resources.jobs.dtlab_course``.
        base: the bundle's folder (notebook paths are relative to it).
        notes: where to add what could not be checked (``UNREADABLE_NOTEBOOKS`` when a notebook exists
            but cannot be read as a file, as on Databricks Runtime before 16.2); ignored when None.

    Returns:
        Problems as ``"key.path: what. Fix: how"``.
    """
    problems: list[str] = []
    clusters = {c.get("job_cluster_key"): c.get("new_cluster") or {} for c in job.get("job_clusters") or []}
    for i, spec in enumerate(clusters.values()):
        problems += cluster_problems(spec, f"{where}.job_clusters[{i}].new_cluster", all_purpose=False)
    tasks = job.get("tasks") or []
    keys = [t.get("task_key") for t in tasks]
    for i, task in enumerate(tasks):
        at = f"{where}.tasks[{i}]"
        if keys.count(task.get("task_key")) > 1:
            problems.append(f"{at}.task_key: {task.get('task_key')!r} is used twice. Fix: make task keys unique")
        for dep in task.get("depends_on") or []:
            if dep.get("task_key") not in keys:
                problems.append(f"{at}.depends_on: no task {dep.get('task_key')!r}. "
                                f"Fix: {suggest(dep.get('task_key'), keys)}")
        cluster_key = task.get("job_cluster_key")
        if cluster_key is not None and cluster_key not in clusters:
            problems.append(f"{at}.job_cluster_key: no job cluster {cluster_key!r}. "
                            f"Fix: {suggest(cluster_key, list(clusters))}")
        nb_task = task.get("notebook_task") or {}
        if not nb_task.get("notebook_path"):
            continue
        nb_path = (base / nb_task["notebook_path"]).resolve()
        if not nb_path.exists():
            others = [p.name for p in sorted(nb_path.parent.glob("*.ipynb"))] if nb_path.parent.is_dir() else []
            close = difflib.get_close_matches(nb_path.name, others, n=1, cutoff=0.85)
            fix = f"did you mean {close[0]!r}?" if close else f"create it, or use one of {', '.join(others) or 'none'}"
            problems.append(f"{at}.notebook_task.notebook_path: {nb_task['notebook_path']} does not exist. Fix: {fix}")
            continue
        params = nb_task.get("base_parameters") or {}
        names = _notebook_parameters(nb_path)
        if names is None:  # it is there, but this runtime cannot read it as a file: not a problem of the bundle
            if notes is not None and UNREADABLE_NOTEBOOKS not in notes:
                notes.append(UNREADABLE_NOTEBOOKS)
        else:
            for name in params:
                if name not in names:
                    problems.append(f"{at}.notebook_task.base_parameters.{name}: {nb_path.name} has no parameter "
                                    f"{name!r} (a widget nobody reads). Fix: {suggest(name, names)}")
        gpu = node_type(clusters.get(cluster_key) or {})
        nprocs = str(params.get("nprocs", "None"))
        if gpu and nprocs.isdigit() and int(nprocs) > gpu.gpus:
            problems.append(f"{at}.notebook_task.base_parameters.nprocs: {nprocs} processes, but the notebook runs "
                            f"on one {gpu.gpus}-GPU node. Fix: nprocs: \"{gpu.gpus}\" (or \"None\": one per GPU)")
    return problems


def _notebook_parameters(path: Path) -> list[str] | None:
    """The parameters a notebook declares, or None when it exists but cannot be read as a file.

    On Databricks Runtime before 16.2, a notebook in the workspace is not a file to the node's
    Python: opening it fails (``OSError``: permission, "operation not supported", a directory).
    """
    if path.is_dir():
        return None
    try:
        return list(course.notebook_parameters(path))
    except OSError:  # IsADirectoryError and PermissionError included
        return None


def bundle_problems(doc: dict, path: Path, notes: list[str] | None = None) -> list[str]:
    """Everything wrong with a loaded bundle (``databricks.yml``), credentials aside.

    Args:
        doc: the loaded bundle.
        path: its file (notebook paths are relative to its folder).
        notes: where to add what could not be checked (see ``job_problems``); ignored when None.

    Returns:
        Problems as ``"key.path: what. Fix: how"``.

    Raises:
        ClusterConfigError: when databricks-bundles is not installed.
    """
    Cluster, Job = strict_models()
    problems = []
    for key in doc:
        if key not in BUNDLE_KEYS:
            problems.append(f"{key}: unknown top-level key of a bundle. Fix: {suggest(key, BUNDLE_KEYS)}")
    if not (doc.get("bundle") or {}).get("name"):
        problems.append("bundle.name: a bundle needs a name. Fix: bundle: {name: dtlab-course}")
    variables = {name: (v or {}).get("default") if isinstance(v, dict) else v
                 for name, v in (doc.get("variables") or {}).items()}
    resolved = _resolve(doc, variables, problems)
    found, outputs = artifact_outputs(resolved, path.parent.resolve())
    problems += found
    resources = resolved.get("resources") or {}
    for name, job in (resources.get("jobs") or {}).items():
        where = f"resources.jobs.{name}"
        found = model_problems(Job, job, where)
        problems += found or (job_problems(job, where, path.parent, notes)
                              + library_problems(job, where, path.parent.resolve(), outputs)
                              + serverless_problems(job, where, path.parent.resolve(), outputs))
    for name, spec in (resources.get("clusters") or {}).items():
        where = f"resources.clusters.{name}"
        problems += model_problems(Cluster, spec, where) or cluster_problems(spec, where)
    return problems


def bundle_notes(path: str | Path) -> list[str]:
    """What validating the bundle at ``path`` could not check, as sentences to show beside its result.

    Today one case: notebooks that exist but cannot be read as files (Databricks Runtime before 16.2),
    whose parameters are then not compared with the tasks' ``base_parameters``. Empty in a checkout.

    Args:
        path: the bundle file (``databricks.yml``).

    Returns:
        The notes (``[]`` when everything could be checked, or when ``path`` is not a bundle).
    """
    import yaml

    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        return []  # validate() reports the syntax error
    if not isinstance(doc, dict) or not ("bundle" in doc or "resources" in doc):
        return []
    notes: list[str] = []
    bundle_problems(doc, path, notes)
    return notes
