import math
import time

import pytest
import torch
from torch.profiler import profile, record_function

from dtlab import measure


def test_step_timer_accumulates_per_section():
    timer = measure.StepTimer()
    for _ in range(3):
        with timer("sleep"):
            time.sleep(0.01)
    assert timer.count["sleep"] == 3
    # A sleep never ends early; the upper bound only catches a timer that adds up wrongly (50x the sleep).
    assert 0.01 <= timer.mean("sleep") < 0.5
    assert timer.summary()["sleep"]["calls"] == 3
    with pytest.raises(KeyError, match="never timed"):
        timer.mean("other")


def test_step_timer_records_even_when_the_body_raises():
    timer = measure.StepTimer()
    with pytest.raises(RuntimeError), timer("boom"):
        raise RuntimeError
    assert timer.count["boom"] == 1


def test_throughput():
    assert measure.throughput(100, 2.0) == 50.0
    with pytest.raises(ValueError):
        measure.throughput(100, 0)


def _profiled(steps=3, phases=measure.PHASES):
    model = torch.nn.Linear(32, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with profile() as prof:
        for _ in range(steps):
            with record_function(phases[0]):
                x = torch.randn(64, 32)
            with record_function(phases[1]):
                loss = model(x).square().mean()
            with record_function(phases[2]):
                loss.backward()
            with record_function(phases[3]):
                opt.step()
    return prof


def test_phase_breakdown_sums_recorded_phases():
    result = measure.phase_breakdown(_profiled())
    assert list(result) == list(measure.PHASES)
    assert all(v["ms"] > 0 for v in result.values())
    assert abs(sum(v["share"] for v in result.values()) - 1) < 1e-9


def test_phase_breakdown_names_a_missing_label():
    prof = _profiled(phases=("data", "fwd", "backward", "optimizer"))
    with pytest.raises(ValueError, match=r"record_function\('forward'\)"):
        measure.phase_breakdown(prof)


def test_matmul_flops_is_measured():
    assert measure.matmul_flops("cpu", torch.float32, n=64, repeats=2) > 1e6


def test_max_diff_compares_state_dicts_or_results_and_refuses_unrelated_ones():
    from dtlab.measure import max_diff

    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}
    b = {"w": torch.tensor([1.0, 2.25], dtype=torch.bfloat16), "b": torch.tensor([0.0]), "extra": torch.ones(1)}
    assert max_diff(a, b) == 0.5                      # over the names both hold; bf16 compared in float32
    assert max_diff({"weights": a}, {"weights": b, "steps": 3}) == 0.5
    assert max_diff(a, a) == 0.0
    with pytest.raises(ValueError, match="only in the first"):
        max_diff({"x": torch.ones(1)}, {"y": torch.ones(1)})


def test_max_diff_is_nan_when_any_tensor_holds_a_nan_not_only_the_first():
    """Python's max() keeps a finite value over a later NaN: a run with NaN weights in its second tensor would
    otherwise pass every "equals one process within the bound" check."""
    from dtlab.measure import max_diff

    ok, bad = {"a": torch.zeros(2), "b": torch.zeros(2)}, {"a": torch.zeros(2), "b": torch.tensor([0.0, math.nan])}
    assert math.isnan(max_diff(bad, ok)) and math.isnan(max_diff(ok, bad))
    assert math.isnan(max_diff({"b": bad["b"], "a": bad["a"]}, ok))


def test_bf16_instructions_are_read_from_the_cpus_own_flags():
    x86 = ("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 amx_tile\n"
           "processor\t: 1\nflags\t\t: fpu avx512_bf16\n")
    assert measure.cpu_bf16_instructions(x86) == ["avx512_bf16"]
    assert measure.cpu_bf16_instructions("Features\t: fp asimd bf16 i8mm\n") == ["bf16"]
    assert measure.cpu_bf16_instructions("flags\t\t: fpu sse2 avx2\n") == []
    with open("/proc/cpuinfo") as f:                         # this machine: what its kernel reports, line by line
        reported = {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    assert measure.cpu_bf16_instructions() == [f for f in measure.BF16_CPU_FLAGS if f in reported]
