"""Stopping what was started: the one place the course waits for processes to go and stops the rest.

Every launcher in the course starts processes it must not leave behind (a course run's kernels, the
ranks of ``dtlab.launch.run``, a local MLflow server, Ray's daemons). They all stop the same way, in
two steps: ask politely and give the processes a moment to exit by themselves (a kernel's children
notice their parent's exit a moment after it), then force what is still there.

    wait_until_gone(find, timeout)   poll ``find()`` until it returns nothing; return what is left
    stop_workers(procs, grace)       multiprocessing workers: terminate, join, kill the stragglers
    stop_group(proc, grace)          a subprocess and its whole process group: SIGTERM, then SIGKILL
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any


def wait_until_gone(find: Callable[[], Sequence[Any]], timeout: float, interval: float = 0.2) -> list[Any]:
    """Call ``find()`` until it returns an empty sequence or ``timeout`` seconds pass; return its last answer
    (empty: everything it looked for is gone)."""
    deadline = time.monotonic() + timeout
    left = list(find())
    while left and time.monotonic() < deadline:
        time.sleep(interval)
        left = list(find())
    return left


def stop_workers(procs: Sequence[Any], grace: float = 5.0) -> None:
    """Stop ``multiprocessing`` workers: ``terminate()`` those alive, join them for up to ``grace`` seconds
    in all, then ``kill()`` and join what is left. Workers that never started are skipped."""
    procs = [p for p in procs if p.pid is not None]
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def stop_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM ``proc`` and everything in its process group (start it with ``start_new_session=True``);
    SIGKILL what is left after ``grace`` seconds. Returns once the group is gone or SIGKILL was sent."""
    for sig, wait_s in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue
        # the leader exited; its workers may take a moment longer
        if not wait_until_gone(lambda: [proc.pid] if _group_alive(proc.pid) else [], wait_s, interval=0.1):
            return
