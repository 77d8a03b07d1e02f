"""Measuring training: a step timer, throughput, a profiler breakdown by training phase, and how far two
trainings' weights are apart (``max_diff``, against the rounding bound ``reduction_tolerance``).

GPU work is asynchronous: a CUDA kernel is queued and Python moves on. A timer that does not
call ``torch.cuda.synchronize()`` measures the queueing, not the work. ``StepTimer`` does the
synchronising for you when the device is CUDA, and nothing extra on CPU.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from dtlab import _compat  # noqa: F401  (work-arounds for the runtime's torch and DeepSpeed)

#: The four phases of a training step, in order, as the course labels them with
#: ``torch.profiler.record_function``.
PHASES = ("data", "forward", "backward", "optimizer")


class StepTimer:
    """Accumulates wall time per named section.

    >>> timer = StepTimer()
    >>> with timer("forward"):
    ...     _ = sum(range(1000))
    >>> timer.count["forward"]
    1
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.cuda = torch.device(device).type == "cuda"
        self.total: dict[str, float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.total[name] += time.perf_counter() - start
            self.count[name] += 1

    def mean(self, name: str) -> float:
        """Mean seconds per call of section ``name``."""
        if not self.count[name]:
            raise KeyError(f"section {name!r} was never timed (timed: {sorted(self.total)})")
        return self.total[name] / self.count[name]

    def summary(self) -> dict[str, dict[str, float]]:
        """``{section: {"calls", "total_s", "mean_ms"}}`` for every timed section."""
        return {k: {"calls": self.count[k], "total_s": self.total[k], "mean_ms": 1e3 * self.mean(k)}
                for k in self.total}


def throughput(samples: int, seconds: float) -> float:
    """Samples per second; raises on a non-positive duration instead of returning inf."""
    if seconds <= 0:
        raise ValueError(f"seconds={seconds} must be positive")
    return samples / seconds


def phase_breakdown(prof: torch.profiler.profile, phases: Iterable[str] = PHASES) -> dict[str, dict[str, float]]:
    """Time per phase from a profiler whose loop labelled its phases with ``record_function``.

    Returns ``{phase: {"ms": total milliseconds, "share": fraction of the phases' sum}}``; on CUDA
    the device (kernel) time is used when it is larger than the CPU time, since the CPU only
    queues kernels.

    Raises:
        ValueError: when a phase was never recorded (a label typo, or no ``record_function``).
    """
    averages = {e.key: e for e in prof.key_averages()}
    result: dict[str, dict[str, float]] = {}
    for phase in phases:
        if phase not in averages:
            raise ValueError(f"phase {phase!r} was not recorded. Fix: wrap that part of the step in "
                             f"torch.profiler.record_function({phase!r}). Recorded: "
                             f"{sorted(k for k in averages if not k.startswith('aten::'))[:10]}")
        e = averages[phase]
        device_us = getattr(e, "device_time_total", 0) or 0
        result[phase] = {"ms": max(e.cpu_time_total, device_us) / 1e3}
    total = sum(v["ms"] for v in result.values()) or 1.0
    for v in result.values():
        v["share"] = v["ms"] / total
    return result


def matmul_flops(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, n: int = 512,
                 repeats: int = 10) -> float:
    """Measured FLOP/s of an ``n x n`` matrix multiply on ``device`` in ``dtype`` (best of ``repeats``).

    A quick probe of what the hardware does with a precision: GPUs with tensor cores run bf16
    many times faster than fp32; CPUs without native bf16 (``cpu_bf16_instructions()`` empty) usually run it
    slower, and CPUs with it (AVX-512 BF16, AMX) may run it faster.
    """
    device = torch.device(device)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    timer = StepTimer(device)
    with timer("warmup"):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        t = StepTimer(device)
        with t("mm"):
            a @ b
        best = min(best, t.total["mm"])
    return 2 * n**3 / best


#: CPU flags (``/proc/cpuinfo``) that mean native bf16 arithmetic: x86's AVX-512 BF16 and AMX, Arm's BF16.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_bf16_instructions(cpuinfo: str | None = None) -> list[str]:
    """The bf16 instruction sets this CPU reports (``BF16_CPU_FLAGS`` found in ``/proc/cpuinfo``'s ``flags``
    or ``Features`` line); ``[]`` when it reports none or there is no ``/proc/cpuinfo`` (not Linux).

    What the CPU says it has; whether bf16 is faster here is ``matmul_flops``'s to measure.
    """
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return []
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return [flag for flag in BF16_CPU_FLAGS if flag in flags]


#: float32's machine epsilon: the relative rounding error of one operation is at most half of it.
FLOAT32_EPS = 2.0**-23


def reduction_tolerance(n_terms: int, steps: int, scale: float, eps: float = FLOAT32_EPS) -> float:
    """How far two *correct* float32 trainings may drift apart when they sum the same numbers in a
    different order: the bound every "N processes = one process" comparison of the course uses.

    Summing ``n_terms`` numbers in another order changes the sum by at most about
    ``n_terms x eps x`` (the sum of their magnitudes) (Higham, "Accuracy and Stability of Numerical
    Algorithms", recursive summation). A gradient is such a sum over the batch (and, distributed,
    over ranks); each of ``steps`` updates adds its rounding difference to the weights, whose
    magnitude is ``scale`` (use the largest absolute weight). The bound is loose by design — real
    differences are usually far smaller — and still tiny next to what a real bug does (a missing
    average doubles the learning rate: differences of order ``scale``).

    >>> round(reduction_tolerance(64, 10, 1.0), 7)
    7.63e-05
    """
    if n_terms < 1 or steps < 1 or scale < 0 or not math.isfinite(scale):
        raise ValueError(f"need n_terms >= 1, steps >= 1 and a finite scale >= 0 (got {n_terms}, {steps}, {scale})")
    return n_terms * eps * steps * max(scale, eps)


def max_diff(a: dict, b: dict) -> float:
    """The largest absolute difference between two state dicts: the number every "distributed equals one
    process" comparison of the course holds against ``reduction_tolerance``.

    ``a`` and ``b`` map names to tensors (a ``state_dict()``), or are results that hold one under
    ``"weights"``. Tensors are compared in float32 on the CPU, so bf16 weights and GPU weights compare
    too. A NaN anywhere makes the result NaN (which no bound admits). When one side has extra entries (DDP's
    buffers, a strategy's scratch), the comparison runs over the names the other side has; names neither side
    shares are an error, not a silent 0.

    >>> max_diff({"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([1.0, 2.5])})
    0.5
    """
    a, b = (x["weights"] if isinstance(x.get("weights"), dict) else x for x in (a, b))
    if a.keys() <= b.keys():
        names = list(a)
    elif b.keys() <= a.keys():
        names = list(b)
    else:
        raise ValueError(f"the two state dicts do not hold the same tensors: only in the first "
                         f"{sorted(a.keys() - b.keys())[:5]}, only in the second {sorted(b.keys() - a.keys())[:5]}")
    if not names:
        raise ValueError("nothing to compare: a state dict is empty")
    diffs = [(a[k].detach().float().cpu() - b[k].detach().float().cpu()).abs().max().item() for k in names]
    return math.nan if any(math.isnan(d) for d in diffs) else max(diffs)   # max() alone skips a NaN after the first


def plot_seconds(seconds: dict[str, float], title: str, xlabel: str = "seconds", color: str = "tab:purple"):
    """A small horizontal bar chart of named durations (the first name on top); returns the figure.

    Notebooks 04 and 18 draw their launchers' costs with it: ``plot_seconds({"launch.run": 3.1, ...}, title)``.
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 0.45 * len(seconds) + 0.8))
    ax.barh(list(seconds)[::-1], list(seconds.values())[::-1], color=color)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    fig.tight_layout()
    return fig


def memory_in_use(device: torch.device | str = "cpu") -> int:
    """Bytes this process holds on ``device`` now: allocated CUDA memory on a GPU, the resident set on the CPU.

    On a GPU, ``torch.cuda.memory_allocated`` counts exactly the live tensors. On the CPU the resident
    set size (RSS) counts everything the process holds, libraries included: use the *growth* of it
    across a step of the program (large tensors are mapped and unmapped as a whole, so their bytes
    show up there one for one), never the absolute value.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    import psutil

    return int(psutil.Process().memory_info().rss)


class SavedBytes:
    """Count the bytes autograd saves for the backward pass inside ``with SavedBytes() as saved:``.

    ``saved.bytes`` after the block: the sum over the tensors saved for backward (by autograd's
    operations and by ``ctx.save_for_backward``) of their size on this rank (a DTensor counts its local
    part). Parameters a layer saves are counted too, identically for every schedule or strategy compared,
    so differences between two runs are activations. On a GPU, ``torch.cuda.max_memory_allocated`` is the
    other measurement; on a CPU this is the one there is.
    """

    def __init__(self) -> None:
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        local = getattr(t, "_local_tensor", t)
        self.bytes += local.numel() * local.element_size()
        return t

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class RunLog:
    """What a lesson's claims measure inside a training function, kept apart from the function itself.

    The training function calls ``step(ids, read_s, train_s)`` after each step and ``finish(model, ...)`` at the
    end (every rank: it is a collective); ``finish`` returns, on every rank, each rank's record: the sample ids of
    every step, the seconds spent waiting for data and training (the first step, which imports and opens files,
    left out), the elements it held (``dtlab.parallel.held_elements``), and the model's greedy answer to a
    prompt with the prompt's logits. A template copied without it trains the same.
    """

    def __init__(self) -> None:
        self.ids: list[list[int]] = []
        self.read_s = self.train_s = 0.0
        self.samples = 0

    def step(self, ids: Any, read_s: float, train_s: float) -> None:
        if self.ids:
            self.read_s, self.train_s, self.samples = self.read_s + read_s, self.train_s + train_s, \
                self.samples + len(ids)
        self.ids.append([int(i) for i in ids])

    @torch.no_grad()
    def finish(self, model: torch.nn.Module, optimizer: Any = None, prompt: Any = None, new_tokens: int = 0,
               device: torch.device | str = "cpu") -> list[dict[str, Any]]:
        import torch.distributed as dist

        from dtlab.parallel import held_elements

        mine: dict[str, Any] = {"ids": self.ids, "read_s": self.read_s, "train_s": self.train_s,
                                "samples": self.samples, "held": held_elements(model, optimizer)}
        if prompt is not None:                     # greedy: each rank runs the same forwards (FSDP2 gathers)
            x = torch.as_tensor(prompt, device=device).long().view(1, -1)
            mine["logits"] = model(input_ids=x, use_cache=False).logits[0].float().cpu()
            for _ in range(new_tokens):
                nxt = model(input_ids=x, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
                x = torch.cat([x, nxt], dim=1)
            mine["answer"] = x[0, len(mine["logits"]):].tolist()
            if hasattr(model, "reshard"):
                model.reshard()
        if not (dist.is_available() and dist.is_initialized()):
            return [mine]
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return every
