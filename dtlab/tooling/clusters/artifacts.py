"""A bundle's artifacts and the local libraries its tasks install.

* each ``artifacts`` entry has the Databricks CLI's fields (``type`` whl or jar, ``build``, ``path``, ``files``,
  ``executable``, ``dynamic_version``);
* a task's local ``whl`` library is a file an artifact builds (``databricks bundle deploy`` fails on a pattern
  that matches nothing: "no files match pattern"), and the task's cluster runs Databricks Runtime 13.3 or later
  (the CLI refuses local libraries before).

The CLI resolves an artifact's ``path`` and ``files`` relative to the file that declares them, and a wheel's
default output is ``<path>/dist/*.whl``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from dtlab.tooling.clusters.problems import suggest

#: The fields of a bundle's artifact (the Databricks CLI's ``config.Artifact``).
ARTIFACT_KEYS = ["type", "build", "path", "files", "executable", "dynamic_version"]
_REMOTE = ("/Workspace/", "/Volumes/", "dbfs:", "s3:", "s3a:", "abfss:", "gs:", "https:", "http:")


def artifact_outputs(doc: dict, base: Path) -> tuple[list[str], list[str]]:
    """Problems of the bundle's ``artifacts``, and the file patterns they build (absolute, as the CLI resolves
    them: ``files[].source``, else ``<path>/dist/*.whl`` for a wheel; relative to the bundle's folder)."""
    import posixpath

    problems, outputs = [], []
    for name, art in (doc.get("artifacts") or {}).items():
        at = f"artifacts.{name}"
        if not isinstance(art, dict):
            problems.append(f"{at}: expected a mapping. Fix: {{type: whl, build: ..., path: .}}")
            continue
        for key in art:
            if key not in ARTIFACT_KEYS:
                problems.append(f"{at}.{key}: not a field of an artifact. Fix: {suggest(key, ARTIFACT_KEYS)}")
        if art.get("type") not in ("whl", "jar"):
            problems.append(f"{at}.type: {art.get('type')!r}. Fix: type: whl (a Python wheel) or jar")
        if art.get("executable") not in (None, "bash", "sh", "cmd"):
            problems.append(f"{at}.executable: {art['executable']!r}. Fix: bash, sh or cmd")
        folder = posixpath.normpath(posixpath.join(base.as_posix(), str(art.get("path") or ".")))
        sources = [f.get("source") for f in art.get("files") or [] if isinstance(f, dict)]
        if art.get("type") == "whl" and not sources:
            sources = [posixpath.join(folder, "dist", "*.whl")]
        outputs += [posixpath.normpath(posixpath.join(folder, s)) for s in sources if s]
    return problems, outputs


def _runtime_version(spark_version: Any) -> tuple[int, int] | None:
    """(major, minor) of a Databricks Runtime key such as ``15.4.x-gpu-ml-scala2.12``; None if unreadable."""
    found = re.match(r"(\d+)\.(\d+)", str(spark_version or ""))
    return (int(found.group(1)), int(found.group(2))) if found else None


def built_by_an_artifact(local_path: str, base: Path, outputs: list[str]) -> bool:
    """Whether ``local_path`` (relative to the bundle's folder, a pattern or a file) is what an artifact builds."""
    import fnmatch
    import posixpath

    local = posixpath.normpath(posixpath.join(base.as_posix(), local_path))
    return any(fnmatch.fnmatch(local, out) or fnmatch.fnmatch(out, local) for out in outputs)


def library_problems(job: dict, where: str, base: Path, outputs: list[str]) -> list[str]:
    """A task's local wheel must be one an artifact builds (``databricks bundle deploy`` fails on a pattern
    that matches nothing), on a cluster of Databricks Runtime 13.3 or later."""
    problems = []
    clusters = {c.get("job_cluster_key"): c.get("new_cluster") or {} for c in job.get("job_clusters") or []}
    for i, task in enumerate(job.get("tasks") or []):
        for j, library in enumerate(task.get("libraries") or []):
            whl = library.get("whl") if isinstance(library, dict) else None
            if not whl or str(whl).startswith(_REMOTE):
                continue
            at = f"{where}.tasks[{i}].libraries[{j}].whl"
            if not built_by_an_artifact(whl, base, outputs):
                problems.append(f"{at}: {whl} is built by no artifact, so deploying finds no file. Fix: an "
                                "artifacts entry {type: whl, path: <the package's folder>} (it builds "
                                "<path>/dist/*.whl), or the path of the wheel it builds")
            version = _runtime_version((clusters.get(task.get("job_cluster_key")) or {}).get("spark_version"))
            if version is not None and version < (13, 3):
                problems.append(f"{at}: a local library needs Databricks Runtime 13.3 or later on the task's cluster "
                                f"(it runs {version[0]}.{version[1]}). Fix: a newer spark_version")
    return problems
