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
import operator
import os
import shutil
import sys
import sysconfig
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
#: The same for one process without a process group to join (``run_limited``).
LIMITED_STARTUP_S = 10.0

#: ``torch.distributed`` calls the tracer watches: name -> (blocks until done unless async_op, who it talks to)
POINT_TO_POINT = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
               "all_gather_coalesced", "all_gather_into_tensor_coalesced", "reduce_scatter", "reduce_scatter_tensor",
               "reduce_scatter_tensor_coalesced", "all_to_all", "all_to_all_single", "barrier", "gather", "scatter")


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
    #: the case that failed (``Case.name``), and every process count the grader ran on
    case: str | None = None
    worlds: list[int] = field(default_factory=list)
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
        """Record a check that held (shown under a passing report; a check already recorded is not repeated)."""
        if check not in self.checks:
            self.checks.append(check)

    def text(self) -> str:
        worlds = sorted(set(self.worlds)) or [self.nprocs]
        counts = ", ".join(map(str, worlds[:-1])) + (" and " if len(worlds) > 1 else "") + str(worlds[-1])
        where = f"{self.exercise} ({self.title}) on {counts} processes"
        if self.case and not self.passed:
            where += f", in case {self.case}"
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

_TORCH_DIR = os.path.dirname(torch.__file__)
_DTLAB_DIR = os.path.dirname(os.path.dirname(__file__))
_STDLIB_DIR = sysconfig.get_paths()["stdlib"]


def _not_learners(filename: str) -> bool:
    """Whether a frame's file is torch's, this package's or Python's own library (not the learner's code)."""
    return (filename.startswith((_TORCH_DIR, _DTLAB_DIR, _STDLIB_DIR)) or "site-packages" in filename
            or "contextlib" in filename)


def _learner_frame(skip: int = 2) -> str:
    """' (line L of fn)' for the innermost caller outside torch and this package ('' if none)."""
    frame = sys._getframe(skip)
    while frame is not None:
        if not _not_learners(frame.f_code.co_filename):
            return f" (line {frame.f_lineno} of {frame.f_code.co_name})"
        frame = frame.f_back
    return ""


#: The process-group layer's operators (``torch.ops.c10d.*``, what every ``torch.distributed`` call and every
#: ``ProcessGroup`` method goes through, whatever name it was imported under) -> (the call a learner knows, the
#: argument holding what this rank contributes, the argument holding what it receives).
C10D_OPS = {
    "allreduce_": ("all_reduce", 0, 0), "allreduce_coalesced_": ("all_reduce_coalesced", 0, 0),
    "broadcast_": ("broadcast", 0, 0), "reduce_": ("reduce", 0, 0),
    "allgather_": ("all_gather", 1, 0), "_allgather_base_": ("all_gather_into_tensor", 1, 0),
    "allgather_coalesced_": ("all_gather_coalesced", 1, 0),
    "allgather_into_tensor_coalesced_": ("all_gather_into_tensor_coalesced", 1, 0),
    "reduce_scatter_": ("reduce_scatter", 1, 0), "_reduce_scatter_base_": ("reduce_scatter_tensor", 1, 0),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter_tensor_coalesced", 1, 0),
    "alltoall_": ("all_to_all", 1, 0), "alltoall_base_": ("all_to_all_single", 1, 0),
    "gather_": ("gather", 1, 0), "scatter_": ("scatter", 1, 0),
    "barrier": ("barrier", None, None), "monitored_barrier_": ("barrier", None, None),
    "send": ("send", 0, None), "recv_": ("recv", None, 0), "recv_any_source_": ("recv", None, 0),
}
#: The functional collectives (``torch.distributed._functional_collectives``, DTensor's): always asynchronous.
FUNCTIONAL_OPS = {
    "all_reduce": ("all_reduce", 0, 0), "all_reduce_": ("all_reduce", 0, 0),
    "all_reduce_coalesced": ("all_reduce_coalesced", 0, 0), "all_reduce_coalesced_": ("all_reduce_coalesced", 0, 0),
    "all_gather_into_tensor": ("all_gather_into_tensor", 0, None),
    "all_gather_into_tensor_out": ("all_gather_into_tensor", 0, None),
    "all_gather_into_tensor_coalesced": ("all_gather_into_tensor_coalesced", 0, None),
    "reduce_scatter_tensor": ("reduce_scatter_tensor", 0, None),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter_tensor_coalesced", 0, None),
    "all_to_all_single": ("all_to_all_single", 0, None), "broadcast": ("broadcast", 0, 0),
    "broadcast_": ("broadcast", 0, 0),
}
#: The learner-facing functions that return before the data has moved.
ASYNC_APIS = ("isend", "irecv", "batch_isend_irecv")


def _numel(x: Any) -> int:
    if torch.is_tensor(x):
        return x.numel()
    if isinstance(x, (list, tuple)):
        return sum(_numel(y) for y in x)
    return 0


def _api_frame() -> Any:
    """The outermost frame of ``torch.distributed``'s own Python code on the stack: the call the learner made."""
    frame, found = sys._getframe(2), None
    dist_dir = os.path.join(_TORCH_DIR, "distributed")
    while frame is not None:
        if frame.f_code.co_filename.startswith(dist_dir) and not frame.f_code.co_name.startswith("_") \
                and "logger" not in frame.f_code.co_filename and frame.f_code.co_name != "wrapper":
            found = frame
        frame = frame.f_back
    return found


try:                                                  # torch >= 2.0: the dispatcher mode every operator passes
    from torch.utils._python_dispatch import TorchDispatchMode as _Mode
except ImportError:                                   # pragma: no cover -- the course's stacks all have it
    _Mode = object


class _CommMode(_Mode):
    """Sees every operator this rank runs; hands the communication ones to the tracer."""

    def __init__(self, tracer: Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        namespace = getattr(func, "namespace", "")
        if namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            table = C10D_OPS if namespace == "c10d" else FUNCTIONAL_OPS
            spec = table.get(func._schema.name.split("::")[-1])
            if spec is not None:
                self.tracer._entry = None
                self.tracer._record(spec, namespace, func, args)
                out = func(*args, **kwargs)
                entry = self.tracer._entry
                if entry is not None and spec[2] is None and spec[0] not in ("send", "barrier"):
                    entry["received"] = _numel(out)      # a functional collective returns what this rank receives
                return out
        return func(*args, **kwargs)


class Tracer:
    """Records this rank's communication at the process group's layer, and keeps its status file while it waits.

    Every ``torch.distributed`` call, by whatever name it was imported (``from torch.distributed import
    all_reduce``), every ``ProcessGroup`` method and every functional collective reaches the process group as one
    of the operators ``torch.ops.c10d.*``; a dispatcher mode (``TorchDispatchMode``) sees each of them, so nothing
    the learner's code sends goes unseen. For each, ``log`` keeps a ``dict``: ``op`` (the call's usual name:
    ``"all_reduce"``, ``"send"``, ...), ``api`` (the ``torch.distributed`` function it came through, e.g.
    ``"isend"``), ``sent`` and ``received`` (this rank's elements: what it contributes, what it gets back),
    ``peer`` (send and recv), ``asynchronous`` (returned before the data moved: ``async_op=True``, ``isend``,
    ``irecv``, ``batch_isend_irecv``, a functional collective), ``label`` (the grader's step, ``doing``),
    ``line`` (the learner's line). ``calls``, ``elements`` and ``sent_to`` sum it up; ``waits`` lists the
    ``Work.wait()`` calls the learner made itself (with the label they were made under).

    ``doing(what)`` labels a stretch the grader runs ("stage 1, action B0: receiving ..."), so a deadlock there
    is reported in the exercise's own words; ``quiet()`` leaves the grader's own communication out of the counts;
    ``watch(codes)`` notes when any of the given code objects runs (the course's own implementation).
    """

    def __init__(self, status_file: str | None):
        self.status_file = status_file
        self.calls: dict[str, int] = {}
        self.elements: dict[str, int] = {}
        self.sent_to: dict[int, int] = {}
        self.log: list[dict[str, Any]] = []
        self.waits: list[str] = []
        self.watched: dict[Any, str] = {}
        self.seen: list[str] = []
        self._label = ""
        self._quiet = 0
        self._last = ""
        self._mode: _CommMode | None = None
        self._work_wait: Any = None
        self._profile: Any = None
        self._entry: dict[str, Any] | None = None

    # -- the status file
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

    @contextmanager
    def quiet(self):
        """The grader's own communication inside: not counted, and not reported as the learner's."""
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    def mark(self, what: str) -> None:
        """Put the grader's own marker in ``log`` (``{"op": "mark", "label": what}``), between the learner's calls:
        e.g. "gradient of layer 3 ready", to see how much of backward was left when a bucket was sent."""
        self.log.append({"op": "mark", "api": "", "sent": 0, "received": 0, "peer": None, "asynchronous": False,
                         "label": what, "line": ""})

    # -- what the mode and the patched Work.wait report
    def _record(self, spec: tuple, namespace: str, func: Any, args: tuple) -> None:
        if self._quiet:
            return
        op, sent_arg, received_arg = spec
        sent = _numel(args[sent_arg]) if sent_arg is not None and len(args) > sent_arg else 0
        received = _numel(args[received_arg]) if received_arg is not None and len(args) > received_arg else 0
        peer = None
        if namespace == "c10d" and op in ("send", "recv") and func._schema.name.endswith(("send", "recv_")):
            peer = args[2] if len(args) > 2 and isinstance(args[2], int) else None
        frame = _api_frame()
        if op in ("broadcast", "reduce", "gather", "scatter") and frame is not None:   # the root, as the call named it
            roots = [frame.f_locals.get(k) for k in ("src", "dst", "group_src", "group_dst")]
            peer = next((r for r in roots if isinstance(r, int)), None)
        api = frame.f_code.co_name if frame is not None else ("functional " + op if namespace != "c10d" else op)
        asynchronous = namespace != "c10d" or api in ASYNC_APIS or bool(
            frame is not None and frame.f_locals.get("async_op"))
        entry = {"op": op, "api": api, "sent": sent, "received": received, "peer": peer,
                 "asynchronous": asynchronous, "label": self._label, "line": _learner_frame(2).strip(" ()")}
        self.log.append(entry)
        self._entry = entry
        self.calls[op] = self.calls.get(op, 0) + 1
        self.elements[op] = self.elements.get(op, 0) + (sent or received)
        if op == "send" and peer is not None:
            self.sent_to[peer] = self.sent_to.get(peer, 0) + sent
        n = sent or received
        where = f" to rank {peer}" if op == "send" else f" from rank {peer}" if op == "recv" and peer is not None \
            else " from any rank" if op == "recv" else ""
        self._last = f"dist.{api if api in ASYNC_APIS else op}({n} elements{where})" + (
            f" (at {entry['line']})" if entry["line"] else "")

    def _wait(self, work: Any, *args: Any, **kwargs: Any) -> Any:
        if self._quiet or not self._last:
            return self._work_wait(work, *args, **kwargs)
        frame = sys._getframe(2)                       # who called wait(): torch itself, for a blocking call
        internal = frame.f_code.co_filename.startswith(_TORCH_DIR)
        if not internal:
            self.waits.append(self._label)
        what = self._last if internal else f"a handle's wait() (the last call issued: {self._last})"
        with self.waiting(what):
            return self._work_wait(work, *args, **kwargs)

    def _profiled(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            name = self.watched.get(frame.f_code)
            if name is not None and name not in self.seen:
                self.seen.append(name)

    def watch(self, codes: dict[Any, str]) -> None:
        """Note (in ``seen``) each of these code objects that runs from now on: name -> shown in the report."""
        self.watched.update(codes)
        if codes and self._profile is None:
            self._profile = sys.getprofile()
            sys.setprofile(self._profiled)

    # -- on and off
    def install(self) -> Tracer:
        if _Mode is not object and self._mode is None:
            self._mode = _CommMode(self)
            self._mode.__enter__()
        work = getattr(torch._C, "_distributed_c10d", None)
        work = getattr(work, "Work", None)
        if work is not None and self._work_wait is None:
            self._work_wait = work.wait
            tracer = self

            def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
                return tracer._wait(self, *args, **kwargs)
            try:
                work.wait = wait
            except (AttributeError, TypeError):     # pragma: no cover -- a torch whose Work is sealed
                self._work_wait = None
        self._write("running")
        return self

    def uninstall(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        if self._work_wait is not None:
            torch._C._distributed_c10d.Work.wait = self._work_wait
            self._work_wait = None
        if self.watched:
            sys.setprofile(self._profile)
            self._profile = None

    def counts(self) -> dict[str, Any]:
        """The rank's communication, as the graders read it back in the notebook's process."""
        per_op: dict[str, dict[str, int]] = {}
        for e in self.log:
            if e["op"] == "mark":
                continue
            o = per_op.setdefault(e["op"], {"calls": 0, "sent": 0, "received": 0})
            o["calls"] += 1
            o["sent"] += e["sent"]
            o["received"] += e["received"]
        return {"calls": dict(self.calls), "elements": dict(self.elements), "sent_to": dict(self.sent_to),
                "per_op": per_op, "log": list(self.log), "waits": list(self.waits), "seen": list(self.seen)}


def course_code(*objects: Any) -> dict[Any, str]:
    """The code objects of these functions and classes (every method, nested functions too) -> the object's name:
    what ``Tracer.watch`` looks for, so a grader can tell when the course's own implementation runs."""
    found: dict[Any, str] = {}

    def add(code: Any, name: str) -> None:
        found[code] = name
        for const in code.co_consts:
            if hasattr(const, "co_code"):
                add(const, name)

    for obj in objects:
        name = f"{obj.__module__}.{obj.__qualname__}"
        members = vars(obj).values() if inspect.isclass(obj) else [obj]
        for m in members:
            m = getattr(m, "__func__", m)
            m = getattr(m, "fget", m)
            if callable(m):
                m = inspect.unwrap(m)     # a decorator's wrapper (torch.no_grad's) is shared by many functions
            if hasattr(m, "__code__") and getattr(m, "__qualname__", "").startswith(obj.__qualname__):
                add(m.__code__, name)
    return found


@dataclass
class Rank:
    """What a grading body gets on each rank: who it is, where its tensors live, and the tracer."""

    rank: int
    world: int
    device: torch.device
    tracer: Tracer


def _graded_worker(body: Callable[..., Any], impl: Any, status_dir: str, pg_timeout_s: float, args: tuple,
                   watched: tuple = ()) -> Any:
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
    if watched:
        tracer.watch(course_code(*watched))
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


def _limited_worker(fn: Callable[..., Any], args: tuple) -> Any:
    try:
        return {"value": fn(*args)}
    except NotImplementedError as exc:
        return {"not_attempted": str(exc) or "NotImplementedError"}
    except Exception as exc:            # noqa: BLE001 -- the learner's error, in words, back in the notebook
        return {"error": learner_error(exc)}


# ---------------------------------------------------------------------------------------------- in the notebook

def _learner_lines(tb: str) -> str:
    """The traceback's frames that are the learner's (not torch's, not dtlab's), last first, as 'line L of f'."""
    out = []
    for line in tb.splitlines():
        line = line.strip()
        if line.startswith("File ") and "/dtlab/" not in line and "/torch/" not in line \
                and "multiprocessing" not in line:
            parts = line.split(", ")
            if len(parts) >= 3 and not _not_learners(parts[0].removeprefix("File ").strip('"')):
                out.append(f"{parts[1]} of {parts[2].removeprefix('in ')}")
    return out[-1] if out else ""


def run_ranks(report: Report, body: Callable[..., Any], impl: Any, *args: Any, nprocs: int,
              limit_s: float = DEFAULT_LIMIT_S, watched: tuple = ()) -> list[Any] | None:
    """Run ``body(impl, rank_info, *args)`` on ``nprocs`` processes; return the results, or None after filling
    ``report`` with what stopped them (not attempted, a rank that raised, ranks stuck past ``limit_s``).
    ``watched``: functions and classes whose running the tracer notes (``traffic["seen"]``)."""
    from dtlab.launch import LaunchTimeout, WorkerError, run

    report.nprocs = nprocs
    report.worlds.append(nprocs)
    status_dir = tempfile.mkdtemp(prefix="dtlab-grade-")
    start = time.monotonic()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        results = run(_graded_worker, body, impl, status_dir, limit_s, args, watched, nprocs=nprocs,
                      backend="nccl" if gpus >= nprocs else "gloo", timeout=limit_s + STARTUP_S, prefix_output=True)
    except LaunchTimeout as exc:
        _stuck(report, status_dir, exc.pending, time.monotonic() - start)
        return None
    except WorkerError as exc:
        message = str(exc).split("\n")[0]
        if any(word in message for word in ("Timed out", "timed out", "Timeout", "Connection closed by peer")) \
                or (_waiting(status_dir) and not _learner_lines(exc.remote_traceback)):
            _stuck(report, status_dir, [exc.rank], time.monotonic() - start,
                   ended=message.removeprefix(f"rank {exc.rank} failed: ")[:200], ended_rank=exc.rank)
            return None
        where = _learner_lines(exc.remote_traceback)
        report.fail(f"{message}" + (f" (at {where})" if where else ""))
        return None
    finally:
        report.seconds += time.monotonic() - start
        shutil.rmtree(status_dir, ignore_errors=True)
    skipped = [r.get("not_attempted") for r in results if isinstance(r, dict) and "not_attempted" in r]
    if skipped:
        report.attempted = False
        report.problems.append(f"Your code raised NotImplementedError ({skipped[0]}): fill in the stub and run the "
                               "cell again.")
        return None
    return results


@dataclass(frozen=True)
class Case:
    """One run of a grader: ``nprocs`` processes, the exercise's own ``params``, and the ``name`` the report shows
    when this case fails (its sizes and settings, so the failure can be reproduced: every input is seeded)."""

    name: str
    nprocs: int
    params: dict = field(default_factory=dict, hash=False)


def grade_cases(report: Report, cases: list[Case], grade_one: Callable[[Case, Report], Any],
                nprocs: int | None = None) -> Report:
    """Run ``grade_one(case, report)`` for each case in order (those on ``nprocs`` processes only, when given) and
    stop at the first one that fails or is not attempted, naming it in the report."""
    chosen = [c for c in cases if nprocs is None or c.nprocs == nprocs]
    if not chosen:
        report.fail(f"this exercise is graded on {', '.join(sorted({str(c.nprocs) for c in cases}))} processes, "
                    f"not {nprocs}: leave nprocs out")
        return report
    for case in chosen:
        before = len(report.problems)
        grade_one(case, report)
        if not report.attempted or len(report.problems) > before:
            report.case = case.name
            return report
    report.ok(f"{len(chosen)} case{'s' if len(chosen) > 1 else ''}: " + "; ".join(c.name for c in chosen))
    return report


def run_limited(report: Report, fn: Callable[..., Any], *args: Any, limit_s: float, what: str) -> tuple[bool, Any]:
    """Run ``fn(*args)`` (code of the learner's that needs no process group) in a child process stopped after
    ``limit_s`` seconds, so an endless loop cannot hang the notebook: ``(True, its result)``, or ``(False, None)``
    after filling ``report`` (not attempted, the error it raised, or "did not return")."""
    from dtlab.launch import LaunchTimeout, WorkerError, run

    start = time.monotonic()
    try:
        out = run(_limited_worker, fn, args, nprocs=1, backend="gloo", timeout=limit_s + LIMITED_STARTUP_S,
                  prefix_output=False)[0]
    except LaunchTimeout:
        report.fail(f"{what} did not return within {limit_s:.0f} s: an endless loop? (it was stopped)")
        return False, None
    except WorkerError as exc:
        report.fail(f"{what} failed: {str(exc).splitlines()[0]}")
        return False, None
    finally:
        report.seconds += time.monotonic() - start
    if "not_attempted" in out:
        report.attempted = False
        report.problems.append(f"Your code raised NotImplementedError ({out['not_attempted']}): fill in the stub and "
                               "run the cell again.")
        return False, None
    if "error" in out:
        report.fail(f"{what} raised {out['error']}")
        return False, None
    return True, out["value"]


def as_index(x: Any) -> int | None:
    """``x`` as a plain int when it is an integer of any kind (``int``, ``numpy.int64``, a 0-d integer tensor),
    else None (``True``/``False`` are not indices here)."""
    if isinstance(x, bool) or (torch.is_tensor(x) and (x.dim() != 0 or x.is_floating_point() or x.dtype == torch.bool)):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def _statuses(status_dir: str) -> dict[int, str]:
    return {int(f.name): f.read_text() for f in Path(status_dir).iterdir() if f.name.isdigit()}


def _waiting(status_dir: str) -> dict[int, str]:
    """The ranks whose status file says they are waiting in a call, and in which."""
    return {r: s for r, s in sorted(_statuses(status_dir).items()) if s.startswith("waiting")}


def _stuck(report: Report, status_dir: str, pending: list[int], seconds: float, ended: str = "",
           ended_rank: int = -1) -> None:
    statuses = _statuses(status_dir)
    waiting = _waiting(status_dir)
    named = waiting or {r: statuses.get(r, "never started") for r in pending}
    point_to_point = any(f"dist.{op}(" in s for s in waiting.values() for op in POINT_TO_POINT)
    report.fail(f"deadlock: stopped after {seconds:.0f} s; "
                + "; ".join(f"rank {r} was {s}" for r, s in named.items())
                + (f" (rank {ended_rank} ended with: {ended})" if ended else ""),
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
        if math.isnan(d) or math.isinf(d):
            report.fail(f"{where}: {what} {name} holds {'NaN' if math.isnan(d) else 'inf'}")
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
