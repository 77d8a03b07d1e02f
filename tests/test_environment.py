import os
import re
import sys
from pathlib import Path

import pytest
import torch

from dtlab import environment

pytestmark = pytest.mark.cluster  # code a cluster runs: make test-runtime repeats these on its stack


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only default")
def test_cpu_machine_plans_gloo_with_default_process_count():
    p = environment.plan()
    assert (p.backend, p.device, p.nprocs) == ("gloo", "cpu", environment.DEFAULT_CPU_PROCESSES)
    assert "no CUDA GPU" in p.reason


@pytest.mark.gpu
def test_gpu_machine_plans_nccl_one_process_per_gpu():
    p = environment.plan()
    assert (p.backend, p.device, p.nprocs) == ("nccl", "cuda", torch.cuda.device_count())
    forced = environment.plan(backend="gloo")
    assert (forced.backend, forced.device) == ("gloo", "cpu")


def test_forcing_gloo_and_nprocs_is_respected():
    p = environment.plan(backend="gloo", device="cpu", nprocs=3)
    assert (p.backend, p.device, p.nprocs) == ("gloo", "cpu", 3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="nccl is valid where a GPU exists")
def test_nccl_without_gpu_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="backend='gloo'"):
        environment.plan(backend="nccl")
    with pytest.raises(ValueError, match="device='cpu'"):
        environment.plan(device="cuda")


def test_too_many_processes_is_refused_with_the_fix():
    cores = os.cpu_count() or 1
    limit = environment.MAX_CPU_PROCESSES_PER_CORE * cores
    assert environment.plan(device="cpu", nprocs=limit).nprocs == limit
    with pytest.raises(ValueError, match=rf"nprocs<={cores}"):
        environment.plan(device="cpu", nprocs=limit + 1)


@pytest.mark.parametrize("kwargs, match", [
    ({"backend": "mpi2"}, "not one the course uses"),
    ({"device": "tpu"}, "not supported"),
    ({"nprocs": 0}, "positive integer"),
    ({"backend": "nccl", "device": "cpu"}, "gloo"),
])
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        environment.plan(**kwargs)


def test_report_names_versions_backends_and_plan():
    info = environment.report()
    assert info["torch"] == torch.__version__
    assert info["backends"]["gloo"] is True
    assert set(info["packages"]) >= {"deepspeed", "pyspark", "mlflow"}
    text = environment.format_report(info)
    assert torch.__version__ in text and "course plan backend=" in text and "horovod" in text


_RUNTIME = os.environ.get("DTLAB_TEST_RUNTIME")
#: The stack under test has no Horovod (a Databricks runtime after 15.4): the tests that need one are skipped there.
no_horovod = pytest.mark.skipif(bool(_RUNTIME) and "horovod" not in environment.DATABRICKS_RUNTIME_STACKS[_RUNTIME],
                                reason=f"Databricks Runtime {_RUNTIME} ML has no Horovod: its stack does not build it")


@no_horovod
def test_horovod_reported_as_built_with_gloo():
    status = environment.horovod_status()
    assert status["installed"], status.get("problem")
    assert status["gloo"] is True


def test_missing_horovod_is_reported_with_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "horovod", None)  # makes `import horovod` raise ImportError
    status = environment.horovod_status()
    assert status == {"installed": False, "problem": "horovod is not installed", "fix": status["fix"]}
    assert "make setup" in status["fix"] and "15.4 LTS ML" in status["fix"]
    assert "MISSING" in environment.format_report({**environment.report(), "horovod": status})
    with pytest.raises(RuntimeError, match="horovod is not installed. Fix: run `make setup`"):
        environment.require_horovod()


@no_horovod
def test_horovod_without_pytorch_support_is_reported(monkeypatch):
    monkeypatch.setitem(sys.modules, "horovod.torch", None)  # horovod imports, horovod.torch does not
    status = environment.horovod_status()
    assert not status["installed"] and "not built for PyTorch" in status["problem"]


def test_a_folder_named_horovod_on_the_path_is_not_horovod(tmp_path, monkeypatch):
    """clusters/ holds a folder horovod/ (launch templates): a script run from there imported it as a namespace
    package, and the report then failed on its missing __version__ (found running the serverless job's task)."""
    import importlib.util

    (tmp_path / "horovod").mkdir()
    # what `import horovod` gives where no package of that name is installed (one is, on the course's stack)
    spec = importlib.machinery.PathFinder.find_spec("horovod", [str(tmp_path)])
    folder = importlib.util.module_from_spec(spec)
    assert getattr(folder, "__file__", None) is None and list(folder.__path__) == [str(tmp_path / "horovod")]
    monkeypatch.setitem(sys.modules, "horovod", folder)
    status = environment.horovod_status()
    assert not status["installed"] and str(tmp_path / "horovod") in status["problem"], status
    assert "make setup" in status["fix"]


def test_java_is_present_for_spark():
    assert environment.java_version() is not None


# --- the plan on machines with 0, 1, 4 and 8 GPUs (gpu_count simulated) -----------------------------

@pytest.mark.parametrize("gpus, expected", [
    (0, ("gloo", "cpu", 2)),
    (1, ("gloo", "cpu", 2)),     # one GPU: NCCL cannot put two ranks on it; CPU processes teach the lesson
    (4, ("nccl", "cuda", 4)),
    (8, ("nccl", "cuda", 8)),
])
def test_multi_process_plan_for_each_machine(monkeypatch, gpus, expected):
    monkeypatch.setattr(environment, "gpu_count", lambda: gpus)
    p = environment.plan()
    assert (p.backend, p.device, p.nprocs) == expected, p
    assert p.nprocs >= 2, "a multi-process lesson always gets at least two processes"
    if gpus == 1:
        assert "NCCL needs one GPU per process" in p.reason


@pytest.mark.parametrize("gpus, device", [(0, "cpu"), (1, "cuda"), (4, "cuda"), (8, "cuda")])
def test_single_device_work_uses_a_gpu_whenever_there_is_one(monkeypatch, gpus, device):
    monkeypatch.setattr(environment, "gpu_count", lambda: gpus)
    p = environment.plan(nprocs=1)
    assert (p.device, p.nprocs) == (device, 1)


@pytest.mark.parametrize("gpus", [1, 4])
def test_more_processes_than_gpus_run_on_the_cpu_unless_cuda_is_forced(monkeypatch, gpus):
    monkeypatch.setattr(environment, "gpu_count", lambda: gpus)
    p = environment.plan(nprocs=gpus + 1)
    assert (p.backend, p.device, p.nprocs) == ("gloo", "cpu", gpus + 1)
    with pytest.raises(ValueError, match=rf"nprocs={gpus + 1} but this machine has {gpus} GPU"):
        environment.plan(nprocs=gpus + 1, device="cuda")
    with pytest.raises(ValueError, match="pass nprocs<="):
        environment.plan(nprocs=gpus + 1, backend="nccl")


def test_nccl_forced_on_one_gpu_for_a_multi_process_lesson_names_the_fix(monkeypatch):
    monkeypatch.setattr(environment, "gpu_count", lambda: 1)
    with pytest.raises(ValueError, match="needs 2 or more GPUs.*leave backend unset"):
        environment.plan(backend="nccl")
    assert environment.plan(backend="nccl", nprocs=1).device == "cuda"


def test_setup_plans_for_the_processes_on_this_machine(monkeypatch):
    """A 2-process job on a one-GPU machine: each rank's setup() must plan for 2 local processes (so
    the CPU), not for itself alone (which would send rank 1 to cuda:1)."""
    from dtlab import distributed

    asked = []

    def spy(backend=None, nprocs=None, device=None):
        asked.append(nprocs)
        raise RuntimeError("stop before joining")

    monkeypatch.setattr(distributed, "plan", spy)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(RuntimeError, match="stop before joining"):
        distributed.setup()
    assert asked == [2]


def test_console_scripts_are_found_beside_the_packages_not_only_on_path(tmp_path, monkeypatch):
    """A Databricks notebook's python is in its own folder, away from the runtime's scripts."""
    monkeypatch.setenv("PATH", str(tmp_path))             # nothing on PATH
    found = environment.console_script("torchrun")         # installed with torch, in every stack
    assert found is not None and found.endswith("/bin/torchrun"), found
    assert environment.console_script("no-such-tool-anywhere") is None


@pytest.mark.parametrize("runtime", sorted(environment.DATABRICKS_RUNTIME_STACKS))
def test_the_runtime_table_agrees_with_the_runtimes_requirements_file(runtime):
    text = (Path(__file__).resolve().parent.parent / f"requirements-dbr{runtime}.txt").read_text()
    pins = {}
    for line in text.splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[name.strip().lower()] = version.strip()
    for built in ("deepspeed", "horovod"):    # built by the set-up, named in the file's header
        header = re.search(rf"^# {built}: (\S+)$", text, flags=re.M)
        if header and header.group(1) != "none":
            pins[built] = header.group(1)
    shipped = environment.DATABRICKS_RUNTIME_STACKS[runtime]
    both = set(shipped) & set(pins)
    assert len(both) >= 10 and all(shipped[p] == pins[p] for p in both), {p: (shipped[p], pins[p]) for p in both}
    assert ("horovod" in shipped) == ("horovod" in pins), "Horovod is where the runtime has it, and only there"


def test_dtlab_env_names_libraries_installed_over_the_runtime(monkeypatch):
    """requirements.txt installed on a cluster replaces the runtime's torch, PySpark and MLflow."""
    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "15.4")
    found = environment.runtime_mismatches()
    if torch.__version__.split("+")[0] == "2.3.1":          # the runtime stack itself: nothing to report
        assert found == []
    else:
        assert any(line.startswith("torch ") and "runtime ships 2.3.1" in line for line in found)
        text = environment.format_report({**environment.report()})
        assert "MISMATCH" in text and "install only dtlab" in text
    monkeypatch.delenv("DATABRICKS_RUNTIME_VERSION")
    assert environment.runtime_mismatches() == []


def test_the_supported_ranges_start_at_the_runtimes_versions():
    """pyproject.toml's lower bounds are Databricks Runtime 15.4 LTS ML's versions, never newer."""
    import re
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    specs = project["dependencies"] + [d for extra in project["optional-dependencies"].values() for d in extra]
    lower = {m.group(1).lower(): m.group(2) for d in specs if (m := re.fullmatch(r"([\w-]+)>=([\d.]+)", d))}
    shipped = environment.DATABRICKS_RUNTIME_STACKS["15.4"]
    both = set(lower) & set(shipped)
    assert {"torch", "numpy", "pyspark", "mlflow", "pandas", "pyarrow", "cloudpickle"} <= both
    assert all(lower[p] == shipped[p] for p in both), {p: (lower[p], shipped[p]) for p in both}


def test_the_resumed_runs_size_and_the_global_batch_follow_the_gpus():
    from dtlab.environment import Plan, global_batch, resume_world

    cpu = Plan("gloo", "cpu", 2, "")
    assert resume_world(cpu) == 3 and resume_world(cpu, 1) == 1
    gpus = environment.gpu_count()
    node = Plan("nccl", "cuda", max(gpus, 1), "")               # every GPU of the node in use
    assert resume_world(node) == (node.nprocs - 1 if node.nprocs > 1 else 1)      # N + 1 does not exist: N - 1
    with pytest.raises(ValueError, match=rf"resume_on={gpus + 1} processes, one per GPU, but this node has {gpus} "
                                         r"GPU\(s\). Fix: resume_on <="):
        resume_world(node, gpus + 1)
    assert [global_batch(6, 2, 3), global_batch(6, 4, 3), global_batch(6, 8, 7)] == [12, 24, 56]
    for n, m in ((2, 3), (4, 3), (8, 7), (3, 4)):
        b = global_batch(5, n, m)
        assert b % n == 0 and b % m == 0 and b >= 5 * n
