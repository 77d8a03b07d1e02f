"""Run the course's notebooks headless with papermill, and summarise what happened.

Each run goes to its own folder ``runs/<timestamp>/``: the executed notebooks (with outputs and
plots), whatever the notebooks wrote (checkpoints, the MLflow store), and ``summary.json`` /
``summary.md`` with each notebook's status, duration, and failing cell and error if any, and
``environment.json`` (the machine and library versions).
Notebooks execute with that folder as their working directory, so nothing lands in the repo.

A notebook may carry small "CI" parameters in its metadata (``metadata.dtlab.ci_parameters``);
``ci=True`` uses them, so tests run the same notebooks in seconds rather than minutes. A second,
different set (``metadata.dtlab.alt_parameters``: more processes, other batch sizes) is what the
tests also run, so a lesson holds for any sensible parameters, not only its defaults.

Exercise solutions are code cells tagged ``solution`` (collapsed in Jupyter). A course run skips
them (``solutions=False``, the default: the learner tries first); the tests run them.

Horovod and DeepSpeed are built from source (minutes each, then cached as wheels). ``make course`` and ``make lab``
set up without them; before the first notebook that imports one, ``run`` builds it (``ensure_built``), saying so.

Everything a notebook starts must end with it: each run gives the kernel a ``DTLAB_RUN_ID``, and
any process that still carries it after the notebook finished is stopped and reported
(``Result.leftovers``). The kernel's scratch folder (``DTLAB_SCRATCH``) is the run folder.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dtlab.processes import wait_until_gone


class CourseError(ValueError):
    """Bad input to the course runner (unknown notebook, malformed parameter); exit code 2."""


@dataclass
class Result:
    """What happened to one notebook."""

    notebook: str
    status: str  # "ok" or "failed"
    seconds: float
    output: str
    failing_cell: int | None = None
    error: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    leftovers: list[str] = field(default_factory=list)  # processes the notebook left running (stopped)


def default_notebook_dir() -> Path:
    """``./notebooks`` when run from the repo root, else the folder next to the installed package."""
    here = Path.cwd() / "notebooks"
    return here if here.is_dir() else Path(__file__).resolve().parents[2] / "notebooks"


def find_notebooks(directory: str | os.PathLike | None = None) -> list[Path]:
    """The course notebooks (``NN_topic.ipynb``) in order."""
    directory = Path(directory) if directory else default_notebook_dir()
    return sorted(p for p in directory.glob("[0-9][0-9]_*.ipynb"))


#: The old names of lessons renumbered in December 2026, when notebook 12 became two lessons (12, FSDP; 13, sharded
#: checkpoints) and 13-20 became 14-21. An old name still runs what it named, with a note, for one release.
RENAMED = {"12_fsdp_and_sharded_checkpoints": ("12_fsdp", "13_sharded_checkpoints"),
           **{f"{n}_{topic}": (f"{n + 1}_{topic}",) for n, topic in (
               (13, "tensor_parallelism"), (14, "pipeline_parallelism"), (15, "context_and_expert_parallelism"),
               (16, "composing_parallelism"), (17, "ray_train"), (18, "activation_recomputation"),
               (19, "choosing_a_strategy"), (20, "from_table_to_registered_model"))}}


def renumbering_note(name: str) -> str | None:
    """What changed for ``name`` (a number from 12 to 21, or an old name) in the December 2026 renumbering, or None."""
    stem = Path(name).stem
    if stem in RENAMED:
        return f"note: {stem} was renamed in December 2026: it is now {' and '.join(RENAMED[stem])}"
    if not (stem.isdigit() and 12 <= int(stem) <= 21):
        return None
    number = f"{int(stem):02d}"
    now = next(new for news in RENAMED.values() for new in news if new.startswith(number + "_"))
    was = next((old for old in RENAMED if old.startswith(number + "_")), None)
    moved = f"; what was {number} ({was}) is now {' and '.join(RENAMED[was])}" if was else ""
    return f"note: the lessons were renumbered in December 2026: {number} is {now}{moved}"


def resolve(names: list[str], available: list[Path]) -> list[Path]:
    """Map user-given names (``01``, ``01_single_device_baseline``, a file name or path) to notebooks.

    A lesson's old name from before the December 2026 renumbering (``RENAMED``) runs what it named, with a note on
    stderr; so does a number from 12 to 21, whose lesson changed then.

    Raises:
        CourseError: for a name that matches no notebook, listing the valid names.
    """
    if not names:
        return list(available)
    chosen = []
    for name in names:
        path = Path(name)
        if path.suffix == ".ipynb" and path.is_file():
            chosen.append(path)
            continue
        stem = path.stem if path.suffix == ".ipynb" else name
        note = renumbering_note(stem)
        if note:
            print(note, file=sys.stderr)
        if stem in RENAMED and not any(p.stem == stem for p in available):
            chosen.extend(resolve(list(RENAMED[stem]), available))
            continue
        matches = [p for p in available if p.stem == stem or p.stem.split("_", 1)[0] == stem]
        if len(matches) != 1:
            valid = ", ".join(p.stem for p in available) or "(none found)"
            raise CourseError(f"unknown notebook {name!r}. Valid names: {valid} "
                              "(or just the number, e.g. 01).")
        chosen.append(matches[0])
    return chosen


def parse_params(items: list[str]) -> dict[str, Any]:
    """Parse ``["epochs=3", "backend='gloo'", "lr=1e-3"]`` into a dict of Python values.

    Values are read as Python literals when they are one (``3``, ``1e-3``, ``True``, ``None``,
    ``[1, 2]``) and as plain strings otherwise (``backend=gloo``).

    Raises:
        CourseError: for an item that is not ``name=value`` with a valid identifier.
    """
    params: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or not name.isidentifier():
            raise CourseError(f"malformed parameter {item!r}. Format: -p name=value, e.g. -p epochs=3 "
                              "-p backend=gloo -p lr=1e-3")
        try:
            params[name] = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            params[name] = raw.strip()
    return params


def notebook_parameters(path: Path) -> dict[str, Any]:
    """The parameters a notebook declares in its ``parameters`` cell (name -> default source).

    Read with Python's own parser: papermill's inspector skips a parameter whose comment holds
    parentheses (notebook 11's ``use_spark``), which made ``-p use_spark=False`` "undeclared".
    """
    nb = json.loads(Path(path).read_text())
    cell = next((c for c in nb["cells"] if c["cell_type"] == "code"
                 and "parameters" in c.get("metadata", {}).get("tags", [])), None)
    if cell is None:
        return {}
    source = "".join(cell["source"])
    return {node.targets[0].id: ast.get_source_segment(source, node.value) for node in ast.parse(source).body
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)}


def ci_parameters(path: Path) -> dict[str, Any]:
    """The small parameters a notebook asks for under CI (``metadata.dtlab.ci_parameters``)."""
    meta = json.loads(Path(path).read_text()).get("metadata", {})
    return dict(meta.get("dtlab", {}).get("ci_parameters", {}))


def edge_parameters(path: Path) -> dict[str, Any]:
    """Values at the edge of what the parameters cell accepts (``metadata.dtlab.edge_parameters``: degrees of 1,
    the most processes it allows, another node type), which the tests run on top of the CI set: a claim must hold
    for every value the cell accepts."""
    meta = json.loads(Path(path).read_text()).get("metadata", {})
    return dict(meta.get("dtlab", {}).get("edge_parameters", {}))


def alt_parameters(path: Path) -> dict[str, Any]:
    """A second parameter set the tests run on top of the CI one (``metadata.dtlab.alt_parameters``)."""
    meta = json.loads(Path(path).read_text()).get("metadata", {})
    return dict(meta.get("dtlab", {}).get("alt_parameters", {}))


def second_parameters(path: Path) -> dict[str, Any]:
    """What a notebook's second run sets over its CI parameters: its ``alt_parameters`` with its
    ``edge_parameters`` over them, so that one run reaches both other values and the edge of the range."""
    return {**alt_parameters(path), **edge_parameters(path)}


def without_solutions(path: Path, out: Path) -> Path:
    """Write ``path`` to ``out`` without its exercise-solution cells (tag ``solution``); return ``out``."""
    nb = json.loads(Path(path).read_text())
    nb["cells"] = [c for c in nb["cells"] if "solution" not in c.get("metadata", {}).get("tags", [])]
    out.write_text(json.dumps(nb, indent=1))
    return out


def stop_leftovers(run_id: str, grace: float = 5.0) -> list[str]:
    """Stop every process whose environment carries ``DTLAB_RUN_ID=run_id``; return their command lines.

    Processes get ``grace`` seconds to exit by themselves first: a kernel's children (a Spark JVM, say)
    notice their parent's exit a moment after it, and only what is still running then was left behind.
    """
    import psutil

    def running() -> list:
        out = []
        for proc in psutil.process_iter(["pid", "cmdline", "status"]):
            try:
                if (proc.pid == os.getpid() or proc.info["status"] == psutil.STATUS_ZOMBIE
                        or proc.environ().get("DTLAB_RUN_ID") != run_id):
                    continue
                out.append(proc)
            except (psutil.Error, OSError):
                continue
        return out

    found = wait_until_gone(running, grace)
    lines = []
    for proc in found:
        try:
            lines.append(" ".join(proc.cmdline())[:300])
            proc.kill()
        except psutil.Error:
            continue
    return lines


#: Seconds one cell may run before the notebook is stopped and reported as failed.
CELL_TIMEOUT_S = 900


def run_one(path: Path, run_dir: Path, params: dict[str, Any] | None = None, ci: bool = False,
            stream: bool = True, cell_timeout: int = CELL_TIMEOUT_S, solutions: bool = False,
            alt: bool = False, cwd: Path | None = None, kernel_name: str = "python3",
            env: dict[str, str] | None = None, inject_parameters: bool = True) -> Result:
    """Execute one notebook into ``run_dir`` (also its working directory) and return the Result.

    ``ci`` uses the notebook's CI parameters, ``alt`` adds its second run's on top (``second_parameters``),
    ``params`` override both. ``solutions=True`` also runs the exercise solutions.
    A cell running longer than ``cell_timeout`` seconds stops the notebook (a hang becomes a failure).
    ``cwd``, ``kernel_name``, ``env`` (added to the kernel's environment) and
    ``inject_parameters=False`` (the parameters reach the notebook some other way, as Databricks
    widgets do) let the tests run a notebook the way another platform would.
    """
    import uuid

    import papermill
    from papermill.exceptions import PapermillExecutionError

    merged = {**(ci_parameters(path) if ci else {}), **(second_parameters(path) if alt else {}), **(params or {})}
    out = run_dir / path.name
    source = path if solutions else without_solutions(path, run_dir / f".{path.stem}.input.ipynb")
    run_id = uuid.uuid4().hex
    kernel_env = {"DTLAB_HEADLESS": "1",  # LiveView prints lines instead of widgets
                  "DTLAB_RUN_ID": run_id,  # marks every process the notebook starts
                  "DTLAB_SCRATCH": str(Path(run_dir).resolve()),  # checkpoints and scripts stay in the run
                  **(env or {})}
    before = {k: os.environ.get(k) for k in kernel_env}
    for key, value in kernel_env.items():  # the kernel inherits them (an empty value unsets one)
        if value == "":
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    start = time.perf_counter()
    try:
        papermill.execute_notebook(
            str(source), str(out), parameters=merged if inject_parameters else None, cwd=str(cwd or run_dir),
            kernel_name=kernel_name,
            progress_bar=False, execution_timeout=cell_timeout, stdout_file=sys.stdout if stream else None,
            stderr_file=sys.stderr if stream else None)
        result = Result(path.stem, "ok", time.perf_counter() - start, str(out), parameters=merged)
    except PapermillExecutionError as exc:
        result = Result(path.stem, "failed", time.perf_counter() - start, str(out), failing_cell=exc.cell_index,
                        error=f"{exc.ename}: {exc.evalue}", parameters=merged)
    except Exception as exc:  # kernel died, timeout, unreadable notebook
        result = Result(path.stem, "failed", time.perf_counter() - start, str(out),
                        error=f"{type(exc).__name__}: {exc}", parameters=merged)
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if source != path:
            Path(source).unlink(missing_ok=True)
    result.leftovers = stop_leftovers(run_id)
    return result


def new_run_dir(root: str | os.PathLike = "runs") -> Path:
    """A fresh ``runs/<YYYYmmdd-HHMMSS>/`` folder (suffixed if two runs start in one second)."""
    base = Path(root) / time.strftime("%Y%m%d-%H%M%S")
    path, i = base, 1
    while path.exists():
        path, i = Path(f"{base}-{i}"), i + 1
    path.mkdir(parents=True)
    return path


#: Packages a lesson may import that the set-up builds from source, and the script in ``scripts/`` that builds one
#: (once per Python and torch, cached as a wheel: see ``scripts/lib.sh``).
BUILT_FROM_SOURCE = {"horovod": "build_horovod.sh", "deepspeed": "build_deepspeed.sh"}
#: How to tell that one is built, run by the Python the lessons use: requirements.txt installs DeepSpeed's
#: Python package, whose ops the build script compiles in (without them a lesson would compile them itself).
BUILT_CHECK = {"horovod": "import horovod.torch",
               "deepspeed": "import sys\nfrom deepspeed.git_version_info import installed_ops\n"
                            "sys.exit(not installed_ops.get('cpu_adam'))"}


def is_built(name: str, python: str = sys.executable) -> bool:
    """Whether ``python`` has ``name`` built (``BUILT_CHECK``; any other name: importable)."""
    if name not in BUILT_CHECK:
        return subprocess.run([python, "-c", f"import {name}"], capture_output=True).returncode == 0
    return subprocess.run([python, "-c", BUILT_CHECK[name]], capture_output=True).returncode == 0


def needed_builds(path: Path, builds: dict[str, str] = BUILT_FROM_SOURCE) -> list[str]:
    """The packages of ``builds`` (``BUILT_FROM_SOURCE``) that the notebook's code imports (anywhere, workers'
    functions too)."""
    cells = json.loads(Path(path).read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    imported = re.findall(r"^\s*(?:import|from)\s+([A-Za-z_]\w*)", code, re.MULTILINE)
    return [name for name in builds if name in imported]


def ensure_built(path: Path, python: str = sys.executable, builds: dict[str, str] = BUILT_FROM_SOURCE,
                 scripts: Path | None = None) -> list[str]:
    """Build what the notebook imports and this Python lacks (``needed_builds``) with the repository's scripts
    (``scripts``: the folder, by default the repository's ``scripts/``); returns the names built. Without the
    scripts (dtlab installed from a wheel) it says what is missing and builds nothing: the notebook then names
    the fix itself."""
    scripts = Path(scripts) if scripts else Path(__file__).resolve().parents[2] / "scripts"
    built = []
    for name in needed_builds(path, builds):
        if is_built(name, python):
            continue
        script = scripts / builds[name]
        if not script.is_file():
            print(f"[course] {Path(path).stem} imports {name}, which this Python lacks and no scripts/ folder is "
                  "here to build", flush=True)
            continue
        print(f"[course] {Path(path).stem} is the first lesson here that needs {name}: building it once "
              f"(scripts/{script.name}; minutes, then cached)", flush=True)
        subprocess.run(["bash", str(script), python], cwd=scripts.parent, check=True)
        built.append(name)
    return built


def run(names: list[str] | None = None, params: dict[str, Any] | None = None, ci: bool = False,
        root: str | os.PathLike = "runs", notebook_dir: str | os.PathLike | None = None,
        stream: bool = True, solutions: bool = False) -> tuple[Path, list[Result]]:
    """Run the named notebooks (all when empty) into a new run folder; return it and the results.

    Raises:
        CourseError: unknown notebook, or a parameter that none of the chosen notebooks declares.
    """
    notebooks = resolve(list(names or []), find_notebooks(notebook_dir))
    if not notebooks:
        raise CourseError(f"no notebooks found in {notebook_dir or default_notebook_dir()}")
    params = params or {}
    if params:
        declared = set().union(*(notebook_parameters(nb) for nb in notebooks))
        unknown = sorted(set(params) - declared)
        if unknown:
            raise CourseError(f"parameter(s) {', '.join(unknown)} not declared by "
                              f"{', '.join(nb.stem for nb in notebooks)}. Valid: {', '.join(sorted(declared))}")
    run_dir = new_run_dir(root)
    write_environment(run_dir)
    results = []
    for nb in notebooks:
        own = {k: v for k, v in params.items() if k in notebook_parameters(nb)}
        ensure_built(nb)
        print(f"[course] {nb.stem}: running{' (CI parameters)' if ci else ''} ...", flush=True)
        result = run_one(nb, run_dir, own, ci=ci, stream=stream, solutions=solutions)
        print(f"[course] {nb.stem}: {result.status} in {result.seconds:.1f} s"
              + (f" — cell {result.failing_cell}: {result.error}" if result.error else ""), flush=True)
        if result.leftovers:
            print(f"[course] {nb.stem}: stopped {len(result.leftovers)} process(es) it left running: "
                  + "; ".join(result.leftovers), flush=True)
        results.append(result)
    write_summary(run_dir, results)
    return run_dir, results


def format_summary(results: list[Result]) -> str:
    """A Markdown table: notebook, status, seconds, failing cell and error."""
    rows = ["| notebook | status | seconds | failing cell | error |", "|---|---|---:|---:|---|"]
    for r in results:
        error = (r.error or "").replace("|", "\\|").splitlines()[0][:200] if r.error else ""
        rows.append(f"| {r.notebook} | {r.status} | {r.seconds:.1f} | "
                    f"{'' if r.failing_cell is None else r.failing_cell} | {error} |")
    ok = sum(r.status == "ok" for r in results)
    rows.append(f"\n{ok}/{len(results)} notebooks ok, {sum(r.seconds for r in results):.1f} s in total")
    return "\n".join(rows)


def write_environment(run_dir: Path) -> None:
    """Write ``environment.json`` (what ``dtlab env --json`` prints) into the run folder: the machine
    and library versions the run's numbers come from (the course website shows it on every page)."""
    from dtlab import environment

    (run_dir / "environment.json").write_text(json.dumps(environment.report(), indent=2, default=str))


def write_summary(run_dir: Path, results: list[Result]) -> None:
    """Write ``summary.json`` and ``summary.md`` into the run folder."""
    (run_dir / "summary.json").write_text(json.dumps([asdict(r) for r in results], indent=2, default=str))
    (run_dir / "summary.md").write_text(f"# Course run {run_dir.name}\n\n{format_summary(results)}\n")
