"""The grader's machinery: run a learner's code on N processes, watch what it sends, and say what went wrong.

Every build exercise is graded the way the course tests its own strategies: the learner's code runs on N real
processes (gloo on CPUs, nccl on GPUs, started by ``dtlab.launch.run``), and what it produces is compared with
one process doing the same work. ``run_ranks`` does the launching; it answers with the workers' results, or
fills the ``Report`` with what stopped them:

* the stub still raises ``NotImplementedError``: "not attempted yet", not a failure;
* a rank raised: which rank, the error, and the line of *your* code it came from;
* the job did not finish within the time limit (a deadlock): which ranks were stuck, and the operation each
  was waiting in (``dist.recv`` from which rank, at which line; or the step the grader was running for it),
  read from the status file each rank keeps while it waits. Never a hang.

Inside the workers, ``Tracer`` wraps ``torch.distributed``'s point-to-point and collective calls: it counts the
calls and the elements each rank sends (so a grader can say "your ring sent 2.0x what a ring sends") and writes
"waiting in ..." to the status file for as long as a call blocks.

``compare`` turns "this tensor differs from one process" into sentences a learner can act on: which rank,
which tensor, by how much, against which bound; ``scale_of`` recognises a result that is the right one times
a constant (N: summed but not averaged; 1/N: averaged twice).
"""

from __future__ import annotations

import inspect
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

#: Seconds one blocking call may wait before the run is stopped and reported as stuck (the process group's
#: timeout: gloo raises inside the waiting rank); the whole run is stopped at this plus ``STARTUP_S`` regardless.
DEFAULT_LIMIT_S = 30.0
#: Process start-up allowance on top of the limit (forked workers, process-group rendezvous).
STARTUP_S = 30.0

#: ``torch.distributed`` calls the tracer watches: name -> (blocks until done unless async_op, who it talks to)
POINT_TO_POINT = ("send", "recv", "isend", "irecv")
COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
               "barrier", "gather", "scatter")


class ExerciseFailed(AssertionError):
    """Raised by ``Report.raise_for_failure`` (the solutions' cells call it): the report's text is the message."""


@dataclass
class Report:
    """What the grader found: ``passed``, the ``problems`` (each a sentence naming rank, tensor, size and bound),
    the likely ``causes`` it recognised, and the ``checks`` that held. ``print(report)`` shows all of it."""

    exercise: str
    title: str
    nprocs: int = 0
    problems: list[str] = field(default_factory=list)
    causes: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    attempted: bool = True
    seconds: float = 0.0
    #: problems printed (the first ones: each grader lists the most telling first); ``problems`` holds all.
    SHOWN = 6

    @property
    def passed(self) -> bool:
        return self.attempted and not self.problems

    def fail(self, problem: str, cause: str | None = None) -> None:
        """Record a problem (and the likely cause, when one is recognised)."""
        self.problems.append(problem)
        if cause and cause not in self.causes:
            self.causes.append(cause)

    def ok(self, check: str) -> None:
        """Record a check that held (shown under a passing report)."""
        self.checks.append(check)

    def text(self) -> str:
        where = f"{self.exercise} ({self.title}) on {self.nprocs} processes"
        if not self.attempted:
            return f"{where}: not attempted yet. " + " ".join(self.problems)
        if self.passed:
            return "\n".join([f"PASSED {where} in {self.seconds:.1f} s:"] + [f"  ok  {c}" for c in self.checks])
        shown = self.problems[:self.SHOWN]
        lines = [f"NOT YET {where}:"] + [f"  - {p}" for p in shown]
        if len(self.problems) > len(shown):
            lines.append(f"  - ... and {len(self.problems) - len(shown)} more problems (report.problems lists all)")
        lines += [f"  likely cause: {c}" for c in self.causes]
        lines += [f"  ok  {c}" for c in self.checks]
        return "\n".join(lines)

    __str__ = text

    def __repr__(self) -> str:
        return self.text()

    def _ipython_display_(self) -> None:
        """In a notebook, ``check(...)`` as a cell's last line has printed the report already: show it once."""
        if getattr(self, "_printed", False):
            self._printed = False
            return
        print(self.text())

    def raise_for_failure(self) -> Report:
        """Raise ``ExerciseFailed`` unless the exercise passed (a stub that was not attempted fails too)."""
        if not self.passed:
            raise ExerciseFailed(self.text())
        return self


# ---------------------------------------------------------------------------------------------- in the workers

def _learner_frame(skip: int = 2) -> str:
    """' at line L of fn' for the innermost caller outside torch and this package ('' if none)."""
    here = os.path.dirname(os.path.dirname(__file__))
    torch_dir = os.path.dirname(torch.__file__)
    frame = sys._getframe(skip)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(torch_dir) or name.startswith(here) or "contextlib" in name):
            return f" (line {frame.f_lineno} of {frame.f_code.co_name})"
        frame = frame.f_back
    return ""


def _peer(name: str, args: tuple, kwargs: dict) -> str:
    if name in ("send", "isend"):
        peer = kwargs.get("dst", args[1] if len(args) > 1 else None)
        return f" to rank {peer}"
    if name in ("recv", "irecv"):
        peer = kwargs.get("src", args[1] if len(args) > 1 else None)
        return f" from rank {peer}" if peer is not None else " from any rank"
    return ""


def _elements(args: tuple, kwargs: dict) -> int:
    t = args[0] if args else kwargs.get("tensor")
    if torch.is_tensor(t):
        return t.numel()
    if isinstance(t, (list, tuple)):
        return sum(x.numel() for x in t if torch.is_tensor(x))
    return 0


class _TracedWork:
    """An async op's handle: ``wait()`` is reported as waiting in that op."""

    def __init__(self, work: Any, tracer: Tracer, what: str):
        self._work, self._tracer, self._what = work, tracer, what

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        with self._tracer.waiting(self._what + _learner_frame()):
            return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class Tracer:
    """Counts this rank's ``torch.distributed`` calls and keeps its status file while one blocks.

    ``calls[name]`` and ``elements[name]`` count each call (``send``: elements sent; collectives: the tensor's
    elements). ``doing(what)`` labels a stretch the grader runs itself ("stage 1, action B0: receiving ..."),
    so a deadlock there is reported in the exercise's own words.
    """

    def __init__(self, status_file: str | None):
        self.status_file = status_file
        self.calls: dict[str, int] = {}
        self.elements: dict[str, int] = {}
        self.sent_to: dict[int, int] = {}
        self._label = ""
        self._saved: dict[str, Any] = {}

    def _write(self, text: str) -> None:
        if self.status_file:
            tmp = self.status_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, self.status_file)

    @contextmanager
    def waiting(self, what: str):
        self._write(f"waiting in {what}" + (f", during {self._label}" if self._label else ""))
        yield                      # if the call raises (a timeout), the file keeps saying where it waited
        self._write(f"running (last finished: {what})")

    @contextmanager
    def doing(self, label: str):
        previous, self._label = self._label, label
        self._write(f"running {label}")
        try:
            yield
        finally:
            self._label = previous

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def traced(*args: Any, **kwargs: Any) -> Any:
            n = _elements(args, kwargs)
            self.calls[name] = self.calls.get(name, 0) + 1
            self.elements[name] = self.elements.get(name, 0) + n
            if name in ("send", "isend"):
                dst = kwargs.get("dst", args[1] if len(args) > 1 else -1)
                self.sent_to[dst] = self.sent_to.get(dst, 0) + n
            what = f"dist.{name}({n} elements{_peer(name, args, kwargs)})"
            if name in ("isend", "irecv") or kwargs.get("async_op"):
                work = fn(*args, **kwargs)
                return _TracedWork(work, self, what) if work is not None else work
            with self.waiting(what + _learner_frame()):
                return fn(*args, **kwargs)
        traced.__wrapped__ = fn
        traced.__name__ = name
        return traced

    def install(self) -> Tracer:
        import torch.distributed as dist

        for name in POINT_TO_POINT + COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None and name not in self._saved:
                self._saved[name] = fn
                setattr(dist, name, self._wrap(name, fn))
        self._write("running")
        return self

    def uninstall(self) -> None:
        import torch.distributed as dist

        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()

    def counts(self) -> dict[str, Any]:
        return {"calls": dict(self.calls), "elements": dict(self.elements), "sent_to": dict(self.sent_to)}


@dataclass
class Rank:
    """What a grading body gets on each rank: who it is, where its tensors live, and the tracer."""

    rank: int
    world: int
    device: torch.device
    tracer: Tracer


def _graded_worker(body: Callable[..., Any], impl: Any, status_dir: str, pg_timeout_s: float, args: tuple) -> Any:
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if use_cuda:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=pg_timeout_s))
    tracer = Tracer(os.path.join(status_dir, str(rank))).install()
    try:
        out = body(impl, Rank(rank, world, device, tracer), *args)
    except NotImplementedError as exc:
        return {"not_attempted": str(exc) or "NotImplementedError"}
    finally:
        tracer.uninstall()
    tracer._write("finished")
    dist.barrier()
    dist.destroy_process_group()
    return out if not isinstance(out, dict) else {**out, "traffic": out.get("traffic", tracer.counts())}


# ---------------------------------------------------------------------------------------------- in the notebook

def _learner_lines(tb: str) -> str:
    """The traceback's frames that are the learner's (not torch's, not dtlab's), last first, as 'line L of f'."""
    out = []
    for line in tb.splitlines():
        line = line.strip()
        if line.startswith("File ") and "site-packages" not in line and "/dtlab/" not in line \
                and "/torch/" not in line and "multiprocessing" not in line:
            parts = line.split(", ")
            if len(parts) >= 3:
                out.append(f"{parts[1]} of {parts[2].removeprefix('in ')}")
    return out[-1] if out else ""


def run_ranks(report: Report, body: Callable[..., Any], impl: Any, *args: Any, nprocs: int,
              limit_s: float = DEFAULT_LIMIT_S) -> list[Any] | None:
    """Run ``body(impl, rank_info, *args)`` on ``nprocs`` processes; return the results, or None after filling
    ``report`` with what stopped them (not attempted, a rank that raised, ranks stuck past ``limit_s``)."""
    from dtlab.launch import LaunchTimeout, WorkerError, run

    report.nprocs = nprocs
    status_dir = tempfile.mkdtemp(prefix="dtlab-grade-")
    start = time.monotonic()
    try:
        results = run(_graded_worker, body, impl, status_dir, limit_s, args, nprocs=nprocs,
                      timeout=limit_s + STARTUP_S, prefix_output=True)
    except LaunchTimeout as exc:
        _stuck(report, status_dir, exc.pending, time.monotonic() - start)
        return None
    except WorkerError as exc:
        message = str(exc).split("\n")[0]
        if any(word in message for word in ("Timed out", "timed out", "Timeout", "Connection closed by peer")) \
                or (_waiting(status_dir) and not _learner_lines(exc.remote_traceback)):
            _stuck(report, status_dir, [exc.rank], time.monotonic() - start)
            return None
        where = _learner_lines(exc.remote_traceback)
        report.fail(f"{message}" + (f" (at {where})" if where else ""))
        return None
    finally:
        report.seconds = time.monotonic() - start
        shutil.rmtree(status_dir, ignore_errors=True)
    skipped = [r.get("not_attempted") for r in results if isinstance(r, dict) and "not_attempted" in r]
    if skipped:
        report.attempted = False
        report.problems.append(f"Your code raised NotImplementedError ({skipped[0]}): fill in the stub and run the "
                               "cell again.")
        return None
    return results


def _statuses(status_dir: str) -> dict[int, str]:
    return {int(f.name): f.read_text() for f in Path(status_dir).iterdir() if f.name.isdigit()}


def _waiting(status_dir: str) -> dict[int, str]:
    """The ranks whose status file says they are waiting in a call, and in which."""
    return {r: s for r, s in sorted(_statuses(status_dir).items()) if s.startswith("waiting")}


def _stuck(report: Report, status_dir: str, pending: list[int], seconds: float) -> None:
    statuses = _statuses(status_dir)
    waiting = _waiting(status_dir)
    named = waiting or {r: statuses.get(r, "never started") for r in pending}
    point_to_point = any(f"dist.{op}(" in s for s in waiting.values() for op in POINT_TO_POINT)
    report.fail(f"deadlock: stopped after {seconds:.0f} s; "
                + "; ".join(f"rank {r} was {s}" for r, s in named.items()),
                "two ranks each wait for the other: every send needs a matching receive on the peer, in an order "
                "both sides reach (a rank that receives before it sends waits for a peer doing the same)"
                if point_to_point or not waiting else
                "the ranks are in different collectives, or the same one with different arguments (a broadcast's "
                "src, a tensor's size): every rank must call the same collectives in the same order")


# ---------------------------------------------------------------------------------------------- comparing

def scale_of(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The factor c that best fits actual = c x expected (least squares); nan when expected is all zero."""
    a, e = actual.detach().double().flatten().cpu(), expected.detach().double().flatten().cpu()
    denom = float((e * e).sum())
    return float((a * e).sum()) / denom if denom > 0 else math.nan


def compare(report: Report, where: str, actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
            bound: float, what: str = "tensor", listed: int = 3, against: str = "one process") -> float:
    """Fail the report for the tensors of ``actual`` further than ``bound`` from ``expected`` (the worst
    ``listed`` are named; a missing, misshapen or NaN tensor always is); return the largest difference (inf for
    those)."""
    worst: list[tuple[float, str]] = []
    for name, exp in expected.items():
        act = actual.get(name)
        if act is None:
            report.fail(f"{where}: {what} {name} is missing (None)")
            worst.append((math.inf, name))
            continue
        if tuple(act.shape) != tuple(exp.shape):
            report.fail(f"{where}: {what} {name} has shape {tuple(act.shape)}, expected {tuple(exp.shape)}")
            worst.append((math.inf, name))
            continue
        d = (act.detach().float().cpu() - exp.detach().float().cpu()).abs().max().item() if exp.numel() else 0.0
        if math.isnan(d):
            report.fail(f"{where}: {what} {name} holds NaN")
            worst.append((math.inf, name))
        else:
            worst.append((d, name))
    bad = sorted([(d, n) for d, n in worst if not d <= bound and d != math.inf], reverse=True)
    for d, name in bad[:listed]:
        report.fail(f"{where}: {what} {name} differs from {against} by {d:.2e} (bound {bound:.1e})")
    if len(bad) > listed:
        report.fail(f"{where}: {len(bad) - listed} more of the {len(expected)} tensors compared differ too")
    return max((d for d, _ in worst), default=0.0)


def signature_of(impl: Any) -> str:
    """'name(args)' of a class's __init__ or a function, for messages."""
    try:
        target = impl.__init__ if inspect.isclass(impl) else impl
        return f"{impl.__name__}{inspect.signature(target)}".replace("(self, ", "(").replace("(self)", "()")
    except (TypeError, ValueError, AttributeError):
        return repr(impl)


def learner_error(exc: BaseException) -> str:
    """'TypeError: ... (at line L of f)' for an exception raised by the learner's code inside a worker."""
    where = _learner_lines("".join(traceback.format_exception(exc)))
    return f"{type(exc).__name__}: {exc}" + (f" (at {where})" if where else "")
