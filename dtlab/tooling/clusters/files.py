"""Reading and checking files: ``load``, ``validate``, ``check``; and finding the repository's files.

``validate`` reads a cluster file or a bundle and runs both layers (``schema``: the strict models;
``rules`` / ``bundle``: the course's rules), plus the credential scan, the shared-folder scan
(``sharing``) and a platform team's rules (``governance``: policies, production targets, pinned code), on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dtlab.tooling.clusters.bundle import bundle_problems, secret_problems
from dtlab.tooling.clusters.governance import bundle_governance_problems, source_problems
from dtlab.tooling.clusters.problems import ClusterConfigError
from dtlab.tooling.clusters.rules import cluster_problems
from dtlab.tooling.clusters.schema import model_problems, strict_models
from dtlab.tooling.clusters.sharing import shared_path_problems


def load(path: str | Path) -> Any:
    """Read a YAML file with ``yaml.safe_load``.

    Args:
        path: the file.

    Returns:
        What the file holds (a dict for a cluster file or a bundle).

    Raises:
        ClusterConfigError: for a YAML syntax error, naming the line.
        FileNotFoundError: when ``path`` does not exist.
    """
    import yaml

    try:
        return yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        raise ClusterConfigError([f"{path}: not valid YAML: {exc}. Fix: check the indentation there"]) from exc


def validate(path: str | Path) -> list[str]:
    """Check one file: a cluster definition or a bundle (``databricks.yml``).

    A file with a top-level ``bundle`` or ``resources`` key is read as a bundle.

    Args:
        path: the YAML file.

    Returns:
        The problems, each ``file: key.path: what is wrong. Fix: what to write``; ``[]`` means valid.

    Raises:
        ClusterConfigError: when databricks-bundles is not installed (nothing can be validated).
        FileNotFoundError: when ``path`` does not exist.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    Cluster, _ = strict_models()
    try:
        doc = load(path)
    except ClusterConfigError as exc:
        return exc.problems
    if not isinstance(doc, dict):
        return [f"{path}: expected a YAML mapping (key: value lines), got {type(doc).__name__}. "
                "Fix: see clusters/g5-12xlarge-single-node.yml for the shape"]
    if "bundle" in doc or "resources" in doc:
        problems = bundle_problems(doc, path) + bundle_governance_problems(doc)
    else:
        problems = (model_problems(Cluster, doc, "") or cluster_problems(doc)) + source_problems(doc)
    problems += secret_problems(doc) + shared_path_problems(doc)
    return [f"{path}: {p}" for p in problems]


def check(path: str | Path) -> None:
    """``validate``, raising when there is any problem.

    Args:
        path: the YAML file.

    Raises:
        ClusterConfigError: with every problem (``.problems``) when the file is invalid.
        FileNotFoundError: when ``path`` does not exist.
    """
    problems = validate(path)
    if problems:
        raise ClusterConfigError(problems)


def find_root(start: str | Path | None = None) -> Path:
    """The repository root.

    Args:
        start: where to start looking (default: the current directory).

    Returns:
        The first of ``start`` and its parents with both ``clusters/`` and ``dtlab/`` folders, else
        the folder above the installed ``dtlab`` package.
    """
    here = Path(start or Path.cwd()).resolve()
    for folder in [here, *here.parents]:
        if (folder / "clusters").is_dir() and (folder / "dtlab").is_dir():
            return folder
    return Path(__file__).resolve().parents[3]


def default_paths(root: str | Path | None = None) -> list[Path]:
    """The files ``dtlab clusters validate`` checks by default.

    Args:
        root: the repository root (default: ``find_root()``).

    Returns:
        Every YAML file in ``clusters/`` (sorted), then ``databricks.yml`` if the root has one.
    """
    root = Path(root) if root else find_root()
    paths = sorted([*root.glob("clusters/*.yml"), *root.glob("clusters/*.yaml")])
    return paths + ([root / "databricks.yml"] if (root / "databricks.yml").is_file() else [])
