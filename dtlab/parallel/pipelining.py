"""PyTorch's pipeline API (``torch.distributed.pipelining``): which torch runs it, on which backend.

``PipelineStage`` and the schedules (``ScheduleGPipe``, ``Schedule1F1B``, ...) are public from
torch 2.4. On gloo (CPU) they hang up to torch 2.7: the schedule waited on only one of the
``Work`` objects gloo returns for a batch of sends and receives (pytorch/pytorch#132644, fixed by
PR #152938 in 2.8). ``import dtlab`` mends that on 2.4-2.7 (``dtlab._compat``), so with dtlab
imported they run on gloo on torch 2.7.0 too (Databricks Runtime 17.3 LTS ML). Databricks Runtime
15.4 LTS ML has torch 2.3, without the package.

* ``AVAILABLE`` — this torch has ``torch.distributed.pipelining``;
* ``problem(backend)`` — why it cannot run here with ``backend`` (``""`` when it can);
* ``require(backend)`` — raise ``RuntimeError`` with that reason and the fix;
* ``Work(seconds)`` — an identity layer that costs ``seconds`` forward and twice that backward, so a
  schedule's timeline on a noisy CPU is the schedule's, not the machine's;
* ``record_actions(stage, events)`` — time each micro-batch's forward and backward of a
  ``torch.distributed.pipelining.PipelineStage`` (what ``dtlab.parallel.pipeline.idle_fraction`` and
  ``plot_timeline`` read, once wrapped in a ``StepResult``).

On torch 2.9.0 (Databricks Runtime 18 LTS ML) a 2-stage ``ScheduleGPipe`` on gloo aborts at its first step:
gloo receives 8 bytes where it posted 4 ("Received data size doesn't match expected size"), the stages' shape
exchange (``send_object_list``) and the schedule's sends crossing. torch 2.13 runs the same code; 2.8 and
2.10-2.12 were not measured, so ``problem`` refuses gloo from 2.9 up to 2.13 (``GLOO_FAILS``). nccl on GPUs
is not affected.

The interleaved schedule (``ScheduleInterleaved1F1B``: several stages per rank) needs what the others
need: ``problem(backend)`` is its guard too (checked here on torch 2.13; not run on 2.8-2.12).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from dtlab._compat import PIPELINING_WAITS_ALL, _version

#: The torch version from which the pipeline schedules run on gloo without hanging (without dtlab's mend).
NEEDS_TORCH_GLOO = PIPELINING_WAITS_ALL
#: torch versions whose schedules abort on gloo: measured on 2.9.0, running on 2.13 (between: not measured).
GLOO_FAILS = ((2, 9), (2, 13))

try:
    import torch.distributed.pipelining  # noqa: F401

    AVAILABLE = True
except ImportError:
    AVAILABLE = False


def problem(backend: str) -> str:
    """Why ``torch.distributed.pipelining`` cannot run here with ``backend``; ``""`` when it can."""
    if not AVAILABLE:
        return (f"torch.distributed.pipelining needs torch >= 2.4; this is {torch.__version__}. "
                "Fix: a runtime with a newer torch, or dtlab.parallel.pipeline, which runs on 2.3")
    if backend == "gloo" and _version() < NEEDS_TORCH_GLOO and not waits_on_whole_batches():
        return (f"on gloo, torch {torch.__version__}'s pipeline schedules can hang (pytorch/pytorch#132644, fixed in "
                "2.8). Fix: torch >= 2.8, nccl on GPUs, or dtlab.parallel.pipeline")
    if backend == "gloo" and GLOO_FAILS[0] <= _version() < GLOO_FAILS[1]:
        return (f"on gloo, torch {torch.__version__}'s pipeline schedules abort at the first step (gloo receives "
                "more bytes than it posted for: measured on 2.9.0; 2.13 runs). Fix: nccl on GPUs, torch >= 2.13, "
                "or dtlab.parallel.pipeline")
    return ""


def waits_on_whole_batches() -> bool:
    """Whether the schedules wait on every ``Work`` of a batch of sends and receives: torch >= 2.8, or
    dtlab's mend of ``_batch_p2p`` in force (``dtlab._compat``)."""
    if _version() >= NEEDS_TORCH_GLOO:
        return True
    from torch.distributed.pipelining import schedules

    return getattr(schedules._batch_p2p, "_dtlab", False)


def require(backend: str) -> None:
    """Raise ``RuntimeError`` naming the version (and the fix) when the schedules cannot run here."""
    reason = problem(backend)
    if reason:
        raise RuntimeError(reason)


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.seconds)
        return grad, None


class Work(nn.Module):
    """An identity layer costing ``seconds`` in forward and twice that in backward (sleeps; 0: free).

    Put it after a stage's last layer (its input must require grad for the backward cost to run).
    ``seconds`` can be changed between steps, e.g. 0 for a warm-up step.
    """

    def __init__(self, seconds: float = 0.0):
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.seconds) if self.seconds else x


def record_actions(stage, events: list, clock=time.perf_counter) -> None:
    """Append (kind, micro-batch, start, end, chunk) to ``events`` for each forward ("F") and backward ("B")
    that ``stage`` (a ``torch.distributed.pipelining.PipelineStage``) computes; chunk is its stage index // ranks.

    Every schedule computes a micro-batch by calling the stage's ``forward_one_chunk`` and
    ``backward_one_chunk``; they are wrapped on this one stage object (times: ``clock()``, the
    caller's to subtract from). Sends and receives are separate calls, so they count as idle.
    """
    chunk = stage.stage_index // stage.group_size

    def timed(kind, method):
        def call(micro_batch, *args, **kwargs):
            start = clock()
            out = method(micro_batch, *args, **kwargs)
            events.append((kind, micro_batch, start, clock(), chunk))
            return out
        return call

    stage.forward_one_chunk = timed("F", stage.forward_one_chunk)
    stage.backward_one_chunk = timed("B", stage.backward_one_chunk)
