"""Set-up is idempotent: a second run installs and builds nothing, and says so."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _compiled_ops():
    from torch.utils.cpp_extension import _get_build_directory

    root = Path(_get_build_directory("x", verbose=False)).parent  # torch's extension cache
    return {p: p.stat().st_mtime for p in root.glob("*/*.so")}


def test_second_setup_builds_nothing():
    venv = Path(sys.prefix)
    ops_before = _compiled_ops()
    result = subprocess.run(["bash", "scripts/setup.sh"], cwd=ROOT, capture_output=True, text=True,
                            env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "VENV": str(venv)}, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "packages up to date" in out
    assert "with PyTorch + Gloo already installed" in out
    assert "building" not in out
    for op in ("ShareMemCommBuilder", "FusedAdamBuilder", "CPUAdamBuilder"):
        assert f"[deepspeed] {op}: ready" in out
    assert {p.parent.name for p in ops_before} >= {"deepspeed_shm_comm", "fused_adam", "cpu_adam"}
    assert _compiled_ops() == ops_before, "DeepSpeed ops were compiled again"


def test_dtlab_env_command_reports_the_plan():
    result = subprocess.run([str(Path(sys.prefix) / "bin" / "dtlab"), "env"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "course plan backend=" in result.stdout and "horovod     0.28.1" in result.stdout
