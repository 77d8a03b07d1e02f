"""Notebook plumbing: the lesson's claims, parameters from papermill or Databricks widgets, checks that name
a fix, scratch space.

``Claims`` is the course's central mechanism: every number a lesson states (a speed-up, memory saved,
"equal to one process") is checked in its last cell, each claim with the measured values it rests on,
written to ``<notebook>.claims.json`` and raising when one does not hold — so running a notebook
headless (``make test``) tests what it teaches.

    claims = Claims("03_ddp")
    claims.check("DDP on 2 processes = one process on the full batch", diff <= bound, max_diff=diff, bound=bound)
    claims.verify()

A course notebook's first code cell (tagged ``parameters``) assigns every knob a default.
papermill overrides them by inserting a cell after it. On Databricks there is no papermill: a job
passes ``base_parameters``, which arrive as widgets. ``apply_databricks_widgets`` bridges the two: it
creates a text widget per parameter (default = the notebook's value) and writes the widget's
value back into the notebook's variables, converted to the default's type. Where ``dbutils``
does not exist (everywhere but Databricks) it does nothing.

    apply_databricks_widgets(globals(), ["epochs", "batch_size", "backend"])

On Databricks it also checks the cluster's runtime: the course needs an ML runtime (torch, MLflow,
Spark's TorchDistributor); a non-ML runtime stops here with the fix, a CPU ML runtime says in one
line that the lessons will run on CPU processes.

``require_divisible`` turns "this parameter must divide by that" into an error naming values
that work; ``scratch_dir`` moves a notebook's files (checkpoints, scripts) to local disk.
"""

from __future__ import annotations

import ast
import os
import tempfile
from pathlib import Path
from typing import Any


def _convert(text: str, default: Any) -> Any:
    if isinstance(default, bool):
        if text.strip().lower() in ("true", "1", "yes"):
            return True
        if text.strip().lower() in ("false", "0", "no"):
            return False
        raise ValueError(f"expected a boolean (true/false), got {text!r}")
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        if not text.strip():
            return default
        value = ast.literal_eval(text)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"expected a number, got {text!r}")
        if isinstance(default, int) and float(value) != int(value):
            raise ValueError(f"expected a whole number, got {text!r}")
        return type(default)(value)
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
    check_databricks_runtime(namespace.get("spark"))
    changed: dict[str, Any] = {}
    for name in names:
        default = namespace[name]
        dbutils.widgets.text(name, "" if default is None else str(default))
        text = dbutils.widgets.get(name)
        try:
            value = _convert(text, default)
        except (ValueError, SyntaxError) as exc:
            kind = {bool: "true or false", int: "whole number", float: "number"}.get(type(default), "Python literal")
            raise ValueError(f"widget {name}={text!r} cannot be used as {type(default).__name__} "
                             f"(default {default!r}): {exc}. Fix: set the job parameter {name} to a {kind}, "
                             f"e.g. \"{default}\"") from None
        if value != default:
            namespace[name] = changed[name] = value
    return changed



class RuntimeMismatch(RuntimeError):
    """The cluster's Databricks runtime cannot run the course; the message names the fix."""


def check_databricks_runtime(spark: Any = None, version: str | None = None) -> str:
    """The cluster's runtime (``18.x-gpu-ml-scala2.13``); raise for a non-ML runtime.

    The course targets Databricks Runtime 18 LTS ML (any of its point releases, 18.0-18.2) and 15.4 LTS ML (the last
    with Horovod, notebook 05), and keeps 17.3 LTS ML's library versions (not run in CI); on
    another ML runtime it prints which of its lessons' version-gated cells to expect skipped or untested.

    ``version`` defaults to the cluster's ``spark.databricks.clusterUsageTags.sparkVersion``.
    A CPU ML runtime is accepted with a one-line note: the lessons run CPU processes with gloo.
    """
    if version is None:
        try:
            version = spark.conf.get("spark.databricks.clusterUsageTags.sparkVersion") if spark is not None else None
        except Exception:  # not a Databricks session
            version = None
    if not version:
        return ""
    if "-ml-" not in version:
        raise RuntimeMismatch(f"this cluster runs Databricks Runtime {version}, which is not an ML runtime: the course "
                              "needs PyTorch, MLflow and TorchDistributor from Databricks Runtime ML. Fix: edit the "
                              "cluster (or the job cluster in databricks.yml) to 18.x-gpu-ml-scala2.13, "
                              "Databricks Runtime 18 LTS ML for GPUs (15.4.x-gpu-ml-scala2.12 for Horovod).")
    if "-gpu-" not in version:
        print(f"note: {version} is a CPU runtime: the lessons run CPU processes with gloo (use "
              "18.x-gpu-ml-scala2.13 on a GPU node to run them on GPUs).")
    major_minor = version.split(".x")[0]
    if major_minor != "15.4" and major_minor.split(".")[0] != "18":
        print(f"note: the course is tested on Databricks Runtime 18 and 15.4 LTS ML, not {major_minor}: a lesson may "
              "meet library versions it was not run with (`dtlab env` lists them).")
    return version


def require_divisible(name: str, value: int, by: int, what: str) -> None:
    """Raise ``ValueError`` when ``value`` does not divide by ``by``, naming the nearest values that do.

    ``require_divisible("global_batch", 64, 3, "processes")`` raises "global_batch=64 must divide by 3
    processes. Fix: global_batch=63 or global_batch=66 (or change the processes)".
    """
    if by < 1:
        raise ValueError(f"{what}={by} must be at least 1")
    if value % by:
        low, high = value // by * by, (value // by + 1) * by
        options = " or ".join(f"{name}={v}" for v in (low, high) if v > 0)
        raise ValueError(f"{name}={value} must divide by {by} {what}. Fix: {options} (or change the {what})")


def scratch_dir(name: str = "") -> Path:
    """Where a notebook writes its files (checkpoints, scripts, stores), created if missing.

    * ``DTLAB_SCRATCH`` when set (``dtlab course run`` sets it to the run folder);
    * on Databricks, ``/local_disk0/tmp/dtlab``: the node's local disk. The notebook's own folder is
      in the workspace, which has file-size limits, is not writable from worker processes, and is
      not where checkpoints belong;
    * elsewhere, ``<temp>/dtlab-scratch``.

    ``name`` adds a sub-folder (e.g. the notebook's name).
    """
    if os.environ.get("DTLAB_SCRATCH"):
        base = Path(os.environ["DTLAB_SCRATCH"])
    elif "DATABRICKS_RUNTIME_VERSION" in os.environ:
        local = Path("/local_disk0")
        base = local / "tmp" / "dtlab" if local.is_dir() else Path(tempfile.gettempdir()) / "dtlab"
    else:
        base = Path(tempfile.gettempdir()) / "dtlab-scratch"
    folder = base / name if name else base
    folder.mkdir(parents=True, exist_ok=True)
    return folder.resolve()


def use_scratch_dir(name: str = "") -> Path:
    """``os.chdir(scratch_dir(name))`` and return it: every relative path the notebook (and the processes
    it starts) writes to lands on local scratch space. Prints where, so you can find the files."""
    folder = scratch_dir(name)
    os.chdir(folder)
    print(f"working directory: {folder}")
    return folder


class Claims:
    """A notebook's claims, checked together at the end and recorded with their measured values.

    Every claim is evaluated (one failing claim does not hide the others), written to
    ``claims.json`` in the scratch folder (the claim-stability benchmark and the course website
    read it), and ``verify()`` raises ``AssertionError`` listing each claim that did not hold.

        claims = Claims("08_performance_and_scaling")
        claims.check("accumulation amortises the all-reduce", acc > plain, accumulated=acc, plain=plain)
        claims.verify()
    """

    def __init__(self, notebook: str):
        self.notebook = notebook
        self.results: list[dict[str, Any]] = []

    def check(self, claim: str, holds: Any, **measured: Any) -> bool:
        """Record ``claim`` with whether it ``holds`` and the measured numbers it rests on."""
        ok = bool(holds)
        self.results.append({"claim": claim, "holds": ok,
                             "measured": {k: _plain(v) for k, v in measured.items()}})
        return ok

    def verify(self) -> None:
        """Write ``claims.json`` and print each claim; raise if any did not hold."""
        import json

        path = scratch_dir() / f"{self.notebook}.claims.json"
        path.write_text(json.dumps(self.results, indent=1))
        for r in self.results:
            values = ", ".join(f"{k}={v}" for k, v in r["measured"].items())
            print(f"{'holds ' if r['holds'] else 'FAILED'}  {r['claim']}" + (f"  ({values})" if values else ""))
        failed = [r for r in self.results if not r["holds"]]
        if failed:
            raise AssertionError(f"{len(failed)} of {len(self.results)} claims failed: "
                                 + "; ".join(f"{r['claim']} {r['measured']}" for r in failed))
        print(f"all {len(self.results)} claims hold")


def _plain(value: Any) -> Any:
    """A JSON-friendly form of a measured value (numbers rounded to 6 significant digits)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return float(f"{value:.6g}") if isinstance(value, float) else value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    try:
        return _plain(value.item())  # a 0-d tensor or numpy scalar
    except (AttributeError, ValueError):
        return str(value)
