"""DeepSpeed configs: build one from a few readable choices, and check one before DeepSpeed does.

DeepSpeed reads a JSON config (``ds_config.json``). Its most common mistakes fail late or
silently: a batch size that does not add up is caught only inside ``deepspeed.initialize`` on
every rank; a misspelt top-level key is ignored (your setting never applies); offload with the
wrong stage is refused deep in the engine. ``validate`` checks these first and names the key and
the fix::

    cfg = build(stage=2, micro_batch=8, accumulation=4, world_size=16, precision="bf16",
                offload_optimizer=True)
    validate(cfg, world_size=16)
"""

from __future__ import annotations

import difflib
from typing import Any

#: Top-level keys DeepSpeed 0.19 understands (a typo of one is almost certainly a mistake).
KNOWN_KEYS = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer",
    "scheduler", "fp16", "bf16", "amp", "torch_autocast", "zero_optimization", "gradient_clipping",
    "steps_per_print", "wall_clock_breakdown", "dump_state", "prescale_gradients", "gradient_predivide_factor",
    "sparse_gradients", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "activation_checkpointing",
    "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet", "communication_data_type",
    "seq_parallel_communication_data_type", "elasticity", "pipeline", "compression_training", "data_efficiency",
    "aio", "checkpoint", "autotuning", "nebula", "memory_breakdown", "data_types", "disable_allgather",
    "sparse_attention", "curriculum_learning", "eigenvalue", "progressive_layer_drop", "dataloader_drop_last",
    "quantize_training", "weight_quantization", "hybrid_engine", "graph_harvesting", "use_data_before_expert_parallel",
    "compile", "timers", "mics_shard_size", "mics_hierarchical_params_gather", "zero_optimization_stage",
})


class ConfigError(ValueError):
    """A DeepSpeed config that would fail or silently misbehave; the message names key and fix."""


def build(stage: int = 0, micro_batch: int = 8, accumulation: int = 1, world_size: int = 1,
          precision: str = "fp32", offload_optimizer: bool = False, offload_params: bool = False,
          lr: float = 1e-3, weight_decay: float = 0.0, optimizer: str = "AdamW",
          torch_adam: bool = True, persistence_threshold: int = 0) -> dict[str, Any]:
    """A complete, valid DeepSpeed config from readable choices.

    Args:
        stage: ZeRO stage 0-3.
        micro_batch: samples per GPU per forward/backward.
        accumulation: micro-batches per optimizer step.
        world_size: number of processes (GPUs); sets ``train_batch_size`` consistently.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (fp16 uses dynamic loss scaling).
        offload_optimizer, offload_params: move optimizer state / parameters to CPU memory.
        torch_adam: for Adam/AdamW without offload, run PyTorch's own optimizer (``"torch_adam": true``)
            instead of DeepSpeed's fused one. The fused kernel is compiled on first use, which needs
            ``nvcc`` on a GPU node — absent on Databricks ML runtimes — and is what makes a lesson stall
            or fail there; torch's AdamW gives the same update and matches a DDP baseline's optimizer.
            (With optimizer offload DeepSpeed requires its CPU Adam, so the flag is not set then.)
        persistence_threshold: stage 3 only: parameters with fewer elements than this stay whole on
            every rank (DeepSpeed's ``stage3_param_persistence_threshold``; its default is 100,000,
            which saves all-gathers of biases and norms on a large model). 0 partitions every
            parameter, as stage 3 is defined in the ZeRO paper. It is the course's default because
            DeepSpeed 0.14.4 (Databricks Runtime 15.4 LTS ML) on CPU processes sometimes gives wrong
            weights with whole small parameters: measured, 4 of 40 fp32 runs and 1 of 30 bf16 runs
            differed (one with NaN loss), 0 of 40 each with 0.
    """
    cfg: dict[str, Any] = {
        "train_batch_size": micro_batch * accumulation * world_size,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": optimizer, "params": {"lr": lr, "weight_decay": weight_decay}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,  # DeepSpeed's own step logging off; the lessons print what matters
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16}
    elif precision != "fp32":
        raise ConfigError(f"precision={precision!r}: use 'fp32', 'bf16' or 'fp16'")
    if torch_adam and optimizer.lower() in ("adam", "adamw") and not offload_optimizer:
        cfg["optimizer"]["params"]["torch_adam"] = True
    if offload_optimizer:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if offload_params:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = persistence_threshold
    validate(cfg, world_size)
    return cfg


def validate(cfg: dict[str, Any], world_size: int) -> dict[str, Any]:
    """Check ``cfg`` for ``world_size`` processes; return it unchanged or raise ``ConfigError``."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"the config must be a dict (parsed JSON), got {type(cfg).__name__}")
    for key in cfg:
        if key not in KNOWN_KEYS:
            close = difflib.get_close_matches(key, KNOWN_KEYS, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else "remove it or check DeepSpeed's config docs"
            raise ConfigError(f"unknown top-level key {key!r}: DeepSpeed would ignore it silently. Fix: {hint}")

    _check_batch(cfg, world_size)

    fp16 = _enabled(cfg, "fp16")
    bf16 = _enabled(cfg, "bf16")
    if fp16 and bf16:
        raise ConfigError("'fp16' and 'bf16' are both enabled. Fix: enable one (bf16 on A100/A10G/H100 "
                          "needs no loss scaling; fp16 for older GPUs such as V100/T4).")

    zero = cfg.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError("'zero_optimization' must be an object such as {\"stage\": 2}")
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_optimization.stage={stage!r}: must be 0, 1, 2 or 3")
    if _device(zero.get("offload_optimizer")) in ("cpu", "nvme") and stage == 0:
        raise ConfigError("zero_optimization.offload_optimizer needs stage 1, 2 or 3 (got stage 0). "
                          "Fix: set zero_optimization.stage to 2 (or 3).")
    if _device(zero.get("offload_param")) in ("cpu", "nvme") and stage != 3:
        raise ConfigError(f"zero_optimization.offload_param needs stage 3 (got stage {stage}): only stage 3 "
                          "partitions parameters. Fix: set stage to 3, or drop offload_param.")
    return cfg


def _enabled(cfg: dict[str, Any], key: str) -> bool:
    section = cfg.get(key)
    return isinstance(section, dict) and bool(section.get("enabled", False))


def _device(section: Any) -> str | None:
    return section.get("device") if isinstance(section, dict) else None


def _check_batch(cfg: dict[str, Any], world_size: int) -> None:
    total = cfg.get("train_batch_size")
    micro = cfg.get("train_micro_batch_size_per_gpu")
    accum = cfg.get("gradient_accumulation_steps")
    for key, value in (("train_batch_size", total), ("train_micro_batch_size_per_gpu", micro),
                       ("gradient_accumulation_steps", accum)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ConfigError(f"{key}={value!r} must be a positive integer")
    given = sum(v is not None for v in (total, micro, accum))
    if total is None and micro is None:
        raise ConfigError("set 'train_micro_batch_size_per_gpu' (samples per GPU per step) or 'train_batch_size'")
    if given == 3 and total != micro * accum * world_size:
        raise ConfigError(f"train_batch_size={total} but train_micro_batch_size_per_gpu x gradient_accumulation_steps "
                          f"x world size = {micro} x {accum} x {world_size} = {micro * accum * world_size}. "
                          f"Fix: set train_batch_size to {micro * accum * world_size}, or drop it and let "
                          "DeepSpeed compute it.")
    if total is not None and micro is not None and accum is None and total % (micro * world_size):
        raise ConfigError(f"train_batch_size={total} is not a multiple of train_micro_batch_size_per_gpu x world "
                          f"size = {micro * world_size}. Fix: make it {micro * world_size} x (accumulation steps).")
    if total is not None and accum is not None and micro is None and total % (accum * world_size):
        raise ConfigError(f"train_batch_size={total} is not a multiple of gradient_accumulation_steps x world size "
                          f"= {accum * world_size}. Fix: adjust one of them.")
