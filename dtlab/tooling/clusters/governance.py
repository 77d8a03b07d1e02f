"""What a platform team asks of a bundle and a cluster before it lets them into a shared workspace.

* **Every job cluster under a cluster policy** (``policy_id``): users without unrestricted cluster creation can
  only create clusters through one, and the policy is where the team caps node types, sizes and costs. The
  bundle takes it as a variable without a default (``--var policy_id=<id>``), so no deploy forgets it.
* **A production target runs as a service principal and says who may see it**: ``mode: production`` with
  ``run_as: {service_principal_name: ...}`` (the jobs keep running when the deployer leaves, with the service
  principal's rights, not a person's) and ``permissions`` (without them only the deployer and admins can see the
  jobs). Databricks, "Databricks Asset Bundle deployment modes": "Databricks recommends using service principals
  for production deployments. You can enforce this by setting run_as to a service principal."
* **The CLI the bundle's features need** (``bundle.databricks_cli_version``): an artifact's ``dynamic_version``
  arrived in Databricks CLI 0.245.0 (its CHANGELOG), ``artifacts`` themselves in 0.229.0 or earlier; an older CLI
  would reject the file or deploy it half-understood.
* **Code installed as root is pinned** (``DTLAB_SOURCE`` read by ``clusters/init/install-dtlab.sh``): a wheel by
  its exact file name *and* its sha256 (``DTLAB_WHEEL_SHA256``: the init script refuses a file that does not
  match), a ``git+https`` URL at a commit (40 hex digits), or a source folder in your own user folder. Not a
  volume folder: "the newest wheel there" lets anyone with WRITE VOLUME on it run code as root on every node.
  ``pin_wheel`` writes both lines into a cluster file (``dtlab clusters pin-wheel``).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from dtlab.tooling.clusters.problems import join

#: The oldest Databricks CLI that understands each bundle feature the course uses (its CHANGELOG).
CLI_NEEDS = {"artifacts": (0, 229, 0), "dynamic_version": (0, 245, 0)}
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_COMMIT = re.compile(r"@[0-9a-f]{40}$")
_VERSION = re.compile(r">=\s*v?(\d+)\.(\d+)\.(\d+)")


def source_problems(spec: dict, where: str = "") -> list[str]:
    """Whether a cluster spec's ``DTLAB_SOURCE`` (if any) names pinned code; one problem per unpinned source."""
    env = spec.get("spark_env_vars") or {}
    if not isinstance(env, dict) or not env.get("DTLAB_SOURCE"):
        return []
    at = join(where, "spark_env_vars")
    source = str(env["DTLAB_SOURCE"])
    digest = str(env.get("DTLAB_WHEEL_SHA256") or "")
    pin = "Fix: `dtlab clusters pin-wheel dist/dtlab-<version>-py3-none-any.whl --volume <volume folder> <this file>`"
    if source.endswith(".whl"):
        if not _SHA256.match(digest):
            return [f"{at}.DTLAB_WHEEL_SHA256: the init script installs {source} as root without checking it is the "
                    f"wheel you built (anyone who can write there could replace it). {pin} (writes its sha256)"]
        return []
    if source.startswith("git+"):
        if not _COMMIT.search(source):
            return [f"{at}.DTLAB_SOURCE: {source} follows a branch: whoever pushes to it changes what every node "
                    "installs as root. Fix: end the URL with @<the commit's 40-hex sha>"]
        return []
    if source.startswith(("/Volumes/", "dbfs:/Volumes/")):
        return [f"{at}.DTLAB_SOURCE: {source} is a volume folder: the init script would install whichever wheel is "
                "newest there, so anyone with WRITE VOLUME on it runs code as root on every node. " + pin]
    return []   # a source folder (a Git folder in your own user folder; shared folders: sharing.py)


def _cli_minimum(text: Any) -> tuple[int, ...] | None:
    match = _VERSION.search(str(text or ""))
    return tuple(int(x) for x in match.groups()) if match else None


def bundle_governance_problems(doc: dict) -> list[str]:
    """Policies, production targets, the CLI version and pinned sources of a loaded bundle (not yet resolved).

    Args:
        doc: the loaded ``databricks.yml``.

    Returns:
        Problems as ``"key.path: what. Fix: how"``; empty when the bundle meets every rule above.
    """
    out: list[str] = []
    variables = doc.get("variables") or {}
    for job_key, job in ((doc.get("resources") or {}).get("jobs") or {}).items():
        for i, jc in enumerate((job or {}).get("job_clusters") or []):
            spec = (jc or {}).get("new_cluster") or {}
            at = f"resources.jobs.{job_key}.job_clusters[{i}].new_cluster"
            if not spec.get("policy_id"):
                out.append(f"{at}.policy_id: no cluster policy: users without unrestricted cluster creation cannot "
                           "start it, and the platform team's limits do not apply. Fix: policy_id: ${var.policy_id} "
                           "(a variable without a default: `databricks bundle deploy --var policy_id=<id>`)")
            out += source_problems(spec, at)
    for key, spec in ((doc.get("resources") or {}).get("clusters") or {}).items():
        out += source_problems(spec or {}, f"resources.clusters.{key}")
    if "policy_id" in variables and isinstance(variables["policy_id"], dict) and variables["policy_id"].get("default"):
        out.append("variables.policy_id.default: one workspace's policy ID as everybody's default. Fix: leave the "
                   "default out (each deploy passes --var policy_id=<id>, or BUNDLE_VAR_policy_id)")
    for name, target in (doc.get("targets") or {}).items():
        target = target or {}
        if target.get("mode") != "production":
            continue
        run_as = target.get("run_as") or doc.get("run_as") or {}
        if not (isinstance(run_as, dict) and run_as.get("service_principal_name")):
            out.append(f"targets.{name}.run_as: a production target that runs as whoever deploys it (their rights, "
                       "and it stops when they leave). Fix: run_as: {service_principal_name: ${var.service_principal}}")
        if not (target.get("permissions") or doc.get("permissions")):
            out.append(f"targets.{name}.permissions: nobody but the deployer and admins can see or run the production "
                       "jobs. Fix: permissions: [{group_name: ${var.team_group}, level: CAN_VIEW}]")
    artifacts = doc.get("artifacts") or {}
    if artifacts:
        needed = max([CLI_NEEDS["artifacts"]] + [CLI_NEEDS["dynamic_version"] for a in artifacts.values()
                                                 if isinstance(a, dict) and a.get("dynamic_version")])
        given = _cli_minimum((doc.get("bundle") or {}).get("databricks_cli_version"))
        if given is None or given < needed:
            want = ".".join(map(str, needed))
            out.append(f"bundle.databricks_cli_version: the bundle's artifacts need Databricks CLI {want} or later, "
                       f"and {'nothing stops an older one' if given is None else 'this allows older ones'}. "
                       f"Fix: databricks_cli_version: \">= {want}\"")
    return out


def wheel_sha256(wheel: str | Path) -> str:
    """The sha256 of a file, as ``sha256sum`` prints it."""
    h = hashlib.sha256()
    with open(wheel, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pin_wheel(wheel: str | Path, volume: str, files: list[str | Path]) -> list[str]:
    """Write ``DTLAB_SOURCE: <volume>/<wheel's name>`` and its ``DTLAB_WHEEL_SHA256`` into cluster files.

    Each file must have both lines in its ``spark_env_vars`` (commented out or not, as the course's files do);
    they are replaced in place, the rest of the file (its comments) kept. Copy the wheel to that volume folder
    yourself (``databricks fs cp``): the name must stay the same.

    Args:
        wheel: the wheel you built (``python3 -m pip wheel --no-deps -w dist .``).
        volume: the Unity Catalog volume folder the wheel goes to, ``/Volumes/<catalog>/<schema>/<volume>``.
        files: cluster files to pin.

    Returns:
        The lines written (the same for every file).

    Raises:
        ValueError: the wheel is not a dtlab wheel, the folder is not a volume, or a file lacks the two lines.
    """
    wheel = Path(wheel)
    if not (wheel.is_file() and wheel.name.startswith("dtlab-") and wheel.suffix == ".whl"):
        raise ValueError(f"{wheel}: not a dtlab wheel file. Fix: python3 -m pip wheel --no-deps -w dist . and pass "
                         "dist/dtlab-<version>-py3-none-any.whl")
    if not re.fullmatch(r"/Volumes/[^/]+/[^/]+/[^/]+(/[^/]+)*", volume.rstrip("/")):
        raise ValueError(f"--volume {volume}: not a Unity Catalog volume folder. Fix: /Volumes/<catalog>/<schema>/"
                         "<volume> (`databricks volumes create <catalog> <schema> <volume> MANAGED`)")
    lines = {"DTLAB_SOURCE": f"{volume.rstrip('/')}/{wheel.name}", "DTLAB_WHEEL_SHA256": wheel_sha256(wheel)}
    for path in map(Path, files):
        text = path.read_text()
        for key, value in lines.items():
            pattern = re.compile(rf"^([ \t]*)#?[ \t]*{key}:.*$", re.M)
            if not pattern.search(text):
                raise ValueError(f"{path}: no {key} line under spark_env_vars. Fix: add `{key}: ...` there "
                                 "(clusters/g5-12xlarge-single-node.yml shows where)")
            text = pattern.sub(lambda m, k=key, v=value: f"{m.group(1)}{k}: {v}", text, count=1)
        path.write_text(text)
    return [f"{k}: {v}" for k, v in lines.items()]
