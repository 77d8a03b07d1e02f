"""PyTorch's pipeline API (``torch.distributed.pipelining``): which torch runs it, on which backend.

``PipelineStage`` and the schedules (``ScheduleGPipe``, ``Schedule1F1B``, ...) are public from
torch 2.4. On gloo (CPU) they hang and then fail ("Connection reset by peer") up to torch 2.7:
the schedule waited on only one of the ``Work`` objects gloo returns for a batch of sends and
receives (pytorch/pytorch#132644, fixed by PR #152938 in 2.8). Databricks Runtime 15.4 LTS ML has
torch 2.3, without the package.

* ``AVAILABLE`` — this torch has ``torch.distributed.pipelining``;
* ``problem(backend)`` — why it cannot run here with ``backend`` (``""`` when it can);
* ``require(backend)`` — raise ``RuntimeError`` with that reason and the fix.
"""

from __future__ import annotations

import torch

from dtlab._compat import _version

#: The torch version from which the pipeline schedules run on gloo without hanging.
NEEDS_TORCH_GLOO = (2, 8)

try:
    import torch.distributed.pipelining  # noqa: F401

    AVAILABLE = True
except ImportError:
    AVAILABLE = False


def problem(backend: str) -> str:
    """Why ``torch.distributed.pipelining`` cannot run here with ``backend``; ``""`` when it can."""
    if not AVAILABLE:
        return (f"torch.distributed.pipelining needs torch >= 2.4 (>= 2.8 on gloo); this is {torch.__version__}. "
                "Fix: a runtime with a newer torch, or dtlab.parallel.pipeline, which runs on 2.3")
    if backend == "gloo" and _version() < NEEDS_TORCH_GLOO:
        return (f"on gloo, torch {torch.__version__}'s pipeline schedules can hang (pytorch/pytorch#132644, fixed in "
                "2.8). Fix: torch >= 2.8, nccl on GPUs, or dtlab.parallel.pipeline")
    return ""


def require(backend: str) -> None:
    """Raise ``RuntimeError`` naming the version (and the fix) when the schedules cannot run here."""
    reason = problem(backend)
    if reason:
        raise RuntimeError(reason)
