"""The benchmarks run, and what the README reports from them holds at a tiny size."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from dtlab.parallel import fsdp2

pytestmark = pytest.mark.cluster  # code a cluster runs: make test-runtime repeats these on its stack


ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_sharding_benchmark_memory_model_within_5_percent():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sharding.py"), "--steps", "1", "--repeats", "1",
                          "--n-embd", "32", "--n-layer", "1"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in out.stdout.splitlines() if re.match(r"\| [A-Za-z]", line)]
    names = [r[0].strip() for r in rows if r[0].strip() != "strategy"]
    assert names == ["DDP", "ZeRO-3 (DeepSpeed)"] + (["FSDP2"] if fsdp2.AVAILABLE else []) + ["scratch FSDP"]
    errors = [float(r[-1].strip().rstrip("%")) for r in rows if r[0].strip() != "strategy"]
    assert all(abs(e) <= 5 for e in errors), out.stdout
    ratios = {r[0].strip(): float(r[5].strip().rstrip("x")) for r in rows if r[0].strip() != "strategy"}
    assert all(ratios[s] < 0.7 for s in ratios if s != "DDP"), "every sharded strategy holds well under DDP's bytes"
