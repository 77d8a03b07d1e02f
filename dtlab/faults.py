"""Faults on purpose, to watch recovery work.

Used by the reliability tests (``tests/test_reliability.py``) and by ``benchmarks/fault_trials.py``,
which repeats them many times. The SIGKILL of a training rank at a chosen step lives in
``dtlab.resumable`` (``crash_at_step``).

* ``kill_checkpoint_writer`` — start a process that writes checkpoints as fast as it can, kill it
  with SIGKILL after ``delay`` seconds, and return the newest checkpoint a resumed run would load.
* ``all_reduce_with_failing_peer`` — rank 1 gets stuck (or dies) after a first all-reduce; rank 0
  reports how long its next all-reduce took to fail.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from dtlab import checkpoint


def write_checkpoints_forever(directory: str | os.PathLike, size: int, keep: int = 2) -> None:
    """Write checkpoints until killed, continuing from the newest one as a resumed run does.

    The checkpoint of step ``s`` holds ``size`` copies of ``s``, so a file that mixed two writes
    would be caught by comparing its tensor with its ``step``.
    """
    ckpt = checkpoint.Checkpointer(directory, every_steps=1, keep=keep)
    latest = ckpt.load_latest()
    step = latest["step"] if latest else 0
    while True:
        step += 1
        ckpt.save(step, {"model": {"w": torch.full((size,), float(step))}, "step": step})


def kill_checkpoint_writer(directory: str | os.PathLike, size: int, delay: float, keep: int = 2) -> dict | None:
    """Kill -9 a ``write_checkpoints_forever`` process after ``delay`` s; return ``load_latest()`` after it.

    The writer is forked (it starts at once, with torch already imported), so the kill lands at
    a random point of a write, a rename or a prune.
    """
    writer = multiprocessing.get_context("fork").Process(target=write_checkpoints_forever,
                                                         args=(directory, size, keep), daemon=True)
    writer.start()
    try:
        time.sleep(delay)
    finally:  # also on Ctrl-C or an error here: the writer must not outlive the call
        os.kill(writer.pid, signal.SIGKILL)
        writer.join()
    return checkpoint.Checkpointer(directory, every_steps=1, keep=keep).load_latest()


def checkpoint_files(directory: str | os.PathLike) -> list[Path]:
    """The complete checkpoint files in ``directory`` (``keep`` of them, one more if killed before pruning)."""
    return sorted(Path(directory).glob("step-*.pt"))


def all_reduce_with_failing_peer(timeout_s: float, how: str = "stuck") -> dict[str, Any] | None:
    """Run under a launcher with 2 or more ranks: rank 1 is ``"stuck"`` (never joins) or ``"dies"`` (exits).

    Every rank first completes one all-reduce (the job has been running: on nccl this also creates
    the communicator), then rank 1 fails. The tensor lives on the device ``setup`` returns: a CPU
    tensor on nccl would fail at once, without any timeout. On nccl, run it with
    ``TORCH_NCCL_BLOCKING_WAIT=1`` in the workers' environment so the collective itself raises
    after the timeout (by default NCCL's watchdog tears the process down instead).

    Rank 0 returns ``{"seconds": how long its all_reduce took, "error": the error text or None}``.
    """
    import torch.distributed as dist

    from dtlab import distributed

    device = distributed.setup(timeout=timedelta(seconds=timeout_s))     # the collective timeout
    dist.all_reduce(torch.ones(4, device=device))                         # all ranks alive so far
    if dist.get_rank() == 1:
        if how == "dies":
            os._exit(1)
        time.sleep(timeout_s + 5)
        return None
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4, device=device))
        return {"seconds": time.monotonic() - start, "error": None}
    except RuntimeError as exc:
        return {"seconds": time.monotonic() - start, "error": str(exc)}
