"""How the cluster validator words a problem: ``key.path: what is wrong. Fix: what to write``.

Every check in ``dtlab.tooling.clusters`` reports problems as such strings (``validate`` prefixes the file),
builds key paths with ``join`` and proposes a close valid name with ``suggest``.
"""

from __future__ import annotations

import difflib
from typing import Any


class ClusterConfigError(ValueError):
    """A cluster or bundle file is invalid (``problems`` lists each, naming file, key and fix)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def join(where: str, key: Any) -> str:
    """The key path of ``key`` inside ``where``: ``a.b`` for a mapping key, ``a[0]`` for a list index.

    Args:
        where: the path so far ("" at the top of a file).
        key: a mapping key (str) or a list index (int).

    Returns:
        The joined path, e.g. ``join("spark_conf", "spark.master") == "spark_conf.spark.master"``.
    """
    return f"{where}[{key}]" if isinstance(key, int) else (f"{where}.{key}" if where else str(key))


def suggest(word: Any, choices: list[str]) -> str:
    """``did you mean 'x'?`` for the closest of ``choices``, else the list of valid choices.

    Args:
        word: what the file says.
        choices: the valid names.

    Returns:
        The text that follows ``Fix: `` in a problem.
    """
    close = difflib.get_close_matches(str(word), choices, n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else f"valid: {', '.join(sorted(choices))}"
