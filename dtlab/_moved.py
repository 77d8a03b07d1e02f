"""Old import paths that keep working for one release, with a DeprecationWarning naming the new one.

``forward(old, new, renamed, gone)`` returns a module ``__getattr__``: a name found in the new module is
returned with a warning that says where it lives now; a name that no longer exists raises an
AttributeError that names what replaces it.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def forward(old: str, new: str, gone: dict[str, str] | None = None,
            elsewhere: dict[str, str] | None = None) -> Callable[[str], Any]:
    """A module ``__getattr__`` for the moved module ``old``: names come from ``new`` (or, for the names in
    ``elsewhere``, from the module it maps them to) with a DeprecationWarning; names in ``gone`` raise an
    AttributeError carrying their replacement."""
    gone, elsewhere = gone or {}, elsewhere or {}

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in gone:
            raise AttributeError(f"{old}.{name} is gone: {gone[name]}")
        home = elsewhere.get(name, new)
        try:
            value = getattr(importlib.import_module(home), name)
        except AttributeError:
            raise AttributeError(f"module {old!r} has no attribute {name!r} (it moved to {new})") from None
        warnings.warn(f"{old}.{name} moved to {home}.{name}; {old} will be removed in the next release",
                      DeprecationWarning, stacklevel=2)
        return value

    return __getattr__
