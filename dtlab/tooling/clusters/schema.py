"""The first layer: the strict models of ``databricks-bundles``, and where their errors are.

``databricks.bundles.clusters.Cluster`` and ``databricks.bundles.jobs.Job`` raise on unknown keys
and bad enum values (``databricks-sdk``'s ``from_dict`` silently drops unknown keys: useless for
this). Their errors name a class, not a place; ``schema_problems`` walks the model's fields to find
every such error with its key path and a "did you mean".
"""

from __future__ import annotations

import dataclasses
import enum
import re
import typing
from typing import Any

from dtlab.tooling.clusters.problems import ClusterConfigError, join, suggest

#: The databricks-bundles release the course validates with (as pinned in requirements.txt).
BUNDLES_PIN = "1.22.1"


def strict_models() -> tuple[Any, Any]:
    """The strict model classes ``(Cluster, Job)`` of databricks-bundles.

    Returns:
        ``databricks.bundles.clusters.Cluster`` and ``databricks.bundles.jobs.Job``.

    Raises:
        ClusterConfigError: when databricks-bundles is not installed (naming the install command).
    """
    try:
        from databricks.bundles.clusters import Cluster
        from databricks.bundles.jobs import Job
    except ImportError as exc:
        raise ClusterConfigError([f"cannot validate without the strict Databricks models ({exc}). "
                                  f"Fix: pip install databricks-bundles=={BUNDLES_PIN}"]) from exc
    return Cluster, Job


def _concrete(tpe: Any, value: Any) -> Any:
    """The type a model field holds for ``value``: strip Variable[...], Optional and Union wrappers."""
    if isinstance(value, str) and re.fullmatch(r"\$\{[^}]+\}", value):
        return None  # an interpolation the bundle resolves at deploy time
    while typing.get_origin(tpe) is typing.Union or type(tpe).__name__ == "UnionType":
        args = [a for a in typing.get_args(tpe)
                if a is not type(None) and getattr(typing.get_origin(a), "__name__", "") != "Variable"]
        if len(args) != 1:
            return None
        tpe = args[0]
    return tpe


def schema_problems(cls: Any, value: Any, where: str = "") -> list[str]:
    """Unknown keys, bad enum values and non-numbers under ``where``, walking a model's fields.

    The strict model raises on the first such error without saying where it is; this walk finds
    every one, with its key path and a suggestion.

    Args:
        cls: a model class (or a field type inside one), e.g. ``Cluster``.
        value: the loaded YAML for it.
        where: the key path of ``value`` in its file ("" at the top).

    Returns:
        Problems as ``"key.path: what. Fix: how"``; empty when the walk finds nothing.
    """
    tpe = _concrete(cls, value)
    if tpe is None or value is None:
        return []
    problems = []
    if dataclasses.is_dataclass(tpe):
        if not isinstance(value, dict):
            return [f"{where}: expected a mapping of {tpe.__name__} fields, got {value!r}. "
                    "Fix: indent its keys under it"]
        hints = typing.get_type_hints(tpe)
        names = [f.name for f in dataclasses.fields(tpe)]
        for key, item in value.items():
            if key in names:
                problems += schema_problems(hints[key], item, join(where, key))
            else:
                problems.append(f"{join(where, key)}: unknown key {key!r} for {tpe.__name__}. "
                                f"Fix: {suggest(key, names)}")
    elif typing.get_origin(tpe) is list:
        if not isinstance(value, list):
            return [f"{where}: expected a list, got {value!r}. Fix: write it as a YAML list (- item)"]
        for i, item in enumerate(value):
            problems += schema_problems(typing.get_args(tpe)[0], item, join(where, i))
    elif typing.get_origin(tpe) is dict:
        if not isinstance(value, dict):
            return [f"{where}: expected a mapping, got {value!r}. Fix: write it as key: value lines"]
        for key, item in value.items():
            problems += schema_problems(typing.get_args(tpe)[1], item, join(where, key))
    elif isinstance(tpe, type) and issubclass(tpe, enum.Enum):
        allowed = [m.value for m in tpe]
        if str(value) not in allowed:
            problems.append(f"{where}: {value!r} is not a valid {tpe.__name__}. Fix: {suggest(value, allowed)}")
    elif tpe in (int, float) and not isinstance(value, bool):
        try:
            tpe(value)
        except (TypeError, ValueError):
            problems.append(f"{where}: {value!r} is not a number. Fix: write a {tpe.__name__}, e.g. 30")
    return problems


def model_problems(cls: Any, value: Any, where: str) -> list[str]:
    """Validate ``value`` with the strict model ``cls``; explain any error with ``schema_problems``.

    Args:
        cls: ``Cluster`` or ``Job`` from ``strict_models()``.
        value: the loaded YAML.
        where: its key path in the file.

    Returns:
        ``[]`` when the model accepts ``value``, else the problems found (at least one).
    """
    try:
        cls.from_dict(value)
        return []
    except Exception as exc:  # the models raise ValueError/TypeError/KeyError with a bare message
        found = schema_problems(cls, value, where)
        return found or [f"{where or cls.__name__}: {exc}. Fix: compare with the {cls.__name__} model's fields"]
