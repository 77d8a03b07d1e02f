import inspect
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from torch import nn

from dtlab import checkpoint, models
from dtlab.launch import run

pytestmark = pytest.mark.cluster  # code a cluster runs: make test-runtime repeats these on its stack


def _trained_pair(seed=0):
    torch.manual_seed(seed)
    model = models.MLP(8, 16, 3, depth=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt


def test_round_trip_restores_weights_optimizer_position_and_rng(tmp_path):
    model, opt = _trained_pair()
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    state = checkpoint.training_state(model, optimizer=opt, epoch=2, step=30, note="x")
    path = checkpoint.save(tmp_path / "ck.pt", state)
    expected = (random.random(), float(np.random.rand()), torch.rand(3))

    fresh, fresh_opt = models.MLP(8, 16, 3, depth=1), None
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    state = checkpoint.load(path)
    assert checkpoint.restore(state, fresh, optimizer=fresh_opt) == (2, 30) and state["note"] == "x"
    got = (random.random(), float(np.random.rand()), torch.rand(3))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]


def test_missing_directory_is_a_clear_error_and_creates_nothing(tmp_path):
    target = tmp_path / "nope" / "ck.pt"
    with pytest.raises(checkpoint.CheckpointError, match="does not exist.*os.makedirs"):
        checkpoint.save(target, {"a": torch.ones(1)})
    assert not (tmp_path / "nope").exists()


def test_a_failed_write_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    path = checkpoint.save(tmp_path / "ck.pt", {"v": torch.tensor([1.0])})

    def broken_save(obj, f, *a, **k):
        f.write(b"PK\x03\x04 half a zip")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(path, {"v": torch.tensor([2.0])})
    monkeypatch.undo()
    assert checkpoint.load(path)["v"].item() == 1.0
    assert os.listdir(tmp_path) == ["ck.pt"], "the temporary file was cleaned up"


WRITER = textwrap.dedent("""
    import sys, torch
    from dtlab import checkpoint
    path, i = sys.argv[1], 0
    while True:
        i += 1
        checkpoint.save(path, {"i": i, "w": torch.full((1_000_000,), float(i))})
        print(i, flush=True)
""")


@pytest.mark.slow
def test_kill_9_during_writes_always_leaves_a_loadable_checkpoint(tmp_path):
    path = tmp_path / "ck.pt"
    rng = random.Random(0)
    for _ in range(4):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True)
        proc.stdout.readline()  # at least one checkpoint exists
        time.sleep(rng.uniform(0.0, 0.3))  # then die at a random point of a later write
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        state = checkpoint.load(path)
        assert torch.all(state["w"] == float(state["i"])), "a complete checkpoint, never a mix"


def test_corrupt_and_truncated_files_are_reported(tmp_path):
    good = checkpoint.save(tmp_path / "good.pt", {"w": torch.ones(1000)})
    data = good.read_bytes()
    (tmp_path / "trunc.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    for name in ("trunc.pt", "junk.pt"):
        with pytest.raises(checkpoint.CheckpointError, match="truncated or corrupt"):
            checkpoint.load(tmp_path / name)
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint at"):
        checkpoint.load(tmp_path / "absent.pt")


class Arbitrary:
    pass


def test_loading_uses_weights_only(tmp_path):
    torch.save({"obj": Arbitrary()}, tmp_path / "code.pt")
    with pytest.raises(checkpoint.CheckpointError, match="weights_only=True refuses"):
        checkpoint.load(tmp_path / "code.pt")


def test_a_checkpoint_for_another_shape_is_refused_and_the_model_untouched(tmp_path):
    model, opt = _trained_pair()
    path = checkpoint.save(tmp_path / "ck.pt", checkpoint.training_state(model, optimizer=opt))
    other = models.MLP(8, 32, 3, depth=1)
    before = [p.clone() for p in other.parameters()]
    with pytest.raises(checkpoint.CheckpointError, match=r"net\.0\.weight: checkpoint \(16, 8\) vs model \(32, 8\)"):
        checkpoint.restore(checkpoint.load(path), other)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))


def test_a_ddp_prefixed_checkpoint_gets_a_hint(tmp_path):
    model = models.MLP(8, 16, 3, depth=1)
    prefixed = {"model": {f"module.{k}": v for k, v in model.state_dict().items()}}
    with pytest.raises(checkpoint.CheckpointError, match="save ddp_model.module"):
        checkpoint.restore(prefixed, model)


def _rank0_writer(directory):
    from dtlab import distributed

    distributed.setup()
    path = os.path.join(directory, "shared.pt")
    checkpoint.save_on_rank0(path, {"writer": torch.tensor(distributed.rank())})
    seen = checkpoint.load(path)["writer"].item()  # every rank can read it after the barrier
    distributed.teardown()
    return seen


@pytest.mark.slow
def test_save_on_rank0_writes_once_and_everyone_can_read(tmp_path):
    assert run(_rank0_writer, str(tmp_path), nprocs=2) == [0, 0]
    assert os.listdir(tmp_path) == ["shared.pt"]


def test_training_state_is_a_snapshot_that_training_on_does_not_change():
    """state_dict() hands out live tensors: a state kept in memory used to follow the training."""
    model, opt = _trained_pair()
    state = checkpoint.training_state(model, optimizer=opt, step=3)
    frozen = {k: v.clone() for k, v in state["model"].items()}
    moment = state["optimizer"]["state"][0]["exp_avg"].clone()
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert all(torch.equal(frozen[k], state["model"][k]) for k in frozen)
    assert torch.equal(moment, state["optimizer"]["state"][0]["exp_avg"])


def test_restoring_the_same_state_twice_gives_the_same_start():
    model, opt = _trained_pair()
    state = checkpoint.training_state(model, optimizer=opt)
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    after = []
    for _ in range(2):
        fresh, fresh_opt = _trained_pair(seed=1)
        checkpoint.restore(state, fresh, optimizer=fresh_opt)
        fresh_opt.zero_grad()
        torch.nn.functional.cross_entropy(fresh(x), y).backward()
        fresh_opt.step()
        after.append([p.detach().clone() for p in fresh.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*after)), "the first restore trained the saved state on"


def test_calls_written_with_positional_optimizer_get_the_keyword_form():
    """Last month's README called ``training_state(model, opt, ...)`` and ``restore(state, model, opt, ...)``;
    such code gets a message that shows the keyword form, and nothing is restored half-way."""
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"training_state\(model, optimizer=opt"):
        checkpoint.training_state(model, opt, 0, 3)
    state = checkpoint.training_state(model, optimizer=opt, step=3)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    with pytest.raises(TypeError, match=r"restore\(state, model, optimizer=opt"):
        checkpoint.restore(state, model, opt)
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert checkpoint.restore(state, model, optimizer=opt) == (0, 3)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert "optimizer" in str(inspect.signature(checkpoint.restore))
