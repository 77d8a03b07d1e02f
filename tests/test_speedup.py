"""The speed-up model's arithmetic: known inputs, known outputs."""

import pytest

from dtlab.planner import speedup


def test_ring_allreduce_time():
    assert speedup.allreduce_seconds(1e9, 1, 1e9) == 0
    assert speedup.allreduce_seconds(1e9, 2, 1e9) == pytest.approx(1.0)            # 2(N-1)/N = 1
    assert speedup.allreduce_seconds(1e9, 4, 1e9, latency=1e-3) == pytest.approx(1.5 + 6e-3)
    with pytest.raises(ValueError):
        speedup.allreduce_seconds(1e9, 2, 0)


def test_the_growing_communication_model():
    assert speedup.linear_comm_speedup(4, 0.8) == pytest.approx(4 / 3.4)
    assert speedup.linear_comm_speedup(1, 5.0) == 1.0
    assert speedup.break_even_ratio(4) == pytest.approx(1.0)
    assert speedup.break_even_ratio(4, 2.0) == pytest.approx(1 / 3)


def test_prediction_matches_the_growing_model_at_two_processes():
    # t_compute 55 ms; 2(N-1)/N * bytes / bw = 44 ms at N=2 -> r = 0.8
    p = speedup.predict(0.055, 44e6, 2, 1e9)
    assert p.comm_s == pytest.approx(0.044)
    assert p.speedup == pytest.approx(speedup.linear_comm_speedup(2, 0.8))
    assert p.efficiency == pytest.approx(p.speedup / 2)


def test_accumulation_compression_and_overlap_reduce_exposed_communication():
    plain = speedup.predict(0.01, 10e6, 2, 1e9)
    assert plain.comm_s == pytest.approx(0.01) and plain.speedup == pytest.approx(1.0)
    accumulated = speedup.predict(0.01, 10e6, 2, 1e9, accumulation=4)
    assert accumulated.compute_s == pytest.approx(0.04) and accumulated.speedup == pytest.approx(2 * 0.04 / 0.05)
    assert speedup.predict(0.01, 10e6, 2, 1e9, compression=0.5).comm_s == pytest.approx(0.005)
    assert speedup.predict(0.01, 10e6, 2, 1e9, overlap=1.0).speedup == pytest.approx(2.0)


@pytest.mark.parametrize("kwargs", [dict(t_compute=0), dict(accumulation=0), dict(compression=0), dict(overlap=2)])
def test_bad_inputs(kwargs):
    args = dict(t_compute=0.01, grad_bytes=1e6, n=2, bandwidth=1e9) | kwargs
    with pytest.raises(ValueError):
        speedup.predict(**args)


def test_the_two_formulas_agree_only_at_two_processes():
    """Communication growing with every peer, S = N / (1 + r(N-1)), vs the ring model's S = N t / (t + t_comm)."""
    ring = speedup.predict(0.055, 40e-3 * 1e9 / 1.5, 4, 1e9)      # a 40 ms all-reduce on 4 GPUs
    assert ring.comm_s == pytest.approx(0.040)
    assert ring.speedup == pytest.approx(4 * 55 / 95)               # 2.32x, not 1.18x
    assert speedup.linear_comm_speedup(4, 40 / 55) == pytest.approx(4 / (1 + 3 * 40 / 55))
    assert speedup.predict(0.055, 0.044e9, 2, 1e9).speedup == pytest.approx(speedup.linear_comm_speedup(2, 0.8))
    assert speedup.break_even_comm(4) == pytest.approx(3.0) and speedup.break_even_comm(4, 2.0) == pytest.approx(1.0)


@pytest.mark.parametrize("k", [1, 4, 8])
def test_accumulation_pays_one_all_reduce_per_k_micro_batches(k):
    """Synthetic times with a known answer: 10 ms per micro-batch, a 20 ms all-reduce, 2 processes."""
    p = speedup.predict(0.010, 20e-3 * 1e9, 2, 1e9, accumulation=k)   # 2(N-1)/N = 1 -> 20 ms
    assert p.compute_s == pytest.approx(0.010 * k) and p.comm_s == pytest.approx(0.020)
    assert p.speedup == pytest.approx(2 * 0.010 * k / (0.010 * k + 0.020))


@pytest.mark.slow   # 3.5 s or more warm (make test-quick --durations, 2026-12-07)
def test_measured_accumulation_times_no_sync_beside_an_all_reduce_per_micro_batch():
    """Real launches: with k > 1 every timed step gets a paired step that all-reduces after each micro-batch;
    with k = 1 there is nothing to pair. (How large the ratio is, is the notebook's measurement, not a test.)"""
    cfg = dict(hidden=32, depth=1, batch=8, steps=3, device="cpu", backend="gloo")
    accumulated = speedup.measure_speedup({**cfg, "accumulation": 4}, nprocs=2, repeats=2)
    assert len(accumulated["sync_each_ratios"]) == 2 * 3
    assert all(r > 0 for r in accumulated["sync_each_ratios"])
    assert len(accumulated["rounds"]) == 2 and accumulated["measured"] > 0
    each = [r["predicted"] / r["measured"] - 1 for r in accumulated["rounds"]]
    assert accumulated["error"] == pytest.approx(sum(each) / 2), "the error pairs each launch's own numbers"
    assert len(accumulated["allreduce_samples_s"]) == 2 * 3 and all(t > 0 for t in accumulated["allreduce_samples_s"])
    assert speedup.measure_speedup({**cfg, "accumulation": 1}, nprocs=2)["sync_each_ratios"] == []


def test_a_launch_reports_the_mean_of_its_timed_steps():
    """A step's time is the sum of its parts only on average (a small all-reduce on a shared CPU is either fast
    or a scheduler tick late), so the ingredients are means of the timed steps, warm-up left out."""
    import statistics

    from dtlab.launch import run

    cfg = dict(hidden=32, depth=1, batch=8, steps=5, device="cpu", backend="gloo")
    out = run(speedup.measure_step, cfg, nprocs=2)[0]
    for name in ("step_s", "alone_s", "allreduce_s"):
        assert len(out["samples"][name]) == 5
        assert out[name] == pytest.approx(statistics.fmean(out["samples"][name]), rel=1e-12)


def test_the_old_name_still_works_for_a_release_and_says_the_new_one():
    with pytest.warns(DeprecationWarning, match="linear_comm_speedup"):
        assert speedup.seed_formula(4, 0.8) == speedup.linear_comm_speedup(4, 0.8)
