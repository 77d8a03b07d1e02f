import os

import pytest
import torch
import torch.distributed as dist
from spawn import run_on

from dtlab import distributed


def _collectives_worker():
    device = distributed.setup()
    r, w = distributed.rank(), distributed.world_size()
    t = torch.tensor([float(r + 1)], device=device)
    dist.all_reduce(t)
    decorated = distributed.on_rank0(lambda: "rank0 only")()
    result = {"rank": r, "world": w, "local": distributed.local_rank(), "sum": t.item(),
              "main": distributed.is_main(), "decorated": decorated, "backend": dist.get_backend(),
              "timeout_s": distributed.DEFAULT_TIMEOUT.total_seconds()}
    distributed.teardown()
    result["initialized_after_teardown"] = dist.is_initialized()
    return result


def test_setup_teardown_and_rank_helpers_on_two_processes():
    results = run_on(2, _collectives_worker)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 and r["sum"] == 3.0 and r["backend"] == "gloo" for r in results)
    assert [r["main"] for r in results] == [True, False]
    assert [r["decorated"] for r in results] == ["rank0 only", None]
    assert [r["local"] for r in results] == [0, 1]
    assert not any(r["initialized_after_teardown"] for r in results)
    assert results[0]["timeout_s"] == float(os.environ["DTLAB_TIMEOUT_S"])


def test_setup_without_launcher_variables_names_the_fix(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        distributed.setup()


def test_single_process_defaults(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert (distributed.rank(), distributed.world_size(), distributed.local_rank()) == (0, 1, 0)
    assert distributed.is_main()
    distributed.barrier()  # a no-op outside a process group


def test_print0_prints_only_on_rank0(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    distributed.print0("hidden")
    monkeypatch.setenv("RANK", "0")
    distributed.print0("shown")
    assert capsys.readouterr().out == "shown\n"


def test_seed_everything_repeats_all_generators():
    import random

    import numpy as np

    def draw():
        return random.random(), float(np.random.rand()), torch.rand(1).item()

    distributed.seed_everything(123)
    first = draw()
    distributed.seed_everything(123)
    assert draw() == first
    distributed.seed_everything(124)
    assert draw() != first


def test_free_port_is_bindable():
    import socket

    port = distributed.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
