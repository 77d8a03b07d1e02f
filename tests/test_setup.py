"""Set-up is idempotent: a second run installs and builds nothing, and says so."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test here starts a cluster, a browser, a set-up or several launches


ROOT = Path(__file__).resolve().parent.parent


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
