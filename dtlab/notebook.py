"""Notebook plumbing: the same parameters from papermill locally and from widgets on Databricks.

A course notebook's first code cell (tagged ``parameters``) assigns every knob a default.
papermill overrides them by inserting a cell after it. On Databricks there is no papermill: a job
passes ``base_parameters``, which arrive as widgets. ``apply_databricks_widgets`` bridges the two: it
creates a text widget per parameter (default = the notebook's value) and writes the widget's
value back into the notebook's variables, converted to the default's type. Where ``dbutils``
does not exist (everywhere but Databricks) it does nothing.

    apply_databricks_widgets(globals(), ["epochs", "batch_size", "backend"])
"""

from __future__ import annotations

import ast
from typing import Any


def _convert(text: str, default: Any) -> Any:
    if isinstance(default, bool):
        if text.strip().lower() in ("true", "1", "yes"):
            return True
        if text.strip().lower() in ("false", "0", "no"):
            return False
        raise ValueError(f"expected a boolean (true/false), got {text!r}")
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        return type(default)(ast.literal_eval(text)) if text.strip() else default
    if isinstance(default, str):
        return text
    # None or containers: a Python literal ("None", "4", "[1, 2]"); anything else stays text.
    if text.strip() in ("", "None"):
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def apply_databricks_widgets(namespace: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """On Databricks, read each of ``names`` from a widget into ``namespace``; elsewhere a no-op.

    Returns the values that changed (empty off Databricks).

    Raises:
        ValueError: when a widget's text cannot become the parameter's type, naming both.
    """
    dbutils = namespace.get("dbutils")
    if dbutils is None:
        return {}
    changed: dict[str, Any] = {}
    for name in names:
        default = namespace[name]
        dbutils.widgets.text(name, "" if default is None else str(default))
        text = dbutils.widgets.get(name)
        try:
            value = _convert(text, default)
        except (ValueError, SyntaxError) as exc:
            raise ValueError(f"widget {name}={text!r} cannot be used as {type(default).__name__} "
                             f"(default {default!r}): {exc}. Fix: set the job parameter to such a value.") from exc
        if value != default:
            namespace[name] = changed[name] = value
    return changed

