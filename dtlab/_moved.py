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


#: Modules that moved when dtlab's folders became its map (old name -> new path). Their old import paths
#: (``import dtlab.fsdp2``, ``from dtlab import hardware``, ``dtlab.clusters.bundle``) keep working for one
#: release: each gives a module whose names come from the new one, with a DeprecationWarning naming it.
MOVED = {
    "fsdp2": "dtlab.parallel.fsdp2",
    "dtensor": "dtlab.parallel.dtensor",
    "pipelining": "dtlab.parallel.pipelining",
    "composition": "dtlab.parallel.mesh",
    "side_by_side": "dtlab.parallel.side_by_side",
    "hardware": "dtlab.planner.hardware",
    "speedup": "dtlab.planner.speedup",
    "cli": "dtlab.tooling.cli",
    "course": "dtlab.tooling.runner",
    "website": "dtlab.tooling.website",
    "jobs": "dtlab.tooling.jobs",
    "clusters": "dtlab.tooling.clusters",
}


def new_home(fullname: str) -> str | None:
    """``dtlab.clusters.bundle`` -> ``dtlab.tooling.clusters.bundle``; None for a name that did not move."""
    parts = fullname.split(".")
    if len(parts) < 2 or parts[0] != "dtlab" or parts[1] not in MOVED:
        return None
    return ".".join([MOVED[parts[1]], *parts[2:]])


class _OldPathLoader:
    """Builds the forwarding module for an old path (``importlib.abc.Loader``'s two methods)."""

    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):  # the default: a fresh, empty module
        return None

    def exec_module(self, module) -> None:
        new = importlib.import_module(self.new)
        old = module.__name__
        warnings.warn(f"{old} moved to {self.new}; the old path will be removed in the next release",
                      DeprecationWarning, stacklevel=2)
        module.__doc__ = f"Moved: {old} is now {self.new} (this old path works for one release). {new.__doc__ or ''}"
        module.__getattr__ = forward(old, self.new)
        module.__dir__ = lambda: dir(new)
        if hasattr(new, "__path__"):
            module.__path__ = []  # its submodules' old paths come here too


class OldPathFinder:
    """A meta-path finder that answers only for the moved modules' old names (``sys.meta_path``)."""

    @classmethod
    def find_spec(cls, fullname: str, path=None, target=None):
        new = new_home(fullname)
        if new is None:
            return None
        import importlib.machinery

        is_package = hasattr(importlib.import_module(new), "__path__")
        return importlib.machinery.ModuleSpec(fullname, _OldPathLoader(new), is_package=is_package)


def install_old_paths() -> None:
    """Let the moved modules' old paths import (once per interpreter)."""
    import sys

    if not any(f is OldPathFinder for f in sys.meta_path):
        sys.meta_path.append(OldPathFinder)
