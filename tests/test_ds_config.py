import pytest

from dtlab.ds_config import ConfigError, build, validate

pytestmark = pytest.mark.cluster  # code a cluster runs: make test-runtime repeats these on its stack


def test_build_makes_consistent_configs():
    cfg = build(stage=2, micro_batch=8, accumulation=4, world_size=16, precision="bf16", offload_optimizer=True)
    assert cfg["train_batch_size"] == 512 and cfg["bf16"] == {"enabled": True}
    assert cfg["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    assert build(stage=3, offload_params=True, offload_optimizer=True)["zero_optimization"]["offload_param"]


GOOD = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4,
        "zero_optimization": {"stage": 2}}


def test_a_good_config_passes_unchanged():
    assert validate(dict(GOOD), world_size=2) == GOOD


def test_batch_sizes_that_do_not_add_up():
    with pytest.raises(ConfigError, match=r"8 x 4 x 4 = 128. Fix: set train_batch_size to 128"):
        validate(GOOD, world_size=4)


def test_batch_not_divisible_without_accumulation_given():
    with pytest.raises(ConfigError, match="not a multiple of train_micro_batch_size_per_gpu"):
        validate({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 8}, world_size=2)


def test_no_batch_size_at_all():
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu"):
        validate({"zero_optimization": {"stage": 1}}, world_size=2)


def test_fp16_and_bf16_both_on():
    with pytest.raises(ConfigError, match="'fp16' and 'bf16' are both enabled"):
        validate({**GOOD, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, world_size=2)


def test_optimizer_offload_on_stage_0():
    cfg = {**GOOD, "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(ConfigError, match="offload_optimizer needs stage 1, 2 or 3"):
        validate(cfg, world_size=2)


def test_parameter_offload_below_stage_3():
    cfg = {**GOOD, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}
    with pytest.raises(ConfigError, match="offload_param needs stage 3"):
        validate(cfg, world_size=2)


def test_a_typo_in_a_top_level_key_is_named_with_a_suggestion():
    with pytest.raises(ConfigError, match="unknown top-level key 'zero_optimisation'.*'zero_optimization'"):
        validate({**GOOD, "zero_optimisation": {"stage": 3}}, world_size=2)


def test_a_bad_stage():
    with pytest.raises(ConfigError, match="must be 0, 1, 2 or 3"):
        validate({**GOOD, "zero_optimization": {"stage": 5}}, world_size=2)


def test_a_non_integer_batch():
    with pytest.raises(ConfigError, match="positive integer"):
        validate({**GOOD, "train_micro_batch_size_per_gpu": 0}, world_size=2)


def test_adam_runs_torchs_own_optimizer_unless_offloaded():
    """DeepSpeed's fused Adam compiles with nvcc on first use; Databricks ML runtimes have no nvcc."""
    assert build(stage=2)["optimizer"]["params"]["torch_adam"] is True
    assert "torch_adam" not in build(stage=2, offload_optimizer=True)["optimizer"]["params"]
    assert "torch_adam" not in build(stage=1, torch_adam=False)["optimizer"]["params"]


def test_stage_3_partitions_every_parameter_unless_asked():
    """DeepSpeed 0.14.4 on CPU gave wrong weights now and then with small parameters kept whole."""
    assert build(stage=3)["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    kept = build(stage=3, persistence_threshold=10**5)["zero_optimization"]
    assert kept["stage3_param_persistence_threshold"] == 10**5
    assert "stage3_param_persistence_threshold" not in build(stage=2)["zero_optimization"]
