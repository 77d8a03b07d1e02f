"""The memory model against the ZeRO formulas, DeepSpeed's own estimators and its published table."""

import itertools

import pytest
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from dtlab import memory
from dtlab.memory import GB

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
    gpu, _ = memory.deepspeed_estimate(T5_3B, 8, 1, stage, off_opt, off_par, largest_layer_params=T5_LARGEST)
    assert gpu / GB == pytest.approx(gb, abs=0.01)


def test_published_zero2_without_offload_used_the_older_formula():
    # The table says 15.93 GB: 4Ψ + 16Ψ/N, DeepSpeed's estimate before it counted the fp32 gradient
    # shard in 18Ψ/N. The current estimator (and ours) gives 2Ψ + 18Ψ/N = 11.28 GB.
    assert (4 * T5_3B + 16 * T5_3B / 8) / GB == pytest.approx(15.93, abs=0.01)
    gpu, _ = memory.deepspeed_estimate(T5_3B, 8, 1, 2)
    assert gpu / GB == pytest.approx(11.28, abs=0.01)


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


def test_recommendation_for_the_seed_cases():
    assert memory.recommend(100e6, 4, 24) == "DDP (stage 0)"
    assert memory.recommend(7e9, 16, 24) == "ZeRO-2"
    assert memory.recommend(13e9, 16, 24).startswith("ZeRO-3")
    assert memory.recommend(70e9, 16, 24) == "nothing fits on 16 GPUs: ZeRO-3 needs about 55 GPUs of 24 GB"
    assert memory.recommend(70e9, 64, 24) == "ZeRO-3"
    assert memory.recommend(70e9, 32, 24, cpu_gb_per_gpu=512).startswith("ZeRO-3 + optimizer")
    assert memory.size_guide(70e9)[1].endswith("ZeRO-3") and "offloading" in memory.size_guide(405e9)[1]


def test_dtlab_memory_command_prints_the_table(capsys):
    from dtlab import cli

    assert cli.main(["memory", "--params", "7e9", "--gpus", "16", "--gpu-mem-gb", "24"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO-3" in out and "recommended: ZeRO-2" in out and "7B parameters on 16 GPUs of 24 GB" in out
