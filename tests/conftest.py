"""Shared test set-up: one thread per process (2 cores, many processes), headless views."""

import os
import platform
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DTLAB_HEADLESS", "1")
os.environ.setdefault("DTLAB_TIMEOUT_S", "60")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)



# --- markers: which suite runs a test (declared in pyproject.toml, rule in the README's "Tests") ---------
#   slow     takes 3 s or more warm on 2 cores (a cluster, a server, a browser, a set-up, several launches):
#            left out of `make test-quick`
#   cluster  tests code a Databricks cluster runs (a job task, a notebook cell, a launched worker) with
#            libraries the runtime pins at other versions: `make test-runtime` repeats it on that stack
#   gpu      needs a CUDA GPU: skipped here with the reason, never faked
#   notebook, runtime  a course notebook run (make test), a simulated Databricks job task (make test-runtime)

#: Test files of code that imports only Python's standard library (the planner: tests/test_package.py holds it to
#: that). On a runtime stack whose Python is the course stack's own, their `cluster` tests would run the very same
#: code on the very same interpreter again, so there they are skipped (CI: 15.4, 3.11 like the course; 18's 3.12
#: runs them).
STDLIB_ONLY = {"test_published_runs.py", "test_planner_memory.py", "test_planner_cost.py"}


def _same_python_as_the_course() -> bool:
    """A runtime stack (make test-runtime) on the Python version of the course's .venv, if that exists."""
    cfg = Path(__file__).resolve().parent.parent / ".venv" / "pyvenv.cfg"
    if not os.environ.get("DTLAB_TEST_RUNTIME") or not cfg.is_file():
        return False
    version = dict(line.split(" = ", 1) for line in cfg.read_text().splitlines() if " = " in line).get("version")
    return version == platform.python_version()


def pytest_collection_modifyitems(config, items):
    if _same_python_as_the_course():
        same = pytest.mark.skip(reason=f"standard-library code on Python {platform.python_version()}, "
                                       "the course stack's own: make test runs these")
        for item in items:
            if item.path.name in STDLIB_ONLY:
                item.add_marker(same)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# --- nothing a test starts may outlive it ----------------------------------------------------------

import time  # noqa: E402

import psutil  # noqa: E402

#: Long-lived helpers of this test process, started once and reused by design.
_SHARED = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")


def _descendants() -> dict[int, str]:
    """Live processes below this one, except the shared helpers themselves (their children count)."""
    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(p.cmdline())[:200]
            if p.ppid() == os.getpid() and any(name in cmdline for name in _SHARED):
                continue  # the fork server itself, not a worker forked from it
            out[p.pid] = cmdline
        except psutil.Error:
            continue
    return out


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _kept_by_a_wider_spark(pid: int, cmdline: str, before: set[int]) -> bool:
    """A Spark Python worker (``pyspark.daemon``) under a Spark JVM that was running before the test: a wider
    fixture's session (one per test file) keeps its workers for the next task (``spark.python.worker.reuse``); they
    end with that session. Workers of a session the test started itself still count."""
    if "pyspark.daemon" not in cmdline:
        return False
    try:
        return any(parent.pid in before and parent.name() == "java" for parent in psutil.Process(pid).parents())
    except psutil.Error:
        return False


@pytest.fixture(autouse=True)
def no_process_outlives_its_test():
    before = set(_descendants())
    # A server a wider fixture started in its own session (the simulated workspace's mlflow server) may replace its
    # workers while a test runs (gunicorn respawns a worker that dies): they are that fixture's to stop, not the test's.
    servers = {_session(pid) for pid in before} - {os.getsid(0), None}
    yield
    deadline = time.monotonic() + 15
    while True:
        left = {pid: cmd for pid, cmd in _descendants().items() if pid not in before and _session(pid) not in servers
                and not _kept_by_a_wider_spark(pid, cmd, before)}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pid in left:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    assert not left, f"processes started by this test are still running: {left}"


# --- nor 66 MB of DeepSpeed shared memory per rank (see dtlab._compat) ------------------------------

from dtlab._compat import SHM_FOLDER, leftover_deepspeed_shm  # noqa: E402


@pytest.fixture(autouse=True)
def no_deepspeed_shared_memory_outlives_its_test():
    before = leftover_deepspeed_shm()
    yield
    deadline = time.monotonic() + 5  # dtlab.launch removes its workers' files just after they exit
    while (left := leftover_deepspeed_shm() - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    for path in left:
        path.unlink(missing_ok=True)
    assert not left, f"DeepSpeed shared memory left in {SHM_FOLDER}: {sorted(p.name for p in left)}"
