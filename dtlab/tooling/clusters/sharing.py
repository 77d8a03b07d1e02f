"""Paths every user of a shared workspace can write to, where a cluster reads code from them.

An init script runs as root on every node before Spark starts, and ``DTLAB_SOURCE`` names the code it
installs. Where either lives in a folder all workspace users may change, any of them can change what runs
on your cluster (and with your credentials). Such folders:

* ``/Shared`` and ``/Workspace/Shared``: every workspace user can read and write there by default
  (Databricks, "Folders": "Shared folder");
* DBFS (``dbfs:/...``, the ``dbfs`` init-script type): the DBFS root is readable and writable by all users,
  and init scripts on DBFS are end-of-life (Databricks, "What are init scripts?": "Init scripts on DBFS are
  end-of-life").

The fix is a place whose access is granted per person: a Unity Catalog volume (``/Volumes/<catalog>/
<schema>/<volume>/...``, where Databricks recommends keeping init scripts), your own folder
(``/Workspace/Users/<you>/...``), or, in a bundle, the bundle's own folder (``${workspace.file_path}``),
which a bundle in development mode puts under the deployer's user folder.
"""

from __future__ import annotations

from typing import Any

from dtlab.tooling.clusters.problems import join

#: Prefixes of paths that every workspace user can write to.
SHARED_PREFIXES = ("/Shared/", "/Workspace/Shared/", "dbfs:/")

_FIX = ("Fix: a Unity Catalog volume (/Volumes/<catalog>/<schema>/<volume>/...), your own folder "
        "(/Workspace/Users/<you>/...), or in a bundle ${workspace.file_path}")


def is_shared(path: Any) -> bool:
    """Whether ``path`` lies in a folder every workspace user can write to (``SHARED_PREFIXES``)."""
    return isinstance(path, str) and (path + "/").startswith(SHARED_PREFIXES)


def _init_script_problems(scripts: Any, where: str) -> list[str]:
    out = []
    for i, script in enumerate(scripts if isinstance(scripts, list) else []):
        if not isinstance(script, dict):
            continue
        at = f"{join(where, 'init_scripts')}[{i}]"
        if "dbfs" in script:
            out.append(f"{at}.dbfs: an init script on DBFS, which every workspace user can write (and DBFS init "
                       f"scripts are end-of-life). {_FIX}")
        for kind, spec in script.items():
            destination = spec.get("destination") if isinstance(spec, dict) else None
            if kind != "dbfs" and is_shared(destination):
                out.append(f"{at}.{kind}.destination: {destination} runs as root on every node from a folder every "
                           f"workspace user can change. {_FIX}")
    return out


def _cluster_problems(spec: dict, where: str) -> list[str]:
    out = _init_script_problems(spec.get("init_scripts"), where)
    env = spec.get("spark_env_vars") or {}
    for key, value in (env.items() if isinstance(env, dict) else []):
        if is_shared(value):
            out.append(f"{join(where, 'spark_env_vars')}.{key}: {value} is a folder every workspace user can "
                       f"change, and the cluster reads from it. {_FIX}")
    return out


def shared_path_problems(doc: dict) -> list[str]:
    """Init scripts, environment paths and bundle folders in ``/Shared``, ``/Workspace/Shared`` or DBFS.

    Args:
        doc: a loaded cluster file, or a loaded ``databricks.yml``.

    Returns:
        One problem per such path, as ``"key.path: what. Fix: how"``; empty when there is none.
    """
    if not isinstance(doc, dict):
        return []
    if "bundle" not in doc and "resources" not in doc:
        return _cluster_problems(doc, "")
    out = []
    workspace = doc.get("workspace") or {}
    for key in ("root_path", "file_path", "artifact_path", "state_path"):
        if is_shared(workspace.get(key)):
            out.append(f"workspace.{key}: {workspace[key]} deploys the bundle where every workspace user can change "
                       "its files. Fix: leave it out (a bundle in development mode deploys under your own folder), "
                       "or /Workspace/Users/${workspace.current_user.userName}/.bundle/${bundle.name}/${bundle.target}")
    for name, target in (doc.get("targets") or {}).items():
        for key in ("root_path", "file_path", "artifact_path", "state_path"):
            value = ((target or {}).get("workspace") or {}).get(key)
            if is_shared(value):
                out.append(f"targets.{name}.workspace.{key}: {value} deploys the bundle where every workspace user "
                           "can change its files. Fix: /Workspace/Users/${workspace.current_user.userName}/.bundle/"
                           "${bundle.name}/${bundle.target}")
    for job_key, job in ((doc.get("resources") or {}).get("jobs") or {}).items():
        for i, jc in enumerate((job or {}).get("job_clusters") or []):
            spec = (jc or {}).get("new_cluster")
            if isinstance(spec, dict):
                out += _cluster_problems(spec, f"resources.jobs.{job_key}.job_clusters[{i}].new_cluster")
        for i, task in enumerate((job or {}).get("tasks") or []):
            spec = (task or {}).get("new_cluster")
            if isinstance(spec, dict):
                out += _cluster_problems(spec, f"resources.jobs.{job_key}.tasks[{i}].new_cluster")
    for key, cluster in ((doc.get("resources") or {}).get("clusters") or {}).items():
        if isinstance(cluster, dict):
            out += _cluster_problems(cluster, f"resources.clusters.{key}")
    for key, experiment in ((doc.get("resources") or {}).get("experiments") or {}).items():
        name = (experiment or {}).get("name")
        if isinstance(name, str) and (name + "/").startswith(("/Shared/", "/Workspace/Shared/")):
            out.append(f"resources.experiments.{key}.name: {name} is an experiment every workspace user can change. "
                       "Fix: /Users/${workspace.current_user.userName}/<name>")
    return out
