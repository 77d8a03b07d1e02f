import os

import pytest
import torch
import torch.distributed as dist

from dtlab import distributed
from dtlab.launch import run

pytestmark = pytest.mark.cluster  # code a cluster runs: make test-runtime repeats these on its stack


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
    results = run(_collectives_worker, nprocs=2)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 and r["sum"] == 3.0 and r["backend"] == "gloo" for r in results)
    assert [r["main"] for r in results] == [True, False]
    assert [r["decorated"] for r in results] == ["rank0 only", None]
    assert [r["local"] for r in results] == [0, 1]
    assert not any(r["initialized_after_teardown"] for r in results)
    assert results[0]["timeout_s"] == float(os.environ["DTLAB_TIMEOUT_S"])


def test_setup_with_some_launcher_variables_missing_names_them(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="missing: WORLD_SIZE, MASTER_ADDR, MASTER_PORT.*torchrun"):
        distributed.setup()


def test_setup_without_a_launcher_runs_as_one_process():
    """A learner calls the training function directly in a notebook cell to debug it."""
    import subprocess
    import sys

    code = ("import torch, torch.distributed as dist\n"
            "from dtlab import distributed\n"
            "device = distributed.setup()\n"
            "t = torch.ones(1, device=device); dist.all_reduce(t)\n"
            "print(dist.get_world_size(), distributed.rank(), t.item(), device.type)\n"
            "distributed.teardown()\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    # the last line: torch 2.9's gloo prints "[Gloo] Rank 0 is connected to 0 peer ranks. ..." before it
    assert out.stdout.strip().splitlines()[-1].split() == ["1", "0", "1.0", "cpu"], out.stdout


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


def test_free_port_is_below_the_ephemeral_range_and_never_handed_out_twice_while_promised(monkeypatch, tmp_path):
    """The kernel's own picks come from the ephemeral range, where any program's next socket may take the port
    before the workers bind it; free_port draws below it and promises each port it hands out."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    draws = iter([23456, 23456, 23457])

    class Draw:
        def randint(self, low, high):
            return next(draws)

        def random(self):
            return 1.0

    monkeypatch.setattr(distributed.random, "SystemRandom", Draw)
    first = distributed.free_port()
    second = distributed.free_port()         # the same draw again: promised to the first caller, so skipped
    assert (first, second) == (23456, 23457)
    assert first < distributed._ephemeral_start()
    assert sorted(os.listdir(tmp_path / "dtlab-ports")) == ["23456", "23457"]


def test_a_lapsed_promise_is_taken_over(monkeypatch, tmp_path):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    (tmp_path / "dtlab-ports").mkdir()
    stale = tmp_path / "dtlab-ports" / "24000"
    stale.touch()
    os.utime(stale, (0, 0))
    assert distributed._claim(24000)
    assert not distributed._claim(24000)


def _fails_on_rank_1_while_rank_0_communicates():
    import time

    distributed.setup()
    start = time.monotonic()
    try:
        if distributed.rank() == 1:
            raise ValueError("rank 1's real error")
        dist.all_reduce(torch.ones(1000))          # rank 0 is busy in a collective rank 1 never joins
        outcome = "all_reduce returned"
    except BaseException as exc:
        distributed.teardown(failed=True)
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    distributed.teardown()
    return {"error": None, "outcome": outcome, "seconds": time.monotonic() - start}


def test_a_failing_rank_leaves_at_once_and_its_peer_fails_fast_not_at_the_timeout(monkeypatch):
    # The gloo timeout here is 60 s (DTLAB_TIMEOUT_S, conftest). With a barrier in teardown's
    # `finally`, rank 1 sat in it until then and rank 0's all_reduce waited as long.
    results = run(_fails_on_rank_1_while_rank_0_communicates, nprocs=2)
    assert results[1]["error"] == "ValueError: rank 1's real error", "the first error stays the error"
    assert results[1]["seconds"] < 5
    assert results[0]["error"] is not None, "rank 0's all_reduce could not have succeeded"
    assert results[0]["seconds"] < 30, f"rank 0 waited {results[0]['seconds']:.0f} s, as if for the timeout"


def _agree_and_broadcast(values):
    distributed.setup()
    out = {"agree": distributed.all_agree(values[distributed.rank()]),
           "broadcast": distributed.broadcast_object({"from": distributed.rank()}, src=1),
           "device": distributed.collective_device().type}
    distributed.teardown()
    return out


def test_all_agree_and_broadcast_object():
    results = run(_agree_and_broadcast, [True, False], nprocs=2)
    assert all(r["agree"] == [True, False] for r in results)
    assert all(r["broadcast"] == {"from": 1} and r["device"] == "cpu" for r in results)


def _machine_ranks(hosts):
    import socket

    import torch.distributed as dist

    dist.init_process_group("gloo")
    if hosts:                                               # a cluster's machines, by name
        socket.gethostname = lambda: hosts[dist.get_rank()]
    try:
        return distributed.machine_ranks()
    except ValueError as err:
        return str(err)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("hosts, expected", [
    (None, [(0, 3), (1, 3), (2, 3)]),                                   # one machine: every rank on it
    (["a", "a", "b", "b"], [(0, 2), (1, 2), (0, 2), (1, 2)]),           # two machines of two
    (["a", "b", "a", "b"], "consecutive"),                              # Mosaic would number machines wrongly
    (["a", "a", "a", "b"], "consecutive"),                              # 3 and 1
])
def test_machine_ranks_come_from_the_machines_not_the_launchers_nodes(hosts, expected):
    out = run(_machine_ranks, hosts, nprocs=len(hosts) if hosts else 3)
    if isinstance(expected, str):
        assert all(expected in r and "Fix" in r for r in out), out
    else:
        assert out == expected
