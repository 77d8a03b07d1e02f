"""Set-up is idempotent: a second run installs and builds nothing, and says so."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test here starts a cluster, a browser, a set-up or several launches


ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.alone  # with anything to do, the set-up reinstalls into the venv the other tests run from
def test_second_setup_builds_nothing():
    venv = Path(sys.prefix)
    result = subprocess.run(["bash", "scripts/setup.sh"], cwd=ROOT, capture_output=True, text=True,
                            env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "VENV": str(venv)}, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "packages up to date" in out
    assert "with PyTorch + Gloo already installed" in out
    assert "deepspeed 0.19.8 with prebuilt ops" in out and "already installed" in out
    assert "building" not in out and "installing" not in out


def test_the_installed_packages_are_compiled_to_bytecode():
    """The set-up installs with --no-compile and compiles afterwards on every core: nothing may be left out."""
    import importlib.util

    import mlflow
    import pandas
    import torch

    for module in (torch, pandas, mlflow, torch.distributed):
        assert Path(importlib.util.cache_from_source(module.__file__)).exists(), f"{module.__name__} not compiled"


def test_deepspeed_ops_are_prebuilt_so_no_lesson_compiles():
    from deepspeed.git_version_info import installed_ops

    assert installed_ops["cpu_adam"]
    if __import__("torch").cuda.is_available():
        assert installed_ops["fused_adam"]
    else:  # CPU: fused_adam is not built (the course's configs run torch's AdamW: nothing loads it)
        assert installed_ops["deepspeed_shm_comm"]


def test_dtlab_env_command_reports_the_plan():
    result = subprocess.run([str(Path(sys.prefix) / "bin" / "dtlab"), "env"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "course plan backend=" in result.stdout and "horovod     0.28.1" in result.stdout


@pytest.mark.parametrize("second_fails", [False, True])
@pytest.mark.parametrize("first_fails", [False, True])
def test_the_two_test_phases_both_run_and_exit_as_one_pytest_run(tmp_path, first_fails, second_fails):
    """make test's phases (scripts/test_phases.sh): a failure in the first does not skip the second."""
    (tmp_path / "test_phases_a.py").write_text(
        "import pytest\n\ndef test_two_at_a_time():\n    assert " + str(not first_fails) + "\n")
    (tmp_path / "test_phases_b.py").write_text(
        "import pytest\n\n@pytest.mark.serial\ndef test_one_at_a_time():\n    assert " + str(not second_fails) + "\n")
    result = subprocess.run(["bash", str(ROOT / "scripts" / "test_phases.sh"), sys.executable, "not serial", "serial",
                             "-p", "no:cacheprovider", "-W", "ignore::pytest.PytestUnknownMarkWarning", str(tmp_path)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = result.stdout + result.stderr
    assert "2 workers [1 item]" in out and out.count("passed") + out.count("failed") >= 2, out
    assert result.returncode == (1 if first_fails or second_fails else 0), out


def test_the_test_phases_exit_5_only_when_neither_selects_a_test(tmp_path):
    (tmp_path / "test_phases_a.py").write_text("def test_a():\n    pass\n")
    run = ["bash", str(ROOT / "scripts" / "test_phases.sh"), sys.executable, "not serial", "serial", "-p",
           "no:cacheprovider", "-W", "ignore::pytest.PytestUnknownMarkWarning", str(tmp_path)]
    env = {**__import__("os").environ, "TEST_WORKERS": "0"}
    assert subprocess.run(run, cwd=tmp_path, capture_output=True, env=env, timeout=300).returncode == 0
    assert subprocess.run([*run, "-k", "nothing"], cwd=tmp_path, capture_output=True, env=env,
                          timeout=300).returncode == 5


def test_make_lab_has_jupyterlab_and_the_course_kernel():
    """``make lab`` runs the venv's ``jupyter lab`` on notebooks/ with the kernel the set-up registers."""
    import json

    jupyter = Path(sys.executable).parent / "jupyter"
    version = subprocess.run([str(jupyter), "lab", "--version"], capture_output=True, text=True, timeout=120)
    assert version.returncode == 0 and version.stdout.strip()[0].isdigit(), version.stderr[-2000:]
    specs = subprocess.run([str(jupyter), "kernelspec", "list", "--json"], capture_output=True, text=True, timeout=120)
    kernel = json.loads(specs.stdout)["kernelspecs"]["python3"]
    assert kernel["spec"]["display_name"] == "Python 3 (dtlab)" and kernel["spec"]["argv"][0] == sys.executable
