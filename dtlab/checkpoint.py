"""Checkpoints that never leave you with nothing.

* ``save``   writes to a temporary file in the same directory, flushes it to disk, then renames it
  over the target. A crash at any moment leaves either the old checkpoint or the new one, never
  half of one.
* ``load``   reads with ``weights_only=True`` (no arbitrary code runs from a checkpoint file) and
  turns a truncated or corrupt file into a ``CheckpointError`` that says what to do.
* ``training_state`` / ``restore`` bundle and unbundle model, optimizer, position and RNG states,
  so a resumed run continues where it stopped.
* ``save_on_rank0`` is the distributed form: rank 0 writes, and every rank learns whether it
  worked (a failed write raises on every rank at once instead of leaving the others at a barrier).
* ``Checkpointer``  saves every K steps or T seconds, keeps the newest M, and finds the newest
  readable one to resume from — chosen by rank 0, so every rank resumes from the same step.

>>> state = training_state(model, optimizer=optimizer, epoch=3, step=120)       # doctest: +SKIP
>>> save("checkpoints/last.pt", state)                                          # doctest: +SKIP
>>> epoch, step = restore(load("checkpoints/last.pt"), model, optimizer=optimizer)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import pickle
import random
import re
import tempfile
import time
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dtlab import (
    _compat,  # noqa: F401  (work-arounds for the runtime's torch and DeepSpeed)
    distributed,
)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, read or applied; the message says why and what to do."""


def save(path: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Write ``state`` to ``path`` atomically (temporary file + fsync + rename).

    The directory must exist: a typo in a path should fail loudly rather than scatter
    checkpoints in new folders. If anything fails, the previous file at ``path`` is untouched.
    """
    path = Path(path)
    directory = path.parent
    if not directory.is_dir():
        raise CheckpointError(f"cannot save checkpoint to {path}: directory {directory} does not exist. "
                              f"Fix: create it first, e.g. os.makedirs({str(directory)!r}, exist_ok=True).")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    return path


def load(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint with ``weights_only=True``; unreadable files raise ``CheckpointError``."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}. Fix: check the path, or start from scratch.")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as exc:
        if "Unsupported global" in str(exc) or "Unsupported class" in str(exc):  # code, not a corrupt file
            # (torch >= 2.4 says "global", 2.3 — Databricks 15.4 — says "class")
            raise CheckpointError(f"{path} holds Python objects that weights_only=True refuses to unpickle "
                                  "(only tensors, numbers, strings and containers are allowed). Fix: save "
                                  "plain state_dicts (dtlab.checkpoint.training_state), or, if you trust the "
                                  "file, torch.load(path, weights_only=False).") from exc
        raise CheckpointError(f"{path} is not a readable checkpoint (truncated or corrupt: "
                              f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). "
                              "The file was left as it is. Fix: resume from an earlier checkpoint.") from exc


def rng_state() -> dict[str, Any]:
    """The random states of Python, NumPy and torch (CPU and CUDA), in a weights_only-safe form."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` captured."""
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def _keywords_after(positional: int, example: str) -> Callable[[Callable], Callable]:
    """Calls with more than ``positional`` positional arguments (code written when the rest were positional)
    get a TypeError that shows the keyword form, not Python's bare "takes 1 positional argument"."""
    import functools

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if len(args) > positional:
                raise TypeError(f"{fn.__name__}() takes {positional} positional argument(s) and {len(args)} were "
                                f"given; everything after them is a keyword since the optimizer, scheduler and "
                                f"loader were added: {fn.__name__}({example})")
            return fn(*args, **kwargs)
        return call
    return wrap


@_keywords_after(1, "model, optimizer=opt, scheduler=sched, loader=loader, epoch=e, step=s")
def training_state(model: nn.Module, *, optimizer: torch.optim.Optimizer | None = None,
                   scheduler: Any = None, loader: Any = None, epoch: int = 0, step: int = 0,
                   **extra: Any) -> dict[str, Any]:
    """Everything needed to continue training exactly: weights, optimizer, scheduler, position,
    the data loader's place in its epoch, the RNG states, and ``extra``.

    Everything after ``model`` is a keyword (``restore`` takes the same keywords), so the two
    cannot be called with their arguments in different orders.

    Pass the *unwrapped* model (``ddp_model.module``) so the keys carry no ``module.`` prefix and
    the checkpoint loads into a plain model too. It holds this rank's RNG state only and runs no
    collective of its own, so rank 0 alone may call it — unless the optimizer's ``state_dict`` is
    itself a collective (``dtlab.parallel.zero.ShardedOptimizer`` gathers its shards: every rank
    calls it then). ``Checkpointer.save`` adds every rank's RNG state.

    It is a snapshot: tensors are copied, so training on does not change it. (``state_dict()``
    alone returns the live tensors: a state kept in memory and restored later would hold the
    weights and momentum of *now*, not of when it was taken.)
    """
    state = {"model": model.state_dict(), "epoch": epoch, "step": step, "world_size": distributed.world_size(),
             "rng": rng_state()}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if loader is not None:
        state["loader"] = loader.state_dict()
    state.update(extra)
    return _snapshot(state)


def _snapshot(value: Any) -> Any:
    """``value`` with every tensor copied (containers rebuilt, everything else as is)."""
    if torch.is_tensor(value):
        return value.detach().clone()
    if isinstance(value, dict):
        return type(value)((k, _snapshot(v)) for k, v in value.items()) if type(value) is not dict \
            else {k: _snapshot(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_snapshot(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_snapshot(v) for v in value)
    return value


@_keywords_after(2, "state, model, optimizer=opt, scheduler=sched, loader=loader")
def restore(state: dict[str, Any], model: nn.Module, *, optimizer: torch.optim.Optimizer | None = None,
            scheduler: Any = None, loader: Any = None, restore_rng: bool = True,
            allow_new_world_size: bool = False) -> tuple[int, int]:
    """Load ``state`` (from ``training_state``) into what is given; return ``(epoch, step)``.

    Everything is checked before anything is changed: a checkpoint of another model (the
    mismatching tensor is named), an optimizer with other parameter groups, or another world
    size raise ``CheckpointError`` and leave model, optimizer and loader as they were.

    ``allow_new_world_size=True`` resumes weights, optimizer and scheduler with a different number
    of processes. A ``DistributedLoader``'s position cannot be resharded exactly, so it restarts the
    saved epoch from its beginning; a ``dtlab.shards.ShardStream`` (``reshards = True``) continues at
    the same next sample. The RNG is seeded afresh by you.
    """
    if "model" not in state:
        raise CheckpointError(f"checkpoint has no 'model' entry (keys: {sorted(state)}); "
                              "it was not written by dtlab.checkpoint.training_state.")
    own = model.state_dict()
    problems = [f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
                for k, v in state["model"].items() if k in own and hasattr(v, "shape") and v.shape != own[k].shape]
    missing = sorted(set(own) - set(state["model"]))
    unexpected = sorted(set(state["model"]) - set(own))
    if problems or missing or unexpected:
        detail = "; ".join(problems[:3] + ([f"missing {missing[:3]}"] if missing else [])
                           + ([f"unexpected {unexpected[:3]}"] if unexpected else []))
        hint = " (keys start with 'module.': save ddp_model.module, not the DDP wrapper)" \
            if any(k.startswith("module.") for k in unexpected) else ""
        raise CheckpointError(f"checkpoint does not fit this model: {detail}{hint}. "
                              "Fix: build the model with the same configuration as the one that was saved.")
    if optimizer is not None and "optimizer" in state:
        saved = [len(g["params"]) for g in state["optimizer"]["param_groups"]]
        now = [len(g["params"]) for g in optimizer.param_groups]
        if saved != now:
            raise CheckpointError(f"optimizer state does not fit: parameter groups of sizes {saved} in the "
                                  f"checkpoint, {now} now. Fix: create the optimizer over the same parameters "
                                  "(and groups) as the run that saved it.")
    world = distributed.world_size()
    saved_world = int(state.get("world_size", world))
    new_world = saved_world != world
    if new_world and not allow_new_world_size:
        raise CheckpointError(f"checkpoint was written by a run of {saved_world} processes; this run has {world}. "
                              "Weights and optimizer would load, but each rank's data shard and RNG would not "
                              "continue where they stopped. Fix: resume with the same number of processes, or "
                              "pass allow_new_world_size=True to restart the saved epoch on the new world size.")
    if loader is not None and "loader" in state and (not new_world or getattr(loader, "reshards", False)):
        # validates first; raises before anything else changes. A loader whose position does not depend on the
        # world size (dtlab.shards.ShardStream) continues from it on any number of ranks.
        loader.load_state_dict(state["loader"])
    elif loader is not None and "loader" in state:
        loader.set_epoch(int(state["loader"]["epoch"]))
    model.load_state_dict(state["model"])
    if optimizer is not None and "optimizer" in state:
        # a copy: torch's load_state_dict keeps the given tensors as its state, and training would then
        # change the checkpoint held in memory (restoring it twice would not give the same start)
        optimizer.load_state_dict(_snapshot(state["optimizer"]))
    if scheduler is not None and "scheduler" in state:
        scheduler.load_state_dict(state["scheduler"])
    if restore_rng and not new_world:
        if "rng_per_rank" in state:
            set_rng_state(state["rng_per_rank"][distributed.rank()])
        elif "rng" in state:
            set_rng_state(state["rng"])
    return int(state.get("epoch", 0)), int(state.get("step", 0))


def save_on_rank0(path: str | os.PathLike, state: dict[str, Any]) -> None:
    """Rank 0 writes ``state``; every rank then learns the outcome, so nobody reads a file that is not
    there yet, and a failed write raises ``CheckpointError`` on every rank (not a wait at a barrier)."""
    _rank0_then_agree(lambda: save(path, state), f"saving {path}")


def _rank0_then_agree(work: Callable[[], Any], what: str) -> None:
    """Run ``work`` on rank 0; broadcast whether it succeeded; raise everywhere if it did not.

    The broadcast is the synchronisation point (no separate barrier), and rank 0 re-raises its own
    exception, so the first error stays the error.
    """
    error = None
    if distributed.is_main():
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 — told to the other ranks, then re-raised
            error = exc
    message = distributed.broadcast_object(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if message is not None:
        raise CheckpointError(f"rank 0 failed {what}: {message}")


def _all_ranks_rng() -> dict[str, Any]:
    """``{"rng_per_rank": [...]}`` in a process group of several ranks (a collective), else ``{}``."""
    import torch.distributed as dist

    if not distributed.initialized() or dist.get_world_size() == 1:
        return {}
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, rng_state())
    return {"rng_per_rank": per_rank}


class Checkpointer:
    """Periodic checkpoints in one directory: every ``every_steps`` steps and/or every
    ``every_seconds`` seconds, written atomically, the newest ``keep`` kept.

    On spot instances the advice is a checkpoint every 30–60 minutes: a preempted run then
    loses at most that much. Time-based saving is decided on rank 0 and broadcast, so all
    ranks save at the same step even though their clocks differ.

    >>> ckpt = Checkpointer("checkpoints", every_steps=100, keep=3)            # doctest: +SKIP
    >>> state = ckpt.load_latest()                   # None on a fresh start   # doctest: +SKIP
    >>> for step in range(start, total):                                       # doctest: +SKIP
    ...     train_one_step()
    ...     ckpt.maybe_save(step + 1, lambda: training_state(model, optimizer=optimizer, step=step + 1))

    Weights that are NaN or infinite are never written (``CheckpointError``): a diverged step
    must not replace the last good checkpoint.
    """

    PATTERN = re.compile(r"^step-(\d+)\.pt$")

    def __init__(self, directory: str | os.PathLike, every_steps: int | None = None,
                 every_seconds: float | None = None, keep: int = 3):
        if not every_steps and not every_seconds:
            raise ValueError("Checkpointer needs every_steps or every_seconds (or both), e.g. every_steps=100.")
        if keep < 1:
            raise ValueError(f"keep={keep}: keep at least the newest checkpoint (keep=1); 2-3 is safer.")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.every_steps, self.every_seconds, self.keep = every_steps, every_seconds, keep
        self._last_save = time.monotonic()
        if distributed.is_main():  # temporary files of a writer killed mid-write are garbage
            for tmp in self.directory.glob(".step-*.tmp"):
                tmp.unlink(missing_ok=True)

    def path(self, step: int) -> Path:
        """Where the checkpoint of ``step`` goes."""
        return self.directory / f"step-{step:08d}.pt"

    def checkpoints(self) -> list[Path]:
        """The complete checkpoints in the directory, oldest first."""
        found = [(int(m.group(1)), p) for p in self.directory.iterdir() if (m := self.PATTERN.match(p.name))]
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        """The newest checkpoint, or ``None``."""
        found = self.checkpoints()
        return found[-1] if found else None

    def due(self, step: int) -> bool:
        """Whether ``step`` should be saved (the same answer on every rank)."""
        import torch.distributed as dist

        due = bool(self.every_steps and step % self.every_steps == 0)
        if self.every_seconds and not due:
            due = time.monotonic() - self._last_save >= self.every_seconds
            if distributed.initialized() and dist.get_world_size() > 1:
                due = bool(distributed.broadcast_object(due))  # rank 0's clock decides for everyone
        return due

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write ``state`` as the checkpoint of ``step`` (rank 0), drop the oldest, then wait for all ranks.

        Every rank must call it: in a process group it gathers each rank's RNG state into the
        checkpoint (dropout masks differ per rank), then waits at a barrier.
        """
        path = self.path(step)
        bad = [k for k, v in state.get("model", {}).items()
               if torch.is_tensor(v) and v.is_floating_point() and not torch.isfinite(v).all()]
        if bad:
            raise CheckpointError(f"weights {bad[:3]} hold NaN or inf at step {step}; not saved, so the last good "
                                  f"checkpoint ({self.latest()}) stays. Fix: resume from it with a lower learning "
                                  "rate, gradient clipping, or a loss scaler.")
        state = {**state, **_all_ranks_rng()}

        def write() -> None:
            save(path, state)
            for old in self.checkpoints()[:-self.keep]:
                old.unlink(missing_ok=True)

        _rank0_then_agree(write, f"writing checkpoint {path}")
        self._last_save = time.monotonic()
        return path

    def maybe_save(self, step: int, make_state: Callable[[], dict[str, Any]]) -> Path | None:
        """Save ``make_state()`` if ``step`` is due; ``make_state`` is only called then (every rank calls this)."""
        return self.save(step, make_state()) if self.due(step) else None

    def load_latest(self, map_location: str | torch.device = "cpu") -> dict[str, Any] | None:
        """The newest checkpoint that can be read, or ``None`` when there is none.

        A newest file that cannot be read (a disk fault; atomic writes never leave half a file)
        is reported and the one before it is used, so nothing more than one interval is lost.

        In a process group every rank must call it: rank 0 chooses the file and tells the others,
        so all ranks resume from the same step even when their folders differ (node-local disks)
        or one read fails. A rank that cannot read rank 0's choice makes every rank raise.
        """
        if distributed.world_size() == 1 or not distributed.initialized():
            return self._newest_readable(map_location)[0]
        state, choice = None, None
        if distributed.is_main():
            try:
                state, path = self._newest_readable(map_location)
                choice = ("name", Path(path).name if path else None)
            except CheckpointError as exc:
                choice = ("error", str(exc))
        kind, chosen = distributed.broadcast_object(choice)
        if kind == "error":
            raise CheckpointError(chosen)
        if chosen is None:
            return None
        error = None
        if not distributed.is_main():  # the same step, from this rank's own folder
            try:
                state = load(self.directory / chosen, map_location)
                state.setdefault("path", str(self.directory / chosen))
            except CheckpointError as exc:
                error = exc
        agreed = distributed.all_agree(error is None)
        if not all(agreed):
            failed = [r for r, ok in enumerate(agreed) if not ok]
            raise CheckpointError(f"rank 0 chose {chosen} to resume from, but rank(s) {failed} cannot read it"
                                  + (f" ({error})" if error else "") + ". Fix: make the checkpoint folder the same "
                                  "on every node (shared storage), or copy the file to the ranks that lack it.")
        return state

    def _newest_readable(self, map_location: str | torch.device) -> tuple[dict[str, Any] | None, str | None]:
        """``(state, path)`` of the newest readable checkpoint in this process's folder, or ``(None, None)``."""
        errors = []
        for path in reversed(self.checkpoints()):
            try:
                state = load(path, map_location)
            except CheckpointError as exc:
                errors.append(str(exc))
                warnings.warn(f"skipping unreadable checkpoint {path.name}: {exc}", stacklevel=3)
                continue
            state.setdefault("path", str(path))
            return state, str(path)
        if errors:
            raise CheckpointError(f"no readable checkpoint in {self.directory}: {' | '.join(errors)}")
        return None, None
