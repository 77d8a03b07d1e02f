import os
import sys

import pytest
import torch
from conftest import requires_gpu

from dtlab import environment


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only default")
def test_cpu_machine_plans_gloo_with_default_process_count():
    p = environment.plan()
    assert (p.backend, p.device, p.nprocs) == ("gloo", "cpu", environment.DEFAULT_CPU_PROCESSES)
    assert "no CUDA GPU" in p.reason


@requires_gpu
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


def test_horovod_without_pytorch_support_is_reported(monkeypatch):
    monkeypatch.setitem(sys.modules, "horovod.torch", None)  # horovod imports, horovod.torch does not
    status = environment.horovod_status()
    assert not status["installed"] and "not built for PyTorch" in status["problem"]


def test_java_is_present_for_spark():
    assert environment.java_version() is not None
