"""DeepSpeed ZeRO on 2 CPU processes: same weights as DDP, and per-rank partitions as the model says.

Model, batches and the DDP baseline's loop are the strategy tests' shared ones (``tests/strategy.py``).
"""

import pytest
import torch
from strategy import LOCAL_BATCH, STEPS, loss_of, make_batches, make_model, train_rank_share

from dtlab._compat import leftover_deepspeed_shm
from dtlab.launch import run
from dtlab.measure import max_diff


def train(stage):
    """stage None: torch DDP with torch AdamW; 0-3: DeepSpeed with its AdamW."""
    import logging

    import torch.distributed as dist

    from dtlab import ds_config
    from dtlab.parallel import held_elements  # every strategy's one interface: here a DeepSpeed engine
    from dtlab.parallel.zero import full_state_dict

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model("mlp")
    xs, ys = make_batches("mlp", LOCAL_BATCH * world)
    rows = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    held = None
    if stage is None:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        train_rank_share(ddp, opt, "mlp", rank, world)
    else:
        import deepspeed
        from deepspeed.utils import logger

        logger.setLevel(logging.ERROR)
        cfg = ds_config.build(stage=stage, micro_batch=LOCAL_BATCH, world_size=world, lr=1e-2, weight_decay=0.1)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        for step in range(STEPS):
            engine.backward(loss_of(engine, "mlp", xs[step][rows], ys[step][rows]))
            grads = held_elements(engine)["grads"]
            engine.step()
        held = {**held_elements(engine), "grads": grads}
        if stage == 3:  # gather the shards to compare full weights
            held["whole_on_every_rank"] = sum(bool(getattr(p, "ds_persist", False)) for p in model.parameters())
            state = full_state_dict(model)      # every rank joins the gathers
            dist.destroy_process_group()
            return {"state": state, "held": held}
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dist.destroy_process_group()
    return {"state": state, "held": held}


@pytest.fixture(scope="module")
def ddp_result():
    return run(train, None, nprocs=2, timeout=300)[0]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_trains_the_same_weights_as_ddp_and_holds_what_the_model_says(stage, ddp_result):
    results = run(train, stage, nprocs=2, timeout=300)
    for r in results:
        # Two ranks sum a gradient in one order only, and DeepSpeed runs torch's AdamW here
        # (ds_config's torch_adam): the same arithmetic as DDP, so the same bits.
        diff = max_diff(r["state"], ddp_result["state"])
        assert diff == 0, f"stage {stage} drifted from DDP by {diff:.2e}"

    psi, n = sum(p.numel() for p in make_model("mlp").parameters()), 2
    pad = 8  # DeepSpeed pads each shard to an alignment: allow a few elements
    for r in results:
        h = r["held"]
        assert h["params"] == pytest.approx(psi / n if stage == 3 else psi, abs=pad)
        assert h["optimizer_moments"] == pytest.approx(2 * psi / (n if stage >= 1 else 1), abs=2 * pad)
        assert h["master_weights"] == pytest.approx(psi / n if stage >= 1 else 0, abs=pad)
        assert h["optimizer"] == h["optimizer_moments"] + h["master_weights"]
        # At the end of an accumulation cycle DeepSpeed's stages 1-3 keep only their reduced shard.
        assert h["grads"] == pytest.approx(psi if stage == 0 else psi / n, abs=pad)
        if stage == 3:  # ds_config partitions every parameter (see ds_config.build, persistence_threshold)
            assert h["whole_on_every_rank"] == 0


def _init_deepspeed():
    import os

    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    return int(os.environ["LOCAL_SIZE"])


@pytest.mark.slow
def test_a_launch_leaves_no_deepspeed_shared_memory_behind():
    # DeepSpeed's CPU all-reduce creates a 66 MB /dev/shm file per rank and never removes it (324 of them,
    # 21 GB, had filled this machine's memory); dtlab.launch removes its workers' files after they exit.
    before = leftover_deepspeed_shm()
    assert run(_init_deepspeed, nprocs=2, backend="gloo") == [2, 2]
    assert leftover_deepspeed_shm() - before == set()


@pytest.mark.slow
def test_a_process_that_imports_dtlab_removes_its_deepspeed_shared_memory_at_exit(tmp_path):
    import os
    import subprocess
    import sys

    from dtlab.distributed import free_port

    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    code = ("import dtlab.models, deepspeed, pathlib, os\n"
            "deepspeed.init_distributed(dist_backend='gloo')\n"
            "from dtlab._compat import deepspeed_shm_buffers\n"
            "print(all(p.exists() for p in deepspeed_shm_buffers('127.0.0.1', os.environ['MASTER_PORT'], [0])))\n")
    before = leftover_deepspeed_shm()
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "True", "DeepSpeed no longer creates it: drop the work-around"
    assert leftover_deepspeed_shm() - before == set()
