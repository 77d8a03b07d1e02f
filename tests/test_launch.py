import os
import time

import psutil
import pytest

from dtlab import launch

# Functions made the way a notebook makes them: they live in __main__, which no child can import,
# so they must travel by value.
pytestmark = pytest.mark.cluster  # code a cluster runs: make test-runtime repeats these on its stack


NOTEBOOK_CODE = '''
def notebook_fn(base):
    import os
    import torch.distributed as dist
    dist.init_process_group("gloo")
    t = __import__("torch").tensor([float(dist.get_rank() + base)])
    dist.all_reduce(t)
    print("hello from", dist.get_rank())
    dist.destroy_process_group()
    return {"rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]), "sum": t.item(),
            "threads": __import__("torch").get_num_threads()}
'''


def _notebook_function():
    namespace = {"__name__": "__main__"}
    exec(compile(NOTEBOOK_CODE, "<notebook cell>", "exec"), namespace)
    return namespace["notebook_fn"]


def _workers():
    """Live worker processes: children of the forkserver that launch.run forks them from."""
    servers = [p for p in psutil.Process().children() if "forkserver" in " ".join(p.cmdline())]
    return [c for s in servers for c in s.children() if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def _no_workers_left():
    for _ in range(50):
        if not _workers():
            return True
        time.sleep(0.1)
    return False


def test_runs_a_notebook_function_and_returns_results_in_rank_order(capfd):
    fn = _notebook_function()
    assert fn.__module__ == "__main__"
    results = launch.run(fn, 10, nprocs=3)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["world"] == 3 and r["sum"] == 33.0 and r["threads"] == 1 for r in results)
    out = capfd.readouterr().out
    assert "[rank 0] hello from 0" in out and "[rank 2] hello from 2" in out


def test_a_closure_and_keyword_arguments_travel_too():
    offset = 5
    assert launch.run(lambda x, scale=1: (int(os.environ["RANK"]) + offset + x) * scale, 1, scale=2,
                      nprocs=2) == [12, 14]


def _raise_on_rank_1():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError("bad batch on purpose")
    dist.barrier()  # rank 0 waits here for a peer that will never come
    return "unreachable"


def test_a_raising_rank_is_named_with_its_traceback_and_no_process_survives():
    start = time.monotonic()
    with pytest.raises(launch.WorkerError, match="rank 1 failed: ValueError: bad batch on purpose") as info:
        launch.run(_raise_on_rank_1, nprocs=2, timeout=60)
    assert info.value.rank == 1 and "_raise_on_rank_1" in info.value.remote_traceback
    # Had rank 0 been waited for, this would take its gloo timeout (DTLAB_TIMEOUT_S=60, conftest).
    assert time.monotonic() - start < 45, "the other rank was stopped, not waited for"
    assert _no_workers_left()


def _hang_on_rank_0():
    if os.environ["RANK"] == "0":
        time.sleep(3600)
    return "done"


@pytest.mark.slow
def test_a_hanging_rank_times_out_naming_it():
    with pytest.raises(launch.LaunchTimeout, match=r"ranks \[0\] had not finished after 3 s") as info:
        launch.run(_hang_on_rank_0, nprocs=2, timeout=3)
    assert info.value.pending == [0]
    assert _no_workers_left()


def _rank_1_exits(code):
    if os.environ["RANK"] == "1":
        os._exit(code)
    time.sleep(3600)


@pytest.mark.parametrize("code, says", [(7, "process exited with code 7"),
                                        (0, "process exited with code 0 without returning")])
def test_a_rank_that_exits_without_raising_is_reported_at_once(code, says):
    # Before the launcher watched process exits, a clean exit (code 0) waited for the whole launch timeout (600 s).
    with pytest.raises(launch.WorkerError, match=f"rank 1 failed: {says}"):
        launch.run(_rank_1_exits, code, nprocs=2, timeout=120)
    assert _no_workers_left()


def test_an_unpicklable_function_is_refused_before_starting():
    import threading

    lock = threading.Lock()
    with pytest.raises(launch.LaunchError, match="cannot be sent to the workers.*inside the function"):
        launch.run(lambda: lock.locked(), nprocs=2)


def test_too_many_processes_is_refused():
    with pytest.raises(ValueError, match="nprocs="):
        launch.run(print, nprocs=10_000)


@pytest.mark.slow
def test_a_script_without_a_main_guard_gets_the_fix(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "no_guard.py"
    script.write_text("from dtlab.launch import run\nprint(run(abs, -1, nprocs=2))\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "if __name__ == \"__main__\":" in out.stderr and "LaunchError" in out.stderr
    guarded = tmp_path / "guard.py"
    guarded.write_text("from dtlab.launch import run\nif __name__ == '__main__':\n    print(run(abs, -1, nprocs=2))\n")
    out = subprocess.run([sys.executable, str(guarded)], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[1, 1]", out.stderr


class _SlowToDie:
    def __del__(self):  # stands in for a process-group teardown that never finishes
        time.sleep(3600)


def _returns_then_hangs_in_teardown():
    blocker = _SlowToDie()  # noqa: F841 — released when the function's locals are
    return "done"


@pytest.mark.slow
def test_a_teardown_that_hangs_after_returning_does_not_lose_the_result(capfd):
    start = time.monotonic()
    assert launch.run(_returns_then_hangs_in_teardown, nprocs=2, timeout=120) == ["done", "done"]
    # The stuck ranks are stopped after a 10 s grace; waiting for them would take the 120 s timeout.
    assert time.monotonic() - start < 100
    assert "did not exit within 10 s" in capfd.readouterr().err
    assert _no_workers_left()


def _read_env(name):
    return os.environ.get(name)


def test_workers_see_the_environment_as_it_is_at_each_launch(monkeypatch):
    launch.run(_read_env, "PATH", nprocs=1)          # the fork server exists from here on
    monkeypatch.setenv("DTLAB_TEST_LATE_VARIABLE", "set after the first launch")
    assert launch.run(_read_env, "DTLAB_TEST_LATE_VARIABLE", nprocs=2) == ["set after the first launch"] * 2
    monkeypatch.delenv("DTLAB_TEST_LATE_VARIABLE")
    assert launch.run(_read_env, "DTLAB_TEST_LATE_VARIABLE", nprocs=1) == [None], "an unset variable is gone too"
    assert launch.run(_read_env, "RANK", nprocs=2, env={"RANK": "ignored"}) == ["ignored", "ignored"], \
        "env= is applied last, as documented"


def _chatty_rank_0_dead_rank_1():
    if os.environ["RANK"] == "1":
        time.sleep(1)
        os._exit(3)
    while True:  # a peer that prints all the time: the queue is never quiet
        print("still training", flush=True)
        time.sleep(0.001)


def test_a_dead_rank_is_noticed_even_while_a_peer_prints_without_pause(capfd):
    # Event, not time: with liveness checked only in quiet moments, this ended in LaunchTimeout.
    with pytest.raises(launch.WorkerError, match="rank 1 failed: process exited with code 3"):
        launch.run(_chatty_rank_0_dead_rank_1, nprocs=2, timeout=60)
    capfd.readouterr()
    assert _no_workers_left()


def _cwd():
    return os.getcwd()


def test_workers_start_in_the_callers_working_directory_at_each_launch(tmp_path, monkeypatch):
    """Workers fork from a server started at the first launch; a notebook that changed directory since
    (dtlab.notebook.use_scratch_dir) must not have its files written into the old one."""
    launch.run(_cwd, nprocs=1)
    monkeypatch.chdir(tmp_path)
    assert launch.run(_cwd, nprocs=2) == [str(tmp_path)] * 2
