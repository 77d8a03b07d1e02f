"""Activation memory, measured, and recomputation (activation checkpointing) — notebook 19.

Between a layer's forward and its backward, training keeps the tensors the backward needs: the
*activations*. They grow with batch x sequence x width x layers and, at long sequences, they rather than
the weights decide what fits (sharding the weights, notebook 12, leaves them whole on every rank).
Recomputation keeps less and runs part of the forward again during the backward:

* ``"none"``: keep everything;
* ``"selective"``: recompute each block's attention core (scores, softmax, weighted sum: the part that
  grows with the sequence squared), keeping its inputs q, k, v — Korthikanti et al. 2022's selective
  recomputation; a fused attention kernel already does this inside its own backward;
* ``"full"``: recompute each whole block, keeping only the block's input: about one more forward pass.

``recompute(model, mode)`` applies it to a model made of blocks (``dtlab.models.TinyGPT``) with PyTorch's
``checkpoint_wrapper`` — the wrapper torchtitan applies per block before ``fully_shard``.
``SavedTensors`` counts what autograd keeps, tensor by tensor (saved-tensor hooks, on any device), and
``step_memory`` what a training step allocates, from the allocator's own records (the profiler's memory
events on a CPU, ``torch.cuda.max_memory_allocated`` on a GPU); ``memory_after_each`` the same for any
sequence of phases (the micro-batches of an accumulation step, notebook 12).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from dtlab.measure import SavedBytes

MODES = ("none", "selective", "full")


class SavedTensors(SavedBytes):
    """Count what autograd keeps for the backward pass inside ``with SavedTensors(exclude) as saved:``.

    Each distinct storage is counted once (a layer norm's output that three projections save is one
    tensor), and the tensors in ``exclude`` (pass the model's parameters: they are kept anyway) are left
    out. After the block: ``saved.bytes`` and ``saved.tensors``, and ``saved.shapes`` (one per tensor, in
    the order they were first saved).

    Unlike ``dtlab.measure.SavedBytes`` (which adds up every save, the same tensor each time it is saved),
    this is the memory the saved tensors occupy. What a checkpoint keeps by reference (its inputs) is not
    a saved tensor: ``step_memory`` measures everything.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()                       # the hooks, ``bytes`` and the context manager
        self._skip = {_key(t) for t in exclude}
        self._seen: set[tuple] = set()
        self.tensors = 0
        self.shapes: list[tuple[int, ...]] = []

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _key(t)
        if key not in self._skip and key not in self._seen:
            self._seen.add(key)
            self.bytes += t.untyped_storage().nbytes()
            self.tensors += 1
            self.shapes.append(tuple(t.shape))
        return t


def _key(t: torch.Tensor) -> tuple:
    return (t.device.type, t.device.index, t.untyped_storage().data_ptr())


@dataclass(frozen=True)
class StepMemory:
    """What one forward + backward allocated, in bytes above what was allocated before it.

    ``held``: allocated by the forward and still alive when the backward starts (the activations, the
    loss and the logits). ``peak``: the most alive at any moment of the step (recomputed activations and
    gradients included).
    """

    held: int
    peak: int


def step_memory(loss_fn: Callable[[], torch.Tensor], device: torch.device | str = "cpu") -> StepMemory:
    """Run ``loss = loss_fn()`` and ``loss.backward()``; return what they allocated (``StepMemory``).

    On a GPU: ``torch.cuda.memory_allocated`` before and after the forward, ``max_memory_allocated``
    across the step. On a CPU: the profiler's record of every allocation and free (``profile_memory``),
    added up in time order. Set gradients to None before the step to count them where they are made.
    """
    loss = []
    phases = memory_after_each([lambda: loss.append(loss_fn()), lambda: loss.pop().backward()], device)
    return StepMemory(held=phases.after[0], peak=phases.peak)


@dataclass(frozen=True)
class PhaseMemory:
    """Bytes allocated above the start: ``after[i]`` still alive when phase i ended, ``peak`` the most at any
    moment."""

    after: list[int]
    peak: int


def memory_after_each(phases: Iterable[Callable[[], object]], device: torch.device | str = "cpu") -> PhaseMemory:
    """Run each function of ``phases`` in turn; return what was alive after each, and the peak (``PhaseMemory``).

    For what a step holds *between* its parts: after a forward (activations), after each micro-batch of a
    gradient-accumulation step (gradients and gathered weights kept for the next one). The allocator's own
    count: ``torch.cuda.memory_allocated``/``max_memory_allocated`` on a GPU; on a CPU the CPU allocator's
    running total of every byte it handed out and got back, read through the profiler's memory events
    (``profile_memory``). Tensors made before the call and freed during it are not seen (the count starts at
    the call).
    """
    phases = list(phases)
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        after = []
        for phase in phases:
            phase()
            torch.cuda.synchronize(device)
            after.append(int(torch.cuda.memory_allocated(device) - start))
        return PhaseMemory(after=after, peak=int(torch.cuda.max_memory_allocated(device) - start))
    from torch.profiler import ProfilerActivity, profile, record_function

    def probe(name: str) -> None:              # one byte in and out: a reading of the running total
        with record_function(name):
            torch.empty(1, dtype=torch.uint8)

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _cpu_allocator_counting_every_thread() as counting:
        with _native_stderr_muted():           # Kineto prints a line at every start and stop
            prof.start()
        try:
            probe("dtlab.probe.start")
            for i, phase in enumerate(phases):
                phase()
                probe(f"dtlab.probe{i}")
        finally:
            with _native_stderr_muted():
                prof.stop()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    memory = sorted((e["ts"], e["args"]["Bytes"], e["args"].get("Total Allocated")) for e in events
                    if e.get("name") == "[memory]" and e["args"].get("Device Type", 0) == 0)
    probes = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in events
              if e.get("name", "").startswith("dtlab.probe") and "dur" in e}
    names = ["dtlab.probe.start"] + [f"dtlab.probe{i}" for i in range(len(phases))]
    if counting and all(total is not None for _, _, total in memory):
        # The total after each probe's byte came back: what every thread holds at that moment.
        def reading(name: str) -> int:
            begin, end = probes[name]
            return next(total for ts, change, total in reversed(memory) if begin <= ts <= end and change < 0)

        base = reading(names[0])
        window = [total for ts, _, total in memory if probes[names[0]][0] <= ts <= probes[names[-1]][1]]
        return PhaseMemory(after=[int(reading(n) - base) for n in names[1:]], peak=int(max(window) - base))
    # Without the running total (an allocator that does not keep one): add up the events in time order; a
    # tensor freed by a thread the profiler does not follow (gloo's workers) then stays counted.
    alive = peak = 0
    after = []
    ends = [probes[n][1] for n in names[1:]]
    for ts, change, _ in memory:
        while len(after) < len(ends) and ts > ends[len(after)]:
            after.append(alive)
        alive += change
        peak = max(peak, alive)
    after += [alive] * (len(ends) - len(after))
    return PhaseMemory(after=[int(a) for a in after], peak=int(peak))


@contextlib.contextmanager
def _cpu_allocator_counting_every_thread():
    """Make PyTorch's CPU allocator keep its running total for allocations and frees on every thread, for the
    block; yield whether it does.

    By default the allocator counts only on threads the profiler follows, so a tensor the main thread
    allocated and a gloo worker thread freed (the last reference to a collective's buffer often dies there)
    stays counted for ever: an FSDP2 step then seemed to hold a block's gathered weights more, in some runs and
    not others. The switch is c10's ``caffe2_report_cpu_memory_usage`` flag (a command-line flag of c10's with
    no Python binding, set here through ``ctypes``); where it cannot be found, nothing changes (yields False).
    """
    flag = _c10_flag("FLAGS_caffe2_report_cpu_memory_usage")
    if flag is None:
        yield False
        return
    before = flag.value
    older = torch.empty(1, dtype=torch.uint8)    # made before the count starts
    flag.value = True
    with _native_stderr_muted():
        del older   # c10 warns once per process when such a tensor is freed ("unknown size"): spent here, unseen
    try:
        yield True
    finally:
        flag.value = before


def _c10_flag(name: str):
    """c10's boolean command-line flag ``name`` as a ``ctypes.c_bool``, or None where c10's library has none."""
    import ctypes
    import glob

    for lib in sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.*"))):
        try:
            return ctypes.c_bool.in_dll(ctypes.CDLL(lib), name)
        except (OSError, ValueError):
            continue
    return None


@contextlib.contextmanager
def _native_stderr_muted():
    """Send what C++ code writes to file descriptor 2 to /dev/null for the block (Python's stderr is untouched)."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def blocks_of(model: nn.Module, blocks: str = "blocks") -> nn.ModuleList:
    """The ``ModuleList`` of blocks at the dotted path ``blocks`` in ``model``: ``"blocks"`` for
    ``dtlab.models.TinyGPT``, ``"model.layers"`` for a Hugging Face ``LlamaForCausalLM`` (``transformer.h`` for GPT-2).

    Raises:
        ValueError: nothing at that path, or not a ``ModuleList``, naming the lists the model has.
    """
    try:
        layers = model.get_submodule(blocks)
    except AttributeError:
        layers = None
    if not isinstance(layers, nn.ModuleList):
        lists = [name for name, m in model.named_modules() if isinstance(m, nn.ModuleList)][:4]
        raise ValueError(f"{type(model).__name__} has no ModuleList {blocks!r} of blocks. Fix: pass blocks=<the dotted "
                         f"path to the list of layers> ({', '.join(map(repr, lists)) or 'it has no ModuleList'}), or "
                         "wrap modules yourself with checkpoint_wrapper")
    return layers


def recompute(model: nn.Module, mode: str, *, reentrant: bool = False, preserve_rng_state: bool = True,
              blocks: str = "blocks", selective: str | type = "attn.core") -> nn.Module:
    """Apply activation recomputation to each block of ``model`` (in place; returns ``model``).

    ``mode``: ``"none"`` (nothing), ``"selective"`` (inside each block, the part named by ``selective`` is wrapped)
    or ``"full"`` (each whole block is wrapped), with
    ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``: the wrapped module's forward runs under
    ``torch.utils.checkpoint.checkpoint`` and its state-dict keys stay those of the plain model.
    ``reentrant=False`` is PyTorch's recommended implementation (the reentrant one needs an input that requires
    grad and cannot be nested); ``preserve_rng_state=False`` saves the cost of stashing the RNG state, and is
    wrong as soon as the block has dropout (notebook 19 shows it). With FSDP2, apply it before ``fully_shard``.

    ``blocks`` is the dotted path to the ``ModuleList`` of blocks (``blocks_of``): ``"model.layers"`` for a Hugging
    Face Llama. ``selective`` says what to recompute inside a block: a dotted path (``"attn.core"``, TinyGPT's
    attention core) or a module class (every module of that class inside the block, e.g. transformers'
    ``LlamaAttention``).

    Raises:
        ValueError: an unknown mode, a model without that list of blocks, or a block without the selective part
        (the fix named).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: use one of {', '.join(map(repr, MODES))}")
    layers = blocks_of(model, blocks)
    if mode == "none":
        return model
    impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT

    def wrap(module: nn.Module) -> nn.Module:
        return checkpoint_wrapper(module, checkpoint_impl=impl, preserve_rng_state=preserve_rng_state)

    for i, block in enumerate(layers):
        if mode == "full":
            layers[i] = wrap(block)
            continue
        if isinstance(selective, type):
            targets = [name for name, m in block.named_modules() if isinstance(m, selective) and name]
        else:
            try:
                block.get_submodule(selective)
                targets = [selective]
            except AttributeError:
                targets = []
        if not targets:
            what = selective.__name__ if isinstance(selective, type) else selective
            raise ValueError(f"block {i} ({type(block).__name__}) has no {what} to recompute selectively. "
                             "Fix: mode='full', or selective=<a dotted path or a module class inside the block>")
        for name in targets:
            parent_name, _, attr = name.rpartition(".")
            parent = block.get_submodule(parent_name) if parent_name else block
            setattr(parent, attr, wrap(getattr(parent, attr)))
    return model


def recomputed(model: nn.Module) -> int:
    """How many modules of ``model`` are wrapped for recomputation."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return sum(isinstance(m, CheckpointWrapper) for m in model.modules())
