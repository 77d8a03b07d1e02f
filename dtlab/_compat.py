"""Work-arounds for the library versions the course's learners run, in force on any import of dtlab.

``import dtlab`` (which ``import dtlab.<anything>`` runs first) installs them without importing torch or
DeepSpeed: each patches one faulty call, of the versions that have the fault, when its module is loaded
(at once if it already is).

* **torch before 2.13, gloo: ``destroy_process_group`` can deadlock.** A gloo worker thread finishes its
  last collective *after* the caller's ``wait()`` returned, and then needs the GIL to clean up (to free
  the tensors of an all-gather's work); ``destroy_process_group`` holds the GIL while it joins that
  thread (``~ProcessGroupGloo``). On torch 2.3.1 (Databricks Runtime 15.4 LTS ML) 9 of 15 two-process
  launches hung here, and on torch 2.7.0 (17.3 LTS ML) tests of FSDP and of asynchronous checkpoints hung
  the same way; letting go of the GIL for 50 ms first lets the thread finish (0 of 20 hung on 2.3.1).
  torch 2.13 does not need it (0 of 10 without it); the versions in between were not measured, so they
  get it too (``GLOO_DESTROY_FIXED``).
* **torch before 2.13, gloo: averaging collectives.** ``reduce_scatter_tensor(op=AVG)`` on a gloo group
  returns the sum, silently (pytorch/pytorch#162338), and ``all_reduce(op=AVG)`` raises "Cannot use
  ReduceOp.AVG with Gloo" before 2.8 (#149781). FSDP2 asks for AVG for fp32 and bf16 gradients (HSDP for its
  all-reduce too), so on CPU processes with torch 2.7.0 (Databricks Runtime 17.3 LTS ML) FSDP2 on 2 gloo ranks
  left one process's weights at the first step and HSDP failed; on 2.13 both match it bit for bit. Where the
  group is gloo and the tensor is on the CPU, dtlab asks for SUM and divides by the group's size, as the fix in
  torch does (#162344); every other call is untouched.
* **torch 2.4 to 2.7, gloo: the pipeline schedules hang.** ``torch.distributed.pipelining``'s ``_batch_p2p``
  returns only the last of the ``Work`` objects ``batch_isend_irecv`` gives back, and the schedule waits on
  that one (pytorch/pytorch#132644). NCCL completes a batch as one, gloo does not: on torch 2.7.0 (Databricks
  Runtime 17.3 LTS ML) a 2-stage ``Schedule1F1B`` and ``ScheduleInterleaved1F1B`` on gloo hung until killed.
  dtlab makes ``_batch_p2p`` return a ``Work`` that waits on all of them, what torch 2.8 does (PR #152938).
* **DeepSpeed's ZeRO-3 reduce-scatter pads with ``torch.empty``.** ``reduce_scatter_coalesced``
  (``deepspeed/runtime/comm/coalesced_collectives.py``, 0.14.4 and 0.19.8 alike) pads each gradient to a
  multiple of the world size with uninitialised memory, which is summed with the other ranks' padding:
  whether a run trains then depends on what that memory last held (on the runtime's stack the same MLP's
  bf16 ZeRO-3 loss went to NaN, or its fp32 weights 510 away from DDP's, after unrelated code changed the
  process's allocation history). Where that function's source pads with ``torch.empty``, its padding is
  made of zeros; nothing else in DeepSpeed changes.
* **ipykernel 6.29 (Databricks Runtime 17.3 LTS ML's): a notebook's output can loop forever.** To route a
  thread's output to its cell, ``OutStream.parent_header`` follows a map of thread idents to the idents of the
  threads that started them; Python reuses the idents of threads that ended, and a cycle in that map loops
  forever while holding the GIL (ipython/ipykernel#1269). ``TorchDistributor(local_mode=False)`` starts a log
  server with a thread per task on every run: in the 17.3 job simulation notebook 21 hung on its third run,
  the kernel at 100% CPU in that loop. dtlab stops the walk at the first repeated ident (the output then goes
  to the cell the thread's own chain reaches); ipykernel 6.25 (15.4) and 7 do not walk the map.
* **DeepSpeed on CPU leaves 66 MB per rank in /dev/shm.** When every rank is on one machine
  (``LOCAL_SIZE`` = world size), DeepSpeed's shared-memory all-reduce (``ops/csrc/cpu/comm/shm.cpp``,
  0.14.4 and 0.19.8 alike) creates ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``
  and never unlinks it: a day of test runs left 324 of them, 21 GB of the machine's 24 GB of memory.
  ``dtlab.launch.run`` removes its workers' buffers when they have exited, and any process that
  imported dtlab (a ``deepspeed`` launcher's or TorchDistributor's rank) removes its own at exit.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import inspect
import os
import sys
import time
import types
from collections.abc import Callable, Iterable
from pathlib import Path


def _version() -> tuple[int, int]:
    """torch's (major, minor)."""
    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


# --- torch before GLOO_DESTROY_FIXED: destroy_process_group ------------------------------------------

#: The first torch measured not to deadlock in ``destroy_process_group`` after gloo collectives (see above).
GLOO_DESTROY_FIXED = (2, 13)


def _patch_destroy_process_group(c10d: types.ModuleType) -> None:
    """Release the GIL for 50 ms before ``destroy_process_group`` on torch before ``GLOO_DESTROY_FIXED``
    (``c10d``: distributed_c10d)."""
    original = getattr(c10d, "destroy_process_group", None)
    if original is None or getattr(original, "_dtlab", False) or _version() >= GLOO_DESTROY_FIXED:
        return

    @functools.wraps(original)
    def destroy_process_group(*args, **kwargs):
        time.sleep(0.05)  # release the GIL: gloo's threads finish their last work's clean-up
        return original(*args, **kwargs)

    destroy_process_group._dtlab = True
    c10d.destroy_process_group = destroy_process_group
    package = sys.modules.get("torch.distributed")
    if package is not None and getattr(package, "destroy_process_group", None) is original:
        package.destroy_process_group = destroy_process_group   # already re-exported: replace it there too


def _patch_gloo_average(c10d: types.ModuleType) -> None:
    """Make ``reduce_scatter_tensor(op=AVG)`` on a gloo group average (SUM, then divide) on torch before
    ``GLOO_DESTROY_FIXED`` (measured wrong on 2.7.0, right on 2.13)."""
    original = getattr(c10d, "reduce_scatter_tensor", None)
    if original is None or getattr(original, "_dtlab", False) or _version() >= GLOO_DESTROY_FIXED:
        return

    @functools.wraps(original)
    def reduce_scatter_tensor(output, input, op=c10d.ReduceOp.SUM, group=None, async_op=False):
        if op == c10d.ReduceOp.AVG and input.device.type == "cpu" and "gloo" in str(c10d.get_backend(group)):
            work = original(output, input, op=c10d.ReduceOp.SUM, group=group, async_op=async_op)
            if work is not None:
                work.wait()
            output.div_(c10d.get_world_size(group))
            return work
        return original(output, input, op=op, group=group, async_op=async_op)

    original_all_reduce = c10d.all_reduce

    @functools.wraps(original_all_reduce)
    def all_reduce(tensor, op=c10d.ReduceOp.SUM, group=None, async_op=False):
        if op == c10d.ReduceOp.AVG and tensor.device.type == "cpu" and "gloo" in str(c10d.get_backend(group)):
            work = original_all_reduce(tensor, op=c10d.ReduceOp.SUM, group=group, async_op=async_op)
            if work is not None:
                work.wait()
            tensor.div_(c10d.get_world_size(group))
            return work
        return original_all_reduce(tensor, op=op, group=group, async_op=async_op)

    package = sys.modules.get("torch.distributed")
    for name, patched, was in (("reduce_scatter_tensor", reduce_scatter_tensor, original),
                               ("all_reduce", all_reduce, original_all_reduce)):
        patched._dtlab = True
        setattr(c10d, name, patched)
        if package is not None and getattr(package, name, None) is was:
            setattr(package, name, patched)


def _patch_c10d(c10d: types.ModuleType) -> None:
    """The work-arounds for ``torch.distributed.distributed_c10d``."""
    _patch_destroy_process_group(c10d)
    _patch_gloo_average(c10d)


# --- DeepSpeed: zero padding in ZeRO-3's coalesced reduce-scatter -------------------------------------

class _ZeroedEmpty:
    """``torch`` as one function sees it, except that ``empty`` returns zeros."""

    def __init__(self, torch_module: types.ModuleType):
        self._torch = torch_module

    def __getattr__(self, name: str):
        return getattr(self._torch, name)

    def empty(self, *args, **kwargs):
        return self._torch.zeros(*args, **kwargs)


def _pads_with_empty(function: types.FunctionType) -> bool:
    """Whether the function's own code (not a function it wraps) pads with ``torch.empty``."""
    try:
        return "torch.empty(padding_sz" in inspect.getsource(function.__code__)
    except (OSError, TypeError):
        return False


def _with_zeroed_empty(function: types.FunctionType) -> types.FunctionType:
    """A copy of ``function`` whose global ``torch`` has ``empty`` returning zeros."""
    scope = dict(function.__globals__)
    scope["torch"] = _ZeroedEmpty(function.__globals__["torch"])
    patched = types.FunctionType(function.__code__, scope, function.__name__, function.__defaults__,
                                 function.__closure__)
    patched = functools.wraps(function)(patched)
    patched.__kwdefaults__ = function.__kwdefaults__
    patched._dtlab = True
    return patched


def _wrapped_functions(function: types.FunctionType):
    """``(cell, f)`` for ``function`` (cell None) and every function inside the decorators around it (each in the
    closure cell that holds it): DeepSpeed wraps ``reduce_scatter_coalesced`` in ``instrument_w_nvtx`` around
    ``torch.no_grad()``."""
    stack, seen = [(None, function)], set()
    while stack:
        cell, f = stack.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        yield cell, f
        for inner in f.__closure__ or ():
            try:
                contents = inner.cell_contents
            except ValueError:                      # an empty cell
                continue
            if isinstance(contents, types.FunctionType):
                stack.append((inner, contents))


def _zero_deepspeed_padding(module: types.ModuleType) -> None:
    """Zero padding in ``reduce_scatter_coalesced``, where it pads with ``torch.empty``. The function is replaced
    where it is held (inside DeepSpeed's decorators), so every name already bound to the decorated one sees it."""
    outer = getattr(module, "reduce_scatter_coalesced", None)
    if not isinstance(outer, types.FunctionType):
        return
    for cell, function in _wrapped_functions(outer):
        if getattr(function, "_dtlab", False) or not _pads_with_empty(function):
            continue
        if cell is None:
            module.reduce_scatter_coalesced = _with_zeroed_empty(function)
        else:
            cell.cell_contents = _with_zeroed_empty(function)
        return


def _padding_is_zeroed(module: types.ModuleType) -> bool:
    """Whether ``module.reduce_scatter_coalesced`` runs with zeroed padding."""
    return any(getattr(f, "_dtlab", False) for _, f in _wrapped_functions(module.reduce_scatter_coalesced))


# --- torch 2.4 to 2.7: wait on every Work of a pipeline schedule's batch of sends and receives ---------

#: The first torch whose pipeline schedules wait on every ``Work`` of a batch (PR #152938).
PIPELINING_WAITS_ALL = (2, 8)


class _AllWork:
    """The ``Work`` objects of one ``batch_isend_irecv``, waited on together."""

    def __init__(self, works):
        self.works = list(works)

    def wait(self, *args, **kwargs):
        for work in self.works:
            work.wait(*args, **kwargs)
        return True

    def is_completed(self):
        return all(work.is_completed() for work in self.works)


def _patch_pipeline_batch_p2p(schedules: types.ModuleType) -> None:
    """Make ``_batch_p2p`` of ``torch.distributed.pipelining.schedules`` return a ``Work`` that waits on the whole
    batch, on torch before ``PIPELINING_WAITS_ALL`` (measured hanging on 2.7.0 with gloo)."""
    original = getattr(schedules, "_batch_p2p", None)
    if original is None or getattr(original, "_dtlab", False) or _version() >= PIPELINING_WAITS_ALL:
        return

    @functools.wraps(original)
    def _batch_p2p(p2p_ops, desc=None):
        if len(p2p_ops) == 0:
            return None
        return _AllWork(schedules.dist.batch_isend_irecv(p2p_ops))

    _batch_p2p._dtlab = True
    schedules._batch_p2p = _batch_p2p


# --- applied when the module loads, or now -------------------------------------------------------------

#: Module name -> the patch to apply to it once it is loaded.
def _patch_thread_parent(iostream: types.ModuleType) -> None:
    """ipykernel 6.29's ``OutStream.parent_header`` follows thread idents to their oldest ancestor; a cycle among
    recycled idents of threads that ended loops forever (ipython/ipykernel#1269). Stop at the first repeat."""
    stream = getattr(iostream, "OutStream", None)
    prop = getattr(stream, "__dict__", {}).get("parent_header")
    if not isinstance(prop, property) or getattr(prop.fget, "_dtlab_cycle_safe", False):
        return
    try:
        follows_threads = "_thread_to_parent[identity]" in inspect.getsource(prop.fget)
    except (OSError, TypeError):
        return
    if not follows_threads:
        return
    import threading

    def parent_header(self):
        try:
            return self._parent_header.get()
        except LookupError:
            identity = threading.current_thread().ident
            seen = {identity}
            while identity in self._thread_to_parent:
                identity = self._thread_to_parent[identity]
                if identity in seen:                     # a cycle of recycled idents
                    break
                seen.add(identity)
            return self._thread_to_parent_header.get(identity, self._parent_header_global)

    parent_header._dtlab_cycle_safe = True
    stream.parent_header = property(parent_header, prop.fset)


PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    "torch.distributed.distributed_c10d": _patch_c10d,
    "ipykernel.iostream": _patch_thread_parent,
    "deepspeed.runtime.comm.coalesced_collectives": _zero_deepspeed_padding,
    "torch.distributed.pipelining.schedules": _patch_pipeline_batch_p2p,
}


class _PatchOnImport:
    """A meta-path finder that runs a module's patch right after the module's own code."""

    def find_spec(self, name, path=None, target=None):
        if name not in PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        original = spec.loader.exec_module

        def exec_module(module):
            original(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Apply every patch to the modules already loaded, and arrange the others' at their import."""
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


install()


# --- DeepSpeed's shared-memory files -------------------------------------------------------------------

SHM_FOLDER = Path("/dev/shm")


def deepspeed_shm_buffers(addr: str, port: str | int, ranks: Iterable[int]) -> list[Path]:
    """The shared-memory files DeepSpeed's CPU all-reduce creates for a job on ``addr:port``."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return [SHM_FOLDER / f"deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}" for rank in ranks]


def leftover_deepspeed_shm() -> set[Path]:
    """The DeepSpeed all-reduce buffers in /dev/shm that no running process has mapped: what finished jobs
    left behind (tests check that none outlives them; a job still running, as in another test run beside
    this one, maps its own and is not counted)."""
    found = set(SHM_FOLDER.glob("deepspeed_allreduce_buffer_*")) if SHM_FOLDER.is_dir() else set()
    if not found:
        return found
    mapped = _mapped_deepspeed_shm()  # one pass over /proc, not one per buffer
    return {path for path in found if path.name not in mapped}


def _mapped_deepspeed_shm() -> set[str]:
    """Names of the DeepSpeed buffers some live process maps, from /proc/<pid>/maps (empty off Linux)."""
    names = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            with open(maps) as lines:
                names.update(line.rsplit("/", 1)[-1].strip() for line in lines if "deepspeed_allreduce_buffer_" in line)
        except OSError:  # the process ended, or is not ours to read
            continue
    return names


def remove_deepspeed_shm(addr: str, port: str | int, ranks: Iterable[int]) -> int:
    """Unlink those files (safe once their ranks have exited); returns how many were there."""
    removed = 0
    for path in deepspeed_shm_buffers(addr, port, ranks):
        try:
            path.unlink()
            removed += 1
        except OSError:
            pass
    return removed


def _remove_own_deepspeed_shm() -> None:
    env = os.environ
    if "deepspeed" in sys.modules and env.get("MASTER_PORT") and env.get("RANK", "").isdigit():
        remove_deepspeed_shm(env.get("MASTER_ADDR", ""), env["MASTER_PORT"], [int(env["RANK"])])


atexit.register(_remove_own_deepspeed_shm)
