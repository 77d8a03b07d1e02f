"""Work-arounds for the library versions the course's learners run, applied once when dtlab is imported.

* **torch < 2.4, gloo: ``destroy_process_group`` can deadlock.** A gloo worker thread finishes its
  last collective *after* the caller's ``wait()`` returned, and then needs the GIL to clean up;
  ``destroy_process_group`` holds the GIL while it joins that thread. On torch 2.3.1 (Databricks
  Runtime 15.4 LTS ML) 9 of 15 two-process launches hung here; letting go of the GIL for 50 ms first
  lets the thread finish (0 of 20 hung). Newer torch does not need it (0 of 10 without it).
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
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist


def _version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _patch_destroy_process_group() -> None:
    if not dist.is_available() or _version() >= (2, 4) or getattr(dist.destroy_process_group, "_dtlab", False):
        return
    original = dist.destroy_process_group

    @functools.wraps(original)
    def destroy_process_group(*args, **kwargs):
        time.sleep(0.05)  # release the GIL: gloo's threads finish their last work's clean-up
        return original(*args, **kwargs)

    destroy_process_group._dtlab = True
    dist.destroy_process_group = destroy_process_group
    torch.distributed.distributed_c10d.destroy_process_group = destroy_process_group


_patch_destroy_process_group()


SHM_FOLDER = Path("/dev/shm")


def deepspeed_shm_buffers(addr: str, port: str | int, ranks: Iterable[int]) -> list[Path]:
    """The shared-memory files DeepSpeed's CPU all-reduce creates for a job on ``addr:port``."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return [SHM_FOLDER / f"deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}" for rank in ranks]


def leftover_deepspeed_shm() -> set[Path]:
    """Every DeepSpeed all-reduce buffer now in /dev/shm (tests check that none outlives them)."""
    return set(SHM_FOLDER.glob("deepspeed_allreduce_buffer_*")) if SHM_FOLDER.is_dir() else set()


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


# DeepSpeed's ZeRO-3 reduce-scatter pads each gradient to a multiple of the world size with
# ``torch.empty`` (``deepspeed/runtime/comm/coalesced_collectives.py``, 0.14.4 and 0.19.8 alike):
# whatever the allocator hands back is summed into the padded slots and lands in the last rank's
# gradient partition. Whether a run trains depends on what that memory last held: on the runtime's
# stack the same MLP's bf16 ZeRO-3 loss went to NaN, or its fp32 weights 510 away from DDP's, after
# unrelated code changed the process's allocation history. Zero padding makes the result depend on
# the gradients alone.
_COALESCED = "deepspeed.runtime.comm.coalesced_collectives"


class _TorchWithZeroedEmpty:
    """``torch`` as that module sees it, except that ``empty`` returns zeros (only its padding uses it)."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        return torch.zeros(*args, **kwargs)


def _zero_deepspeed_padding(module) -> None:
    if isinstance(getattr(module, "torch", None), _TorchWithZeroedEmpty):
        return
    module.torch = _TorchWithZeroedEmpty()


class _PatchOnImport:
    """A meta-path finder that patches the coalesced collectives right after DeepSpeed imports them."""

    def find_spec(self, name, path=None, target=None):
        if name != _COALESCED:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        original = spec.loader.exec_module

        def exec_module(module):
            original(module)
            _zero_deepspeed_padding(module)

        spec.loader.exec_module = exec_module
        return spec


if _COALESCED in sys.modules:
    _zero_deepspeed_padding(sys.modules[_COALESCED])
elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _PatchOnImport())
