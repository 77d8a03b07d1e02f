"""A training loop that survives being killed: checkpoint often, resume from the newest.

``train(cfg)`` is the pattern of notebook 10, ready for any launcher (``dtlab.launch.run``,
``torchrun``, ``TorchDistributor``):

1. build model, optimizer, scheduler and a ``DistributedLoader``;
2. if ``cfg["ckpt_dir"]`` holds a checkpoint, restore *all* of them from it (weights, optimizer,
   scheduler, step, the loader's place in its epoch, every rank's RNG);
3. train, handing a ``Checkpointer`` the state after every step; it writes every
   ``every_steps`` steps.

Because everything that decides the next step is restored, a run that is killed and resumed
ends with exactly the weights of a run that never stopped (bitwise, on CPU), on any number of
processes: the gradients are summed in rank order (``ordered_sum_hook``), so DDP regrouping its
buckets at the first step after a restart cannot change a sum's rounding.

``resume="weights"`` restores only weights and step, the common shortcut, to see what it
costs: the optimizer's momentum, the learning-rate schedule, the data order and the dropout
masks all start over, and the run ends elsewhere.

Fault injection, to see it happen: ``crash_at_step=S`` makes rank ``crash_rank`` kill itself
with SIGKILL after step S on the first attempt — a worker that crashed or was OOM-killed (to the
other ranks, a peer that vanished mid-training). ``crash_at_step=[S1, S2]`` kills it after step
S1 on the first attempt and after S2 on the second. Under ``torchrun --max-restarts`` the job
restarts its workers on the same, still running node and resumes by itself:

    python -m torch.distributed.run --nproc_per_node 2 --max-restarts 1 -m dtlab.resumable \
        --ckpt-dir ckpt --crash-at-step 17

(A spot preemption removes the node itself, and torchrun with it: that is for job-level retries or
elastic ``--nnodes MIN:MAX`` training, both resuming from a checkpoint on shared storage; see
notebook 10.)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from dtlab import checkpoint, data, distributed, models

DEFAULTS: dict[str, Any] = {
    "steps": 40, "every_steps": 10, "keep": 2, "batch_size": 16, "lr": 0.05, "hidden": 32, "samples": 512,
    "dropout": 0.1, "seed": 0, "ckpt_dir": "checkpoints", "crash_at_step": None, "crash_rank": 1,
    "timeout_s": None, "out": None, "resume": "all", "backend": None, "ordered_sum": True,
}


def attempt(cfg: dict[str, Any]) -> int:
    """Which attempt this is: torchrun counts restarts in ``TORCHELASTIC_RESTART_COUNT``."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", cfg.get("attempt", 0)))


def ordered_sum_hook(process_group, bucket):  # unannotated: DDP checks a hook's annotations, and these are strings
    """DDP communication hook: the mean of every rank's gradients, summed in rank order.

    DDP's own all-reduce sums a gradient element in an order that depends on where the element sits
    in its bucket (which rank's chunk of the ring it falls in), and DDP regroups its buckets after
    the first backward pass after it is built: at step 1 in a fresh run, at the resume step in a
    resumed one. With 3 or more processes the two runs then round some sums differently
    ((a + b) + c != a + (b + c) in floating point) and end a few units in the last place apart.
    Gathering every rank's bucket and adding them in rank order makes each sum independent of the
    grouping. (With 2 processes a + b == b + a, and the default all-reduce is already exact.)
    Costs an all-gather instead of an all-reduce: fine for a lesson's model, not for a large one.

        ddp.register_comm_hook(None, ordered_sum_hook)
    """
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    grad = bucket.buffer()
    parts = [torch.empty_like(grad) for _ in range(world)]
    future = dist.all_gather(parts, grad, group=group, async_op=True).get_future()

    def rank_order_mean(done: torch.futures.Future) -> torch.Tensor:
        value = done.value()
        gathered = [t for v in value for t in (v if isinstance(v, list) else [v])]  # backends nest differently
        rows = torch.cat([t.reshape(-1) for t in gathered]).view(world, -1)
        total = rows[0].clone()
        for row in rows[1:]:
            total += row                                   # rank 0 + rank 1 + rank 2 ..., always this order
        return (total / world).view_as(grad)

    return future.then(rank_order_mean)


def crash_steps(cfg: dict[str, Any]) -> list[int]:
    """The steps after which ``crash_rank`` kills itself, one per attempt: ``crash_at_step`` as a list.

    Accepts None (no crash), one step (the first attempt only), a list of steps, or the command
    line's comma-separated text (``"7,15"``).
    """
    value = cfg.get("crash_at_step")
    if value is None or value == "":
        return []
    if isinstance(value, str):
        return [int(s) for s in value.split(",") if s.strip()]
    if isinstance(value, int):
        return [value]
    return [int(s) for s in value]


def train(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train ``cfg["steps"]`` steps with DDP, checkpointing and resuming; return this rank's outcome.

    Returns a dict with ``weights`` (all parameters, flattened), ``resumed_from`` (step of the
    checkpoint it started from, or None), ``steps_computed`` (the steps this attempt ran) and
    ``losses``. Rank 0 also appends the same summary to ``<ckpt_dir>/attempts.jsonl``.
    """
    cfg = {**DEFAULTS, **cfg}
    timeout = timedelta(seconds=cfg["timeout_s"]) if cfg["timeout_s"] else None
    device = distributed.setup(cfg["backend"], timeout=timeout)
    crashes = crash_steps(cfg)
    rank = distributed.rank()

    torch.manual_seed(cfg["seed"])                          # same initial weights on every rank
    model = models.MLP(64, cfg["hidden"], 10, dropout=cfg["dropout"]).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=15, gamma=0.5)
    loader = data.DistributedLoader(data.synthetic_classification(cfg["samples"]), cfg["batch_size"], seed=cfg["seed"])
    torch.manual_seed(cfg["seed"] + 1000 + rank)            # each rank's own dropout masks

    ckpt = checkpoint.Checkpointer(cfg["ckpt_dir"], every_steps=cfg["every_steps"], keep=cfg["keep"])
    step, resumed_from = 0, None
    state = ckpt.load_latest()
    if state is not None and cfg["resume"] == "all":         # resume: everything, not just the weights
        _, step = checkpoint.restore(state, model, optimizer=optimizer, scheduler=scheduler, loader=loader)
        resumed_from = step
    elif state is not None:                                  # the common mistake: weights and step only
        model.load_state_dict(state["model"])
        step = resumed_from = state["step"]
    ddp = DDP(model)
    if cfg["ordered_sum"]:
        ddp.register_comm_hook(None, ordered_sum_hook)        # exact on any number of processes

    computed, losses = [], []
    while step < cfg["steps"]:
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(ddp(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            computed.append(step)
            losses.append(loss.item())
            ckpt.maybe_save(step, lambda s=step: checkpoint.training_state(
                model, optimizer=optimizer, step=s, scheduler=scheduler, loader=loader))
            if attempt(cfg) < len(crashes) and step == crashes[attempt(cfg)] and rank == cfg["crash_rank"]:
                os.kill(os.getpid(), signal.SIGKILL)         # a crashed or OOM-killed worker: no exception, no cleanup
            if step == cfg["steps"]:
                break

    weights = torch.cat([p.detach().cpu().flatten() for p in model.parameters()])
    outcome = {"rank": rank, "attempt": attempt(cfg), "resumed_from": resumed_from, "steps_computed": computed,
               "losses": losses, "weights": weights}
    if rank == 0:
        summary = {k: v for k, v in outcome.items() if k != "weights"}
        with open(os.path.join(cfg["ckpt_dir"], "attempts.jsonl"), "a") as f:
            f.write(json.dumps(summary) + "\n")
        if cfg["out"]:
            checkpoint.save(cfg["out"], outcome)
    return outcome


def main(argv: list[str] | None = None) -> None:
    """Command-line entry for launchers: ``torchrun ... -m dtlab.resumable --ckpt-dir DIR ...``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for key, default in DEFAULTS.items():
        text = ("ckpt_dir", "out", "resume", "backend", "crash_at_step")  # crash_at_step: "17" or "7,15"
        kind = float if key in ("lr", "dropout", "timeout_s") else str if key in text else int
        p.add_argument("--" + key.replace("_", "-"), type=kind, default=default)
    cfg = vars(p.parse_args(argv))
    try:
        train(cfg)
    except BaseException:
        distributed.teardown(failed=True)  # the first error stays the error; no wait for peers
        raise
    distributed.teardown()


if __name__ == "__main__":
    main()
