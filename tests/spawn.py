"""Run a module-level test function on N gloo processes and collect each rank's return value.

Tests use it to compare distributed results with a single-process reference. The function must
live in an importable module (a test file), since ``spawn`` pickles it by reference.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from dtlab.distributed import free_port


def _entry(rank: int, fn: Callable, world_size: int, port: int, args: tuple, results: Any) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    results[rank] = fn(*args)


def run_on(world_size: int, fn: Callable, *args: Any) -> list[Any]:
    """``fn(*args)`` on ``world_size`` processes; returns the results in rank order."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_entry, args=(fn, world_size, free_port(), args, results), nprocs=world_size, join=True)
        return [results[r] for r in range(world_size)]
