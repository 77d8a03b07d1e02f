"""The planner's formulas against the papers that give them: ZeRO's model states, DeepSpeed's own estimators and
its published table, Korthikanti et al.'s activations, Megatron-LM's and PaLM's FLOPs, nccl-tests' ring factors."""

import itertools
from decimal import ROUND_HALF_UP, Decimal

import pytest
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from dtlab.planner import formulas as memory
from dtlab.planner.formulas import GB, GiB

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
                    "op": L * s * b * h * 13,     # input, attention output, half of the 9h of matrix products: 2 bytes
                    "full": L * 2 * s * b * h}
    peak = {mode: memory.activation_bytes(b, s, L, h, a, recompute=mode) for mode in memory.RECOMPUTE}
    assert peak["none"] == kept["none"]
    assert peak["selective"] == kept["selective"] + 5 * a * s * s * b  # one layer's attention scores, recomputed
    assert peak["full"] == kept["full"] + s * b * h * (34 + 5 * a * s / h)  # one layer, recomputed
    assert peak["none"] / GB == pytest.approx(30.6, abs=0.05)  # ~30 GB: one 2,048-token sequence of LLaMA 7B
    assert peak["none"] > peak["selective"] > peak["full"] and kept["selective"] > kept["op"] > kept["full"]


@pytest.mark.parametrize("kwargs, match", [
    ({"n_embd": 4100}, "not divisible by 32 heads"), ({"batch": 0}, "must be >= 1"), ({"n_layer": 0}, "must be >= 1"),
    ({"recompute": "some"}, "recompute='some'"),
])
def test_bad_activation_inputs_are_refused(kwargs, match):
    args = {"batch": 1, "seq_len": 2048, "n_layer": 32, "n_embd": 4096, "n_head": 32, **kwargs}
    with pytest.raises(ValueError, match=match):
        memory.activation_bytes(**args)


def test_model_shapes_known_and_derived_from_the_published_families():
    assert {memory.model_shape(psi).name for psi in (6.7e9, 7e9, 7.5e9)} == {"LLaMA 7B"}
    assert (memory.model_shape(70e9).n_layer, memory.model_shape(70e9).n_embd) == (80, 8192)
    assert memory.model_shape(13e9).n_head == 40 and memory.model_shape(1.3e9).n_embd == 2048
    for shape in memory.KNOWN_SHAPES.values():
        assert shape.n_embd % shape.n_head == 0 and shape.source
        assert shape.params == pytest.approx(min(memory.KNOWN_SHAPES, key=lambda k: abs(k - shape.params)), rel=0.07)
    for psi in (3e9, 30e9, 175e9, 400e9, 530e9, 1e12):
        shape = memory.model_shape(psi)
        assert shape.name.startswith("derived") and shape.head_dim == 128
        assert shape.n_head % 8 == 0, "TP 2, 4 and 8 divide the heads, as in GPT-3, LLaMA and Llama 3"
        assert 0.6 < shape.n_layer / shape.n_head < 1.6, "about as many layers as heads"
        assert 12 * shape.n_layer * shape.n_embd**2 == pytest.approx(psi, rel=0.05)
    # the probe: a 530B model used to get 139 heads (= its layers), which only TP=1 divides
    assert memory.model_shape(530e9).n_head % 8 == 0
    assert memory.model_shape(1e3).n_layer == 1
    with pytest.raises(ValueError, match="needs parameters"):
        memory.model_shape(0)


def test_a_shape_counts_its_parameters_like_the_papers():
    # GPT: 12 L h^2 + V h (Narayanan et al. 2021, eq. 2 without the small terms); LLaMA 7B: 6.74B (its paper's "6.7B")
    gpt = memory.ModelShape("gpt", 96, 12288, 96, vocab=51200)
    assert gpt.params == 12 * 96 * 12288**2 + 51200 * 12288
    assert memory.KNOWN_SHAPES[7e9].params / 1e9 == pytest.approx(6.74, abs=0.01)
    with pytest.raises(ValueError, match="KV heads"):
        memory.check_shape(32, 4096, 32, n_kv_head=5)


def test_layer_activations_reduce_to_korthikanti_for_a_gpt_layer():
    s, b, h, a = 2048, 2, 4096, 32
    gpt = memory.ModelShape("gpt", 1, h, a, dropout=True)
    eager = {m: memory.layer_activation_bytes(gpt, b, s, m, flash_attention=False)["total"] for m in memory.RECOMPUTE}
    assert eager["none"] == s * b * h * (34 + 5 * a * s / h) == memory.activation_bytes(b, s, 1, h, a)
    assert eager["selective"] == 34 * s * b * h and eager["full"] == 2 * s * b * h
    fused = memory.layer_activation_bytes(gpt, b, s, "none")
    assert fused["scores"] == 0 and fused["total"] == eager["selective"], "a fused kernel keeps no scores"
    # grouped-query attention keeps smaller K and V; a gated MLP keeps gate, up, activation and product
    llama = memory.KNOWN_SHAPES[70e9]
    parts = memory.layer_activation_bytes(llama, 1, s)
    h, k, f = llama.n_embd, llama.n_kv_head * llama.head_dim, llama.ffn
    assert parts["attention"] == 2 * s * (3 * h + 2 * k) and parts["mlp"] == 2 * s * h + 8 * s * f


def test_training_flops_are_megatrons_and_palms():
    shape = memory.ModelShape("gpt", 96, 12288, 96, vocab=51200)
    s, tokens = 2048, 1536 * 2048
    megatron_full = 96 * 1536 * s * 96 * 12288**2 * (1 + s / (6 * 12288) + 51200 / (16 * 96 * 12288))
    assert memory.training_flops(tokens, shape, s, "full").hardware == pytest.approx(megatron_full, rel=1e-9)
    f = memory.training_flops(tokens, shape, s, "none")
    assert f.hardware == f.model == pytest.approx(tokens * (6 * shape.params + 12 * 96 * 12288 * s), rel=1e-9)
    selective = memory.training_flops(tokens, shape, s, "selective")
    assert selective.recomputed == tokens * 4 * 96 * s * 12288           # QK^T and AV again
    assert 1.3 < memory.training_flops(tokens, shape, s, "full").hardware / f.model < 1.34   # one more forward


@pytest.mark.parametrize("n", [1, 2, 3, 8, 1024])
def test_ring_factors_are_nccl_tests_bus_factors(n):
    assert memory.ring_factor(n) == 2 * (n - 1) / n
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert memory.ring_factor(n, op) == (n - 1) / n
    assert memory.ring_factor(n, "broadcast") == 1
    with pytest.raises(ValueError, match="known: all_reduce"):
        memory.ring_factor(n, "gossip")


def test_the_published_rule_of_thumb_is_kept_as_data_with_its_source():
    assert memory.size_guide(7e9).advice == "TP=2-4 + DP" and memory.size_guide(7e9).tp == (2, 4)
    assert memory.size_guide(70e9).pp == (2, 4) and memory.size_guide(405e9).cp == 2
    assert memory.size_guide(0.5e9).gpus == (1, 8) and "Megatron Bridge" in memory.SIZE_GUIDE_SOURCE
    with pytest.raises(ValueError, match="dtlab advise"):
        memory.size_guide(1e12)


def test_a_hugging_face_config_gives_the_published_shape():
    """LLaMA 7B's config.json values (Touvron et al. 2023, Table 2; 6.7B parameters) read as the planner's shape."""
    config = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
              "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000, "hidden_act": "silu",
              "tie_word_embeddings": False}
    shape = memory.shape_from_hf(config)
    assert shape.params == memory.KNOWN_SHAPES[7e9].params
    assert abs(shape.params / 6.7e9 - 1) < 0.01
    with pytest.raises(ValueError, match="no 'hidden_size'.*Fix"):
        memory.shape_from_hf({"num_hidden_layers": 2})
