"""dtlab.processes: the one way the course stops what it started (launch, the MLflow server, the runner, Ray)."""

import subprocess
import sys
import time

import pytest

from dtlab.processes import stop_group, wait_until_gone


def test_wait_until_gone_returns_nothing_once_the_thing_is_gone_and_what_is_left_at_the_deadline():
    until = time.monotonic() + 0.5
    assert wait_until_gone(lambda: ["x"] if time.monotonic() < until else [], timeout=5) == []
    start = time.monotonic()
    assert wait_until_gone(lambda: ["stuck"], timeout=0.5) == ["stuck"]
    assert 0.4 < time.monotonic() - start < 3


@pytest.mark.parametrize("ignores_sigterm", [False, True])
def test_stop_group_stops_a_process_and_the_child_it_started(ignores_sigterm):
    """A server's worker in the same process group goes with it; one that ignores SIGTERM gets SIGKILL."""
    import psutil

    trap = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); " if ignores_sigterm else ""
    child = f"{trap}import time; time.sleep(600)"
    leader = (f"import subprocess, sys, time; {trap}"
              f"subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", leader], start_new_session=True)
    deadline = time.monotonic() + 30
    while not psutil.Process(proc.pid).children() and time.monotonic() < deadline:
        time.sleep(0.1)
    children = psutil.Process(proc.pid).children()
    assert children, "the leader did not start its child"
    stop_group(proc, grace=1.0)
    assert proc.poll() is not None
    assert wait_until_gone(lambda: [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE],
                           timeout=5) == []
