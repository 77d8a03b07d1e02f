"""Run a function on N local processes — from a script *or a notebook* — and get every result back.

``torch.multiprocessing.spawn`` pickles the function *by reference*, so the children must be able
to import it; a function defined in a notebook lives in ``__main__``, which a child cannot import.
``run`` ships the function *by value* (with cloudpickle, as Spark's TorchDistributor does), so it
works on notebook functions, lambdas and closures.

    from dtlab.launch import run

    def hello(greeting):
        import torch.distributed as dist
        dist.init_process_group("gloo")          # env:// — run() set RANK, WORLD_SIZE, MASTER_*
        rank = dist.get_rank()
        dist.destroy_process_group()
        return f"{greeting} from rank {rank}"

    run(hello, "hi", nprocs=2)   # -> ['hi from rank 0', 'hi from rank 1']

Like torchrun, ``run`` only prepares each process's environment: the caller's ``os.environ`` *as it
is at the call* (so an ``MLFLOW_TRACKING_URI``, ``NCCL_DEBUG`` or ``CUDA_VISIBLE_DEVICES`` set in the
notebook a moment ago reaches the workers) and its working directory, plus ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` (and DeepSpeed's ``LOCAL_SIZE``), ``MASTER_ADDR``, ``MASTER_PORT`` and
``OMP_NUM_THREADS``; your function calls ``init_process_group`` itself, because that line is part of
every lesson.

What it adds over a bare spawn:
* results come back in rank order;
* the first rank to raise stops the job: the others are killed and ``WorkerError`` names the rank
  and carries its traceback; a rank that dies (killed, a crash in native code, ``os._exit``) or
  exits without returning is noticed the moment it exits, however much its peers print;
* a job that runs past ``timeout`` seconds is killed and raises ``LaunchTimeout`` naming the
  ranks that had not finished (a hung collective, usually);
* each worker's ``print`` output appears in the caller's output (a notebook cell), prefixed with
  its rank;
* it is fast: workers are forked from a server process that imported torch once, so a second
  launch costs a fraction of a second instead of a fresh interpreter per rank.
"""

from __future__ import annotations

import gc
import io
import multiprocessing as mp
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

from dtlab import _compat
from dtlab.processes import stop_workers

#: Seconds a launch may run before every worker is killed. Pass ``timeout=`` to change it.
DEFAULT_LAUNCH_TIMEOUT = 600.0

_ctx = mp.get_context("forkserver")
# torch._dynamo: the first torch.optim optimizer imports it, ~5 s per worker when not preloaded.
_ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "dtlab._compat", "dtlab.launch"])


class LaunchError(RuntimeError):
    """The job could not be started (bad arguments, a function that cannot be shipped)."""


class WorkerError(RuntimeError):
    """A worker raised (or died); ``rank`` says which, ``remote_traceback`` shows where."""

    def __init__(self, rank: int, message: str, remote_traceback: str = ""):
        self.rank, self.remote_traceback = rank, remote_traceback
        super().__init__(f"rank {rank} failed: {message}"
                         + (f"\n\n--- traceback from rank {rank} ---\n{remote_traceback}" if remote_traceback else ""))


class LaunchTimeout(TimeoutError):
    """The job ran past its timeout; ``pending`` lists the ranks that had not returned."""

    def __init__(self, timeout: float, pending: list[int]):
        self.pending = pending
        super().__init__(f"ranks {pending} had not finished after {timeout:.0f} s, so every worker was stopped. "
                         "Usually a collective is waiting for a rank that never calls it (or died). "
                         "Fix: make every rank run the same collectives in the same order; pass a "
                         "timeout to init_process_group so the hang raises inside the worker; or raise "
                         "run(..., timeout=...) if the job is simply long.")


class _StreamToQueue(io.TextIOBase):
    """A worker's sys.stdout/stderr: whole lines go to the parent, which prints them with a prefix."""

    def __init__(self, q: Any, rank: int, name: str):
        self.q, self.rank, self.name, self.buf = q, rank, name, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.buf += text
        if "\n" in self.buf:
            lines, self.buf = self.buf.rsplit("\n", 1)
            self.q.put(("out", self.rank, self.name, lines))
        return len(text)

    def flush(self) -> None:
        if self.buf:
            self.q.put(("out", self.rank, self.name, self.buf))
            self.buf = ""


def _die_with_parent() -> None:
    parent = mp.parent_process()
    if parent is not None:
        threading.Thread(target=lambda: (parent.join(), os._exit(1)), daemon=True).start()


def _call_keeping_locals(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Any, list]:
    """Call ``fn`` and also return its frame, so its local variables outlive the call.

    A DDP model or process-group handle released at the moment ``fn`` returns can deadlock
    inside gloo's teardown (its worker thread waits for the GIL while the releasing thread holds
    it and waits for the worker). Keeping the frame lets the worker hand the result to the parent
    *first*; the locals are released afterwards, and a worker stuck there is stopped by the parent.
    """
    code = getattr(fn, "__code__", None)
    frames: list = []
    if code is not None:
        def catch_first_call(frame, event, _arg):  # profiling only until fn's own frame starts
            if event == "call" and frame.f_code is code:
                frames.append(frame)
                sys.setprofile(None)
        sys.setprofile(catch_first_call)
    try:
        return fn(*args, **kwargs), frames
    finally:
        sys.setprofile(None)


def _worker(payload: bytes, rank: int, env: dict[str, str], cwd: str, q: Any) -> None:
    """Entry point of every worker process (runs in the child)."""
    import cloudpickle
    import torch

    os.environ.clear()  # the fork server's environment is as old as the first launch: use the caller's
    os.environ.update(env)
    os.chdir(cwd)  # ... and so is its working directory
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # torch was imported before the env was set
    import torch.distributed as dist

    if dist.is_available():
        dist.set_debug_level_from_env()  # TORCH_DISTRIBUTED_DEBUG arrived after torch.distributed was imported
    _die_with_parent()
    sys.stdout = _StreamToQueue(q, rank, "stdout")
    sys.stderr = _StreamToQueue(q, rank, "stderr")
    try:
        fn, args, kwargs = cloudpickle.loads(payload)
        result, frames = _call_keeping_locals(fn, args, kwargs)
        data = cloudpickle.dumps(result)
    except BaseException as exc:  # noqa: BLE001 — everything must reach the parent
        sys.stdout.flush()
        sys.stderr.flush()
        q.put(("error", rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        # In the pipe before this process exits: its exit closes its connections, its peers then fail with
        # "Connection closed by peer", and the parent must read the cause before those consequences.
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        q.close()
        q.join_thread()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    q.put(("result", rank, data, ""))
    q.close()
    q.join_thread()  # the result is in the pipe before anything below can go wrong
    del frames, result
    gc.collect()  # now fn's locals are released (the kept frame sits in a reference cycle)
    _finish_process_group()


def _finish_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # the function forgot to clean up: do it for it
        try:
            dist.barrier()
        except RuntimeError:
            pass  # a peer is gone (the result is already delivered): nothing left to wait for
        finally:
            dist.destroy_process_group()


def run(fn: Callable[..., Any], *args: Any, nprocs: int | None = None, backend: str | None = None,
        timeout: float = DEFAULT_LAUNCH_TIMEOUT, threads_per_process: int | None = None,
        env: dict[str, str] | None = None, prefix_output: bool = True, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` local processes; return the results in rank order.

    Args:
        fn: any function, including one defined in a notebook; it runs once per rank.
        nprocs: processes to start; default from ``dtlab.environment.plan`` (GPUs, or 2 on CPU).
        backend: only used to validate ``nprocs`` against the machine (``plan(backend, nprocs)``);
            ``fn`` chooses its own backend in ``init_process_group``.
        timeout: seconds before every worker is killed and ``LaunchTimeout`` is raised.
        threads_per_process: torch/OpenMP threads per worker; default ``OMP_NUM_THREADS`` or 1.
        env: extra environment variables for the workers (on top of the caller's ``os.environ``).
        prefix_output: print worker output as ``[rank k] ...`` (False: print it as is).

    Raises:
        ValueError: more processes than the machine can run (the message names the limit).
        LaunchError: ``fn`` or its arguments cannot be pickled.
        WorkerError: a rank raised or died; the message names the rank, with its traceback.
        LaunchTimeout: the job did not finish within ``timeout`` seconds.
    """
    import cloudpickle

    from dtlab.distributed import free_port
    from dtlab.environment import plan

    nprocs = plan(backend=backend, nprocs=nprocs).nprocs
    try:
        payload = cloudpickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise LaunchError(f"{getattr(fn, '__name__', fn)!r} or its arguments cannot be sent to the workers "
                          f"({type(exc).__name__}: {exc}). Fix: create objects such as open files, locks, "
                          "process groups or generators inside the function, and pass plain data "
                          "(numbers, strings, tensors, state_dicts) as arguments.") from exc

    threads = str(threads_per_process or os.environ.get("OMP_NUM_THREADS") or 1)
    port = str(free_port())
    q = _ctx.Queue()
    procs = []
    caller_env = dict(os.environ)  # read now, not when the fork server started
    for rank in range(nprocs):
        worker_env = {**caller_env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nprocs),
                      "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                      # DeepSpeed's name for LOCAL_WORLD_SIZE (its CPU accelerator runs `numactl` without it)
                      "LOCAL_SIZE": str(nprocs), "OMP_NUM_THREADS": threads, **(env or {})}
        procs.append(_ctx.Process(target=_worker, args=(payload, rank, worker_env, os.getcwd(), q), daemon=True,
                                  name=f"dtlab-rank{rank}"))
    results: dict[int, Any] = {}
    try:
        for p in procs:
            try:
                p.start()
            except RuntimeError as exc:
                if "bootstrapping phase" not in str(exc):
                    raise
                raise LaunchError("run() was called while a script's module was being imported by a worker. "
                                  "Fix: in a script, call it under `if __name__ == \"__main__\":` (notebooks "
                                  "need nothing).") from None
        deadline = time.monotonic() + timeout
        sentinels = {p.sentinel: rank for rank, p in enumerate(procs)}
        while len(results) < nprocs:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LaunchTimeout(timeout, [r for r in range(nprocs) if r not in results])
            # Wake up for a message *or* a worker's exit, whichever comes first.
            ready = wait([q._reader, *sentinels], timeout=remaining)
            for kind, rank, a, b in _messages(q):
                if kind == "out":
                    _print(rank, a, b, prefix_output)
                elif kind == "error":
                    dead = _died_first(procs, results, rank)
                    if dead is not None:  # a peer that died makes the others fail: name the cause
                        raise WorkerError(dead, f"{_exited(procs[dead])}; rank {rank} then failed with: "
                                          f"{a.splitlines()[0] if a else ''}", b) from None
                    raise WorkerError(rank, a, b)
                else:
                    results[rank] = cloudpickle.loads(a)
            for sentinel in ready:
                rank = sentinels.pop(sentinel, None)
                if rank is None:
                    continue  # the queue's reader
                procs[rank].join(1)  # reap it, so exitcode is set
                errors = []
                for kind, r, a, b in _messages(q):  # what it (and others) sent just before it exited
                    if kind == "out":
                        _print(r, a, b, prefix_output)
                    elif kind == "error":
                        errors.append(WorkerError(r, a, b))
                    else:
                        results[r] = cloudpickle.loads(a)
                own = [e for e in errors if e.rank == rank]
                if own:  # it raised, reported it, and exited
                    raise own[0]
                if rank not in results:  # it exited without a result or an error: it is the cause
                    raise WorkerError(rank, _exited(procs[rank])) from None
                if errors:
                    raise errors[0]
        deadline = time.monotonic() + 10
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        stuck = [rank for rank, p in enumerate(procs) if p.is_alive()]
        if stuck:
            print(f"[dtlab.launch] ranks {stuck} returned their results but did not exit within 10 s "
                  "(a process-group teardown that hung); they were stopped.", file=sys.stderr, flush=True)
    finally:
        stop_workers(procs)
        _drain(q, prefix_output)
        q.close()
        _compat.remove_deepspeed_shm("127.0.0.1", port, range(nprocs))  # DeepSpeed leaves them behind
    return [results[r] for r in range(nprocs)]


def _exited(proc: Any) -> str:
    if proc.exitcode == 0:
        return ("process exited with code 0 without returning a result (sys.exit(0) or os._exit(0) inside the "
                "function?). Fix: let the function return")
    return (f"process exited with code {proc.exitcode} without returning "
            "(killed, out of memory, or a crash in native code)")


def _messages(q: Any) -> list[tuple]:
    """Everything in the queue right now (possibly nothing)."""
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


def _died_first(procs: list, results: dict, failed: int, grace: float = 0.5) -> int | None:
    """A rank that died (no result, non-zero exit) while ``failed`` raised, if any, within ``grace`` s."""
    deadline = time.monotonic() + grace
    while True:
        dead = [r for r, p in enumerate(procs) if r != failed and r not in results and p.exitcode not in (None, 0)]
        if dead or time.monotonic() > deadline:
            return dead[0] if dead else None
        time.sleep(0.02)


def _print(rank: int, stream: str, text: str, prefix: bool) -> None:
    out = sys.stderr if stream == "stderr" else sys.stdout
    for line in text.split("\n"):
        print(f"[rank {rank}] {line}" if prefix else line, file=out, flush=True)


def _drain(q: Any, prefix: bool) -> None:
    """Print output that arrived after the last result or error."""
    while True:
        try:
            kind, rank, a, b = q.get_nowait()
        except (queue.Empty, OSError, ValueError):
            return
        if kind == "out":
            _print(rank, a, b, prefix)
