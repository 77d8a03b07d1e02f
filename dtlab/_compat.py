"""Work-arounds for the library versions the course's learners run, applied once when dtlab is imported.

* **torch < 2.4, gloo: ``destroy_process_group`` can deadlock.** A gloo worker thread finishes its
  last collective *after* the caller's ``wait()`` returned, and then needs the GIL to clean up;
  ``destroy_process_group`` holds the GIL while it joins that thread. On torch 2.3.1 (Databricks
  Runtime 15.4 LTS ML) 9 of 15 two-process launches hung here; letting go of the GIL for 50 ms first
  lets the thread finish (0 of 20 hung). Newer torch does not need it (0 of 10 without it).
"""

from __future__ import annotations

import functools
import time

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
