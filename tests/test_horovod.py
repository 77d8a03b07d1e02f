"""Horovod must train the same weights as one process and as DDP (same model, data and steps)."""

import os
from pathlib import Path

import pytest

from dtlab.environment import DATABRICKS_RUNTIME_STACKS

if "horovod" not in DATABRICKS_RUNTIME_STACKS.get(os.environ.get("DTLAB_TEST_RUNTIME", "15.4"), {"horovod": ""}):
    pytest.skip(f"Databricks Runtime {os.environ['DTLAB_TEST_RUNTIME']} ML has no Horovod (16.0 ML and later do not "
                "preinstall it); its stack does not build it", allow_module_level=True)

import horovod  # noqa: E402  (the main stack and 15.4's build it: a missing Horovod there fails here)
import torch  # noqa: E402
from strategy import (
    LR,
    make_model,
    max_diff,
    perturbed,
    reference,
    tolerance,
    train_data_parallel,
    train_rank_share,
)

from dtlab.launch import run

pytestmark = pytest.mark.slow  # every test here starts a cluster, a browser, a set-up or several launches


@pytest.fixture(autouse=True)
def workers_can_import_tests(monkeypatch):
    # horovod.run starts fresh interpreters; they unpickle these test functions by module name.
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))


def train_horovod(kind, fp16=False):
    import horovod.torch as hvd

    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    torch.manual_seed(100 + rank)
    model = make_model(kind) if rank == 0 else perturbed(make_model(kind))  # broadcast must fix this
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=[(n, p) for n, p in model.named_parameters()
                                                          if p.requires_grad],
                                   compression=hvd.Compression.fp16 if fp16 else hvd.Compression.none)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    train_rank_share(model, opt, kind, rank, world)
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@pytest.mark.parametrize("kind", ["mlp", "tied"])
def test_horovod_equals_one_process_and_ddp(kind):
    results = horovod.run(train_horovod, args=(kind,), num_proc=2, hosts="localhost:2", use_gloo=True)
    ddp = run(train_data_parallel, kind, "ddp", nprocs=2)[0]
    ref = reference(kind, 2)
    for r in results:
        assert max_diff(r["state"], ref) <= tolerance(ref, 2)
    # Horovod averages (g0 + g1) / 2, DDP g0 / 2 + g1 / 2: the same float32 numbers for two ranks
    assert max_diff(results[0]["state"], ddp["state"]) == 0


def test_fp16_compression_stays_close_but_is_not_exact():
    exact = horovod.run(train_horovod, args=("mlp",), num_proc=2, hosts="localhost:2", use_gloo=True)[0]
    fp16 = horovod.run(train_horovod, args=("mlp", True), num_proc=2, hosts="localhost:2", use_gloo=True)[0]
    assert 0 < max_diff(fp16["state"], exact["state"]) < 1e-2


def test_more_processes_than_slots_is_refused():
    with pytest.raises(ValueError, match="more processes"):
        horovod.run(train_horovod, args=("mlp",), num_proc=3, hosts="localhost:2", use_gloo=True)
