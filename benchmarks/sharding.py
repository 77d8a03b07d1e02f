"""DDP, DeepSpeed ZeRO-3, FSDP2 and the scratch FSDP: time per step and memory per rank, side by side.

    .venv/bin/python benchmarks/sharding.py [--steps 8] [--repeats 3] [--n-embd 128] [--n-layer 4]

One launch per repeat trains the same TinyGPT with AdamW under each strategy in turn, in the same
processes (the order rotates between repeats), and records each strategy's median step time and the
elements its rank holds (parameters, gradients, optimizer state; DeepSpeed also keeps an fp32 master
slice). The memory model (dtlab.planner.formulas.model_states, fp32) predicts the bytes per rank: 16Ψ for DDP,
20Ψ/N for DeepSpeed's ZeRO-3, 16Ψ/N for FSDP. FSDP2 needs torch >= 2.6 and is left out below it.
"""

import argparse
import statistics

from dtlab import models
from dtlab.environment import plan
from dtlab.launch import run
from dtlab.parallel import fsdp2
from dtlab.planner.formulas import model_states

STRATEGIES = ["DDP", "ZeRO-3 (DeepSpeed)", "FSDP2", "scratch FSDP"]


def make_model(cfg):
    import torch

    torch.manual_seed(0)
    return models.TinyGPT(vocab_size=256, block_size=64, n_layer=cfg["n_layer"], n_head=4, n_embd=cfg["n_embd"],
                          tie_weights=False)


def compare(cfg, order):
    """One job: every strategy in ``order``; per strategy the median step time and the held elements."""
    import logging
    import statistics
    import time
    import warnings

    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.utils import logger
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dtlab import data, ds_config
    from dtlab.distributed import local_device
    from dtlab.parallel import fsdp2
    from dtlab.parallel.fsdp import ScratchFSDP
    from dtlab.parallel.zero import held_elements

    logger.setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    warnings.filterwarnings("ignore", message=".* is deprecated. Please use .*_single")  # DeepSpeed's old names
    deepspeed.init_distributed(dist_backend=cfg["backend"])
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = local_device(cfg["device"])
    x, y = data.synthetic_tokens(cfg["batch"] * world, 64, 256, seed=1).tensors
    x, y = x[rank::world].to(dev), y[rank::world].to(dev)

    def timed(step):
        step()  # warm-up; creates the optimizer state
        times = []
        for _ in range(cfg["steps"]):
            dist.barrier()
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def build(name):
        model = make_model(cfg).to(dev)
        if name == "ZeRO-3 (DeepSpeed)":
            config = ds_config.build(stage=3, micro_batch=cfg["batch"], world_size=world, lr=1e-3)
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
            seen = {}

            def step():
                engine.backward(engine(x, y)[1])
                seen["grads"] = held_elements(engine)["grads"]
                engine.step()

            def held():
                h = held_elements(engine)
                return {"params": h["params"], "grads": seen["grads"],
                        "optimizer": h["optimizer_moments"] + h["master_weights"]}
            return step, held
        if name == "DDP":
            wrapped = DDP(model)
        elif name == "scratch FSDP":
            wrapped = model = ScratchFSDP(model)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(cfg["device"], (world,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            wrapped = fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)

        def step():
            opt.zero_grad(set_to_none=False)
            wrapped(x, y)[1].backward()
            if hasattr(wrapped, "finish_gradient_synchronization"):
                wrapped.finish_gradient_synchronization()
            opt.step()
        return step, lambda: fsdp2.held_elements(model, opt)

    out = {}
    for name in order:
        if name == "FSDP2" and not fsdp2.AVAILABLE:
            continue
        step, held = build(name)
        out[name] = {"step_s": timed(step), "held": held()}
    dist.destroy_process_group()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    args = ap.parse_args()
    p = plan()
    cfg = dict(steps=args.steps, n_embd=args.n_embd, n_layer=args.n_layer, batch=args.batch, device=p.device,
               backend=p.backend)
    names = [s for s in STRATEGIES if s != "FSDP2" or fsdp2.AVAILABLE]
    env = {} if p.device == "cuda" else {"DS_ACCELERATOR": "cpu"}
    rounds = []
    for r in range(args.repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        rounds.append(run(compare, cfg, order, nprocs=p.nprocs, env=env)[0])
    psi, n = models.count_parameters(make_model(cfg)), p.nprocs
    predicted = {"DDP": model_states(psi, n, 0, "fp32").gpu, "ZeRO-3 (DeepSpeed)": model_states(psi, n, 3, "fp32").gpu,
                 "FSDP2": 16 * psi / n, "scratch FSDP": 16 * psi / n}
    ddp_s = statistics.median(r["DDP"]["step_s"] for r in rounds)
    print(f"TinyGPT {args.n_layer} x {args.n_embd} ({psi:,} parameters), AdamW fp32, {n} processes "
          f"({p.backend}), {args.batch} sequences per rank, median of {args.steps} steps x {args.repeats} launches\n")
    print("| strategy | step ms | vs DDP | spread | bytes per rank | vs DDP | model predicts | error |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in names:
        times = [r[name]["step_s"] for r in rounds]
        med = statistics.median(times)
        held = rounds[0][name]["held"]
        measured = 4 * sum(held.values())
        ddp_bytes = 4 * sum(rounds[0]["DDP"]["held"].values())
        print(f"| {name} | {1e3 * med:.1f} | {med / ddp_s:.2f}x | {(max(times) - min(times)) / med:.0%} | "
              f"{measured:,} | {measured / ddp_bytes:.2f}x | {predicted[name]:,.0f} | "
              f"{measured / predicted[name] - 1:+.1%} |")


if __name__ == "__main__":
    main()
