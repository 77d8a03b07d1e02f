"""A training loop that survives being killed: checkpoint often, resume from the newest.

``train(cfg)`` is the pattern of notebook 10, ready for any launcher (``dtlab.launch.run``,
``torchrun``, ``TorchDistributor``):

1. build model, optimizer, scheduler and a ``DistributedLoader``;
2. if ``cfg["ckpt_dir"]`` holds a checkpoint, restore *all* of them from it (weights, optimizer,
   scheduler, step, the loader's place in its epoch, every rank's RNG);
3. train, handing a ``Checkpointer`` the state after every step; it writes every
   ``every_steps`` steps.

Because everything that decides the next step is restored, a run that is killed and resumed
ends with exactly the weights of a run that never stopped (bitwise, on CPU).

``resume="weights"`` restores only weights and step, the common shortcut, to see what it
costs: the optimizer's momentum, the learning-rate schedule, the data order and the dropout
masks all start over, and the run ends elsewhere.

Fault injection, to see it happen: ``crash_at_step=S`` makes rank ``crash_rank`` kill itself
with SIGKILL after step S on the first attempt — what a spot preemption looks like to the
other ranks. Under ``torchrun --max-restarts 1`` the job restarts and resumes by itself:

    torchrun --nproc_per_node 2 --max-restarts 1 -m dtlab.resumable --ckpt-dir ckpt --crash-at-step 17
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
    "timeout_s": None, "out": None, "resume": "all",
}


def attempt(cfg: dict[str, Any]) -> int:
    """Which attempt this is: torchrun counts restarts in ``TORCHELASTIC_RESTART_COUNT``."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", cfg.get("attempt", 0)))


def train(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train ``cfg["steps"]`` steps with DDP, checkpointing and resuming; return this rank's outcome.

    Returns a dict with ``weights`` (all parameters, flattened), ``resumed_from`` (step of the
    checkpoint it started from, or None), ``steps_computed`` (the steps this attempt ran) and
    ``losses``. Rank 0 also appends the same summary to ``<ckpt_dir>/attempts.jsonl``.
    """
    cfg = {**DEFAULTS, **cfg}
    timeout = timedelta(seconds=cfg["timeout_s"]) if cfg["timeout_s"] else None
    device = distributed.setup(timeout=timeout)
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
            if step == cfg["crash_at_step"] and rank == cfg["crash_rank"] and attempt(cfg) == 0:
                os.kill(os.getpid(), signal.SIGKILL)         # a preempted node: no exception, no cleanup
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
        kind = float if key in ("lr", "dropout", "timeout_s") else str if key in ("ckpt_dir", "out", "resume") else int
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
