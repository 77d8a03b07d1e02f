"""Measure the peak memory of training steps on this machine's CPUs and write ``dtlab/planner/measured_cpu.json``.

Two gloo processes train each configuration: TinyGPT and a Hugging Face Llama, two sizes each, under DDP,
FSDP2 and DeepSpeed ZeRO (stages 1, 2 and 3; stage 3 also with buckets sized to the model), each for a
warm-up step and then measured steps, fp32, AdamW (``dtlab.parallel.peak_memory.worker``). Each rank's peak
of live tensor bytes is read from PyTorch's CPU allocator (``help(dtlab.parallel.peak_memory)``)::

    OMP_NUM_THREADS=1 python scripts/measure_memory_cpu.py                 # everything (a few minutes)
    OMP_NUM_THREADS=1 python scripts/measure_memory_cpu.py --only Llama-256 --out /tmp/m.json

The file is rewritten after every configuration, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "dtlab" / "planner" / "measured_cpu.json"

#: The models: name -> (model config, sequences per rank, sequence length).
MODELS = {
    "TinyGPT-256": ({"family": "TinyGPT", "n_layer": 4, "n_embd": 256, "n_head": 4, "vocab": 8192}, 8, 256),
    "TinyGPT-512": ({"family": "TinyGPT", "n_layer": 4, "n_embd": 512, "n_head": 8, "vocab": 8192}, 4, 256),
    "Llama-256": ({"family": "Llama", "n_layer": 4, "hidden": 256, "intermediate": 688, "n_head": 4, "n_kv_head": 2,
                   "vocab": 8000}, 8, 256),
    "Llama-512": ({"family": "Llama", "n_layer": 4, "hidden": 512, "intermediate": 1376, "n_head": 8, "n_kv_head": 4,
                   "vocab": 8000}, 4, 256),
}


def _small_buckets(model: dict) -> dict:
    """ZeRO-3 buckets sized to the model as Hugging Face's Trainer fills its "auto" values: reduce bucket h²,
    prefetch 0.9 h² (the persistence threshold stays 0: every parameter partitioned)."""
    h = model.get("n_embd") or model["hidden"]
    return {"reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h)}


#: The strategies: label -> (strategy, options for it, or a function of the model config giving them).
STRATEGIES = {
    "DDP": ("DDP", {"gradient_as_bucket_view": False}),
    "DDP, gradient_as_bucket_view": ("DDP", {"gradient_as_bucket_view": True}),
    "DDP, AdamW foreach": ("DDP", {"gradient_as_bucket_view": False, "foreach": True}),
    "FSDP2": ("FSDP2", {}),
    "FSDP2, reshard_after_forward=True (root too)": ("FSDP2", {"reshard_after_forward": True}),
    "FSDP2, reshard_after_forward=False": ("FSDP2", {"reshard_after_forward": False}),
    "FSDP2, AdamW foreach": ("FSDP2", {"foreach": True}),
    "ZeRO-1 (DeepSpeed)": ("ZeRO-1", {}),
    "ZeRO-2 (DeepSpeed)": ("ZeRO-2", {}),
    "ZeRO-3 (DeepSpeed)": ("ZeRO-3", {}),
    "ZeRO-3 (DeepSpeed), buckets h^2": ("ZeRO-3", _small_buckets),
}

ABOUT = (
    "Peak memory of fp32 training steps measured on CPUs: 2 processes (gloo, one thread each) on one machine "
    "(x86_64, 2 cores, AVX2, 24 GiB; torch {torch}, deepspeed {deepspeed}, transformers {transformers}), written "
    "by scripts/measure_memory_cpu.py (dtlab.parallel.peak_memory.worker). What is measured: the peak of live "
    "tensor bytes per rank, the CPU analogue of torch.cuda.max_memory_allocated (without its rounding to 512-byte "
    "blocks). PyTorch's CPU allocator keeps a running total of the bytes it has handed out and not got back, on "
    "every thread, when c10's caffe2_report_cpu_memory_usage flag is set (set first thing in each worker, before "
    "the model is built, so the total is every tensor the worker allocated and still holds); at c10's INFO log "
    "level it logs that total at every allocation and free. The measured step runs with that log going to a file; "
    "the peak is the largest total logged. torch.profiler's memory events were not used for the number: they come "
    "only from threads the profiler follows (gloo frees collectives' buffers on its own worker threads, and a "
    "tensor made and freed on another thread is never seen); each record keeps the profiler's view beside it "
    "('profiler_peak', the largest running total its events carried), which equals 'peak' unless the peak was "
    "reached on another thread (in every run here it was not). Tensors that PyTorch's CPU allocator did not "
    "allocate are not counted: DeepSpeed's shared-memory all-reduce buffer (its size per rank is "
    "'deepspeed_shm_bytes') and gloo's own buffers. gloo's collectives on CPU tensors allocate temporaries that "
    "NCCL's do not, and those are counted: all_gather_into_tensor and reduce_scatter_tensor each hold a copy of "
    "the full (unsharded) tensor while they run. The method is checked against hand-computed bytes in "
    "tests/test_peak_memory.py. Reproducibility: two full runs gave the same 'start' and 'peak' on every rank, byte "
    "for byte, and rank 0 always equalled rank 1 there; 'after' and 'phase_peaks' of the sharded strategies may "
    "differ (between runs and ranks) by one collective's buffer, which gloo frees on its worker thread when it "
    "gets to it (FSDP2: the root's reduce-scatter copy, e.g. 17041408 bytes for TinyGPT-256), and ZeRO-1/2's "
    "'after' backward differs between ranks by under 4 MB (where the flat partition boundary cuts a parameter). "
    "Each configuration: a warm-up "
    "step (optimizer state then exists), then measured steps, each the three phases forward (loss), backward, "
    "optimizer step (torch: optimizer.step() then zero_grad(set_to_none=True); DeepSpeed: engine.step()). Per rank "
    "and step: 'start' (bytes live at the start of the step), 'peak', 'above_start' (peak - start), 'after' "
    "(live at the end of forward, backward, step) and 'phase_peaks' (the most live within each phase), "
    "'held_at_start' (parameters as this rank holds them, gradients, optimizer state: distinct storages, each "
    "counted once, in that order; DeepSpeed's fp32 master partition counts as optimizer state, its flat gradient "
    "partition as gradients) and 'other_at_start' (start minus those: the batch, DDP's buckets, DeepSpeed's "
    "buffers, small module buffers). 'before_model' is what the worker held before the model was built (process "
    "group set-up, DeepSpeed's import). Batches: synthetic tokens (dtlab.data.synthetic_tokens), int64, "
    "each rank its own sequences. Bytes are bytes; MiB = 2**20 bytes."
)


def configurations(only: str | None) -> list[dict]:
    runs = []
    for model_name, (model, batch, seq) in MODELS.items():
        for label, (strategy, options) in STRATEGIES.items():
            name = f"{model_name} {label}"
            if only and only not in name:
                continue
            opts = options(model) if callable(options) else dict(options)
            runs.append({"name": name, "model_name": model_name, "label": label,
                         "cfg": {"model": model, "batch": batch, "seq_len": seq, "strategy": strategy,
                                 "options": opts, "backend": "gloo", "measured_steps": 1, "cross_check": True}})
    return runs


def record_of(run: dict, ranks: list[dict], wall_s: float) -> dict:
    """One configuration's record from its ranks' results."""
    from dtlab.parallel.peak_memory import model_shape

    cfg, first = run["cfg"], ranks[0]
    family = cfg["model"]["family"]
    shape = model_shape(cfg)
    strategy = {"name": cfg["strategy"], "label": run["label"], "options": cfg["options"]}
    for key in ("ddp", "fsdp2", "deepspeed"):
        if key in first["settings"]:
            strategy[key] = first["settings"][key]
    per_rank = []
    for r in ranks:
        rank = {"rank": r["rank"], "before_model": r["before_model"], "warmup_s": round(r["warmup_s"], 2),
                "steps": []}
        for s in r["steps"]:
            rank["steps"].append({
                "start": s["start"], "peak": s["peak"], "above_start": s["above_start"],
                "after": dict(zip(("forward", "backward", "step"), s["after"])),
                "phase_peaks": dict(zip(("forward", "backward", "step"), s["phase_peaks"])),
                "held_at_start": s["held_at_start"], "other_at_start": s["other_at_start"],
                "profiler_peak": s["profiler_peak"], "allocator_events": s["events"],
                "seconds": round(s["seconds"], 2)})
        if "deepspeed_buffers" in r:
            rank["deepspeed_buffers"] = r["deepspeed_buffers"]
            rank["deepspeed_shm_bytes"] = r["deepspeed_shm_bytes"]
        per_rank.append(rank)
    peaks = [s["peak"] for r in per_rank for s in r["steps"]]
    return {
        "name": run["name"],
        "model": {**shape, "params": first["params_total"], "param_bytes": 4 * first["params_total"]},
        "world": first["world"], "backend": "gloo", "device": "cpu", "dtype": "fp32",
        "batch_per_rank": cfg["batch"], "seq_len": cfg["seq_len"], "tokens_per_rank": cfg["batch"] * cfg["seq_len"],
        "attention": first["attention"],
        "loss": {"function": ("TinyGPT.forward's F.cross_entropy" if family == "TinyGPT" else
                              "F.cross_entropy on LlamaForCausalLM(...).logits (labels not passed to the model)"),
                 "over": "every position: batch_per_rank x seq_len rows of vocab logits, mean reduction",
                 "fp32": True, "logits_dtype": "fp32 (the model's dtype; no upcast copy)", "ops": first["loss_ops"]},
        "activation_recompute": "none", "dropout": "none",
        "optimizer": first["settings"]["optimizer"], "zero_grad": first["settings"]["zero_grad"],
        "strategy": strategy,
        "peak_bytes_max_over_ranks": max(peaks),
        "per_rank": per_rank,
        "launch_wall_s": round(wall_s, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run only the configurations whose name contains this")
    parser.add_argument("--out", type=Path, default=OUT, help=f"the JSON to write (default {OUT.relative_to(ROOT)})")
    parser.add_argument("--steps", type=int, default=1, help="measured steps after the warm-up (default 1)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["DS_ACCELERATOR"] = "cpu"
    sys.path.insert(0, str(ROOT))

    import deepspeed
    import torch
    import transformers

    from dtlab.launch import run
    from dtlab.parallel.peak_memory import worker

    about = ABOUT.format(torch=torch.__version__, deepspeed=deepspeed.__version__,
                         transformers=transformers.__version__)
    out = {"about": about, "runs": []}
    began = time.perf_counter()
    for item in configurations(args.only):
        item["cfg"]["measured_steps"] = args.steps
        t0 = time.perf_counter()
        ranks = run(worker, item["cfg"], nprocs=2, threads_per_process=1, env={"DS_ACCELERATOR": "cpu"},
                    timeout=300)
        wall = time.perf_counter() - t0
        rec = record_of(item, ranks, wall)
        out["runs"].append(rec)
        out["total_wall_s"] = round(time.perf_counter() - began, 1)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
        peaks = " ".join(f"{s['peak'] / 2**20:8.1f}" for r in rec["per_rank"] for s in r["steps"])
        starts = " ".join(f"{s['start'] / 2**20:8.1f}" for r in rec["per_rank"] for s in r["steps"])
        print(f"{rec['name']:<44} peak MiB {peaks}   start MiB {starts}   {wall:5.1f} s", flush=True)
    print(f"{len(out['runs'])} configurations in {time.perf_counter() - began:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
