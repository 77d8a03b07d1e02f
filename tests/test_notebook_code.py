"""The notebooks' own code follows the plan: no hard-coded backend, device or process count, and every
lesson's planning works on machines with 0, 1, 4 and 8 GPUs.

A lesson that writes ``init_process_group("nccl")`` or ``torch.device("cuda", rank)`` breaks on the
machine it did not imagine (a laptop, a one-GPU workstation). Every backend, device and process count
comes from ``dtlab.environment.plan``; a cell that must use one on purpose (a pitfall shown on gloo,
say) says so on that line with a ``# deliberately ...`` comment.
"""

import ast
import json
from pathlib import Path

import pytest

from dtlab import environment

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
CHOICES = {"nccl", "gloo", "cuda", "cpu"}
LAUNCHERS = ("launch.run(", "run(", "TorchDistributor(", "horovod.run(", "horovod.spark.run(")


def _code_cells(path):
    nb = json.loads(path.read_text())
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            source = "".join(cell["source"])
            # IPython magics are not Python
            source = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())
            yield i, cell, source


def _hard_coded(source):
    """(line, text) of each call that passes a backend or device name as a literal."""
    tree = ast.parse(source)
    lines = source.splitlines()
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if func == "plan":
            continue  # asking the planner for a choice (it checks the machine) is how a lesson forces one
        values = [(None, a) for a in node.args] + [(k.arg, k.value) for k in node.keywords]
        for keyword, value in values:
            if not (isinstance(value, ast.Constant) and value.value in CHOICES):
                continue
            if keyword == "map_location" or (func == "to" and value.value == "cpu"):
                continue  # bringing results back to the host is the same on every machine
            line = lines[node.lineno - 1]
            if "# deliberately" not in line:
                found.append((node.lineno, line.strip()))
        fixed = [k for k in node.keywords if k.arg in ("nprocs", "num_proc", "num_processes")
                 and isinstance(k.value, ast.Constant) and k.value.value != 1]  # 1: the single-process reference
        if fixed:
            line = lines[node.lineno - 1]
            if "# deliberately" not in line:
                found.append((node.lineno, line.strip()))
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_no_cell_hard_codes_a_backend_device_or_process_count(path):
    problems = [f"cell {i}, line {n}: {text}" for i, _, src in _code_cells(path) for n, text in _hard_coded(src)]
    assert not problems, (f"{path.name} chooses a backend/device/process count itself instead of following "
                          "dtlab.environment.plan (or mark the line '# deliberately <why>'):\n" + "\n".join(problems))


def _meshless_fully_shard(source):
    """(line, text) of each ``fully_shard(...)`` call without ``mesh=``: the default mesh follows the machine's
    accelerator (CUDA on a one-GPU machine running 2 gloo CPU processes), not the run's device. A line that shows
    the mistake on purpose says so ("the mistake")."""
    lines = source.splitlines()
    return [(node.lineno, lines[node.lineno - 1].strip()) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "fully_shard"
            and not any(k.arg == "mesh" for k in node.keywords) and "the mistake" not in lines[node.lineno - 1]]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_fully_shard_call_passes_the_runs_mesh(path):
    problems = [f"cell {i}, line {n}: {text}"
                for i, _, src in _code_cells(path) for n, text in _meshless_fully_shard(src)]
    assert not problems, f"{path.name}: pass mesh= (e.g. dtlab.parallel.mesh.device_mesh(device, dp=N)):\n" + \
        "\n".join(problems)


def test_the_mesh_check_catches_a_call_without_one():
    assert _meshless_fully_shard("for b in m.blocks:\n    fully_shard(b)\nfully_shard(m, mesh=mesh)") == \
        [(2, "fully_shard(b)")]


#: Calls that need a classic Spark session (a SparkContext): on Spark Connect (serverless compute, a standard access
#: mode cluster) they raise deep inside the library. TorchDistributor runs on Connect (notebook 04 runs on one).
CLASSIC_ONLY = ("horovod.spark.run(", "setup_ray_cluster(", ".sparkContext")
CONNECT_GUARDS = ("classic_problem(", "require_classic(", "is_connect(")


def _unguarded_classic_calls(source):
    """The lines of a cell that call a classic-only API without the cell checking for Spark Connect first."""
    lines = source.splitlines()
    guard = next((n for n, line in enumerate(lines) if any(g in line for g in CONNECT_GUARDS)), None)
    return [line.strip() for n, line in enumerate(lines) if any(c in line for c in CLASSIC_ONLY)
            and not line.lstrip().startswith("#") and (guard is None or n < guard)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_classic_spark_only_call_steps_aside_on_spark_connect(path):
    """Issue 53: a Spark Connect session gets the lesson's message (dtlab.spark.classic_problem), not a traceback."""
    problems = [f"cell {i}: {line}" for i, _, src in _code_cells(path) for line in _unguarded_classic_calls(src)]
    assert not problems, (f"{path.name}: check dtspark.classic_problem(spark, what) before these, and step aside "
                          "with its message:\n" + "\n".join(problems))


def test_the_connect_check_catches_an_unguarded_call():
    assert _unguarded_classic_calls("spark = dtspark.session()\nhorovod.spark.run(f, num_proc=2)")
    assert _unguarded_classic_calls("n = spark.sparkContext.defaultParallelism\nif dtspark.is_connect(spark): pass")
    assert not _unguarded_classic_calls("why = dtspark.classic_problem(spark, 'x')\nif not why:\n    "
                                        "setup_ray_cluster(max_worker_nodes=1)")
    assert not _unguarded_classic_calls("# spark.sparkContext is not on Connect\nx = 1")


def test_the_check_catches_what_it_should():
    assert _hard_coded('dist.init_process_group("nccl")')
    assert _hard_coded('dev = torch.device("cuda", rank) if gpu else torch.device("cpu")')
    assert _hard_coded('run(fn, cfg, nprocs=2)')
    assert not _hard_coded('dist.init_process_group(cfg["backend"])')
    assert not _hard_coded('run(forgets, "gloo", nprocs=n)  # deliberately gloo: the pitfall is shown on CPU')
    assert not _hard_coded('torch.load(p, map_location="cpu"); w.to("cpu")')
    assert not _hard_coded('run(train, cfg, nprocs=1)'), "one process is the reference on every machine"
    assert not _hard_coded('environment.plan(backend="nccl", nprocs=3)'), "the planner checks a forced choice"


def _plan_statements(path):
    """The parameters cell's assignments, and every top-level assignment that calls environment.plan or
    derives from a plan (``N = plan.nprocs``), in notebook order."""
    params, plans = [], []
    for _, cell, source in _code_cells(path):
        tree = ast.parse(source)
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            params += [ast.get_source_segment(source, n) for n in tree.body if isinstance(n, ast.Assign)]
            continue
        for node in tree.body:
            text = ast.get_source_segment(source, node)
            if isinstance(node, ast.Assign) and ("environment.plan(" in text or "plan." in text):
                plans.append(text)
    return params, plans


def _lesson_parameter_sets(path):
    from dtlab.tooling import runner as course

    ci = course.ci_parameters(path)
    return {"defaults": {}, "ci": ci, "second": {**ci, **course.second_parameters(path)}}


@pytest.mark.parametrize("gpus", [0, 1, 4, 8])
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_each_lesson_plans_for_machines_with_0_1_4_and_8_gpus(path, gpus, monkeypatch):
    monkeypatch.setattr(environment, "gpu_count", lambda: gpus)
    params, plans = _plan_statements(path)
    text = "\n".join(src for _, _, src in _code_cells(path))
    if any(launcher in text for launcher in LAUNCHERS):
        assert plans, f"{path.name} starts processes but has no `... = environment.plan(...)` line"
    for name, overrides in _lesson_parameter_sets(path).items():
        namespace = {"environment": environment, "torch": __import__("torch")}
        for assignment in params:
            exec(assignment, namespace)
        namespace.update(overrides)
        for statement in plans:
            try:
                exec(statement, namespace)  # raises if this machine cannot run the lesson's plan
            except NameError:
                if "environment.plan(" in statement:
                    raise
                continue  # derived from something other than the plan: not planning logic
        for value in namespace.values():
            if isinstance(value, environment.Plan):
                assert value.device == "cpu" or value.nprocs <= gpus, (name, value)
                assert value.backend != "nccl" or value.device == "cuda", (name, value)
