"""The memory model against the ZeRO paper, DeepSpeed's own estimators and its published table; activations;
what fits, and the `dtlab memory` command."""

import itertools
from decimal import ROUND_HALF_UP, Decimal

import pytest
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from dtlab import cli, hardware, memory
from dtlab.memory import GB, GiB

SIZES = [1e6, 125e6, 1.3e9, 7e9, 70e9]
GPUS = [(1, 1), (2, 1), (4, 1), (8, 1), (4, 4), (8, 8)]  # (gpus per node, nodes)


@pytest.mark.parametrize("psi, n", list(itertools.product(SIZES, [1, 2, 4, 16, 64])))
def test_zero_paper_formulas(psi, n):
    s = [memory.model_states(psi, n, stage) for stage in range(4)]
    assert s[0].gpu == 16 * psi
    assert s[1].gpu == pytest.approx(4 * psi + 12 * psi / n)
    assert s[2].gpu == pytest.approx(2 * psi + 14 * psi / n)
    assert s[3].gpu == pytest.approx(16 * psi / n)
    assert s[0].gpu >= s[1].gpu >= s[2].gpu >= s[3].gpu


@pytest.mark.parametrize("psi, per_node, nodes", [(s, g, n) for s in SIZES for g, n in GPUS])
def test_zero2_matches_deepspeeds_estimator_exactly(psi, per_node, nodes):
    for offload in (False, True):
        cpu, gpu = estimate_zero2_model_states_mem_needs(psi, per_node, nodes, cpu_offload=offload)
        assert memory.deepspeed_estimate(psi, per_node, nodes, 2, offload_optimizer=offload) == (gpu, cpu)
    # With offload the estimator and the paper model agree: only the 16-bit parameters stay on the GPU.
    assert memory.model_states(psi, per_node * nodes, 2, offload_optimizer=True).gpu == 2 * psi


@pytest.mark.parametrize("psi, per_node, nodes", [(s, g, n) for s in SIZES for g, n in GPUS])
def test_zero3_matches_deepspeeds_estimator_exactly(psi, per_node, nodes):
    largest = psi / 50
    for off_opt, off_par in [(False, False), (True, False), (True, True)]:
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(psi, largest, per_node, nodes, cpu_offload=off_opt,
                                                            cpu_offload_params=off_par)
        ours = memory.deepspeed_estimate(psi, per_node, nodes, 3, off_opt, off_par, largest_layer_params=largest)
        assert ours == (gpu, cpu)
        paper = memory.model_states(psi, per_node * nodes, 3, offload_optimizer=off_opt, offload_params=off_par).gpu
        extra = {(False, False): 2 * psi / (per_node * nodes), (True, False): 0, (True, True): 0}[(off_opt, off_par)]
        assert gpu - paper == pytest.approx(4 * largest + extra, abs=1), "estimator = paper + documented buffers"


# DeepSpeed's documentation: t5-3b (2,851M parameters, largest layer 32.9M), 1 node x 8 GPUs.
T5_3B, T5_LARGEST = 2851e6, 32.9e6
PUBLISHED = [  # (stage, offload optimizer, offload params, GB per GPU)
    (2, True, False, 5.31),
    (3, False, False, 6.10),
    (3, True, False, 0.79),
    (3, True, True, 0.12),
]


@pytest.mark.parametrize("stage, off_opt, off_par, gb", PUBLISHED)
def test_published_t5_3b_table(stage, off_opt, off_par, gb):
    # DeepSpeed prints bytes / 2**30 and calls it "GB": its figures are GiB.
    gpu, _ = memory.deepspeed_estimate(T5_3B, 8, 1, stage, off_opt, off_par, largest_layer_params=T5_LARGEST)
    assert gpu / GiB == pytest.approx(gb, abs=0.01)


def test_published_zero2_without_offload_used_the_older_formula():
    # The table says 15.93 "GB" (GiB): 4Ψ + 16Ψ/N, DeepSpeed's estimate before it counted the fp32
    # gradient shard in 18Ψ/N. The current estimator (and ours) gives 2Ψ + 18Ψ/N = 11.28 GiB.
    assert (4 * T5_3B + 16 * T5_3B / 8) / GiB == pytest.approx(15.93, abs=0.01)
    gpu, _ = memory.deepspeed_estimate(T5_3B, 8, 1, 2)
    assert gpu / GiB == pytest.approx(11.28, abs=0.01)


def test_one_unit_gb_is_decimal():
    assert GB == 10**9 and GiB == 2**30


def test_the_zero_papers_example_in_gb():
    # Rajbhandari et al. (ZeRO), Figure 1: 7.5B parameters on 64 GPUs, K = 12: 120 / 31.4 / 16.6 / 1.9 GB.
    def paper(nbytes):  # the paper rounds half up to one decimal
        return float(Decimal(repr(nbytes / GB)).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP))

    assert [paper(memory.model_states(7.5e9, 64, stage).gpu) for stage in range(4)] == [120, 31.4, 16.6, 1.9]
    rows = memory.plan_table(7.5e9, 64, 32, activations=0)
    assert [round(r["states_gb"], 2) for r in rows[:4]] == [120.0, 31.41, 16.64, 1.88]
    assert all(r["gpu_gb"] == r["states_gb"] for r in rows)


def test_fp32_precision_counts_four_byte_states():
    psi = 1000
    assert memory.model_states(psi, 2, 0, "fp32").as_dict() == {"params": 4000, "grads": 4000, "optimizer": 8000,
                                                                "cpu": 0.0, "gpu": 16000}
    s1 = memory.model_states(psi, 2, 1, "fp32")
    assert (s1.params, s1.grads, s1.optimizer) == (4000, 4000, 6000)  # 12 bytes (fp32 master + moments) / 2


@pytest.mark.parametrize("kwargs, match", [
    ({"stage": 4}, "stages are"), ({"stage": 0, "offload_optimizer": True}, "stage 1, 2 or 3"),
    ({"stage": 2, "offload_params": True}, "stage 3"), ({"stage": 1, "precision": "int8"}, "precision"),
])
def test_impossible_combinations_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        memory.model_states(1e6, 2, **kwargs)


def test_activation_memory_scales_with_batch_and_sequence():
    one = memory.activation_bytes(batch=1, seq_len=128, n_layer=2, n_embd=64, n_head=4)
    assert one == 2 * 128 * 64 * (34 + 5 * 4 * 128 / 64)
    assert memory.activation_bytes(8, 128, 2, 64, 4) == 8 * one
    assert memory.activation_bytes(1, 256, 2, 64, 4) > 2 * one  # attention scores grow with s^2


def test_activations_with_recomputation_follow_korthikanti():
    s, b, h, a, L = 2048, 1, 4096, 32, 32  # noqa: N806
    kept = {mode: memory.activation_bytes(b, s, L, h, a, recompute=mode, peak=False) for mode in memory.RECOMPUTE}
    assert kept == {"none": L * s * b * h * (34 + 5 * a * s / h), "selective": L * s * b * h * 34,
                    "full": L * 2 * s * b * h}
    peak = {mode: memory.activation_bytes(b, s, L, h, a, recompute=mode) for mode in memory.RECOMPUTE}
    assert peak["none"] == kept["none"]
    assert peak["selective"] == kept["selective"] + 5 * a * s * s * b  # one layer's attention scores, recomputed
    assert peak["full"] == kept["full"] + s * b * h * (34 + 5 * a * s / h)  # one layer, recomputed
    assert peak["none"] / GB == pytest.approx(30.6, abs=0.05)  # ~30 GB: one 2,048-token sequence of LLaMA 7B
    assert peak["none"] > peak["selective"] > peak["full"]


@pytest.mark.parametrize("kwargs, match", [
    ({"n_embd": 4100}, "not divisible by 32 heads"), ({"batch": 0}, "must be >= 1"), ({"n_layer": 0}, "must be >= 1"),
    ({"recompute": "some"}, "recompute='some'"),
])
def test_bad_activation_inputs_are_refused(kwargs, match):
    args = {"batch": 1, "seq_len": 2048, "n_layer": 32, "n_embd": 4096, "n_head": 32, **kwargs}
    with pytest.raises(ValueError, match=match):
        memory.activation_bytes(**args)


def test_model_shapes_known_and_derived():
    assert {memory.model_shape(psi).name for psi in (6.7e9, 7e9, 7.5e9)} == {"LLaMA 7B"}
    assert (memory.model_shape(70e9).n_layer, memory.model_shape(70e9).n_embd) == (80, 8192)
    assert memory.model_shape(13e9).n_head == 40 and memory.model_shape(1.3e9).n_embd == 2048
    for shape in memory.KNOWN_SHAPES.values():
        assert shape.n_embd % shape.n_head == 0 and shape.source
    for psi in (100e6, 3e9, 30e9, 400e9):
        shape = memory.model_shape(psi)
        assert shape.name.startswith("derived") and shape.n_embd == 128 * shape.n_layer == 128 * shape.n_head
        assert 12 * shape.n_layer * shape.n_embd**2 == pytest.approx(psi, rel=0.25)
    assert memory.model_shape(1e3).n_layer == 1
    with pytest.raises(ValueError, match="needs parameters"):
        memory.model_shape(0)


def test_what_fits_includes_activations():
    rows = memory.plan_table(7e9, 16)  # defaults: one g5.12xlarge's A10G, micro-batch 1 x 2,048 tokens, no recompute
    assert [r["strategy"] for r in rows] == [name for name, *_ in memory.STRATEGIES]
    act = memory.activation_bytes(1, 2048, 32, 4096, 32) / GB
    for r in rows:
        assert r["activations_gb"] == act and r["gpu_gb"] == pytest.approx(r["states_gb"] + act)
        assert not r["fits"], "30.6 GB of activations alone exceed an A10G"
    budget = (1 - memory.HEADROOM) * hardware.gpu("A10G").memory_bytes / GB
    full = memory.plan_table(7e9, 16, recompute="full")
    assert [r["fits"] for r in full] == [r["gpu_gb"] <= budget and r["cpu_gb_per_gpu"] <= 0.85 * 51.54 for r in full]
    assert memory.first_fit(7e9, 16) is None and memory.first_fit(7e9, 16, recompute="full")["strategy"] == "ZeRO-3"


def test_a_cluster_name_sets_gpus_and_memory():
    assert memory.plan_table(7e9, cluster="g5.12xlarge x4") == memory.plan_table(7e9, 16)
    assert memory.plan_table(7e9) == memory.plan_table(7e9, 4, cluster="g5.12xlarge")
    a100 = memory.plan_table(7e9, cluster="p4d.24xlarge x2", activations=0, headroom=0)
    assert a100 == memory.plan_table(7e9, 16, hardware.gpu("A100").memory_gb, activations=0, headroom=0,
                                     cpu_gb_per_gpu=1152 * GiB / 8 / GB)
    assert memory.plan_table(7e9, 16, gpu="A100") == memory.plan_table(7e9, 16, hardware.gpu("A100").memory_gb)


def test_zero3_states_shrink_as_one_over_n():
    z3 = {n: next(r for r in memory.plan_table(7e9, n) if r["strategy"] == "ZeRO-3") for n in (4, 16)}
    assert z3[4]["states_gb"] / z3[16]["states_gb"] == pytest.approx(4)
    assert z3[4]["activations_gb"] == z3[16]["activations_gb"], "ZeRO does not shard activations"


def test_recommendation_for_the_seed_cases():
    assert memory.recommend(100e6, 4).startswith("DDP (stage 0): ")
    seven = memory.recommend(7e9, 16)
    assert seven.startswith("nothing fits on 16 x A10G: the activations alone are 30.6 GB per GPU"), seven
    assert "with recompute='full' ZeRO-3 fits" in seven and "tensor or pipeline parallelism" in seven
    full = memory.recommend(7e9, 16, recompute="full")
    assert full.startswith("ZeRO-3: 8.5 GB per GPU") and "ZeRO-2 would need 21.6 GB" in full, full
    assert memory.recommend(13e9, 16, recompute="full").startswith("ZeRO-3:")
    seventy = memory.recommend(70e9, 64)
    assert seventy.startswith("nothing fits on 64 x A10G") and "recompute='full' ZeRO-3 + optimizer offload" in seventy
    assert memory.recommend(70e9, 64, recompute="full").startswith("ZeRO-3 + optimizer offload:")
    assert memory.size_guide(70e9)[1].endswith("ZeRO-3") and "offloading" in memory.size_guide(405e9)[1]


def test_model_states_only_on_request():
    assert memory.recommend(7e9, 16, activations=0).startswith("ZeRO-2: 20.1 GB per GPU (model states only)")
    need = memory.recommend(70e9, 16, activations=0)
    assert need.startswith("nothing fits on 16 x A10G: even ZeRO-3 + optimizer and parameter offload") or \
        "CPU memory" in need, need
    assert "ZeRO-3 fits on about 55 GPUs like these" in need
    assert memory.recommend(70e9, 32, activations=0, cpu_gb_per_gpu=512).startswith("ZeRO-3 + optimizer offload:")
    assert memory.recommend(7e9, 16, 24, activations=0).startswith("ZeRO-2:")  # 24 GB = 24e9 bytes


@pytest.mark.parametrize("kwargs, error, match", [
    ({"num_params": 0}, ValueError, "needs parameters. Fix"), ({"gpus": 0}, ValueError, "gpus=0"),
    ({"gpu_memory_gb": -1}, ValueError, "must be positive"), ({"headroom": 1}, ValueError, r"\[0, 1\)"),
    ({"cpu_gb_per_gpu": -1}, ValueError, "cannot be negative"), ({"activations": -1}, ValueError, "negative"),
    ({"recompute": "partial"}, ValueError, "recompute='partial'"), ({"micro_batch": 0}, ValueError, ">= 1"),
    ({"shape": (32, 4100, 32)}, ValueError, "not divisible"), ({"shape": "9B"}, ValueError, "LLaMA 7B"),
    ({"gpu": "A10"}, hardware.UnknownHardware, "did you mean 'A10G'"),
    ({"cluster": "g5.12xlarg"}, ValueError, "did you mean 'g5.12xlarge'"),
])
def test_bad_plan_inputs_are_refused_with_the_fix(kwargs, error, match):
    args = {"num_params": 7e9, "gpus": 16, **kwargs}
    with pytest.raises(error, match=match):
        memory.plan_table(**args)
    with pytest.raises(error, match=match):
        memory.format_table(**args)


def test_unknown_options_are_a_type_error():
    with pytest.raises(TypeError, match="recomputation"):
        memory.recommend(7e9, 16, recomputation="full")


def test_the_table_states_its_assumptions_and_marks_the_rule_of_thumb():
    text = " ".join(memory.format_table(7e9, 16).split())  # long lines are wrapped
    for expected in ["7B parameters on 16 x A10G: 24.15 GB each (nvidia-smi's 23,028 MiB", "85% = 20.5 GB per GPU",
                     "51.5 GB per GPU (g5.12xlarge: 192 GiB for 4 GPUs)", "micro-batch 1 x 2,048 tokens",
                     "LLaMA 7B shape (32 layers, hidden 4,096, 32 heads), no recomputation", "GB = 10^9 bytes",
                     "recommended: nothing fits", "the reference's rule of thumb for 1B-7B",
                     "The computation disagrees: DDP (stage 0) needs 142.6 GB per GPU"]:
        assert expected in text, f"{expected!r} not in:\n{text}"
    only = " ".join(memory.format_table(7.5e9, 64, 32, activations=0).split())
    assert "model states only" in only and "120.00" in only and "recommended: ZeRO-2" in only
    assert "It fits here, but ZeRO-2 does too" in only
    assert "The computation agrees here" in memory.format_table(100e6, 4)


def test_dtlab_memory_command_prints_the_table(capsys):
    assert cli.main(["memory", "--params", "7e9", "--gpus", "16"]) == 0
    out = capsys.readouterr().out
    assert "7B parameters on 16 x A10G" in out and "recommended: nothing fits on 16 x A10G" in out
    assert cli.main(["memory", "--params", "7e9", "--cluster", "g5.12xlarge x4", "--recompute", "full"]) == 0
    out = capsys.readouterr().out
    assert "on 16 x A10G" in out and "recommended: ZeRO-3: 8.5 GB per GPU" in out
    assert cli.main(["memory", "--params", "7.5e9", "--gpus", "64", "--gpu-mem-gb", "32", "--activations-gb", "0"]) == 0
    out = capsys.readouterr().out
    for value in ("120.00", "31.41", "16.64", "1.88", "model states only"):
        assert value in out
    assert cli.main(["memory", "--params", "7e9", "--layers", "32", "--hidden", "4096", "--heads", "32",
                     "--micro-batch", "2", "--seq-len", "1024", "--gpu", "A100", "--gpus", "8"]) == 0
    assert "8 x A100" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--params", "7e9", "--gpu", "A10"], "did you mean 'A10G'?"),
    (["--params", "7e9", "--cluster", "g5.24xl"], "did you mean 'g5.24xlarge'?"),
    (["--params", "7e9", "--layers", "32", "--hidden", "4100", "--heads", "32"], "not divisible by 32 heads"),
    (["--params", "7e9", "--layers", "32"], "go together"),
    (["--params", "7e9", "--activations-gb", "0", "--recompute", "full"], "either --activations-gb"),
])
def test_dtlab_memory_refuses_bad_input_with_exit_code_2(capsys, argv, message):
    assert cli.main(["memory", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dtlab memory: ") and message in err and "Fix:" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("argv, message", [
    (["--params", "0"], "argument --params: 0 is out of range. Fix: a finite value > 0"),
    (["--params", "7e9", "--gpus", "0"], "argument --gpus: 0 is out of range"),
    (["--params", "7e9", "--gpus", "-4"], "argument --gpus"),
    (["--params", "7e9", "--micro-batch", "0"], "argument --micro-batch"),
    (["--params", "7e9", "--headroom", "1.5"], "argument --headroom"),
    (["--params", "inf"], "a finite value"),
    (["--params", "7e9", "--gpus", "2.5"], "not a whole number"),
    (["--params", "7e9", "--recompute", "partial"], "invalid choice: 'partial'"),
])
def test_dtlab_memory_refuses_bad_numbers_with_exit_code_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["memory", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
